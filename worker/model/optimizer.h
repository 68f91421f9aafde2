// AdamW with linear warm-up and cosine decay, and the per-layer hook where
// K-FAC preconditioning plugs in.
//
// One AdamW instance per stage (per replica) updates that stage's parameters.
// The step order, shared by the in-process engine and the distributed worker:
//   1. gradients accumulated over the microbatches that visited the stage;
//   2. all-reduced (summed) among the stage's replicas, with the visit counts;
//   3. normalised (GradNormalizationScale in stage.h);
//   4. clipped by the global norm over all stages (GlobalClipScale);
//   5. PreconditionHook per transformer block (K-FAC; it may update the
//      projections itself and list them in self_updated);
//   6. AdamW update (decoupled weight decay on matrices only).
// Thread-compatible. Holds handles to the parameters (shared storage), owns
// its moment estimates; does not own the hook.
#ifndef DETOUR_WORKER_MODEL_OPTIMIZER_H_
#define DETOUR_WORKER_MODEL_OPTIMIZER_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "detour/v1/spec.pb.h"

namespace detour::model {

using NamedTensor = std::pair<std::string, at::Tensor>;

// Learning rate of step `iteration` (0-based) of `total_iterations`: linear
// warm-up from lr/warmup to lr over OptimizerSpec.warmup_iterations, then a
// cosine from lr down to min_lr_ratio·lr at the last iteration (or constant
// if constant_lr). Reads defaults from the spec as ApplyJobDefaults sets them.
double ScheduledLearningRate(const v1::OptimizerSpec& spec, uint64_t iteration,
                             uint64_t total_iterations);

// Multiplier that clips gradients of global L2 norm sqrt(squared_norm) to
// `max_norm` (1 when below it or when max_norm <= 0).
double GlobalClipScale(double squared_norm, double max_norm);

// Per-layer gradient preconditioning (K-FAC: ∇W ← B⁻¹·∇W·A⁻¹). Called from
// AdamW::Step once per transformer block, after normalisation and clipping.
class PreconditionHook {
 public:
  virtual ~PreconditionHook() = default;
  // `params` are the block's parameters (global names, e.g. "layers.3.wq");
  // their .grad() may be rewritten in place. Names added to `self_updated`
  // are parameters the hook has updated itself (K-FAC with its own lr and
  // momentum); AdamW skips them. A non-OK status aborts the step before any
  // parameter of the stage changes.
  // Called once per AdamW::Step before the first Precondition call, after
  // clipping, even when no block has a gradient: a hook that needs the whole
  // stage's gradients (K-FAC's KL clipping) computes them here. Default: none.
  virtual absl::Status BeginStep(double lr) {
    (void)lr;
    return absl::OkStatus();
  }
  virtual absl::Status Precondition(int layer, const std::vector<NamedTensor>& params, double lr,
                                    std::set<std::string>* self_updated) = 0;
};

class AdamW {
 public:
  AdamW(std::vector<NamedTensor> params, const v1::AdamWSpec& spec);

  // Not owned; nullptr disables. Must outlive the optimiser's use.
  void set_precondition_hook(PreconditionHook* hook) { hook_ = hook; }

  // Multiplies gradients by `grad_scale` (clipping), runs the hook, then the
  // AdamW update on every parameter that has a gradient. Parameters without
  // a gradient this step (not visited) keep their value and moments.
  absl::Status Step(double lr, double grad_scale = 1.0);

  // Optimiser state for checkpoints: "<param>.adam_m", "<param>.adam_v",
  // "<param>.adam_step" (per-parameter step counts, as int64 scalars).
  std::vector<NamedTensor> State() const;
  // Replaces the state. Checks every entry's presence and shape first;
  // INVALID_ARGUMENT naming the entry, and nothing changes, on mismatch.
  absl::Status LoadState(const std::map<std::string, at::Tensor>& state);

  const std::vector<NamedTensor>& params() const { return params_; }

 private:
  struct Moments {
    at::Tensor m;
    at::Tensor v;
    int64_t step = 0;
  };

  std::vector<NamedTensor> params_;
  std::vector<Moments> moments_;
  v1::AdamWSpec spec_;
  PreconditionHook* hook_ = nullptr;
};

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_OPTIMIZER_H_
