// Drives one job whose workers are reserved, from assignment to its end, on
// a thread of its own:
//   ASSIGNING  stage assignment by the planner, StageAssignment to every
//              worker (restored from a checkpoint when the job resumes), wait
//              for each to report its stage built;
//   RUNNING    per iteration: plan routes over the live workers, send the
//              IterationPlan, collect gradient norms, send StepCommand,
//              collect IterationResults and check them (iteration_round.h),
//              checkpoint, publish progress;
//   SUCCEEDED / FAILED (with the reason) / CANCELLED.
//
// Elastic training (docs/RUNTIME.md §"Elastic training"): a worker is lost
// when the registry says so, its session stays closed past the job's
// reconnect grace, it came back without the job, or a peer could not reach
// it. Mid-iteration the runner bumps the membership epoch, tells the
// survivors (MembershipChange), learns from their acks which microbatches
// can run again, re-plans those around the loss (RouteAmendment) and drops
// the rest; replicas reduce among the survivors. A stage left without a
// replica pauses the job until a worker joins. At iteration boundaries idle
// workers join where the job lacks capacity, with the state of a live
// replica (or the newest checkpoint). After a membership change or a re-plan
// with measured speeds, a worker may move from a stage with spare replicas to
// a thin or slow one when the planner predicts a gain that repays moving the
// weights within elastic.reassign_horizon_iterations (stage_reassignment.h);
// workers persistently slower than their replicas are named in the history
// (stragglers.h). A runner can also re-attach to the workers of a job that
// was running when the coordinator restarted.
//
// Thread-safe: Post/RequestStop/Poke from any thread.
#ifndef DETOUR_COORDINATOR_JOB_RUNNER_H_
#define DETOUR_COORDINATOR_JOB_RUNNER_H_

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/metrics/metrics.h"
#include "coordinator/job_store.h"
#include "coordinator/runner_record.h"
#include "coordinator/timing_estimates.h"
#include "coordinator/worker_registry.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/job_service.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

struct JobManagerOptions {
  // Region latencies and bandwidths for planning (ClusterSpec links and
  // intra-region defaults; its nodes are ignored). Empty = a uniform network.
  v1::ClusterSpec network;
  // Ask workers to emulate `network` on their outgoing frames (tests and
  // benchmarks on one machine).
  bool emulate_network = false;
  // Checkpoints go to <checkpoint_root>/<job>/iter-NNNNNN. Workers write
  // there too, so on a real cluster it must be a path every machine shares.
  // Empty = <coordinator data_dir>/checkpoints.
  std::string checkpoint_root;
  absl::Duration assign_timeout = absl::Seconds(120);
  // Every this many iterations, the node speeds the planner assumes are
  // replaced by the ones the workers' timing reports show (forward times);
  // routes of later iterations are planned with them. 0 = never.
  int replan_every = 5;
  absl::Duration iteration_timeout = absl::Seconds(600);
  // Link probes (docs/RUNTIME.md §"Measured links"): before a job's first
  // plan, within link_probe_budget, every worker measures its links to the
  // others (bulk probes up to link_probe_bytes); while it runs, a latency
  // round every link_probe_interval, and after the first latency round once
  // link_probe_bulk_interval has passed since the last bulk probes, one
  // bulk slot over links its last iteration did not cross (zero = none; a
  // zero link_probe_interval means none of either).
  bool link_probe = true;
  absl::Duration link_probe_budget = absl::Seconds(20);
  uint64_t link_probe_bytes = uint64_t{32} << 20;
  absl::Duration link_probe_interval = absl::Seconds(60);
  absl::Duration link_probe_bulk_interval = absl::Minutes(5);
  metrics::Registry* metrics = nullptr;  // not owned; may be null
};

// The coordinator's elastic-training metrics, shared by the runners.
struct RunnerMetrics {
  explicit RunnerMetrics(metrics::Registry* registry);
  void Recovered(double seconds);
  void Microbatches(const char* outcome, int n);  // "rerun", "dropped"
  void WorkerLost();
  void WorkerJoined();
  void WorkerReassigned();
  void StragglerFound();
  void LinkCut();
  // A session message for a job from a registered worker that is not its
  // member (never was, or no longer is); `kind` is the message's field name.
  void OutsiderMessage(const std::string& kind);
  void MembersChanged(int delta);
  // A stage lost its last replica; `action` is "rollback", "pause" or
  // "reinitialize" (elastic.on_stage_loss).
  void StageLost(const std::string& action);

  metrics::Counter* recoveries = nullptr;
  metrics::Histogram* recovery_seconds = nullptr;
  metrics::CounterFamily* microbatches = nullptr;
  metrics::Counter* lost = nullptr;
  metrics::Counter* joined = nullptr;
  metrics::Counter* reassigned = nullptr;
  metrics::Counter* stragglers = nullptr;
  metrics::Counter* links_cut = nullptr;
  metrics::CounterFamily* outsider_messages = nullptr;  // by kind
  metrics::CounterFamily* stage_losses = nullptr;
  metrics::Gauge* members = nullptr;
};

// What a runner needs of its surroundings (the JobManager).
class RunnerHost {
 public:
  virtual ~RunnerHost() = default;
  virtual JobStore& jobs() = 0;
  virtual WorkerRegistry& registry() = 0;
  virtual absl::Status Send(const std::string& worker, const v1::CoordinatorMessage& message) = 0;
  virtual const JobManagerOptions& options() const = 0;
  virtual TimingEstimates& estimates() = 0;
  virtual RunnerMetrics& runner_metrics() = 0;
  // The time the runner judges deadlines, back-off and suspicion by, and
  // compares with the registry's times (tests move a FakeClock).
  virtual const Clock& clock() const { return Clock::Real(); }
  // Idle, registered workers no job holds, now reserved for `job` (at most
  // `count`; `exclude` are never taken).
  virtual std::vector<v1::WorkerInfo> ReserveIdle(const std::string& job, size_t count,
                                                  const std::set<std::string>& exclude) = 0;
  // `worker` left the job (lost): its reservation goes.
  virtual void Unreserve(const std::string& job, const std::string& worker) = 0;
  // The runner ended: every reservation of the job goes.
  virtual void Release(const std::string& job) = 0;
};

class JobRunner {
 public:
  enum class StartMode {
    kFresh,     // assign stages (restoring a checkpoint if the spec says so)
    kReattach,  // the coordinator restarted: the job's workers hold stages
  };

  JobRunner(RunnerHost* host, std::string job_id, v1::JobSpec spec,
            std::vector<v1::WorkerInfo> workers, StartMode start = StartMode::kFresh);
  ~JobRunner();

  void Start();
  // A message from one of the job's workers.
  void Post(const std::string& worker_id, const v1::WorkerMessage& message);
  // The registry changed (a worker lost, registered, reconnected).
  void Poke();
  void RequestStop(JobEnd stop);
  // The coordinator stops gracefully: the runner stops driving the job
  // without ending it, as if the coordinator had died. The record stays
  // RUNNING and the workers keep their stages, untold: they reconnect to
  // the next coordinator on the same store, which re-attaches to them. A
  // job still assigning its stages goes back to PENDING instead (its
  // workers told to drop it). No-op once a stop was requested or the job
  // ended. Returns at once; destroying the runner joins it.
  void Detach();
  bool finished() const;
  // The link matrix the job plans on, as last published (any thread);
  // nullopt before its first plan.
  std::optional<v1::GetLinksResponse> Links() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_RUNNER_H_
