// Owns the job runners (job_runner.h), reserves workers for them and routes
// worker messages to them. Pending jobs wait in one queue served by one
// scheduler thread (no thread per pending job), woken by submissions,
// released workers and registry changes; each job with reserved workers gets
// a runner thread of its own. Thread-safe.
#ifndef DETOUR_COORDINATOR_JOB_MANAGER_H_
#define DETOUR_COORDINATOR_JOB_MANAGER_H_

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/control_service.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_store.h"
#include "coordinator/timing_estimates.h"
#include "coordinator/worker_registry.h"
#include "detour/v1/spec.pb.h"

namespace detour {

// What a coordinator makes of a worker's heartbeat naming a job the worker
// is no member of: the log line and the reason sent with the cancel.
struct WorkerJobVerdict {
  std::string log;
  std::string reason;
};
// `running`: this coordinator has a runner for the job (the worker was
// removed from it, e.g. lost while stalled, unless the record says the job
// has ended and the runner is winding down); `stored`: the job's record, or
// why there is none.
WorkerJobVerdict JudgeWorkerJob(const std::string& worker_id, const std::string& job_id,
                                bool running, const absl::StatusOr<v1::Job>& stored);

class JobManager final : public RunnerHost {
 public:
  // Does not own its arguments; they must outlive the manager. Listens to
  // the registry's changes (WorkerRegistry::SetListener).
  JobManager(JobStore* jobs, WorkerRegistry* registry, ControlServiceImpl* control,
             JobManagerOptions options);
  ~JobManager() override;

  // Queues stored PENDING jobs again; re-attaches to the workers of jobs
  // that were RUNNING when the coordinator stopped (they keep their stages
  // and reconnect), and fails ASSIGNING ones (nothing to keep). Call once
  // after the store is loaded.
  void Recover();
  // Queues a job; it starts once its workers are idle. A spec that does not
  // validate fails the job with `invalid_prefix` + the reason.
  void Add(const std::string& job_id, const std::string& invalid_prefix = "invalid spec: ");
  // Cancels a job: a pending one leaves the queue, a running one's workers
  // are told to drop it within seconds.
  void Cancel(const std::string& job_id);
  // Restarts a FAILED or CANCELLED job from `checkpoint` ("" = its newest):
  // it becomes PENDING again under its id, with `replicas_per_stage`
  // replicas per stage (0 = the job's own; checkpoints hold one file per
  // stage). FAILED_PRECONDITION when it has not ended, succeeded, or there
  // is no checkpoint; NOT_FOUND when unknown; INVALID_ARGUMENT for a replica
  // count the spec does not allow.
  // The link matrix of a running job (JobService.GetLinks).
  absl::StatusOr<v1::GetLinksResponse> Links(const std::string& job_id) const;
  absl::StatusOr<v1::Job> Resume(const std::string& job_id, const std::string& checkpoint,
                                 uint32_t replicas_per_stage = 0);
  // From ControlService (gRPC thread): results, norms, timings, errors.
  void OnWorkerMessage(const std::string& worker_id, const v1::WorkerMessage& message);
  // Stops the scheduler and every runner. Nothing ends: running jobs stay
  // RUNNING with their workers for the next coordinator to re-attach (a job
  // still assigning goes back to PENDING), pending ones stay PENDING.
  void Shutdown();

  // A heartbeat says `worker_id` holds `job_id`: when no runner of that job
  // has the worker, the worker is told to drop the job (at most every 5 s
  // per worker); returns what it was told, or nothing when it was told
  // nothing. Before Recover() has run no verdict is given: the coordinator
  // serves before it has read back the jobs it ran, and a job not re-attached
  // yet is not a job it does not run (heartbeats repeat the question). From a
  // gRPC thread; never blocks.
  std::optional<WorkerJobVerdict> CheckWorkerJob(const std::string& worker_id,
                                                 const std::string& job_id);

  TimingEstimates& estimates() override { return estimates_; }

  // RunnerHost.
  JobStore& jobs() override { return *jobs_; }
  WorkerRegistry& registry() override { return *registry_; }
  absl::Status Send(const std::string& worker, const v1::CoordinatorMessage& message) override;
  const JobManagerOptions& options() const override { return options_; }
  RunnerMetrics& runner_metrics() override { return runner_metrics_; }
  std::vector<v1::WorkerInfo> ReserveIdle(const std::string& job, size_t count,
                                          const std::set<std::string>& exclude) override;
  void Unreserve(const std::string& job, const std::string& worker) override;
  void Release(const std::string& job_id) override;

 private:
  struct Pending {
    std::string job_id;
    v1::JobSpec spec;     // validated
    std::string message;  // why it waits, as last stored
  };

  void ScheduleLoop();
  void OnRegistryChange();
  // Takes the workers `spec` needs (its pinned ones, if it pins) out of
  // `free`, or says in `why` what it waits for (PendingReason; `registered`
  // is every worker not marked lost).
  static std::optional<std::vector<v1::WorkerInfo>> TakeWorkers(
      const v1::JobSpec& spec, std::vector<v1::WorkerInfo>& free,
      const std::vector<v1::WorkerInfo>& registered, std::string* why);

  JobStore* const jobs_;
  WorkerRegistry* const registry_;
  ControlServiceImpl* const control_;
  const JobManagerOptions options_;
  TimingEstimates estimates_;
  RunnerMetrics runner_metrics_;

  mutable absl::Mutex mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(mu_);  // submission order
  bool wake_ ABSL_GUARDED_BY(mu_) = false;
  std::thread scheduler_;
  std::map<std::string, std::unique_ptr<JobRunner>> runners_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> reserved_ ABSL_GUARDED_BY(mu_);  // worker -> job
  // Worker -> when it was last told to drop a job nobody runs.
  std::map<std::string, absl::Time> told_to_drop_ ABSL_GUARDED_BY(mu_);
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  bool recovered_ ABSL_GUARDED_BY(mu_) = false;  // Recover() has run
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_MANAGER_H_
