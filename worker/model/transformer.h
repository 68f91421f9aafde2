// LLaMA-style decoder building blocks (RMSNorm, rotary embeddings, causal
// attention with optional grouped-query attention, SwiGLU MLP) and the plain
// monolithic model used as the reference in tests and benchmarks.
//
// Parameters are initialised deterministically from (seed, global name): a
// block's weights depend only on the job seed and its global layer index, never
// on which stage holds it, so a pipelined model and the monolithic model built
// from the same seed are identical.
//
// Modules here may throw c10::Error (they are LibTorch modules); callers
// outside worker/model go through Stage, which converts errors to Status.
// Modules are thread-compatible: one thread at a time per module.
#ifndef DETOUR_WORKER_MODEL_TRANSFORMER_H_
#define DETOUR_WORKER_MODEL_TRANSFORMER_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "common/model_config.h"

namespace detour::model {

using NamedTensor = std::pair<std::string, at::Tensor>;

// cos/sin tables [context_length, head_dim/2] for rotary embeddings
// ("rotate half" convention: the first and second halves of a head form the
// complex pairs).
struct RotaryTables {
  at::Tensor cos;
  at::Tensor sin;
  static RotaryTables Make(const ModelConfig& config, const at::Device& device);
};

// The copy of a float32 master parameter that a lower-precision forward
// multiplies with (PipelineSpec.precision BF16). Made once per version of the
// parameter (every in-place change — an optimiser step, a checkpoint load —
// bumps it) and per grad mode: with gradients the cast is a node of the
// autograd graph, so each microbatch's gradient flows back into the float32
// parameter, and all microbatches between two optimiser steps share one copy
// instead of each keeping its own in its memory slot. Thread-compatible.
class ComputeCast {
 public:
  // `master` itself when it already has `dtype`.
  at::Tensor Of(const at::Tensor& master, at::ScalarType dtype);

 private:
  struct Entry {
    at::Tensor cast;
    int64_t version = -1;
    const void* data = nullptr;
  };
  Entry with_grad_, without_grad_;
};

// x·rsqrt(mean(x²)+eps)·weight over the last dimension.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Applies rotary embeddings to q or k of shape [B, heads, T, head_dim].
at::Tensor ApplyRotary(const at::Tensor& x, const RotaryTables& rope);

// Deterministic N(0, std²) tensor for a parameter, from (seed, name); drawn on
// the CPU so every device gets the same numbers.
at::Tensor InitNormal(uint64_t seed, const std::string& name, at::IntArrayRef sizes, double std);

// What one block's forward records for K-FAC (kfac.h) while a capture is set:
// the inputs of its projections (detached, [B, T, f_in]) at forward time and,
// through tensor hooks on the projections' outputs, d loss / d output
// ([B, T, f_out]) when the backward runs. The hooks hold only a weak
// reference: dropping the record makes them no-ops.
struct LayerCapture {
  // Inputs: kAttnIn feeds q, k, v; kAttnOut feeds o; kMlpIn feeds gate, up;
  // kMlpHidden (silu(gate)·up) feeds down.
  enum Input { kAttnIn = 0, kAttnOut = 1, kMlpIn = 2, kMlpHidden = 3 };
  std::array<at::Tensor, 4> inputs;
  // Output gradients in KfacModules() order: q k v o gate up down.
  std::array<at::Tensor, 7> output_grads;
  bool forward_done = false;
  // Per input / projection: turned into its A / B sum and freed (K-FAC may
  // take them in parts, Kfac::CurvatureA/B); all of them: consumed.
  std::array<bool, 4> a_taken{};
  std::array<bool, 7> b_taken{};
  bool a_consumed = false;  // every input turned into A and freed
  bool b_consumed = false;  // every output gradient turned into B and freed
  bool backward_done() const {
    for (size_t m = 0; m < output_grads.size(); ++m) {
      if (!output_grads[m].defined() && !b_taken[m]) return false;
    }
    return true;
  }
};

// One transformer block: x + Attn(RMSNorm(x)); then x + SwiGLU(RMSNorm(x)).
class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const ModelConfig& config, int global_index, uint64_t seed);
  at::Tensor forward(const at::Tensor& x, const RotaryTables& rope);

  // While set (non-null), forward() fills `capture` (see LayerCapture); the
  // Stage sets it around the forward of a captured microbatch only.
  void set_capture(std::shared_ptr<LayerCapture> capture) { capture_ = std::move(capture); }

  // Arithmetic of forward(): at::kFloat (the default: everything float32)
  // or at::kBFloat16 (mixed precision as PipelineSpec.precision BF16
  // describes it: projections, attention and the SwiGLU in bf16 on cached
  // bf16 copies of the weights; RMSNorm, rotary embeddings and the residual
  // stream in float32, so input and output stay float32).
  void set_compute_dtype(at::ScalarType dtype) { compute_ = dtype; }

  // Parameters with global names ("layers.3.wq").
  std::vector<NamedTensor> GlobalParameters() const;
  int global_index() const { return global_index_; }

 private:
  ModelConfig config_;
  int global_index_;
  at::Tensor attn_norm_, wq_, wk_, wv_, wo_;
  at::Tensor mlp_norm_, w_gate_, w_up_, w_down_;
  std::shared_ptr<LayerCapture> capture_;
  at::ScalarType compute_ = at::kFloat;
  std::array<ComputeCast, 7> casts_;  // KfacModules() order: q k v o gate up down
};
TORCH_MODULE(DecoderLayer);

// Stage 0's first part: token embedding [vocab, d_model].
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(const ModelConfig& config, uint64_t seed);
  at::Tensor forward(const at::Tensor& tokens);
  std::vector<NamedTensor> GlobalParameters() const;

 private:
  at::Tensor weight_;
};
TORCH_MODULE(Embedding);

// Stage 0's last part: final RMSNorm, LM head (untied) and the loss.
class LmHeadImpl : public torch::nn::Module {
 public:
  LmHeadImpl(const ModelConfig& config, uint64_t seed);
  // Float32 logits [B, T, vocab] (with a bf16 compute dtype the head's
  // product runs in bf16 and the logits are widened before the loss).
  at::Tensor forward(const at::Tensor& hidden);
  // Mean token cross-entropy of `hidden` against `targets` [B, T].
  at::Tensor Loss(const at::Tensor& hidden, const at::Tensor& targets);
  void set_compute_dtype(at::ScalarType dtype) { compute_ = dtype; }
  std::vector<NamedTensor> GlobalParameters() const;

 private:
  double eps_;
  at::Tensor norm_;
  at::Tensor head_;
  at::ScalarType compute_ = at::kFloat;
  ComputeCast head_cast_;
};
TORCH_MODULE(LmHead);

// The whole model as one plain module: the reference the stage split must
// match, and the baseline of the split-overhead benchmark.
class TransformerImpl : public torch::nn::Module {
 public:
  TransformerImpl(const ModelConfig& config, uint64_t seed, const at::Device& device);
  // Mean token loss with the blocks applied in `layer_order` (global indices;
  // empty = all in order). Layers may be skipped or permuted.
  at::Tensor Loss(const at::Tensor& tokens, const at::Tensor& targets,
                  const std::vector<int>& layer_order = {});
  std::vector<NamedTensor> GlobalParameters() const;
  // Compute dtype of every block and the head (DecoderLayerImpl).
  void set_compute_dtype(at::ScalarType dtype);

 private:
  ModelConfig config_;
  RotaryTables rope_;
  Embedding embed_{nullptr};
  std::vector<DecoderLayer> layers_;
  LmHead head_{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_TRANSFORMER_H_
