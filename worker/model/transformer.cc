#include "worker/model/transformer.h"

#include <cmath>

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "worker/model/text_data.h"

namespace detour::model {
namespace {

constexpr double kInitStd = 0.02;

}  // namespace

at::Tensor InitNormal(uint64_t seed, const std::string& name, at::IntArrayRef sizes, double std) {
  uint64_t state = seed ^ Fnv1a64Of(name);
  const uint64_t derived = SplitMix64(&state);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(derived);
  return at::normal(0.0, std, sizes, gen, at::TensorOptions().dtype(at::kFloat));
}

RotaryTables RotaryTables::Make(const ModelConfig& config, const at::Device& device) {
  const int half = config.head_dim() / 2;
  // Computed in double on the CPU so every device sees the same angles.
  at::Tensor inv_freq =
      at::pow(config.rope_theta, -at::arange(0, half, at::TensorOptions().dtype(at::kDouble)) *
                                     2.0 / config.head_dim());
  at::Tensor pos = at::arange(0, config.context_length, at::TensorOptions().dtype(at::kDouble));
  at::Tensor angles = at::outer(pos, inv_freq);
  RotaryTables t;
  t.cos = at::cos(angles).to(at::kFloat).to(device);
  t.sin = at::sin(angles).to(at::kFloat).to(device);
  return t;
}

at::Tensor ComputeCast::Of(const at::Tensor& master, at::ScalarType dtype) {
  if (master.scalar_type() == dtype) return master;
  const bool grad = c10::GradMode::is_enabled() && master.requires_grad();
  Entry& e = grad ? with_grad_ : without_grad_;
  if (!e.cast.defined() || e.cast.scalar_type() != dtype || e.version != master._version() ||
      e.data != master.data_ptr()) {
    e.cast = master.to(dtype);
    e.version = master._version();
    e.data = master.data_ptr();
  }
  return e.cast;
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

at::Tensor ApplyRotary(const at::Tensor& x, const RotaryTables& rope) {
  const int64_t t = x.size(2);
  const int64_t half = x.size(3) / 2;
  at::Tensor cos = rope.cos.narrow(0, 0, t);
  at::Tensor sin = rope.sin.narrow(0, 0, t);
  at::Tensor x1 = x.narrow(-1, 0, half);
  at::Tensor x2 = x.narrow(-1, half, half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& config, int global_index, uint64_t seed)
    : config_(config), global_index_(global_index) {
  const int64_t d = config.d_model;
  const int64_t kv = static_cast<int64_t>(config.num_kv_heads) * config.head_dim();
  const int64_t f = config.ffn_dim;
  const double out_std = kInitStd / std::sqrt(2.0 * config.num_layers);
  const std::string p = absl::StrCat("layers.", global_index, ".");
  auto ones = at::ones({d}, at::TensorOptions().dtype(at::kFloat));
  attn_norm_ = register_parameter("attn_norm", ones.clone());
  wq_ = register_parameter("wq", InitNormal(seed, p + "wq", {d, d}, kInitStd));
  wk_ = register_parameter("wk", InitNormal(seed, p + "wk", {kv, d}, kInitStd));
  wv_ = register_parameter("wv", InitNormal(seed, p + "wv", {kv, d}, kInitStd));
  wo_ = register_parameter("wo", InitNormal(seed, p + "wo", {d, d}, out_std));
  mlp_norm_ = register_parameter("mlp_norm", ones.clone());
  w_gate_ = register_parameter("w_gate", InitNormal(seed, p + "w_gate", {f, d}, kInitStd));
  w_up_ = register_parameter("w_up", InitNormal(seed, p + "w_up", {f, d}, kInitStd));
  w_down_ = register_parameter("w_down", InitNormal(seed, p + "w_down", {d, f}, out_std));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& x, const RotaryTables& rope) {
  const int64_t b = x.size(0);
  const int64_t t = x.size(1);
  const int64_t h = config_.num_heads;
  const int64_t kvh = config_.num_kv_heads;
  const int64_t hd = config_.head_dim();
  LayerCapture* cap = capture_.get();
  std::weak_ptr<LayerCapture> weak = capture_;
  // In float32 both are the identity, and the arithmetic is exactly the
  // all-float32 model's.
  const bool low = compute_ != at::kFloat;
  auto lowered = [&](const at::Tensor& t) { return low ? t.to(compute_) : t; };
  // y = a·Wᵀ (W in the compute dtype); with a capture, keeps a and hooks
  // y's gradient.
  auto project = [&](const at::Tensor& a, const at::Tensor& master, int input, int module) {
    const at::Tensor w = low ? casts_[module].Of(master, compute_) : master;
    at::Tensor y = at::linear(a, w);
    if (cap != nullptr) {
      if (!cap->inputs[input].defined()) cap->inputs[input] = a.detach();
      if (y.requires_grad()) {
        y.register_hook([weak, module](const at::Tensor& grad) {
          if (auto c = weak.lock()) c->output_grads[module] = grad.detach();
        });
      }
    }
    return y;
  };

  at::Tensor a = lowered(RmsNorm(x, attn_norm_, config_.norm_eps));
  at::Tensor q = project(a, wq_, LayerCapture::kAttnIn, 0).view({b, t, h, hd}).transpose(1, 2);
  at::Tensor k = project(a, wk_, LayerCapture::kAttnIn, 1).view({b, t, kvh, hd}).transpose(1, 2);
  at::Tensor v = project(a, wv_, LayerCapture::kAttnIn, 2).view({b, t, kvh, hd}).transpose(1, 2);
  // The float32 tables promote a bf16 q, k: the rotation runs in float32.
  q = lowered(ApplyRotary(q, rope));
  k = lowered(ApplyRotary(k, rope));
  if (kvh != h) {
    k = k.repeat_interleave(h / kvh, /*dim=*/1);
    v = v.repeat_interleave(h / kvh, /*dim=*/1);
  }
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  at::Tensor mask = at::ones({t, t}, x.options().dtype(at::kBool)).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  // With bf16 scores LibTorch's softmax kernel accumulates in float32 and
  // only rounds its result (on the CPU it equals the float32 softmax rounded
  // to bf16); the probabilities kept for the backward are bf16.
  at::Tensor attn = at::matmul(at::softmax(scores, -1), v);
  attn = attn.transpose(1, 2).reshape({b, t, h * hd});
  // float32 + bf16 is float32: the residual stream keeps full precision.
  at::Tensor y = x + project(attn, wo_, LayerCapture::kAttnOut, 3);

  at::Tensor m = lowered(RmsNorm(y, mlp_norm_, config_.norm_eps));
  at::Tensor gated = at::silu(project(m, w_gate_, LayerCapture::kMlpIn, 4)) *
                     project(m, w_up_, LayerCapture::kMlpIn, 5);
  at::Tensor out = y + project(gated, w_down_, LayerCapture::kMlpHidden, 6);
  if (cap != nullptr) cap->forward_done = true;
  return out;
}

std::vector<NamedTensor> DecoderLayerImpl::GlobalParameters() const {
  const std::string p = absl::StrCat("layers.", global_index_, ".");
  return {{p + "attn_norm", attn_norm_},
          {p + "wq", wq_},
          {p + "wk", wk_},
          {p + "wv", wv_},
          {p + "wo", wo_},
          {p + "mlp_norm", mlp_norm_},
          {p + "w_gate", w_gate_},
          {p + "w_up", w_up_},
          {p + "w_down", w_down_}};
}

EmbeddingImpl::EmbeddingImpl(const ModelConfig& config, uint64_t seed) {
  weight_ = register_parameter(
      "weight", InitNormal(seed, "embed.weight", {config.vocab_size, config.d_model}, kInitStd));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& tokens) {
  return at::embedding(weight_, tokens);
}

std::vector<NamedTensor> EmbeddingImpl::GlobalParameters() const {
  return {{"embed.weight", weight_}};
}

LmHeadImpl::LmHeadImpl(const ModelConfig& config, uint64_t seed) : eps_(config.norm_eps) {
  norm_ =
      register_parameter("norm", at::ones({config.d_model}, at::TensorOptions().dtype(at::kFloat)));
  head_ = register_parameter(
      "head", InitNormal(seed, "head.weight", {config.vocab_size, config.d_model}, kInitStd));
}

at::Tensor LmHeadImpl::forward(const at::Tensor& hidden) {
  if (compute_ == at::kFloat) return at::linear(RmsNorm(hidden, norm_, eps_), head_);
  return at::linear(RmsNorm(hidden, norm_, eps_).to(compute_), head_cast_.Of(head_, compute_))
      .to(at::kFloat);
}

at::Tensor LmHeadImpl::Loss(const at::Tensor& hidden, const at::Tensor& targets) {
  at::Tensor logits = forward(hidden);
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

std::vector<NamedTensor> LmHeadImpl::GlobalParameters() const {
  return {{"norm.weight", norm_}, {"head.weight", head_}};
}

TransformerImpl::TransformerImpl(const ModelConfig& config, uint64_t seed, const at::Device& device)
    : config_(config), rope_(RotaryTables::Make(config, device)) {
  embed_ = register_module("embed", Embedding(config, seed));
  for (int i = 0; i < config.num_layers; ++i) {
    layers_.push_back(register_module(absl::StrCat("layer", i), DecoderLayer(config, i, seed)));
  }
  head_ = register_module("head", LmHead(config, seed));
  to(device);
}

at::Tensor TransformerImpl::Loss(const at::Tensor& tokens, const at::Tensor& targets,
                                 const std::vector<int>& layer_order) {
  at::Tensor x = embed_->forward(tokens);
  if (layer_order.empty()) {
    for (auto& layer : layers_) x = layer->forward(x, rope_);
  } else {
    for (int i : layer_order) x = layers_.at(i)->forward(x, rope_);
  }
  return head_->Loss(x, targets);
}

void TransformerImpl::set_compute_dtype(at::ScalarType dtype) {
  for (auto& layer : layers_) layer->set_compute_dtype(dtype);
  head_->set_compute_dtype(dtype);
}

std::vector<NamedTensor> TransformerImpl::GlobalParameters() const {
  std::vector<NamedTensor> out = embed_->GlobalParameters();
  for (const auto& layer : layers_) {
    auto p = layer->GlobalParameters();
    out.insert(out.end(), p.begin(), p.end());
  }
  auto h = head_->GlobalParameters();
  out.insert(out.end(), h.begin(), h.end());
  return out;
}

}  // namespace detour::model
