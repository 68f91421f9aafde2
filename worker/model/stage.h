// One pipeline stage of a LLaMA-style decoder: the unit a worker holds.
//
// Stage 0 (on data nodes) = token embedding + its block group + final norm +
// LM head + loss; stages 1..S-1 = consecutive block groups (StageLayerRange).
// A microbatch travels forward along a route that may skip and reorder stages,
// so every stage accepts hidden states [B, T, d_model] from any other stage;
// stage 0 takes token ids [B, T] at the start and the returning hidden states
// at the end (LossAndBackward).
//
// Life of microbatch `mb` on a stage:
//   out  = Forward(mb, in)          keeps the autograd graph in a memory slot
//   gin  = Backward(mb, grad_out)   accumulates parameter gradients, frees the
//                                   slot, returns d loss / d in
// At most `memory_slots` microbatches may be between Forward and Backward
// (RESOURCE_EXHAUSTED beyond that). Gradients accumulate across microbatches
// until ZeroGrad(); visits() counts the microbatches accumulated, which the
// gradient normalisation needs (GradNormalizationScale).
//
// Errors: every method returns a Status; LibTorch exceptions are caught here
// and reported with context ("stage 2 forward mb 5: shape [4,128,256] vs
// expected [B, T<=128, 384]"). Thread-compatible: one thread at a time (the
// worker's executor). Owns its parameters; tensors returned by Parameters()
// share storage with them.
#ifndef DETOUR_WORKER_MODEL_STAGE_H_
#define DETOUR_WORKER_MODEL_STAGE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "detour/v1/spec.pb.h"
#include "common/model_config.h"

namespace detour::model {

using NamedTensor = std::pair<std::string, at::Tensor>;
struct LayerCapture;  // transformer.h

struct StageOptions {
  // Microbatches held between Forward and Backward (PipelineSpec.memory_slots).
  int memory_slots = 3;
  // Where parameters and activations live; inputs on other devices are moved.
  c10::Device device = c10::Device(c10::kCPU);
  // Initialisation seed (JobSpec.seed).
  uint64_t seed = 0;
  // Activation recomputation (PipelineSpec.recompute_activations): Forward
  // keeps only a microbatch's input, Backward runs the forward again with
  // gradients. A slot then holds one [B, T, d_model] tensor instead of every
  // block's intermediate activations, for about one more forward per
  // microbatch. Microbatches captured for K-FAC keep their graph.
  bool recompute_activations = false;
  // Arithmetic of forward and backward (PipelineSpec.precision): at::kFloat
  // or at::kBFloat16 (mixed precision: bf16 products on bf16 copies of the
  // float32 parameters, see DecoderLayerImpl::set_compute_dtype). Whatever
  // it is, parameters and their gradients are float32, and so are the
  // hidden states a stage takes and returns.
  at::ScalarType compute_dtype = at::kFloat;
};

// The compute dtype of a precision (PRECISION_UNSPECIFIED is float32).
at::ScalarType ComputeDtype(v1::Precision precision);

// Result of the loss on stage 0.
struct LossOutput {
  double loss = 0;         // mean token cross-entropy of the microbatch
  int64_t tokens = 0;      // tokens the mean is over
  at::Tensor grad_hidden;  // d loss / d hidden, to send back along the route
};

class Stage {
 public:
  // Builds stage `stage` of `num_stages` with deterministic parameters.
  // INVALID_ARGUMENT for a bad index or stage count or a compute dtype other
  // than float32 and bfloat16; FAILED_PRECONDITION, naming the device, when
  // the device cannot run bfloat16 products and their backward.
  static absl::StatusOr<std::unique_ptr<Stage>> Create(const ModelConfig& config, int stage,
                                                       int num_stages, const StageOptions& options);
  // Same, from a JobSpec (defaults applied here; model shape, num_stages,
  // memory_slots and seed are read from it). `device` overrides spec.device.
  static absl::StatusOr<std::unique_ptr<Stage>> FromJobSpec(const v1::JobSpec& spec, int stage,
                                                            c10::Device device);

  ~Stage();
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  int index() const;
  int num_stages() const;
  LayerRange layers() const;
  const ModelConfig& config() const;
  c10::Device device() const;

  // Forward of microbatch `mb`. Stage 0: `input` is int64 tokens [B, T];
  // others: float hidden states [B, T, d_model]. Returns the output hidden
  // states (detached, on this stage's device). ALREADY_EXISTS if `mb` is in
  // flight, RESOURCE_EXHAUSTED when all memory slots are taken,
  // INVALID_ARGUMENT for a bad shape or dtype.
  absl::StatusOr<at::Tensor> Forward(uint32_t mb, const at::Tensor& input);

  // Backward of microbatch `mb` given d loss / d output. Accumulates this
  // stage's parameter gradients, frees the slot and returns d loss / d input
  // (an undefined tensor on stage 0). NOT_FOUND if `mb` is not in flight.
  absl::StatusOr<at::Tensor> Backward(uint32_t mb, const at::Tensor& grad_output);

  // Stage 0 only (FAILED_PRECONDITION elsewhere): final norm + LM head + mean
  // cross-entropy of the hidden states that returned from the route, against
  // int64 `targets` [B, T]; runs the head's backward at once (accumulating
  // its gradients) and returns the gradient to send back along the route.
  absl::StatusOr<LossOutput> LossAndBackward(uint32_t mb, const at::Tensor& hidden,
                                             const at::Tensor& targets);

  // Inference (no graph kept, no slot used): the forward of this stage's part.
  absl::StatusOr<at::Tensor> Infer(const at::Tensor& input);
  // Stage 0 only: summed token NLL and token count, without gradients.
  absl::StatusOr<std::pair<double, int64_t>> InferLoss(const at::Tensor& hidden,
                                                       const at::Tensor& targets);

  // Forgets a microbatch in flight (cancelled iteration); no-op if absent.
  void Drop(uint32_t mb);
  void DropAll();
  int in_flight() const;

  // Parameters with global names ("embed.weight", "layers.3.wq",
  // "norm.weight", "head.weight"), in a fixed order. Their .grad() is what
  // replicas all-reduce.
  std::vector<NamedTensor> Parameters() const;
  // Microbatches whose Backward ran since the last ZeroGrad.
  int visits() const;
  // Clears gradients and the visit count.
  void ZeroGrad();
  // Multiplies every accumulated gradient by `factor`.
  absl::Status ScaleGradients(double factor);
  // Sum of squared gradient elements (for global-norm clipping), leaving
  // out the parameters named in `exclude` (may be null).
  absl::StatusOr<double> SquaredGradNorm(const std::set<std::string>* exclude = nullptr) const;

  // Gradient sums in a fixed order. With ordered accumulation on, each
  // microbatch's backward passes (LossAndBackward, Backward) accumulate into
  // gradients of its own, kept apart until FoldGradients adds them to the
  // stage's, in ascending microbatch order: the sums have the same bits
  // whatever order the passes ran in (float addition does not associate,
  // and the pipeline runs backwards in the order their gradients arrive).
  // Off (the default) they accumulate into the stage's at once. ZeroGrad
  // drops what is kept.
  void SetOrderedAccumulation(bool on);
  // Adds the kept gradients of microbatches below `below` (of all with
  // nullopt) to the stage's, ascending, and forgets them.
  absl::Status FoldGradients(std::optional<uint32_t> below = std::nullopt);
  // Microbatches whose gradients are kept apart.
  size_t kept_gradients() const;

  // K-FAC capture (used by Kfac, kfac.h): the next Forward of `mb` fills
  // records[i] for the i-th block this stage holds (LayerCapture, in
  // transformer.h), then forgets them; the records' owner keeps them. Replaces
  // an earlier capture of `mb` whose forward has not run. INVALID_ARGUMENT
  // when the record count differs from the stage's block count.
  absl::Status SetCapture(uint32_t mb, std::vector<std::shared_ptr<LayerCapture>> records);
  // Forgets a capture set for `mb` whose forward has not run (no-op if none).
  void ClearCapture(uint32_t mb);

 private:
  struct Impl;
  explicit Stage(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Factor that turns a stage's accumulated (summed) gradient into the step's
// gradient: 1/visits for GRAD_NORM_VISITS (the default; a mean over the
// microbatches that reached the stage), 1/total for GRAD_NORM_TOTAL. 0 visits
// gives 0 (nothing to scale). With replicas, pass the visits summed over the
// replicas of the stage after the gradient all-reduce (sum).
double GradNormalizationScale(v1::GradNormalization mode, int visits, int total_microbatches);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_STAGE_H_
