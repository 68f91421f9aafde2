// Which incoming tensor frames a worker takes for its job, decided from the
// frame's header before any memory is allocated for it (the transport asks
// for every frame): the job this worker holds; a sender that is a member of
// the job (or one of a newer epoch: a worker that joined in it, before this
// worker has the plan that names it); the current or the next iteration; an
// epoch at most kMaxEpochsAhead ahead (epochs move by one per loss or join:
// one far ahead is a forgery); a shape and dtype the stage expects
// (activations, the replicas' all-reduce payload, a stage state from the one
// expected donor); and bytes within what an honest iteration can have in
// flight here. No LibTorch.
//
// Thread-safe: the executor updates it as the job moves on, transport
// threads ask.
#ifndef DETOUR_WORKER_RUNTIME_FRAME_ADMISSION_H_
#define DETOUR_WORKER_RUNTIME_FRAME_ADMISSION_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

class FrameAdmission {
 public:
  // Epochs a tensor may be ahead of this worker's view.
  static constexpr uint64_t kMaxEpochsAhead = 4;

  // What the worker's stage of a job takes.
  struct Stage {
    std::string job_id;
    uint64_t iteration = 0;  // the next iteration to run
    uint64_t epoch = 0;
    // samples × context × d_model, in `wire` dtype.
    std::vector<int64_t> activation_shape;
    v1::DType wire = v1::DTYPE_FP32;
    int64_t flat_numel = 0;     // the stage's parameters (its gradients)
    int64_t factor_numel = 0;   // K-FAC factors all-reduced with them
    std::string state_from;     // the donor of this worker's state ("" = none)
    uint32_t microbatches = 0;  // per iteration, the job's total
    int replicas = 1;           // of this stage
  };

  // Why a frame was refused, for the metrics.
  enum class Refusal { kNone, kLate, kOverBudget, kOther };
  struct Verdict {
    absl::Status status;
    Refusal refusal = Refusal::kNone;
    bool ok() const { return status.ok(); }
  };

  // The worker holds `stage`: every bound follows from it.
  void Open(const Stage& stage);
  // The worker holds no job: every frame is refused.
  void Close();
  // The job's members (this worker included): the senders taken.
  void SetMembers(std::set<std::string> members);
  // A new iteration (frames of it and the next one are taken) and epoch.
  void SetPosition(uint64_t iteration, uint64_t epoch);
  void SetIteration(uint64_t iteration);
  void SetEpoch(uint64_t epoch);
  // The expected stage state arrived: no more is taken.
  void StateReceived();

  // Whether to take the frame `h`, given `held` bytes of received tensors
  // not yet consumed. FAILED_PRECONDITION (no such job, not current, not
  // expected), PERMISSION_DENIED (not a member), INVALID_ARGUMENT (a shape
  // or dtype the stage does not take), RESOURCE_EXHAUSTED (over the bound).
  Verdict Admit(const v1::FrameHeader& h, uint64_t held) const;

  // The bounds, for the record: the largest stage state taken, and the
  // bytes of received tensors held at once.
  uint64_t state_bytes() const;
  uint64_t held_bytes() const;

 private:
  mutable absl::Mutex mu_;
  Stage stage_ ABSL_GUARDED_BY(mu_);
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> members_ ABSL_GUARDED_BY(mu_);
  uint64_t state_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_FRAME_ADMISSION_H_
