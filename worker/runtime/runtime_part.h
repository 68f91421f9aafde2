// The worker runtime's shared state and the base of its parts
// (docs/ARCHITECTURE.md): RuntimeShared is the job this worker holds (its
// stage, optimiser, K-FAC state, peers, membership epoch and the iteration
// in progress); RuntimeCore is what the executor (JobRuntime::Impl) offers
// the parts: messages to the coordinator, failing and dropping the job, and
// the work queue; RuntimePart gives a part the shared state under the names
// the runtime's code uses, and the helpers more than one part needs (peers,
// tensor sends, task timings).
//
// Everything here runs on the executor thread, except the atomics the
// transport's threads read (bubble_running, arrived_during_bubble_ns).
// Internal to worker/runtime: the header includes LibTorch's tensor types.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_PART_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_PART_H_

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "detour/v1/control_service.pb.h"
#include "worker/model/engine.h"
#include "worker/model/kfac.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"
#include "worker/model/text_data.h"
#include "worker/runtime/bubble_schedule.h"
#include "worker/runtime/frame_admission.h"
#include "worker/runtime/iteration_tracker.h"
#include "worker/runtime/job_runtime.h"
#include "worker/runtime/replica_reducer.h"
#include "worker/runtime/runtime_metrics.h"
#include "worker/runtime/work_queue.h"

namespace detour {

enum class IterationPhase { kRunning, kReducing, kWaitingStep };

// The iteration in progress on this worker.
struct RunningIteration {
  v1::IterationPlan plan;
  absl::Time received;
  std::unique_ptr<IterationTracker> tracker;
  std::vector<model::Microbatch> microbatches;  // data nodes
  v1::TimingReport timing;
  IterationPhase phase = IterationPhase::kRunning;
  // The stage's gradients hold the group's sum (the all-reduce ran with
  // replicas) or were scaled by `scaled` (alone): a membership change must
  // put the local gradient back first.
  bool reduced = false;
  double scaled = 1.0;
  // Replicas preconditioning their own gradients: the raw local gradient
  // (the payload holds the preconditioned one) for putting back.
  at::Tensor raw_local;
  std::set<std::string> unreachable_reported;
  std::set<std::string> bad_frames_reported;  // senders, once per iteration
  double max_delay_s = 0;                     // pipeline work waiting for a bubble task
};

// The job this worker holds; empty job_id = none.
struct RuntimeShared {
  RuntimeShared(const JobRuntimeOptions* options, RuntimeMetrics* metrics,
                FrameAdmission* admission)
      : options(*options), metrics(*metrics), admission(*admission) {}

  const JobRuntimeOptions& options;
  RuntimeMetrics& metrics;
  FrameAdmission& admission;  // what Allocate accepts (read on gRPC threads)

  std::string me;  // this worker's id, from the assignment
  std::string job_id;
  v1::JobSpec spec;
  int stage_index = 0;
  uint64_t epoch = 0;              // membership epoch known here
  uint64_t completed = 0;          // iterations whose step ran here
  std::vector<std::string> group;  // this stage's replicas, rank order
  ReplicaReducer<at::Tensor> reducer;
  c10::Device device = c10::Device(c10::kCPU);
  std::unique_ptr<model::Stage> stage;
  std::unique_ptr<model::AdamW> optimizer;
  std::unique_ptr<model::Kfac> kfac;  // K-FAC jobs only
  std::unique_ptr<BubbleSchedule> bubbles;
  int64_t flat_numel = 0;
  int64_t factor_numel = 0;  // all held layers' factors (all-reduce bound)
  // Set while a bubble task runs; the first pipeline message arriving then
  // records its time (how long bubble work delays pipeline work).
  std::atomic<bool> bubble_running{false};
  std::atomic<int64_t> arrived_during_bubble_ns{0};
  model::TokenSequence train_tokens;
  v1::DType wire = v1::DTYPE_FP32;
  std::unique_ptr<PeerTransport> transport;
  std::map<std::string, PeerEndpoint> peers;  // the transport's peers
  // What this worker measured of its link to a peer (the link prober's
  // hints); unset = nothing known.
  std::function<LinkHint(const std::string& peer)> link_hint;
  std::string state_from;  // joining: the replica whose state we wait for
  std::unique_ptr<RunningIteration> it;
  std::vector<std::pair<v1::FrameHeader, at::Tensor>> early;
  std::vector<v1::WorkerMessage> replay;
  bool fault_done = false;  // a one-time injected fault (kBrokenTransfer) fired
};

// The executor's services to the parts.
class RuntimeCore {
 public:
  virtual ~RuntimeCore() = default;
  // Sends to the coordinator; messages of the iteration in progress are
  // kept (`replay`) and repeated when the session reopens.
  virtual void Send(v1::WorkerMessage message, bool replay) = 0;
  // Reports the error to the coordinator and abandons the job.
  virtual void Fail(const absl::Status& status) = 0;
  virtual void ReportError(const std::string& job, uint64_t iteration,
                           const absl::Status& status) = 0;
  // Forgets the current job: stage, peers, iteration state.
  virtual void Abandon() = 0;
  // Runs `fn` on the executor later (control work).
  virtual void Post(std::function<void()> fn) = 0;
  // Queues a received tensor as the executor's work.
  virtual void Enqueue(const v1::FrameHeader& h, at::Tensor tensor) = 0;
  // Runs `fn` with the work queue, under its lock.
  virtual void WithQueue(const std::function<void(WorkQueue&)>& fn) = 0;
};

// Base of the runtime's parts: the shared state under the runtime's names,
// the core's services and the helpers several parts use.
class RuntimePart {
 protected:
  RuntimePart(RuntimeShared* shared, RuntimeCore* core);

  void Send(v1::WorkerMessage message, bool replay = true) {
    core_->Send(std::move(message), replay);
  }
  void Fail(const absl::Status& status) { core_->Fail(status); }

  // `p` as the transport's peer, with what this worker measured of the link.
  PeerEndpoint Endpoint(const v1::Peer& p) const;
  // The transport's peers: everyone in `peers` but this worker.
  void SetPeers(const google::protobuf::RepeatedPtrField<v1::Peer>& peers);
  // Tells the admission and the transport who the peers are now.
  void PushPeers();
  // Sends a tensor of the iteration in progress to `to`; the outcome comes
  // back on the executor (OnTransferDone).
  void SendTensor(const std::string& to, v1::Direction direction, uint32_t mb, uint32_t hop,
                  const at::Tensor& tensor, uint64_t epoch);
  // --inject_fault=frame_flood: copies of `sent` (carrying `tensor`) as the
  // next iteration's frames, to `to`.
  void SendFlood(const std::string& to, const v1::FrameHeader& sent,
                 const std::shared_ptr<at::Tensor>& tensor);
  // A transfer to `peer` failed: the coordinator decides whether it is lost.
  void ReportUnreachable(uint64_t iteration, const std::string& peer, const absl::Status& why);
  // A tensor from `sender` failed CheckFrameValues and was dropped: the
  // coordinator excludes the sender (once per sender and iteration).
  void ReportBadFrame(const std::string& sender, v1::Direction direction, uint32_t mb,
                      uint64_t epoch, const absl::Status& why);
  // Times a task that started at `start` and just ended. With
  // --compute_slowdown F, a compute task first takes F times as long (the
  // executor sleeps the difference), as on a slower node.
  void Record(v1::TaskTiming::Kind kind, uint32_t mb, absl::Time start);

  RuntimeCore* const core_;
  const JobRuntimeOptions& options_;
  RuntimeMetrics& metrics_;
  FrameAdmission& admission_;
  std::string& me_;
  std::string& job_id_;
  v1::JobSpec& spec_;
  int& stage_index_;
  uint64_t& epoch_;
  uint64_t& completed_;
  std::vector<std::string>& group_;
  ReplicaReducer<at::Tensor>& reducer_;
  c10::Device& device_;
  std::unique_ptr<model::Stage>& stage_;
  std::unique_ptr<model::AdamW>& optimizer_;
  std::unique_ptr<model::Kfac>& kfac_;
  std::unique_ptr<BubbleSchedule>& bubbles_;
  int64_t& flat_numel_;
  int64_t& factor_numel_;
  std::atomic<bool>& bubble_running_;
  std::atomic<int64_t>& arrived_during_bubble_ns_;
  model::TokenSequence& train_tokens_;
  v1::DType& wire_;
  std::unique_ptr<PeerTransport>& transport_;
  std::map<std::string, PeerEndpoint>& peers_;
  const std::function<LinkHint(const std::string& peer)>& link_hint_;
  std::string& state_from_;
  std::unique_ptr<RunningIteration>& it_;
  std::vector<std::pair<v1::FrameHeader, at::Tensor>>& early_;
  std::vector<v1::WorkerMessage>& replay_;
  bool& fault_done_;

 private:
  void OnTransferDone(const std::string& job, uint64_t iteration, const std::string& to,
                      v1::Direction direction, uint64_t bytes, const absl::Status& status,
                      double seconds);
};

// Whether a received tensor holds only values honest training sends: no NaN,
// no infinity, no magnitude above kMaxFrameMagnitude (whose square overflows
// float32: a norm or LayerNorm's variance of it is infinite). One read pass
// (a min and max reduction, which NaN propagates through); INVALID_ARGUMENT
// naming what was found otherwise.
inline constexpr double kMaxFrameMagnitude = 1.8e19;
absl::Status CheckFrameValues(const at::Tensor& t);

// The wire's element type as LibTorch's, and the spec's wire dtype name as
// the wire's.
at::ScalarType TorchType(v1::DType dtype);
v1::DType WireDType(const std::string& name);
// The replicas of `stage` in `groups` (empty when not listed).
std::vector<std::string> GroupOf(const google::protobuf::RepeatedPtrField<v1::ReplicaGroup>& groups,
                                 int stage);

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_PART_H_
