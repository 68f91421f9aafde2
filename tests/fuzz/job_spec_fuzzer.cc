// Fuzzes what the coordinator does with a JobSpec or ClusterSpec a client
// sends (JSON, as in files and detourctl): parse, default, validate; a spec
// that passes must survive a JSON round trip and build a cost model on a
// small cluster without crashing or allocating without bound.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/sim/cost_model.h"
#include "common/spec.h"

namespace {

detour::v1::ClusterSpec SmallCluster() {
  detour::v1::ClusterSpec c;
  for (int i = 0; i < 4; ++i) {
    auto* n = c.add_nodes();
    n->set_id("n" + std::to_string(i));
    n->set_region(i < 2 ? "a" : "b");
  }
  auto* l = c.add_links();
  l->set_region_a("a");
  l->set_region_b("b");
  l->set_latency_ms(50);
  l->set_bandwidth_gbytes_per_s(0.1);
  return *detour::NormalizeClusterSpec(c);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (auto cluster = detour::ParseClusterSpecJson(text); cluster.ok()) {
    (void)detour::NormalizeClusterSpec(*cluster);
  }
  auto parsed = detour::ParseJobSpecJson(text);
  if (!parsed.ok()) return 0;
  auto spec = detour::NormalizeJobSpec(*parsed);
  if (!spec.ok()) return 0;
  auto again = detour::ParseJobSpecJson(detour::ToJson(*spec));
  if (!again.ok() || !detour::NormalizeJobSpec(*again).ok()) __builtin_trap();
  static const detour::v1::ClusterSpec cluster = SmallCluster();
  (void)detour::sim::CostModel::Create(cluster, *spec);
  return 0;
}
