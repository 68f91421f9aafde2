// What a running job writes into its stored record (JobStore): its state,
// history events, stage lists, progress after every iteration, and its end.
// Every write goes through the store (persisted, listeners told); the ones
// a job cannot go on without return their error (progress, the replica
// sync choice), the others are logged by the store and ignored.
// Thread-compatible (the job runner's thread).
#ifndef DETOUR_COORDINATOR_RUNNER_RECORD_H_
#define DETOUR_COORDINATOR_RUNNER_RECORD_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "coordinator/job_store.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/job_service.pb.h"

namespace detour {

// How a job ended: its final state and the reason.
struct JobEnd {
  v1::JobState state;
  std::string message;
};

// One finished iteration, as the record shows it.
struct IterationRecord {
  uint64_t iteration = 0;
  uint64_t total_iterations = 0;
  double loss = 0;
  double seconds = 0;           // wall time of the iteration
  double elapsed_seconds = 0;   // since the run (or resumed run) started
  uint64_t iterations_run = 0;  // iterations since then, this one included
  uint64_t tokens = 0;
  double overhead_seconds = 0;  // coordinator work, not waiting
  const v1::IterationPlan* plan = nullptr;
  const std::map<std::string, v1::TimingReport>* timings = nullptr;
  const std::map<std::string, int>* members = nullptr;
  bool kfac = false;
  uint64_t kfac_refreshes = 0;
  double kfac_refresh_interval = 0;
  uint64_t recoveries = 0;
  uint64_t rerun_total = 0;
  uint64_t dropped_total = 0;
  uint64_t epoch = 0;
};

class RunnerRecord {
 public:
  // Most history events a job keeps (the oldest go first).
  static constexpr int kMaxHistory = 200;

  RunnerRecord(JobStore* jobs, std::string job_id);

  // Appends a history event (and logs it).
  void AddEvent(v1::JobHistoryEvent::Kind kind, uint64_t iteration, const std::string& worker,
                const std::string& message, uint64_t epoch);
  void SetState(v1::JobState state, const std::string& message);
  // The first time the job runs.
  void MarkStarted();
  // Stage lists (worker ids per stage), the epoch and the member count.
  void Stages(const std::vector<std::vector<std::string>>& stages, uint64_t epoch, size_t members);
  // Progress restarts at `iteration` (a resumed job): the last iteration's
  // loss, speed and ETA belong to the run that stopped.
  void RestartProgressAt(uint64_t iteration, uint64_t total_iterations);
  // The K-FAC replica sync chosen for an AUTO spec, into the stored spec.
  absl::Status ReplicaSync(v1::KfacReplicaSync chosen, bool sync_factors);
  // A finished iteration. An error when the record cannot be written.
  absl::Status Iteration(const IterationRecord& r);
  // The step about to be sent (Job.pending_step), before any worker gets
  // it; Iteration clears it. An error when the record cannot be written.
  absl::Status PendingStep(const v1::StepCommand& step);
  // After a write the job cannot go on without failed with `failed`: on a
  // replicated store (JobBackend::Replicated) that could not be reached
  // (UNAVAILABLE, DEADLINE_EXCEEDED) or refused a deposed leader's write
  // (FAILED_PRECONDITION, fenced), the job holds: nothing more is run or
  // sent, and the record as it stands is written again every `retry` until
  // it lands (OK: the job goes on) or `stop()` (the runner is stopped: a
  // leader that lost its lease exits, a draining one leaves the job to the
  // next). Otherwise (files) returns `failed`: the job fails, as before.
  absl::Status Hold(absl::Status failed, const std::function<bool()>& stop,
                    absl::Duration retry = absl::Seconds(1));
  // The newest checkpoint and what the planner warm-starts from after it
  // (Job.checkpoint_plan), in one write.
  void LastCheckpoint(const std::string& dir, const v1::CheckpointPlan& plan);
  // The end: the final state and reason, unless the job already ended (e.g.
  // cancelled by request).
  void End(const JobEnd& end);
  // Back to PENDING with `message` and no stages, unless the job already
  // ended: a job whose stages were still being assigned when the
  // coordinator stopped is scheduled afresh by the next one.
  void Requeue(const std::string& message);

 private:
  JobStore* const jobs_;
  const std::string job_id_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_RECORD_H_
