// Executes the coordinator's instructions for one job on one worker: builds
// the assigned stage (worker/model; from a checkpoint or a live replica's
// state when asked), follows each IterationPlan — data nodes start their
// microbatches within their memory slots, every hop runs its forward (in the
// job's queue policy, within the node's memory slots: work_queue.h) and
// sends the activations on, the data node computes the loss and the gradient
// walks the route back — then all-reduces the stage's gradient with its
// replicas, reports the gradient norm, steps when the coordinator says so,
// and reports the iteration's result and timings.
//
// Elastic training (docs/RUNTIME.md §"Elastic training"): when the
// coordinator reports lost workers mid-iteration, microbatches whose routes
// crossed them freeze (iteration_tracker.h), the survivors re-reduce among
// the new replica groups (replica_reducer.h), and frozen microbatches the
// coordinator re-plans come back on new routes. A failed transfer is
// reported to the coordinator at once (the fast path of loss detection).
// After the control session reopens, the worker tells the coordinator what
// it holds and repeats the current iteration's messages.
//
// The parts (runtime_part.h and docs/ARCHITECTURE.md): this class is the
// executor (its thread and work queue, work_queue.h) and dispatches to
// RuntimeSetup (taking a stage), RuntimePipeline (an iteration's forwards,
// losses and backwards), RuntimeReduce (the replica all-reduce and the
// gradient norm), RuntimeBubbles (K-FAC work in the idle gaps),
// RuntimeMembership (lost workers and amended routes mid-iteration),
// RuntimeStateTransfer (a stage's state to a joining replica) and
// RuntimeStep (the optimiser step and the result). Below them: the
// iteration's pipeline book-keeping (iteration_tracker.h), the all-reduce's
// membership (replica_reducer.h), bubble selection (bubble_schedule.h), frame
// admission (frame_admission.h), the stage's state (stage_state.h), the
// metrics (runtime_metrics.h) and the peer transport (peer_transport.h,
// given as a factory so tests can use in-memory fakes).
//
// Every message names its job and iteration (and tensors their epoch):
// tensors for another job, an old iteration, a replaced route or an
// unexpected hop are rejected and counted, never applied. All LibTorch work
// runs on one executor thread owned here; transport and control callbacks
// only enqueue. Thread-safe.
//
// The header stays free of LibTorch so the daemon's other files compile fast.
#ifndef DETOUR_WORKER_RUNTIME_JOB_RUNTIME_H_
#define DETOUR_WORKER_RUNTIME_JOB_RUNTIME_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "detour/v1/control_service.pb.h"
#include "worker/runtime/peer_transport.h"
#include "worker/transport/activation_server.h"

namespace detour {

struct JobRuntimeOptions {
  // Region of this worker (for network emulation between regions).
  std::string region;
  // Checkpoints go under <data_dir>/checkpoints/<job>.
  std::string data_dir;
  std::string device = "cpu";
  // LibTorch intra-op threads for this worker; 0 = LibTorch's default.
  int torch_threads = 0;
  // Activation memory of this worker in microbatches (what it registered,
  // what the planner assumed); 0 = the job's pipeline.memory_slots.
  int memory_slots = 0;
  // Testing and emulation aid (like --emulate_network): after every compute
  // task (forward, loss, backward, K-FAC bubble task, optimizer step) the
  // executor sleeps (compute_slowdown - 1) times the task's measured time,
  // so this worker behaves like a node that many times slower. 1 = off.
  double compute_slowdown = 1.0;
  // Testing aid (fault injection, worker --inject_fault KIND@N): at
  // iteration N (plan numbering, from 0) the worker misbehaves in a way the
  // coordinator's result checks must catch — kDiverge: after its step it
  // nudges one parameter, so it no longer equals its replicas; a data node
  // reports its first completed microbatch twice (kDuplicateMicrobatch) or
  // leaves its last one out (kMissingMicrobatch); kNanActivations: the
  // forward activations it sends from that iteration on hold NaN (a broken
  // or hostile member: its receivers must report it, and the coordinator
  // exclude it and go on); kFrameFlood: with each forward activation from
  // that iteration on it sends the receiver copies labelled as the next
  // iteration's, every microbatch in each of the next 4 epochs (its quota
  // there must take the flood, not its peers'); kBrokenTransfer: the first
  // all-reduce tensor it sends at that iteration is reported failed, as a
  // connection reset would fail it, though it went through (once: the
  // iteration's re-run sends normally), so it reports the replica
  // unreachable while the link works.
  struct FaultInjection {
    enum class Kind {
      kNone,
      kDiverge,
      kDuplicateMicrobatch,
      kMissingMicrobatch,
      kNanActivations,
      kFrameFlood,
      kBrokenTransfer
    };
    Kind kind = Kind::kNone;
    uint64_t iteration = 0;
  };
  FaultInjection fault;
  metrics::Registry* metrics = nullptr;  // not owned; may be null
  // Makes each job's peer transport; empty = gRPC streams (GrpcPeerTransport).
  PeerTransportFactory transport;
  // Security of the gRPC streams to peers (the default transport).
  TransportSecurity security;
  // Peer transfers: acknowledgement and connect timeouts (PeerTransportConfig).
  absl::Duration peer_ack_timeout = absl::Seconds(60);
  absl::Duration peer_connect_timeout = absl::Seconds(10);
  // Called with the addresses (gRPC and direct transport, "host:port") of
  // the job's peers whenever the coordinator sends a new set: the worker's
  // direct transport server keeps room for their connections. May be empty.
  std::function<void(const std::vector<std::string>& addresses)> peers_changed;
};

class JobRuntime : public TensorSink {
 public:
  // Sends a message to the coordinator (the worker's Session stream).
  using SendFn = std::function<absl::Status(v1::WorkerMessage)>;
  // Tells the heartbeat which job the worker is busy with ("" = idle).
  using JobFn = std::function<void(const std::string&)>;

  JobRuntime(JobRuntimeOptions options, SendFn send, JobFn set_job);
  ~JobRuntime() override;

  // From the control client's reader thread; never blocks.
  void OnCoordinatorMessage(const v1::CoordinatorMessage& message);
  // The control session (re)opened: when holding a job, sends JobStatus and
  // repeats the messages of the iteration in progress (the old session may
  // have lost them). Never blocks.
  void OnSessionOpened();
  // Registered with the coordinator as `worker_id` (detour_worker_info).
  void OnRegistered(const std::string& worker_id);
  // Periodic (every heartbeat): busy fractions fall to 0 once the worker has
  // completed no iteration for a while (RuntimeMetrics::IdleCheck).
  void Tick(absl::Time now);

  // TensorSink, called on gRPC threads.
  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& header) override;
  void Deliver(const v1::FrameHeader& header, MutableBuffer buffer) override;

  // Abandons the current job and stops the executor. Idempotent.
  void Stop();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_JOB_RUNTIME_H_
