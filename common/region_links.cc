#include "common/region_links.h"

namespace detour {

RegionLinks::RegionLinks(const v1::ClusterSpec& net) {
  intra_.latency_ms = net.intra_region_latency_ms();
  intra_.bandwidth_gbytes_per_s = net.intra_region_bandwidth_gbytes_per_s();
  for (const v1::RegionLink& l : net.links()) {
    const RegionLinkFigures f{l.latency_ms(), l.bandwidth_gbytes_per_s()};
    links_[{l.region_a(), l.region_b()}] = f;
    links_[{l.region_b(), l.region_a()}] = f;
  }
}

std::optional<RegionLinkFigures> RegionLinks::Between(absl::string_view a,
                                                      absl::string_view b) const {
  if (a == b) return intra_;
  auto it = links_.find({std::string(a), std::string(b)});
  if (it == links_.end()) return std::nullopt;
  return it->second;
}

}  // namespace detour
