// The job runner's shared state and the base of its decision parts
// (docs/ARCHITECTURE.md): RunnerShared is what every part of one job's
// runner reads and changes (the spec, the membership, the planning model,
// checkpoints, the link to the members, the record, the next iteration);
// RunnerLoop is what the drive loop (JobRunner::Impl) offers the parts that
// wait for workers; RunnerPart gives a part the shared state under the names
// the runner's code uses. All on the runner's thread: thread-compatible.
#ifndef DETOUR_COORDINATOR_RUNNER_PART_H_
#define DETOUR_COORDINATOR_RUNNER_PART_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "coordinator/job_runner.h"
#include "coordinator/runner_checkpoints.h"
#include "coordinator/runner_link.h"
#include "coordinator/runner_membership.h"
#include "coordinator/runner_planner.h"
#include "coordinator/runner_record.h"

namespace detour {

// What one wait for the job's workers brought: messages, workers found lost
// (already removed from the membership), or the end.
struct RunnerEvent {
  std::deque<std::pair<std::string, v1::WorkerMessage>> messages;
  std::vector<std::string> lost;
  // Links between live members found cut (the planner already avoids them).
  std::vector<LinkCut> cuts;
  std::optional<JobEnd> end;
  bool timed_out = false;  // `end` is the deadline passing
  bool changed = false;    // the registry changed (return_on_change)
};

// The drive loop's services to the parts.
class RunnerLoop {
 public:
  virtual ~RunnerLoop() = default;
  // Waits until a message arrives, the deadline passes, a worker of the job
  // is lost or reports an error, or the job is stopped; `describe` names
  // what is awaited in a timeout. `return_on_change`: also when the
  // registry changes (a worker may join).
  virtual RunnerEvent Wait(absl::Time deadline, const std::function<std::string()>& describe,
                           bool detect_loss = true, bool return_on_change = false) = 0;
  virtual bool StopRequested() const = 0;
  // Removes `id` from the membership (a new epoch), tells it to drop the
  // job, records the event.
  virtual void RemoveMember(const std::string& id, const std::string& why, uint64_t iteration) = 0;
  // The StageAssignment that gives `id` stage `stage` from iteration
  // `start`, with a donor's state or a checkpoint to restore.
  virtual v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                               const std::string& state_from,
                                               const std::string& restore_from) = 0;
};

// The state one job's runner shares among its parts.
struct RunnerShared {
  RunnerShared(RunnerHost* host, std::string job_id, v1::JobSpec spec);

  RunnerHost* const host;
  const std::string job_id;
  v1::JobSpec spec;
  RunnerMembership membership;
  RunnerPlanner plan;
  RunnerCheckpoints checkpoints;
  RunnerLink link;
  RunnerRecord record;
  uint64_t next_iteration = 0;
  std::map<uint32_t, uint64_t> last_checksum;  // stage -> parameters after the last step
  // Stages that lost their last replica, and with it their state, not yet
  // dealt with as elastic.on_stage_loss says.
  std::set<int> lost_stages;
};

// Base of the runner's parts: the shared state under the runner's names,
// and the loop's services.
class RunnerPart {
 protected:
  RunnerPart(RunnerShared* shared, RunnerLoop* loop);

  bool elastic() const { return !spec_.elastic().disabled(); }
  bool kfac() const { return spec_.optimizer().kind() == v1::OPTIMIZER_KFAC; }
  const JobManagerOptions& options() const { return host_->options(); }
  const std::map<std::string, int>& members() const { return membership_.members(); }
  uint64_t epoch() const { return membership_.epoch(); }
  // The time deadlines, back-off and suspicion are judged by (the host's
  // clock); measured durations use absl::Now().
  absl::Time Now() const { return host_->clock().Now(); }
  static JobEnd Failed(absl::string_view message) {
    return JobEnd{v1::JOB_STATE_FAILED, std::string(message)};
  }

  void AddEvent(v1::JobHistoryEvent::Kind kind, uint64_t iteration, const std::string& worker,
                const std::string& message);
  // The job record's stage lists follow the membership.
  void RecordStages();
  void AddReplicaGroups(google::protobuf::RepeatedPtrField<v1::ReplicaGroup>* groups) const;
  // Waits (options().assign_timeout) until every worker of `waiting` reports
  // its stage built; a worker lost meanwhile fails the job. `what` starts
  // the description of a timeout ("stage builds of ").
  std::optional<JobEnd> AwaitStageReady(std::set<std::string> waiting, const char* what);
  // K-FAC's job-wide choices once the first plan exists (a start, a resume,
  // a re-attach): the replica sync (ResolveReplicaSync) and the bubble
  // planner. A failure ends the job.
  std::optional<JobEnd> ConfigureKfac();
  std::optional<JobEnd> ResolveReplicaSync();

  RunnerEvent Wait(absl::Time deadline, const std::function<std::string()>& describe,
                   bool detect_loss = true, bool return_on_change = false) {
    return loop_->Wait(deadline, describe, detect_loss, return_on_change);
  }
  bool StopRequested() const { return loop_->StopRequested(); }
  void RemoveMember(const std::string& id, const std::string& why, uint64_t iteration) {
    loop_->RemoveMember(id, why, iteration);
  }
  v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                       const std::string& state_from,
                                       const std::string& restore_from) {
    return loop_->AssignmentFor(id, stage, start, state_from, restore_from);
  }

  RunnerHost* const host_;
  const std::string& job_id_;
  v1::JobSpec& spec_;
  RunnerMembership& membership_;
  RunnerPlanner& plan_;
  RunnerCheckpoints& checkpoints_;
  RunnerLink& link_;
  RunnerRecord& record_;
  uint64_t& next_iteration_;
  std::map<uint32_t, uint64_t>& last_checksum_;
  std::set<int>& lost_stages_;
  RunnerLoop* const loop_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_PART_H_
