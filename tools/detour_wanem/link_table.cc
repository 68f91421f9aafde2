#include "tools/detour_wanem/link_table.h"

#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/region_links.h"

namespace detour::wanem {
namespace {

bool ValidNodeId(absl::string_view id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return id != "." && id != "..";
}

// Mixes the seed with the link's endpoints so each link draws its own stream.
uint64_t LinkSeed(uint64_t seed, int src, int dst) {
  SplitMix64 mix(seed ^ (static_cast<uint64_t>(src) << 32) ^ static_cast<uint64_t>(dst));
  mix.Next();
  return mix.Next();
}

}  // namespace

absl::StatusOr<Subnet> ParseSubnet(absl::string_view text) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrFormat("subnet '%s': %s (expected A.B.C.D/LEN, e.g. 10.77.0.0/16)", text, why));
  };
  std::vector<absl::string_view> parts = absl::StrSplit(text, '/');
  if (parts.size() != 2) return bad("no prefix length");
  std::vector<absl::string_view> octets = absl::StrSplit(parts[0], '.');
  if (octets.size() != 4) return bad("not four octets");
  uint32_t base = 0;
  for (absl::string_view o : octets) {
    uint32_t v = 0;
    if (o.empty() || o.size() > 3 || !absl::SimpleAtoi(o, &v) || v > 255) return bad("bad octet");
    base = (base << 8) | v;
  }
  int len = 0;
  if (!absl::SimpleAtoi(parts[1], &len) || len < 8 || len > 30) {
    return bad("prefix length must be in [8, 30]");
  }
  const uint32_t host_mask = (len == 32) ? 0 : (0xffffffffu >> len);
  if ((base & host_mask) != 0) return bad("host bits are set");
  return Subnet{base, len};
}

std::string FormatIpv4(uint32_t a) {
  return absl::StrFormat("%d.%d.%d.%d", a >> 24, (a >> 16) & 255, (a >> 8) & 255, a & 255);
}

absl::StatusOr<LinkTable> LinkTable::FromCluster(const v1::ClusterSpec& cluster,
                                                 const LinkTableOptions& options) {
  if (!(options.bandwidth_scale > 0 && options.bandwidth_scale <= 1000)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bandwidth_scale: %g must be in (0, 1000]", options.bandwidth_scale));
  }
  if (options.queue_floor_bytes < 1500 || options.queue_floor_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "queue floor: %d bytes must be in [1500, 1 GiB]", options.queue_floor_bytes));
  }
  const int n = cluster.nodes_size();
  if (n < 2 || n > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("nodes: %d nodes; the WAN test bed takes 2 to %d", n, kMaxNodes));
  }
  const uint64_t hosts = (uint64_t{1} << (32 - options.subnet.prefix_len)) - 2;
  if (static_cast<uint64_t>(n) > hosts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("nodes: %d nodes do not fit in %s/%d (%d addresses)", n,
                        FormatIpv4(options.subnet.base), options.subnet.prefix_len, hosts));
  }
  const RegionLinks region_links(cluster);

  LinkTable t;
  t.subnet_ = options.subnet;
  for (int i = 0; i < n; ++i) {
    const v1::NodeSpec& ns = cluster.nodes(i);
    if (!ValidNodeId(ns.id())) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "nodes[%d].id: '%s' cannot name a network namespace (letters, digits, '.', '_', '-', "
          "at most 64 bytes)",
          i, ns.id()));
    }
    if (!t.by_id_.emplace(ns.id(), i).second) {
      return absl::InvalidArgumentError(absl::StrFormat("nodes[%d].id: '%s' repeats", i, ns.id()));
    }
    t.nodes_.push_back({ns.id(), ns.region(), options.subnet.base + static_cast<uint32_t>(i) + 1});
  }
  t.links_.reserve(static_cast<size_t>(n) * static_cast<size_t>(n));
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      Link link(LinkSeed(options.seed, a, b), options.queue_floor_bytes);
      if (a != b) {
        const WanNode& na = t.nodes_[static_cast<size_t>(a)];
        const WanNode& nb = t.nodes_[static_cast<size_t>(b)];
        LinkParams p;
        const std::optional<RegionLinkFigures> table = region_links.Between(na.region, nb.region);
        if (!table.has_value()) {
          return absl::InvalidArgumentError(
              absl::StrFormat("links: no link between regions %s (node %s) and %s (node %s)",
                              na.region, na.id, nb.region, nb.id));
        }
        p.delay_ms = table->latency_ms;
        p.rate_bytes_per_s = table->bandwidth_gbytes_per_s * 1e9 * options.bandwidth_scale;
        link.SetParams(p);
      }
      t.links_.push_back(std::move(link));
    }
  }
  return t;
}

int LinkTable::FindNode(absl::string_view id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? -1 : it->second;
}

int LinkTable::NodeForAddress(uint32_t address) const {
  const uint32_t mask = ~(0xffffffffu >> subnet_.prefix_len);
  if ((address & mask) != subnet_.base) return -1;
  const uint32_t host = address - subnet_.base;
  if (host == 0 || host > nodes_.size()) return -1;
  return static_cast<int>(host - 1);
}

}  // namespace detour::wanem
