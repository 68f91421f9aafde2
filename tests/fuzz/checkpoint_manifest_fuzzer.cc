// Fuzzes the checkpoint manifest parser (common/checkpoint_manifest.h):
// arbitrary bytes as manifest.json. Nothing may crash or trip UBSan (numbers
// are doubles in JSON: NaN, huge or fractional counts must be refused, not
// cast); an accepted manifest must be in range and survive a round trip
// through ManifestJson unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/checkpoint_manifest.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

bool Same(const detour::model::CheckpointManifest& a, const detour::model::CheckpointManifest& b) {
  if (a.iteration != b.iteration || a.num_stages != b.num_stages ||
      a.replicas_per_stage != b.replicas_per_stage || a.seed != b.seed ||
      a.rng_state != b.rng_state || a.model.DebugString() != b.model.DebugString() ||
      a.model.rope_theta != b.model.rope_theta || a.model.norm_eps != b.model.norm_eps ||
      a.stages.size() != b.stages.size()) {
    return false;
  }
  for (size_t i = 0; i < a.stages.size(); ++i) {
    const auto& x = a.stages[i];
    const auto& y = b.stages[i];
    if (x.stage != y.stage || x.file != y.file || !(x.layers == y.layers) || x.bytes != y.bytes ||
        x.checksum != y.checksum) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto m = detour::model::ParseManifest(text, "fuzz/manifest.json");
  if (!m.ok()) return 0;
  Check(m->num_stages >= 1 && m->num_stages <= m->model.num_layers);
  Check(m->stages.size() <= static_cast<size_t>(m->num_stages));
  for (const auto& e : m->stages) {
    Check(e.stage >= 0 && e.stage < m->num_stages);
    Check(e.layers.begin >= 0 && e.layers.begin <= e.layers.end &&
          e.layers.end <= m->model.num_layers);
    Check(!e.file.empty() && e.file.find('/') == std::string::npos);
  }
  auto again = detour::model::ParseManifest(detour::model::ManifestJson(*m), "fuzz/again.json");
  Check(again.ok());
  Check(Same(*m, *again));
  return 0;
}
