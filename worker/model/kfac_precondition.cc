// Kfac's use of the inverses that kfac.cc builds and activates: which layers
// K-FAC steps (agreed among replicas), the preconditioned gradients, and the
// two update rules. kfac.h documents them.
#include "worker/model/kfac.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/kfac_workload.h"
#include "common/status.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace {

// (layer, module index) of "layers.<i>.<suffix>", or (-1, -1).
std::pair<int, int> ProjectionOf(const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '.');
  int layer = -1;
  if (parts.size() != 3 || parts[0] != "layers" || !absl::SimpleAtoi(parts[1], &layer)) {
    return {-1, -1};
  }
  for (int m = 0; m < kfac::kNumProjections; ++m) {
    if (parts[2] == kfac::Projections()[m].param_suffix) return {layer, m};
  }
  return {-1, -1};
}

}  // namespace

absl::StatusOr<at::Tensor> KfacPreconditionedGradient(const at::Tensor& grad,
                                                      const at::Tensor& a_inv,
                                                      const at::Tensor& b_inv) {
  if (!grad.defined() || !a_inv.defined() || !b_inv.defined() || grad.dim() != 2 ||
      a_inv.size(0) != grad.size(1) || b_inv.size(0) != grad.size(0)) {
    return absl::InvalidArgumentError(
        "K-FAC precondition: need grad [f_out, f_in], A⁻¹ [f_in, f_in], "
        "B⁻¹ [f_out, f_out]");
  }
  return GuardTorch("K-FAC precondition", [&]() -> absl::StatusOr<at::Tensor> {
    c10::NoGradGuard no_grad;
    return at::matmul(at::matmul(b_inv, grad), a_inv);
  });
}

bool Kfac::replicas_ready(int layer) const {
  auto it = layers_.find(layer);
  return it != layers_.end() && it->second.replicas_ready;
}

bool Kfac::steps_layer(int layer) const {
  return replicas_precondition_ ? replicas_ready(layer) && has_inverses(layer)
                                : has_inverses(layer);
}

at::Tensor Kfac::ReadyVotes() const {
  std::vector<float> votes;
  for (const auto& [layer, st] : layers_) votes.push_back(has_inverses(layer) ? 1.0f : 0.0f);
  return at::tensor(votes, at::TensorOptions().dtype(at::kFloat));
}

absl::Status Kfac::AgreeReady(const at::Tensor& votes, int members) {
  if (!votes.defined() || votes.numel() != static_cast<int64_t>(layers_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("K-FAC replica votes: ", votes.defined() ? votes.numel() : 0, " values for ",
                     layers_.size(), " layers"));
  }
  const at::Tensor v = votes.to(at::kCPU).to(at::kFloat).contiguous();
  const float* data = v.data_ptr<float>();
  size_t i = 0;
  for (auto& [layer, st] : layers_) {
    // Exact: small whole numbers in float.
    st.agreed = data[i++] == static_cast<float>(members);
  }
  return absl::OkStatus();
}

std::vector<int> Kfac::CommitAgreement() {
  std::vector<int> fresh;
  for (auto& [layer, st] : layers_) {
    if (st.agreed && !st.replicas_ready) fresh.push_back(layer);
    if (st.agreed) st.replicas_ready = true;
    st.agreed = false;
  }
  return fresh;
}

absl::Status Kfac::PreconditionFlat(const std::vector<NamedTensor>& params,
                                    at::Tensor* flat) const {
  return GuardTorch("K-FAC preconditioning the local gradient", [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    int64_t offset = 0;
    for (const auto& [name, p] : params) {
      const int64_t n = p.numel();
      if (offset + n > flat->numel()) {
        return absl::InvalidArgumentError(absl::StrCat("K-FAC precondition: the flat gradient has ",
                                                       flat->numel(), " values, fewer than ",
                                                       "the parameters need"));
      }
      const auto [layer, m] = ProjectionOf(name);
      if (m >= 0 && steps_layer(layer)) {
        const Projection& proj = layers_.at(layer).proj[m];
        at::Tensor slice = flat->narrow(0, offset, n).view(p.sizes());
        at::Tensor pre =
            at::matmul(at::matmul(proj.b_inv, slice.to(proj.b_inv.device())), proj.a_inv);
        slice.copy_(pre.to(at::kCPU));
      }
      offset += n;
    }
    return absl::OkStatus();
  });
}

absl::Status Kfac::PreconditionInPlace() {
  RETURN_IF_ERROR(GuardTorch("K-FAC preconditioning the gradient", [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    for (const auto& [name, p] : stage_->Parameters()) {
      const auto [layer, m] = ProjectionOf(name);
      if (m < 0 || !p.grad().defined() || !steps_layer(layer)) continue;
      const Projection& proj = layers_.at(layer).proj[m];
      at::Tensor g = p.grad();
      g.copy_(at::matmul(at::matmul(proj.b_inv, g), proj.a_inv));
    }
    return absl::OkStatus();
  }));
  return AgreeReady(ReadyVotes(), 1);
}

std::set<std::string> Kfac::PreconditionedParameters() const {
  std::set<std::string> out;
  if (!replicas_precondition_) return out;
  for (const auto& [name, p] : stage_->Parameters()) {
    const auto [layer, m] = ProjectionOf(name);
    if (m >= 0 && steps_layer(layer)) out.insert(name);
  }
  return out;
}

absl::Status Kfac::BeginStep(double lr) {
  step_updates_.clear();
  step_lr_ = kfac_lr_ * lr / adamw_lr_;
  last_kl_scale_ = 1;
  if (update_ == v1::KFAC_UPDATE_GRAFT_ADAMW) return absl::OkStatus();
  return GuardTorch("K-FAC step", [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    double vg = 0;
    for (const auto& [name, p] : stage_->Parameters()) {
      const auto [layer, m] = ProjectionOf(name);
      if (m < 0 || !p.grad().defined() || !has_inverses(layer)) continue;
      const Projection& proj = layers_.at(layer).proj[m];
      const at::Tensor& g = p.grad();
      at::Tensor delta = at::matmul(at::matmul(proj.b_inv, g), proj.a_inv);
      vg += (delta * g).sum().item<double>();
      step_updates_[name] = delta;
    }
    if (kl_clip_ > 0 && vg > 0 && std::isfinite(vg)) {
      last_kl_scale_ = std::min(1.0, std::sqrt(kl_clip_ / (step_lr_ * step_lr_ * vg)));
    }
    if (last_kl_scale_ != 1) {
      for (auto& [name, delta] : step_updates_) delta.mul_(last_kl_scale_);
    }
    return absl::OkStatus();
  });
}

absl::Status Kfac::Precondition(int layer, const std::vector<NamedTensor>& params, double lr,
                                std::set<std::string>* self_updated) {
  if (!steps_layer(layer)) return absl::OkStatus();  // AdamW's
  if (update_ == v1::KFAC_UPDATE_GRAFT_ADAMW) {
    step_lr_ = kfac_lr_ * lr / adamw_lr_;
    return GraftStep(layer, params, self_updated);
  }
  // Without BeginStep (a caller other than AdamW::Step), compute the step now.
  for (const auto& [name, p] : params) {
    if (ProjectionOf(name).second >= 0 && p.grad().defined() && step_updates_.count(name) == 0) {
      RETURN_IF_ERROR(BeginStep(lr));
      break;
    }
  }
  LayerState& st = layers_.at(layer);
  return GuardTorch(absl::StrCat("K-FAC precondition layer ", layer), [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    for (const auto& [name, p] : params) {
      const auto [l, m] = ProjectionOf(name);
      auto it = step_updates_.find(name);
      if (m < 0 || l != layer || it == step_updates_.end()) continue;
      at::Tensor grad = p.grad();
      grad.copy_(it->second);
      Projection& proj = st.proj[m];
      if (!proj.momentum.defined() || momentum_ == 0) {
        proj.momentum = grad.clone();
      } else {
        proj.momentum.mul_(momentum_).add_(grad);
      }
      at::Tensor w = p;
      if (weight_decay_ > 0) w.mul_(1.0 - step_lr_ * weight_decay_);
      w.add_(proj.momentum, -step_lr_);
      self_updated->insert(name);
      step_updates_.erase(it);
    }
    return absl::OkStatus();
  });
}

absl::Status Kfac::GraftStep(int layer, const std::vector<NamedTensor>& params,
                             std::set<std::string>* self_updated) {
  LayerState& st = layers_.at(layer);
  return GuardTorch(absl::StrCat("K-FAC grafted step layer ", layer), [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    for (const auto& [name, p] : params) {
      const auto [l, m] = ProjectionOf(name);
      if (m < 0 || l != layer || !p.grad().defined()) continue;
      Projection& proj = st.proj[m];
      at::Tensor grad = p.grad();
      if (!proj.adam_m.defined()) {
        proj.adam_m = at::zeros_like(grad);
        proj.adam_v = at::zeros_like(grad);
        proj.adam_step = 0;
      }
      ++proj.adam_step;
      proj.adam_m.mul_(beta1_).add_(grad, 1.0 - beta1_);
      proj.adam_v.mul_(beta2_).addcmul_(grad, grad, 1.0 - beta2_);
      const double step = static_cast<double>(proj.adam_step);
      const double bc1 = 1.0 - std::pow(beta1_, step);
      const double bc2 = 1.0 - std::pow(beta2_, step);
      at::Tensor m_hat = proj.adam_m / bc1;
      at::Tensor adam = m_hat / (proj.adam_v / bc2).sqrt_().add_(eps_);
      // With replicas preconditioning, g is already B⁻¹·G·A⁻¹ (reduced).
      at::Tensor dir = replicas_precondition_
                           ? m_hat.clone()
                           : at::matmul(at::matmul(proj.b_inv, m_hat), proj.a_inv);
      const double adam_norm = adam.norm().item<double>();
      const double dir_norm = dir.norm().item<double>();
      at::Tensor s;
      if (dir_norm > 0 && std::isfinite(dir_norm) && std::isfinite(adam_norm)) {
        proj.graft_scale = adam_norm / dir_norm;
        s = dir.mul_(proj.graft_scale);
      } else {
        proj.graft_scale = 0;
        s = adam;
      }
      grad.copy_(s);
      at::Tensor w = p;
      if (weight_decay_ > 0) w.mul_(1.0 - step_lr_ * weight_decay_);
      w.add_(s, -step_lr_);
      self_updated->insert(name);
    }
    return absl::OkStatus();
  });
}

}  // namespace detour::model
