#include "worker/model/stage.h"

#include <map>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "common/status.h"
#include "worker/model/torch_status.h"
#include "worker/model/transformer.h"

namespace detour::model {

struct Stage::Impl {
  struct Slot {
    at::Tensor input;   // leaf with requires_grad (undefined on stage 0)
    at::Tensor output;  // graph root for Backward
    // Recomputation: no graph kept; the input (tokens on stage 0, hidden
    // states elsewhere) and the output's shape, to run the forward again
    // with gradients at Backward.
    bool recompute = false;
    at::Tensor saved_input;
    std::vector<int64_t> output_sizes;
  };

  ModelConfig config;
  int index = 0;
  int num_stages = 1;
  LayerRange range;
  StageOptions options;
  RotaryTables rope;
  Embedding embed{nullptr};
  std::vector<DecoderLayer> layers;
  LmHead head{nullptr};
  std::map<uint32_t, Slot> slots;
  std::map<uint32_t, std::vector<std::shared_ptr<LayerCapture>>> captures;
  int visits = 0;
  // Ordered accumulation (SetOrderedAccumulation): each microbatch's own
  // gradients, one per parameter in Parameters() order (undefined = none).
  bool ordered = false;
  std::map<uint32_t, std::vector<at::Tensor>> kept;

  // Runs `pass` (a backward of `mb`) with `mb`'s own gradients in the
  // parameters' .grad when ordered, the stage's back afterwards.
  template <typename F>
  auto WithOwnGradients(uint32_t mb, F pass) -> decltype(pass()) {
    if (!ordered) return pass();
    std::vector<NamedTensor> params = Parameters();
    std::vector<at::Tensor>& own = kept[mb];
    own.resize(params.size());
    std::vector<at::Tensor> stage(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      stage[i] = params[i].second.grad();
      params[i].second.mutable_grad() = own[i];
    }
    auto restore = [&] {
      for (size_t i = 0; i < params.size(); ++i) {
        own[i] = params[i].second.grad();
        params[i].second.mutable_grad() = stage[i];
      }
    };
    try {
      auto result = pass();
      restore();
      return result;
    } catch (...) {
      restore();
      throw;
    }
  }

  std::string Context(absl::string_view what, uint32_t mb) const {
    return absl::StrCat("stage ", index, " ", what, " mb ", mb);
  }

  absl::Status CheckTokens(const at::Tensor& t, absl::string_view name,
                           const std::string& ctx) const {
    if (!t.defined() || t.dim() != 2 || t.scalar_type() != at::kLong || t.size(1) < 1 ||
        t.size(1) > config.context_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          ctx, ": ", name, " ", t.defined() ? ShapeString(t.sizes()) : std::string("undefined"),
          " ", t.defined() ? std::string(c10::toString(t.scalar_type())) : "",
          " vs expected int64 [B, T<=", config.context_length, "]"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckHidden(const at::Tensor& t, const std::string& ctx) const {
    if (!t.defined() || t.dim() != 3 || t.scalar_type() != at::kFloat || t.size(1) < 1 ||
        t.size(1) > config.context_length || t.size(2) != config.d_model) {
      return absl::InvalidArgumentError(absl::StrCat(
          ctx, ": shape ", t.defined() ? ShapeString(t.sizes()) : std::string("undefined"), " ",
          t.defined() ? std::string(c10::toString(t.scalar_type())) : "",
          " vs expected float [B, T<=", config.context_length, ", ", config.d_model, "]"));
    }
    return absl::OkStatus();
  }

  at::Tensor RunLayers(at::Tensor x) {
    for (auto& layer : layers) x = layer->forward(x, rope);
    return x;
  }

  std::vector<NamedTensor> Parameters() const {
    std::vector<NamedTensor> out;
    if (embed) out = embed->GlobalParameters();
    for (const auto& layer : layers) {
      auto p = layer->GlobalParameters();
      out.insert(out.end(), p.begin(), p.end());
    }
    if (head) {
      auto h = head->GlobalParameters();
      out.insert(out.end(), h.begin(), h.end());
    }
    return out;
  }
};

namespace {

// Whether `device` runs what a bf16 forward and backward need: a product,
// a softmax and their gradients, in bfloat16.
absl::Status CheckComputeDtype(at::ScalarType dtype, c10::Device device) {
  if (dtype == at::kFloat) return absl::OkStatus();
  if (dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat("compute dtype ", c10::toString(dtype),
                                                   ": only float32 and bfloat16 are supported"));
  }
  absl::Status probe = GuardTorch("bfloat16 probe", [&]() -> absl::Status {
    c10::AutoGradMode grad(true);
    at::Tensor w = at::ones({4, 4}, at::TensorOptions().device(device)).requires_grad_(true);
    at::Tensor x = at::ones({2, 4}, at::TensorOptions().device(device).dtype(at::kBFloat16));
    at::Tensor y = at::softmax(at::linear(x, w.to(at::kBFloat16)), -1).to(at::kFloat).sum();
    torch::autograd::backward({y});
    if (!w.grad().defined() || w.grad().scalar_type() != at::kFloat) {
      return absl::InternalError("no float32 gradient");
    }
    return absl::OkStatus();
  });
  if (!probe.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("pipeline.precision PRECISION_BF16: device ",
                                                      device.str(), " cannot compute in bfloat16 (",
                                                      probe.message(), "); use PRECISION_FP32"));
  }
  return absl::OkStatus();
}

}  // namespace

at::ScalarType ComputeDtype(v1::Precision precision) {
  return precision == v1::PRECISION_BF16 ? at::kBFloat16 : at::kFloat;
}

Stage::Stage(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Stage::~Stage() = default;

absl::StatusOr<std::unique_ptr<Stage>> Stage::Create(const ModelConfig& config, int stage,
                                                     int num_stages, const StageOptions& options) {
  auto range = StageLayerRange(config.num_layers, num_stages, stage);
  if (!range.ok()) return range.status();
  if (options.memory_slots < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("pipeline.memory_slots: ", options.memory_slots, " must be >= 1"));
  }
  RETURN_IF_ERROR(CheckComputeDtype(options.compute_dtype, options.device));
  return GuardTorch(absl::StrCat("stage ", stage, " construction"),
                    [&]() -> absl::StatusOr<std::unique_ptr<Stage>> {
                      auto impl = std::make_unique<Impl>();
                      impl->config = config;
                      impl->index = stage;
                      impl->num_stages = num_stages;
                      impl->range = *range;
                      impl->options = options;
                      impl->rope = RotaryTables::Make(config, options.device);
                      if (stage == 0) {
                        impl->embed = Embedding(config, options.seed);
                        impl->embed->to(options.device);
                        impl->head = LmHead(config, options.seed);
                        impl->head->to(options.device);
                        impl->head->set_compute_dtype(options.compute_dtype);
                      }
                      for (int i = range->begin; i < range->end; ++i) {
                        impl->layers.push_back(DecoderLayer(config, i, options.seed));
                        impl->layers.back()->to(options.device);
                        impl->layers.back()->set_compute_dtype(options.compute_dtype);
                      }
                      return std::unique_ptr<Stage>(new Stage(std::move(impl)));
                    });
}

absl::StatusOr<std::unique_ptr<Stage>> Stage::FromJobSpec(const v1::JobSpec& spec, int stage,
                                                          c10::Device device) {
  v1::JobSpec s = spec;
  ApplyJobDefaults(&s);
  auto config = ModelConfigFromShape(s.model());
  if (!config.ok()) return config.status();
  StageOptions options;
  options.memory_slots = static_cast<int>(s.pipeline().memory_slots());
  options.recompute_activations = s.pipeline().recompute_activations();
  options.compute_dtype = ComputeDtype(s.pipeline().precision());
  options.device = device;
  options.seed = s.seed();
  return Create(*config, stage, static_cast<int>(s.pipeline().num_stages()), options);
}

int Stage::index() const { return impl_->index; }
int Stage::num_stages() const { return impl_->num_stages; }
LayerRange Stage::layers() const { return impl_->range; }
const ModelConfig& Stage::config() const { return impl_->config; }
c10::Device Stage::device() const { return impl_->options.device; }

absl::StatusOr<at::Tensor> Stage::Forward(uint32_t mb, const at::Tensor& input) {
  Impl& s = *impl_;
  const std::string ctx = s.Context("forward", mb);
  if (s.slots.count(mb) != 0) {
    return absl::AlreadyExistsError(absl::StrCat(ctx, ": microbatch already in flight"));
  }
  if (static_cast<int>(s.slots.size()) >= s.options.memory_slots) {
    return absl::ResourceExhaustedError(
        absl::StrCat(ctx, ": all ", s.options.memory_slots,
                     " memory slots hold microbatches awaiting backward"));
  }
  if (s.index == 0) {
    RETURN_IF_ERROR(s.CheckTokens(input, "tokens", ctx));
  } else {
    RETURN_IF_ERROR(s.CheckHidden(input, ctx));
  }
  return GuardTorch(ctx, [&]() -> absl::StatusOr<at::Tensor> {
    c10::AutoGradMode grad(true);
    Impl::Slot slot;
    at::Tensor x;
    if (s.index == 0) {
      x = s.embed->forward(input.to(s.options.device));
    } else {
      slot.input = input.to(s.options.device).detach().requires_grad_(true);
      x = slot.input;
    }
    auto cap = s.captures.find(mb);
    if (cap != s.captures.end()) {
      // One-shot: the records belong to the capture's owner; the layers
      // drop their references whatever happens in the forward.
      std::vector<std::shared_ptr<LayerCapture>> records = std::move(cap->second);
      s.captures.erase(cap);
      struct Reset {
        std::vector<DecoderLayer>* layers;
        ~Reset() {
          for (auto& l : *layers) l->set_capture(nullptr);
        }
      } reset{&s.layers};
      for (size_t i = 0; i < s.layers.size(); ++i) {
        s.layers[i]->set_capture(records[i]);
      }
      slot.output = s.RunLayers(x);
    } else if (s.options.recompute_activations) {
      // Keep only the input; the graph is rebuilt at Backward.
      c10::AutoGradMode no_grad(false);
      slot.recompute = true;
      slot.saved_input = input.to(s.options.device).detach();
      slot.input = at::Tensor();
      at::Tensor y =
          s.RunLayers(s.index == 0 ? s.embed->forward(slot.saved_input) : slot.saved_input);
      slot.output_sizes = y.sizes().vec();
      s.slots.emplace(mb, std::move(slot));
      return y;
    } else {
      slot.output = s.RunLayers(x);
    }
    at::Tensor out = slot.output.detach();
    slot.output_sizes = out.sizes().vec();
    s.slots.emplace(mb, std::move(slot));
    return out;
  });
}

absl::StatusOr<at::Tensor> Stage::Backward(uint32_t mb, const at::Tensor& grad_output) {
  Impl& s = *impl_;
  const std::string ctx = s.Context("backward", mb);
  auto it = s.slots.find(mb);
  if (it == s.slots.end()) {
    return absl::NotFoundError(absl::StrCat(ctx, ": microbatch has no forward in flight"));
  }
  if (!grad_output.defined() || !grad_output.sizes().equals(it->second.output_sizes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        ctx, ": gradient shape ",
        grad_output.defined() ? ShapeString(grad_output.sizes()) : std::string("undefined"),
        " vs expected ", ShapeString(it->second.output_sizes)));
  }
  auto result = GuardTorch(ctx, [&]() -> absl::StatusOr<at::Tensor> {
    Impl::Slot& slot = it->second;
    if (slot.recompute) {
      c10::AutoGradMode grad(true);
      at::Tensor x;
      if (s.index == 0) {
        x = s.embed->forward(slot.saved_input);
      } else {
        slot.input = slot.saved_input.requires_grad_(true);
        x = slot.input;
      }
      slot.output = s.RunLayers(x);
    }
    s.WithOwnGradients(mb, [&] {
      torch::autograd::backward({slot.output},
                                {grad_output.to(s.options.device).to(slot.output.scalar_type())});
      return 0;
    });
    at::Tensor grad_in;
    if (slot.input.defined()) grad_in = slot.input.grad();
    return grad_in;
  });
  // The graph is consumed (or broken) either way: free the slot.
  s.slots.erase(it);
  if (result.ok()) ++s.visits;
  return result;
}

absl::StatusOr<LossOutput> Stage::LossAndBackward(uint32_t mb, const at::Tensor& hidden,
                                                  const at::Tensor& targets) {
  Impl& s = *impl_;
  const std::string ctx = s.Context("loss", mb);
  if (s.index != 0) {
    return absl::FailedPreconditionError(absl::StrCat(ctx, ": only stage 0 holds the LM head"));
  }
  RETURN_IF_ERROR(s.CheckHidden(hidden, ctx));
  RETURN_IF_ERROR(s.CheckTokens(targets, "targets", ctx));
  if (targets.size(0) != hidden.size(0) || targets.size(1) != hidden.size(1)) {
    return absl::InvalidArgumentError(absl::StrCat(ctx, ": targets ", ShapeString(targets.sizes()),
                                                   " vs hidden ", ShapeString(hidden.sizes())));
  }
  return GuardTorch(ctx, [&]() -> absl::StatusOr<LossOutput> {
    c10::AutoGradMode grad(true);
    at::Tensor h = hidden.to(s.options.device).detach().requires_grad_(true);
    at::Tensor loss = s.head->Loss(h, targets.to(s.options.device));
    s.WithOwnGradients(mb, [&] {
      torch::autograd::backward({loss});
      return 0;
    });
    LossOutput out;
    out.loss = loss.item<double>();
    out.tokens = targets.numel();
    out.grad_hidden = h.grad();
    return out;
  });
}

absl::StatusOr<at::Tensor> Stage::Infer(const at::Tensor& input) {
  Impl& s = *impl_;
  const std::string ctx = absl::StrCat("stage ", s.index, " inference");
  if (s.index == 0) {
    RETURN_IF_ERROR(s.CheckTokens(input, "tokens", ctx));
  } else {
    RETURN_IF_ERROR(s.CheckHidden(input, ctx));
  }
  return GuardTorch(ctx, [&]() -> absl::StatusOr<at::Tensor> {
    c10::NoGradGuard no_grad;
    at::Tensor x = input.to(s.options.device);
    if (s.index == 0) x = s.embed->forward(x);
    return s.RunLayers(x);
  });
}

absl::StatusOr<std::pair<double, int64_t>> Stage::InferLoss(const at::Tensor& hidden,
                                                            const at::Tensor& targets) {
  Impl& s = *impl_;
  const std::string ctx = absl::StrCat("stage ", s.index, " inference loss");
  if (s.index != 0) {
    return absl::FailedPreconditionError(absl::StrCat(ctx, ": only stage 0 holds the LM head"));
  }
  RETURN_IF_ERROR(s.CheckHidden(hidden, ctx));
  RETURN_IF_ERROR(s.CheckTokens(targets, "targets", ctx));
  return GuardTorch(ctx, [&]() -> absl::StatusOr<std::pair<double, int64_t>> {
    c10::NoGradGuard no_grad;
    at::Tensor logits = s.head->forward(hidden.to(s.options.device));
    at::Tensor nll =
        at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}),
                               targets.to(s.options.device).reshape({-1}), {}, at::Reduction::Sum);
    return std::make_pair(nll.item<double>(), targets.numel());
  });
}

void Stage::Drop(uint32_t mb) { impl_->slots.erase(mb); }
void Stage::DropAll() { impl_->slots.clear(); }
int Stage::in_flight() const { return static_cast<int>(impl_->slots.size()); }

std::vector<NamedTensor> Stage::Parameters() const { return impl_->Parameters(); }

int Stage::visits() const { return impl_->visits; }

void Stage::ZeroGrad() {
  for (auto& [name, p] : impl_->Parameters()) {
    if (p.mutable_grad().defined()) p.mutable_grad() = at::Tensor();
  }
  impl_->visits = 0;
  impl_->kept.clear();
}

void Stage::SetOrderedAccumulation(bool on) { impl_->ordered = on; }

size_t Stage::kept_gradients() const { return impl_->kept.size(); }

absl::Status Stage::FoldGradients(std::optional<uint32_t> below) {
  Impl& s = *impl_;
  if (s.kept.empty()) return absl::OkStatus();
  return GuardTorch(absl::StrCat("stage ", s.index, " fold gradients"), [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    std::vector<NamedTensor> params = s.Parameters();
    for (auto it = s.kept.begin(); it != s.kept.end() && (!below || it->first < *below);
         it = s.kept.erase(it)) {
      for (size_t i = 0; i < params.size() && i < it->second.size(); ++i) {
        const at::Tensor& g = it->second[i];
        if (!g.defined()) continue;
        at::Tensor& sum = params[i].second.mutable_grad();
        if (sum.defined()) {
          sum.add_(g);
        } else {
          sum = g;
        }
      }
    }
    return absl::OkStatus();
  });
}

absl::Status Stage::ScaleGradients(double factor) {
  return GuardTorch(absl::StrCat("stage ", impl_->index, " scale gradients"),
                    [&]() -> absl::Status {
                      c10::NoGradGuard no_grad;
                      for (auto& [name, p] : impl_->Parameters()) {
                        if (p.grad().defined()) p.mutable_grad().mul_(factor);
                      }
                      return absl::OkStatus();
                    });
}

absl::StatusOr<double> Stage::SquaredGradNorm(const std::set<std::string>* exclude) const {
  return GuardTorch(absl::StrCat("stage ", impl_->index, " gradient norm"),
                    [&]() -> absl::StatusOr<double> {
                      c10::NoGradGuard no_grad;
                      double total = 0;
                      for (auto& [name, p] : impl_->Parameters()) {
                        if (exclude != nullptr && exclude->count(name)) continue;
                        if (p.grad().defined()) {
                          total += p.grad().to(at::kDouble).pow(2).sum().item<double>();
                        }
                      }
                      return total;
                    });
}

absl::Status Stage::SetCapture(uint32_t mb, std::vector<std::shared_ptr<LayerCapture>> records) {
  if (records.size() != impl_->layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("stage ", impl_->index, " capture mb ", mb, ": ",
                                                   records.size(), " records for ",
                                                   impl_->layers.size(), " blocks"));
  }
  impl_->captures[mb] = std::move(records);
  return absl::OkStatus();
}

void Stage::ClearCapture(uint32_t mb) { impl_->captures.erase(mb); }

double GradNormalizationScale(v1::GradNormalization mode, int visits, int total_microbatches) {
  if (visits <= 0) return 0.0;
  if (mode == v1::GRAD_NORM_TOTAL) {
    return total_microbatches > 0 ? 1.0 / total_microbatches : 0.0;
  }
  return 1.0 / visits;
}

}  // namespace detour::model
