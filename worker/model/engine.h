// In-process pipeline engine: all stages of one job in one process, one
// replica each, running whole iterations from routes. It is what the tests and
// convergence experiments run on, and it drives Stage / AdamW exactly as the
// distributed worker does (see optimizer.h for the step order), so equality
// proven here carries over. Data-parallel replicas are mathematically one
// replica with summed gradients and visits, so one copy per stage suffices.
//
// Thread-compatible. Owns its stages and optimisers.
#ifndef DETOUR_WORKER_MODEL_ENGINE_H_
#define DETOUR_WORKER_MODEL_ENGINE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "detour/v1/plan.pb.h"
#include "detour/v1/spec.pb.h"
#include "worker/model/kfac.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"
#include "worker/model/text_data.h"

namespace detour::model {

// Inputs and shifted targets of one microbatch, int64 [B, T].
struct Microbatch {
  at::Tensor tokens;
  at::Tensor targets;
};

struct IterationStats {
  double loss = 0;       // mean over microbatches of their mean token loss
  double grad_norm = 0;  // global norm after normalisation, before clipping
  double learning_rate = 0;
  std::vector<int> visits;  // microbatches per stage
};

// Microbatches of `iteration` for the job's data nodes: microbatch m belongs
// to data node m / microbatches_per_data_node and reads its shard offsets
// (SampleSharder) [i·n + j·spm, i·n + (j+1)·spm) where n = per-node samples
// per iteration, j = m mod microbatches_per_data_node, spm =
// samples_per_microbatch. FAILED_PRECONDITION if `tokens` holds no sample.
absl::StatusOr<std::vector<Microbatch>> IterationMicrobatches(const v1::JobSpec& spec,
                                                              const TokenSequence& tokens,
                                                              uint64_t iteration,
                                                              const c10::Device& device);

class PipelineEngine {
 public:
  // Builds every stage and its AdamW from a JobSpec (defaults applied). With
  // optimizer.kind OPTIMIZER_KFAC, also a Kfac per stage as its AdamW's
  // precondition hook: RunIteration captures the first
  // kfac.curvature_microbatches microbatches per data node of every refresh
  // iteration (iteration % refresh_interval == 0; refresh_interval 0 means
  // every 10 iterations here, the engine has no bubble planner), and Step
  // runs Kfac::RefreshSerially before the optimiser step of that iteration,
  // so the new inverses precondition that very step.
  static absl::StatusOr<std::unique_ptr<PipelineEngine>> Create(const v1::JobSpec& spec,
                                                                c10::Device device);

  // Forward along each route, loss, backward along the reversed route, one
  // microbatch after the other; gradients accumulate. Route i uses
  // microbatches[route.microbatch()]. Returns the mean loss. Stops at the
  // first error, dropping microbatches in flight.
  absl::StatusOr<double> Accumulate(const std::vector<v1::Route>& routes,
                                    const std::vector<Microbatch>& microbatches);

  // Normalises (PipelineSpec.grad_normalization over `total_microbatches`),
  // clips by the global norm, steps every stage's AdamW at the scheduled lr
  // of `iteration`, clears gradients.
  absl::StatusOr<IterationStats> Step(uint64_t iteration, int total_microbatches);

  // Accumulate + Step (with K-FAC: captures for a refresh iteration first).
  absl::StatusOr<IterationStats> RunIteration(uint64_t iteration,
                                              const std::vector<v1::Route>& routes,
                                              const std::vector<Microbatch>& microbatches);

  // Only normalises gradients (no step): what tests compare with. Step then
  // skips its own normalisation; Accumulate refuses to add to normalised
  // gradients (FAILED_PRECONDITION) until Step has run.
  absl::Status NormalizeGradients(int total_microbatches);

  int num_stages() const { return static_cast<int>(stages_.size()); }
  Stage& stage(int i) { return *stages_[i]; }
  AdamW& optimizer(int i) { return *optimizers_[i]; }
  // Null unless the job's optimiser is OPTIMIZER_KFAC.
  Kfac* kfac(int i) { return kfacs_.empty() ? nullptr : kfacs_[i].get(); }
  // K-FAC refresh period of the engine (see Create); 0 without K-FAC.
  uint32_t kfac_refresh_interval() const;
  // Captures the curvature microbatches of `iteration` when it is a refresh
  // iteration (RunIteration calls it; callers of Accumulate may too).
  void CaptureForIteration(uint64_t iteration, int num_microbatches);
  std::vector<Stage*> stages();
  const v1::JobSpec& spec() const { return spec_; }

 private:
  PipelineEngine() = default;

  v1::JobSpec spec_;
  std::vector<std::unique_ptr<Stage>> stages_;
  std::vector<std::unique_ptr<AdamW>> optimizers_;
  // After stages_: destroyed first (they hold pointers to the stages).
  std::vector<std::unique_ptr<Kfac>> kfacs_;
  bool kfac_captured_ = false;
  bool normalized_ = false;
};

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_ENGINE_H_
