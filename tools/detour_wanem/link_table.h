// The emulated network: the nodes of a detour ClusterSpec, the IPv4 address
// each gets inside the test bed's subnet, and one Link per ordered pair of
// distinct nodes with the parameters the spec gives it (the same numbers the
// simulator uses: latency_ms is one-way, bandwidth in 1e9 bytes per second,
// intra_region_* between nodes of one region). Thread-compatible; the
// forwarder owns it and its control socket edits it on the same thread.
#ifndef DETOUR_TOOLS_DETOUR_WANEM_LINK_TABLE_H_
#define DETOUR_TOOLS_DETOUR_WANEM_LINK_TABLE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "detour/v1/spec.pb.h"
#include "tools/detour_wanem/link.h"

namespace detour::wanem {

// Node i has address base + i + 1, so the subnet bounds the node count too.
struct Subnet {
  uint32_t base = 0;  // host byte order, host bits zero
  int prefix_len = 0;
};
// "10.77.0.0/16" -> Subnet. INVALID_ARGUMENT for anything else, for host bits
// set, and for a prefix outside [8, 30].
absl::StatusOr<Subnet> ParseSubnet(absl::string_view text);
std::string FormatIpv4(uint32_t address);

struct LinkTableOptions {
  // Every link's bandwidth is multiplied by this (0 < scale <= 1000), for a
  // forwarder that cannot reach the spec's rates.
  double bandwidth_scale = 1.0;
  // Lower bound of the automatic queue limit (LinkParams::queue_bytes = 0).
  int64_t queue_floor_bytes = 64 * 1024;
  uint64_t seed = 1;
  Subnet subnet{0x0a4d0000u, 16};  // 10.77.0.0/16
};

struct WanNode {
  std::string id;
  std::string region;
  uint32_t address = 0;  // host byte order
};

class LinkTable {
 public:
  static constexpr int kMaxNodes = 256;

  // From a loaded (defaulted and validated) cluster spec. INVALID_ARGUMENT for
  // a node id that cannot name a network namespace (it becomes part of one:
  // letters, digits, '.', '_', '-', at most 64 bytes), more than kMaxNodes
  // nodes or than the subnet holds, a missing region link, or a bad option.
  static absl::StatusOr<LinkTable> FromCluster(const v1::ClusterSpec& cluster,
                                               const LinkTableOptions& options);

  int size() const { return static_cast<int>(nodes_.size()); }
  const WanNode& node(int i) const { return nodes_[static_cast<size_t>(i)]; }
  const Subnet& subnet() const { return subnet_; }
  // Index of the node with this id, or -1.
  int FindNode(absl::string_view id) const;
  // Index of the node owning this address (host byte order), or -1.
  int NodeForAddress(uint32_t address) const;

  Link& link(int src, int dst) { return links_[Index(src, dst)]; }
  const Link& link(int src, int dst) const { return links_[Index(src, dst)]; }

 private:
  size_t Index(int src, int dst) const {
    return static_cast<size_t>(src) * nodes_.size() + static_cast<size_t>(dst);
  }

  std::vector<WanNode> nodes_;
  absl::flat_hash_map<std::string, int> by_id_;
  Subnet subnet_;
  std::vector<Link> links_;  // size()², the diagonal unused
};

}  // namespace detour::wanem

#endif  // DETOUR_TOOLS_DETOUR_WANEM_LINK_TABLE_H_
