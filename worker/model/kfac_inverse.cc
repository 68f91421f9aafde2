#include "worker/model/kfac_inverse.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "common/kfac_workload.h"
#include "common/status.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace {

// Damping levels tried: λ, 10λ, ... (each in F's dtype, then fp64).
constexpr int kDampingLevels = 5;

bool AllFinite(const at::Tensor& t) { return at::isfinite(t).all().item<bool>(); }

}  // namespace

DampedInverseWork::DampedInverseWork(const at::Tensor& factor, double damping)
    : factor_(factor),
      n_(factor.size(0)),
      blocks_(kfac::InversionBlocks(factor.size(0))),
      weights_(kfac::InversionUnitWeights(factor.size(0))),
      base_damping_(std::max(damping, kMinKfacDamping)),
      damping_(std::max(damping, kMinKfacDamping)) {}

absl::StatusOr<std::unique_ptr<DampedInverseWork>> DampedInverseWork::Start(
    const at::Tensor& factor, double damping) {
  if (!factor.defined() || factor.dim() != 2 || factor.size(0) != factor.size(1) ||
      factor.size(0) == 0) {
    return absl::InvalidArgumentError("damped inverse: need a non-empty square matrix");
  }
  return GuardTorch("damped inverse", [&]() -> absl::StatusOr<std::unique_ptr<DampedInverseWork>> {
    c10::NoGradGuard no_grad;
    if (!AllFinite(factor)) {
      return absl::FailedPreconditionError("damped inverse: the factor has non-finite entries");
    }
    std::unique_ptr<DampedInverseWork> work(new DampedInverseWork(factor, damping));
    work->BeginAttempt();
    return work;
  });
}

bool DampedInverseWork::BeginAttempt() {
  if (attempt_ >= 2 * kDampingLevels) return false;
  const at::ScalarType dtype = attempt_ % 2 == 0 ? factor_.scalar_type() : at::kDouble;
  at::Tensor f = factor_.to(dtype);
  work_ = (f + f.t()) * 0.5 + at::eye(n_, f.options()) * damping_;
  inverse_ = blocks_ > 1 ? at::zeros({n_, n_}, f.options()) : at::Tensor();
  next_ = 0;
  return true;
}

bool DampedInverseWork::RunUnit() {
  if (blocks_ == 1) {
    if (next_ == 0) {
      auto [l, info] = at::linalg_cholesky_ex(work_);
      if (info.item<int64_t>() != 0) return false;
      work_ = l;
    } else {
      at::Tensor inv = at::cholesky_inverse(work_);
      if (!AllFinite(inv)) return false;
      result_ = inv.to(factor_.scalar_type());
      work_ = at::Tensor();
    }
    ++next_;
    return true;
  }
  auto start = [&](int b) { return kfac::InversionBlockStart(n_, b); };
  if (next_ < blocks_) {
    // Cholesky step k: L_kk, the panel below it (P ← P·L_kk⁻ᵀ), and the
    // later block columns' lower part (A_jj.. ← A_jj.. − P_j.. · P_jᵀ).
    const int k = next_;
    const int64_t s0 = start(k), s1 = start(k + 1);
    at::Tensor akk = work_.narrow(0, s0, s1 - s0).narrow(1, s0, s1 - s0);
    auto [l, info] = at::linalg_cholesky_ex(akk);
    if (info.item<int64_t>() != 0) return false;
    akk.copy_(l);
    if (s1 < n_) {
      at::Tensor panel = work_.narrow(0, s1, n_ - s1).narrow(1, s0, s1 - s0);
      panel.copy_(at::linalg_solve_triangular(l.t(), panel, /*upper=*/true, /*left=*/false));
      work_.narrow(0, s0, s1 - s0).narrow(1, s1, n_ - s1).zero_();
      for (int j = k + 1; j < blocks_; ++j) {
        const int64_t c0 = start(j), c1 = start(j + 1);
        at::Tensor target = work_.narrow(0, c0, n_ - c0).narrow(1, c0, c1 - c0);
        target.addmm_(panel.narrow(0, c0 - s1, n_ - c0), panel.narrow(0, c0 - s1, c1 - c0).t(),
                      /*beta=*/1.0, /*alpha=*/-1.0);
      }
    }
  } else {
    // Block column j of the inverse, rows from its diagonal down:
    // L[c0:, c0:]ᵀ \ (L[c0:, c0:] \ [I; 0]) (the rows above only need
    // L's trailing part: the two systems are triangular).
    const int j = next_ - blocks_;
    const int64_t c0 = start(j), c1 = start(j + 1);
    const int64_t h = n_ - c0, w = c1 - c0;
    at::Tensor lj = work_.narrow(0, c0, h).narrow(1, c0, h);
    at::Tensor e = at::zeros({h, w}, work_.options());
    e.narrow(0, 0, w).copy_(at::eye(w, work_.options()));
    at::Tensor x = at::linalg_solve_triangular(lj, e, /*upper=*/false);
    at::Tensor y = at::linalg_solve_triangular(lj.t(), x, /*upper=*/true);
    inverse_.narrow(0, c0, h).narrow(1, c0, w).copy_(y);
    if (j == blocks_ - 1) {
      // Symmetric by construction: the lower triangle, mirrored.
      at::Tensor full = inverse_.tril() + inverse_.tril(-1).t();
      if (!AllFinite(full)) return false;
      result_ = full.to(factor_.scalar_type());
      work_ = inverse_ = at::Tensor();
    }
  }
  ++next_;
  return true;
}

absl::Status DampedInverseWork::FinishAfterFailure() {
  while (true) {
    const double tried = damping_;
    ++attempt_;
    if (attempt_ % 2 == 0) damping_ *= 10;
    if (!BeginAttempt()) {
      work_ = inverse_ = at::Tensor();
      next_ = units();
      failed_ = absl::InternalError(
          absl::StrCat("damped inverse: Cholesky failed up to damping ", tried));
      return failed_;
    }
    bool failed = false;
    while (!done()) {
      if (!RunUnit()) {
        failed = true;
        break;
      }
    }
    if (!failed) return absl::OkStatus();
  }
}

absl::Status DampedInverseWork::RunUntil(int until) {
  if (!failed_.ok()) return failed_;
  until = std::clamp(until, 0, units());
  return GuardTorch("damped inverse", [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    while (next_ < until && !done()) {
      if (!RunUnit()) return FinishAfterFailure();
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<at::Tensor> BlockedDampedInverse(const at::Tensor& factor, double damping,
                                                double* used_damping) {
  auto work = DampedInverseWork::Start(factor, damping);
  if (!work.ok()) return work.status();
  RETURN_IF_ERROR((*work)->RunUntil((*work)->units()));
  if (used_damping != nullptr) *used_damping = (*work)->used_damping();
  return (*work)->result();
}

}  // namespace detour::model
