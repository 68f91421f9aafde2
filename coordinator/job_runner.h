// Drives submitted jobs through their life on the registered workers:
//   PENDING    until enough idle workers can be reserved for the job;
//   ASSIGNING  stage assignment by the planner, StageAssignment to every
//              worker, wait for each to report its stage built;
//   RUNNING    per iteration: plan routes, send the IterationPlan, collect
//              each stage's gradient norm, send StepCommand, collect
//              IterationResults (checking that replicas stayed identical and
//              every microbatch completed exactly once), publish progress;
//   SUCCEEDED / FAILED (with the reason, e.g. the worker that was lost) /
//   CANCELLED.
// Pending jobs wait in one queue served by one scheduler thread (no thread
// per pending job); each job with reserved workers gets a thread of its own
// (not a gRPC thread), and messages from its workers are queued to it.
// Thread-safe.
#ifndef DETOUR_COORDINATOR_JOB_RUNNER_H_
#define DETOUR_COORDINATOR_JOB_RUNNER_H_

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "coordinator/control_service.h"
#include "coordinator/job_store.h"
#include "coordinator/timing_estimates.h"
#include "coordinator/worker_registry.h"
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
  metrics::Registry* metrics = nullptr;  // not owned; may be null
};

class JobRunner;

// Owns the runners, reserves workers for them, routes worker messages.
class JobManager {
 public:
  // Does not own its arguments; they must outlive the manager.
  JobManager(JobStore* jobs, WorkerRegistry* registry, ControlServiceImpl* control,
             JobManagerOptions options);
  ~JobManager();

  // Queues stored PENDING jobs again; marks jobs that were ASSIGNING or
  // RUNNING when the coordinator stopped as FAILED (their workers dropped
  // them). Call once after the store is loaded.
  void Recover();
  // Queues a job; it starts once its workers are idle. A spec that does not
  // validate fails the job with `invalid_prefix` + the reason.
  void Add(const std::string& job_id, const std::string& invalid_prefix = "invalid spec: ");
  // Cancels a job: a pending one leaves the queue, a running one's workers
  // are told to drop it within seconds.
  void Cancel(const std::string& job_id);
  // From ControlService (gRPC thread): results, norms, timings, errors.
  void OnWorkerMessage(const std::string& worker_id, const v1::WorkerMessage& message);
  // Stops the scheduler and every runner; running jobs become FAILED
  // ("coordinator stopped"), pending ones stay PENDING in the store.
  void Shutdown();

  // Frees the workers reserved for `job_id` (its runner ends).
  void Release(const std::string& job_id);

  // A heartbeat says `worker_id` holds `job_id`: when no runner of that job
  // has the worker, the worker is told to drop the job (at most every 5 s
  // per worker). From a gRPC thread; never blocks.
  void CheckWorkerJob(const std::string& worker_id, const std::string& job_id);

  const JobManagerOptions& options() const { return options_; }
  TimingEstimates& estimates() { return estimates_; }

 private:
  friend class JobRunner;
  JobStore* const jobs_;
  WorkerRegistry* const registry_;
  ControlServiceImpl* const control_;
  const JobManagerOptions options_;
  TimingEstimates estimates_;

  struct Pending {
    std::string job_id;
    v1::JobSpec spec;     // validated
    std::string message;  // why it waits, as last stored
  };

  void ScheduleLoop();
  // Takes the workers `spec` needs (its pinned ones, if it pins) out of
  // `free`, or says in `why` what it waits for.
  static std::optional<std::vector<v1::WorkerInfo>> TakeWorkers(const v1::JobSpec& spec,
                                                                std::vector<v1::WorkerInfo>& free,
                                                                std::string* why);

  absl::Mutex mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);  // submission order
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  std::thread scheduler_;
  std::map<std::string, std::unique_ptr<JobRunner>> runners_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> reserved_ ABSL_GUARDED_BY(mu_);  // worker -> job
  // Worker -> when it was last told to drop a job nobody runs.
  std::map<std::string, absl::Time> told_to_drop_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> worker_job_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_RUNNER_H_
