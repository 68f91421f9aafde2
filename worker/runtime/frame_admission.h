// Which incoming tensor frames a worker takes for its job, decided from the
// frame's header before any memory is allocated for it (the transport asks
// for every frame): the job this worker holds; a sender that is a member of
// the job (or one of a newer epoch: a worker that joined in it, before this
// worker has the plan that names it); the current or the next iteration; an
// epoch at most kMaxEpochsAhead ahead (epochs move by one per loss or join:
// one far ahead is a forgery); a shape and dtype the stage expects
// (activations, the replicas' all-reduce payload, a stage state from the one
// expected donor); and bytes within the sender's own quota: what the routes
// known here have that sender send to this worker, plus what an honest
// sender can send ahead of them (docs/RUNTIME.md §"Frame admission"). Each
// sender has its own account, so one member flooding plausible frames
// exhausts only its own quota, never another member's. No LibTorch.
//
// Thread-safe: the executor updates it as the job moves on, transport
// threads ask.
#ifndef DETOUR_WORKER_RUNTIME_FRAME_ADMISSION_H_
#define DETOUR_WORKER_RUNTIME_FRAME_ADMISSION_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/plan.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

class FrameAdmission {
 public:
  // Epochs a tensor may be ahead of this worker's view.
  static constexpr uint64_t kMaxEpochsAhead = 4;
  // Senders of a newer epoch (not members here yet) with an account at once.
  static constexpr size_t kMaxNewcomerAccounts = 8;

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
    // Taken: the sender's account, already charged with the frame's
    // total_bytes; the caller subtracts them when the tensor is freed.
    std::shared_ptr<std::atomic<uint64_t>> account;
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
  // The iteration's routes (SetRoutes, on a new plan) and re-run routes
  // (AddRoutes, on an amendment): the pipeline frames each sender sends to
  // `me` along them count into that sender's quota.
  void SetRoutes(const std::string& me, const std::vector<v1::Route>& routes);
  void AddRoutes(const std::string& me, const std::vector<v1::Route>& routes);

  // Whether to take the frame `h`, charging its bytes to its sender's
  // account when it is taken. FAILED_PRECONDITION (no such job, not
  // current, not expected), PERMISSION_DENIED (not a member),
  // INVALID_ARGUMENT (a shape or dtype the stage does not take),
  // RESOURCE_EXHAUSTED (over the sender's quota, or too many newcomers).
  Verdict Admit(const v1::FrameHeader& h);

  // The bounds, for the record: the largest stage state taken, and the
  // bytes of received tensors `sender` may have held here at once.
  uint64_t state_bytes() const;
  uint64_t SenderQuota(const std::string& sender) const;
  // Pipeline frames the known routes have `sender` send to this worker.
  uint32_t RoutedFrames(const std::string& sender) const;

 private:
  uint64_t QuotaLocked(const std::string& sender) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  Stage stage_ ABSL_GUARDED_BY(mu_);
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  std::set<std::string> members_ ABSL_GUARDED_BY(mu_);
  uint64_t state_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t activation_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reduce_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  // Pipeline frames the known routes have each sender send here.
  std::map<std::string, uint32_t> routed_ ABSL_GUARDED_BY(mu_);
  // Bytes of received tensors alive per sender (shared with their deleters).
  std::map<std::string, std::shared_ptr<std::atomic<uint64_t>>> accounts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_FRAME_ADMISSION_H_
