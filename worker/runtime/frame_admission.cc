#include "worker/runtime/frame_admission.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace detour {

void FrameAdmission::Open(const Stage& stage) {
  absl::MutexLock lock(&mu_);
  stage_ = stage;
  open_ = true;
  // A stage's state: parameters and AdamW's two moments, K-FAC's sums,
  // running factors and four inverses per factor, its per-projection
  // moments; plus the archive's own bookkeeping.
  state_bytes_ =
      4 * static_cast<uint64_t>(6 * stage.flat_numel + 6 * stage.factor_numel) + (16u << 20);
  // What an honest iteration can have in flight here at once: a forward and
  // a backward per microbatch (and again for re-runs) and the replicas'
  // all-reduce inputs, or one stage state.
  uint64_t activation = 4;
  for (int64_t d : stage.activation_shape) activation *= static_cast<uint64_t>(d);
  const uint64_t reduce = 4 * static_cast<uint64_t>(stage.flat_numel + stage.factor_numel);
  held_bytes_ = 4 * uint64_t{stage.microbatches} * activation +
                (2 * static_cast<uint64_t>(stage.replicas) + 2) * reduce + state_bytes_;
}

void FrameAdmission::Close() {
  absl::MutexLock lock(&mu_);
  open_ = false;
  stage_.job_id.clear();
  stage_.state_from.clear();
}

void FrameAdmission::SetMembers(std::set<std::string> members) {
  absl::MutexLock lock(&mu_);
  members_ = std::move(members);
}

void FrameAdmission::SetPosition(uint64_t iteration, uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  stage_.iteration = iteration;
  stage_.epoch = epoch;
}

void FrameAdmission::SetIteration(uint64_t iteration) {
  absl::MutexLock lock(&mu_);
  stage_.iteration = iteration;
}

void FrameAdmission::SetEpoch(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  stage_.epoch = epoch;
}

void FrameAdmission::StateReceived() {
  absl::MutexLock lock(&mu_);
  stage_.state_from.clear();
}

uint64_t FrameAdmission::state_bytes() const {
  absl::MutexLock lock(&mu_);
  return state_bytes_;
}

uint64_t FrameAdmission::held_bytes() const {
  absl::MutexLock lock(&mu_);
  return held_bytes_;
}

FrameAdmission::Verdict FrameAdmission::Admit(const v1::FrameHeader& h, uint64_t held) const {
  auto refuse = [](absl::Status s, Refusal r = Refusal::kOther) {
    return Verdict{std::move(s), r};
  };
  const std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
  absl::MutexLock lock(&mu_);
  if (!open_ || stage_.job_id.empty() || h.job_id() != stage_.job_id) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("this worker holds no stage of job ", h.job_id())));
  }
  // Only the job's workers may send (with TLS, the transport has checked
  // that `sender` is the certificate's name).
  if (!members_.count(h.sender()) && h.epoch() <= stage_.epoch) {
    return refuse(absl::PermissionDeniedError(absl::StrCat(
        "worker \"", absl::CHexEscape(h.sender()), "\" is not a member of job ", h.job_id())));
  }
  if (h.iteration() < stage_.iteration || h.iteration() > stage_.iteration + 1) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
                      "iteration ", h.iteration(), " is not current (", stage_.iteration, ")")),
                  Refusal::kLate);
  }
  if (h.epoch() > stage_.epoch + kMaxEpochsAhead) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("epoch ", h.epoch(), " is too far ahead of this worker's ", stage_.epoch)));
  }
  if (h.direction() == v1::DIRECTION_ALLREDUCE) {
    // Gradients, plus K-FAC factors in iterations that sync them (the exact
    // size is checked against the plan when the tensor is used).
    if (shape.size() != 1 || shape[0] < stage_.flat_numel ||
        shape[0] > stage_.flat_numel + stage_.factor_numel || h.dtype() != v1::DTYPE_FP32) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
          "all-reduce tensor [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
          " does not match this stage's ", stage_.flat_numel, " fp32 gradients")));
    }
  } else if (h.direction() == v1::DIRECTION_STATE) {
    if (stage_.state_from.empty() || h.sender() != stage_.state_from) {
      return refuse(absl::FailedPreconditionError(
          absl::StrCat("this worker expects no stage state from ", h.sender())));
    }
    if (shape.size() != 1 || h.dtype() != v1::DTYPE_BYTES || shape[0] <= 0 ||
        static_cast<uint64_t>(shape[0]) > state_bytes_) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat("stage state [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
                       " is not a byte string of at most ", state_bytes_, " bytes")));
    }
  } else if (shape != stage_.activation_shape || h.dtype() != stage_.wire) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("activation [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
                     " does not match the job's [", absl::StrJoin(stage_.activation_shape, ","),
                     "] ", v1::DType_Name(stage_.wire))));
  }
  // Tensors received and not yet consumed (queued, kept early, buffered by
  // a stage) are bounded in bytes: a peer flooding plausible frames gets
  // RESOURCE_EXHAUSTED instead of the worker's memory.
  const uint64_t bytes = h.total_bytes();
  if (held + bytes > held_bytes_) {
    return refuse(absl::ResourceExhaustedError(
                      absl::StrCat("this worker holds ", held, " bytes of received tensors; ",
                                   bytes, " more would pass its bound of ", held_bytes_)),
                  Refusal::kOverBudget);
  }
  return Verdict{absl::OkStatus(), Refusal::kNone};
}

}  // namespace detour
