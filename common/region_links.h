// The region table of a ClusterSpec as lookups: what it says of the link
// between two regions, in either order, and within one region. One home for
// a fact the cost model, the coordinator's link expectations, the worker's
// in-process emulation and the WAN test bed's forwarder all read.
#ifndef DETOUR_COMMON_REGION_LINKS_H_
#define DETOUR_COMMON_REGION_LINKS_H_

#include <map>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "detour/v1/spec.pb.h"

namespace detour {

// One link of the region table, as the spec gives it (0 where a field is
// unset).
struct RegionLinkFigures {
  double latency_ms = 0;  // one way
  double bandwidth_gbytes_per_s = 0;
};

class RegionLinks {
 public:
  // Indexes `net`'s links (a pair listed twice: the last one, as a map
  // would; ValidateClusterSpec refuses such specs).
  explicit RegionLinks(const v1::ClusterSpec& net);

  // The link between regions `a` and `b` (either order); for a == b the
  // intra-region figures. nullopt when two regions have no listed link.
  std::optional<RegionLinkFigures> Between(absl::string_view a, absl::string_view b) const;

 private:
  RegionLinkFigures intra_;
  std::map<std::pair<std::string, std::string>, RegionLinkFigures> links_;
};

}  // namespace detour

#endif  // DETOUR_COMMON_REGION_LINKS_H_
