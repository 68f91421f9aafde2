#include "common/stage_layers.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace detour {

absl::StatusOr<LayerSpan> StageLayers(int num_layers, int num_stages, int stage) {
  if (num_stages < 1 || num_stages > num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline.num_stages: ", num_stages,
                                                   " must be in [1, num_layers=", num_layers, "]"));
  }
  if (stage < 0 || stage >= num_stages) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", stage, " is outside [0, ", num_stages, ")"));
  }
  // The last `extra` stages get one block more: stage 0 already carries the
  // embedding, the LM head and the loss.
  const int base = num_layers / num_stages;
  const int extra = num_layers % num_stages;
  const int first_bigger = num_stages - extra;
  LayerSpan r;
  r.begin = stage * base + std::max(0, stage - first_bigger);
  r.end = r.begin + base + (stage >= first_bigger ? 1 : 0);
  return r;
}

}  // namespace detour
