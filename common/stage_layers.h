// How a model's transformer blocks are cut into pipeline stages: stage s of S
// holds a consecutive range, sizes differing by at most one, the larger
// ranges last (stage 0 also carries the embedding, LM head and loss). Shared
// by the coordinator (assignments), the simulator's cost model and the
// worker's model code, so all three always agree.
#ifndef DETOUR_COMMON_STAGE_LAYERS_H_
#define DETOUR_COMMON_STAGE_LAYERS_H_

#include "absl/status/statusor.h"

namespace detour {

struct LayerSpan {
  int begin = 0;  // first block (global index)
  int end = 0;    // one past the last block
  int size() const { return end - begin; }
};

// INVALID_ARGUMENT when num_stages is outside [1, num_layers] or stage is
// outside [0, num_stages).
absl::StatusOr<LayerSpan> StageLayers(int num_layers, int num_stages, int stage);

}  // namespace detour

#endif  // DETOUR_COMMON_STAGE_LAYERS_H_
