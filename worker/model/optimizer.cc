#include "worker/model/optimizer.h"

#include <cmath>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace {

constexpr double kPi = 3.14159265358979323846;

// Global layer index from "layers.<i>.<name>", or -1.
int LayerOf(const std::string& name) {
  if (name.rfind("layers.", 0) != 0) return -1;
  std::vector<absl::string_view> parts = absl::StrSplit(name, '.');
  int layer = -1;
  if (parts.size() < 3 || !absl::SimpleAtoi(parts[1], &layer)) return -1;
  return layer;
}

}  // namespace

double ScheduledLearningRate(const v1::OptimizerSpec& spec, uint64_t iteration,
                             uint64_t total_iterations) {
  const double peak = spec.adamw().lr() > 0 ? spec.adamw().lr() : 3e-4;
  const double floor_ratio = spec.min_lr_ratio() > 0 ? spec.min_lr_ratio() : 0.1;
  const uint64_t warmup = spec.warmup_iterations();
  if (iteration < warmup) {
    return peak * static_cast<double>(iteration + 1) / static_cast<double>(warmup);
  }
  if (spec.constant_lr()) return peak;
  const double span =
      total_iterations > warmup + 1 ? static_cast<double>(total_iterations - warmup - 1) : 1.0;
  double progress = static_cast<double>(iteration - warmup) / span;
  if (progress > 1.0) progress = 1.0;
  const double floor = peak * floor_ratio;
  return floor + (peak - floor) * 0.5 * (1.0 + std::cos(kPi * progress));
}

double GlobalClipScale(double squared_norm, double max_norm) {
  if (max_norm <= 0) return 1.0;
  const double norm = std::sqrt(squared_norm);
  return norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

AdamW::AdamW(std::vector<NamedTensor> params, const v1::AdamWSpec& spec)
    : params_(std::move(params)), moments_(params_.size()), spec_(spec) {
  if (spec_.beta1() == 0) spec_.set_beta1(0.9);
  if (spec_.beta2() == 0) spec_.set_beta2(0.95);
  if (spec_.eps() == 0) spec_.set_eps(1e-8);
}

absl::Status AdamW::Step(double lr, double grad_scale) {
  return GuardTorch("optimizer step", [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    if (grad_scale != 1.0) {
      for (auto& [name, p] : params_) {
        if (p.grad().defined()) p.mutable_grad().mul_(grad_scale);
      }
    }
    std::set<std::string> self_updated;
    if (hook_ != nullptr) {
      absl::Status begin = hook_->BeginStep(lr);
      if (!begin.ok()) {
        return absl::Status(begin.code(), absl::StrCat("precondition hook: ", begin.message()));
      }
      std::map<int, std::vector<NamedTensor>> by_layer;
      for (const auto& np : params_) {
        const int layer = LayerOf(np.first);
        if (layer >= 0 && np.second.grad().defined()) {
          by_layer[layer].push_back(np);
        }
      }
      for (const auto& [layer, group] : by_layer) {
        absl::Status s = hook_->Precondition(layer, group, lr, &self_updated);
        if (!s.ok()) {
          return absl::Status(s.code(),
                              absl::StrCat("precondition hook, layer ", layer, ": ", s.message()));
        }
      }
    }
    const double b1 = spec_.beta1();
    const double b2 = spec_.beta2();
    const double eps = spec_.eps();
    for (size_t i = 0; i < params_.size(); ++i) {
      auto& [name, p] = params_[i];
      if (!p.grad().defined() || self_updated.count(name) != 0) continue;
      Moments& mo = moments_[i];
      if (!mo.m.defined()) {
        mo.m = at::zeros_like(p);
        mo.v = at::zeros_like(p);
      }
      const at::Tensor& g = p.grad();
      ++mo.step;
      // Decoupled decay on matrices; norms (1-D) are not decayed.
      if (p.dim() >= 2 && spec_.weight_decay() > 0) {
        p.mul_(1.0 - lr * spec_.weight_decay());
      }
      mo.m.mul_(b1).add_(g, 1.0 - b1);
      mo.v.mul_(b2).addcmul_(g, g, 1.0 - b2);
      const double bc1 = 1.0 - std::pow(b1, static_cast<double>(mo.step));
      const double bc2 = 1.0 - std::pow(b2, static_cast<double>(mo.step));
      at::Tensor denom = (mo.v / bc2).sqrt_().add_(eps);
      p.addcdiv_(mo.m, denom, -lr / bc1);
    }
    return absl::OkStatus();
  });
}

std::vector<NamedTensor> AdamW::State() const {
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    const Moments& mo = moments_[i];
    out.emplace_back(name + ".adam_m", mo.m.defined() ? mo.m : at::zeros_like(p));
    out.emplace_back(name + ".adam_v", mo.v.defined() ? mo.v : at::zeros_like(p));
    out.emplace_back(name + ".adam_step",
                     at::scalar_tensor(mo.step, at::TensorOptions().dtype(at::kLong)));
  }
  return out;
}

absl::Status AdamW::LoadState(const std::map<std::string, at::Tensor>& state) {
  return GuardTorch("optimizer load state", [&]() -> absl::Status {
    for (const auto& [name, p] : params_) {
      for (const char* suffix : {".adam_m", ".adam_v"}) {
        auto it = state.find(name + suffix);
        if (it == state.end()) {
          return absl::InvalidArgumentError(absl::StrCat("optimizer state lacks ", name, suffix));
        }
        if (!it->second.sizes().equals(p.sizes())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "optimizer state ", name, suffix, ": shape ", ShapeString(it->second.sizes()),
              " vs parameter ", ShapeString(p.sizes())));
        }
      }
      auto it = state.find(name + ".adam_step");
      if (it == state.end() || it->second.numel() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("optimizer state lacks scalar ", name, ".adam_step"));
      }
      // A stored step is a count: a negative or fractional one would turn
      // the bias corrections into nonsense.
      const double step = it->second.item<double>();
      if (!(step >= 0 && step <= 9.007199254740992e15 && step == std::floor(step))) {
        return absl::InvalidArgumentError(
            absl::StrCat("optimizer state ", name, ".adam_step: ", step, " is not a step count"));
      }
    }
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto& [name, p] = params_[i];
      Moments& mo = moments_[i];
      mo.m = state.at(name + ".adam_m").to(p.device(), p.scalar_type()).clone();
      mo.v = state.at(name + ".adam_v").to(p.device(), p.scalar_type()).clone();
      mo.step = state.at(name + ".adam_step").item<int64_t>();
    }
    return absl::OkStatus();
  });
}

}  // namespace detour::model
