// The damped inverse (F + λI)⁻¹ of a symmetric K-FAC factor, computed in
// units so that one bubble task can run a bounded share of it
// (docs/KFAC.md "Granules"). The units are common/kfac_workload.h's
// (InversionUnitWeights): up to kUnblockedInversion wide, the Cholesky
// factorisation and the inverse from it (LAPACK potrf, potri); wider, the
// blocked Cholesky steps (one per block column) and the inverse's block
// columns (two triangular solves each). The result depends on F, λ and the
// width only — a caller running the units in one go (DampedInverse) or over
// several tasks gets the same bits.
//
// Attempts, as DampedInverse always made them: F's dtype with λ, then fp64
// with λ, then both again with λ·10, up to 4 times (λ floored at 1e-7); an
// attempt fails when a Cholesky step finds the matrix not positive definite
// or the inverse is not finite. A failure is found in the unit where it
// happens, and the remaining attempts then run in full in that call (rare:
// that granule is longer than planned).
//
// Thread-compatible. While in progress it holds two n×n working matrices
// and a reference to F (which K-FAC replaces, never modifies in place).
#ifndef DETOUR_WORKER_MODEL_KFAC_INVERSE_H_
#define DETOUR_WORKER_MODEL_KFAC_INVERSE_H_

#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace detour::model {

// The smallest damping any K-FAC inverse uses: a requested or pi-split
// damping below it is raised to it (kfac.cc's PiDamping too), so a factor
// with a zero eigenvalue still inverts.
constexpr double kMinKfacDamping = 1e-7;

class DampedInverseWork {
 public:
  // INVALID_ARGUMENT for an undefined or non-square F, FAILED_PRECONDITION
  // for a non-finite one.
  static absl::StatusOr<std::unique_ptr<DampedInverseWork>> Start(const at::Tensor& factor,
                                                                  double damping);

  // kfac::InversionUnitWeights(n).size().
  int units() const { return static_cast<int>(weights_.size()); }
  int units_done() const { return next_; }
  const std::vector<int64_t>& unit_weights() const { return weights_; }
  bool done() const { return result_.defined(); }

  // Runs units until `until` of them are done (clamped to [0, units()]);
  // the last unit finishes the inverse. INTERNAL when every attempt failed,
  // a LibTorch error as a Status.
  absl::Status RunUntil(int until);

  // Once done(): the inverse in F's dtype, and the damping that succeeded.
  const at::Tensor& result() const { return result_; }
  double used_damping() const { return damping_; }

 private:
  DampedInverseWork(const at::Tensor& factor, double damping);
  // (Re)starts attempt `attempt_` from F. False when none is left.
  bool BeginAttempt();
  // Runs unit next_ of the current attempt; false when the attempt failed.
  bool RunUnit();
  // Runs every remaining attempt in full after a failure.
  absl::Status FinishAfterFailure();

  at::Tensor factor_;
  int64_t n_ = 0;
  int blocks_ = 1;
  std::vector<int64_t> weights_;
  double base_damping_ = 0;
  int attempt_ = 0;  // 2 per damping: F's dtype, then fp64
  double damping_ = 0;
  int next_ = 0;
  at::Tensor work_;     // the damped matrix, becoming L in place
  at::Tensor inverse_;  // blocked: the inverse's lower block columns
  at::Tensor result_;
  absl::Status failed_;  // every attempt failed
};

// (F + damping·I)⁻¹ in F's dtype: every unit of DampedInverseWork in one go.
// `used_damping` (optional) receives the damping that succeeded.
absl::StatusOr<at::Tensor> BlockedDampedInverse(const at::Tensor& factor, double damping,
                                                double* used_damping = nullptr);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_KFAC_INVERSE_H_
