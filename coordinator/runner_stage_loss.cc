#include "coordinator/runner_stage_loss.h"

#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "coordinator/runner_elastic.h"
#include "coordinator/runner_iteration.h"

namespace detour {

RunnerStageLoss::RunnerStageLoss(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic,
                                 RunnerIteration* iteration)
    : RunnerPart(shared, loop), elastic_(elastic), iteration_(iteration) {}

bool RunnerStageLoss::KeepHolder(int stage, const std::string& worker) {
  if (!elastic() || lost_stages_.count(stage) ||
      spec_.elastic().on_stage_loss() != v1::STAGE_LOSS_PAUSE) {
    return false;
  }
  holders_[stage] = worker;
  return true;
}

void RunnerStageLoss::Lost(int stage, const std::string& worker, uint64_t iteration) {
  if (!elastic() || lost_stages_.count(stage)) return;
  const v1::StageLossAction action = spec_.elastic().on_stage_loss();
  lost_stages_.insert(stage);
  const std::string checkpoint = checkpoints_.last();
  std::string what;
  const char* label = "rollback";
  if (action == v1::STAGE_LOSS_PAUSE) {
    label = "pause";
    what = absl::StrCat("the job pauses until a worker holding its state (", worker,
                        ") comes back, for up to ", spec_.elastic().pause_timeout_s(),
                        " s; then it fails");
  } else if (action == v1::STAGE_LOSS_REINITIALIZE) {
    label = "reinitialize";
    what = checkpoint.empty()
               ? "a worker that joins it starts from fresh parameters while the other "
                 "stages keep theirs"
               : absl::StrCat("a worker that joins it restores it from checkpoint ", checkpoint,
                              " while the other stages keep theirs");
  } else {
    what = checkpoint.empty()
               ? "once every stage has a worker, the whole job starts again at iteration 0 "
                 "with fresh parameters (there is no checkpoint)"
               : absl::StrCat(
                     "once every stage has a worker, the whole job goes back to "
                     "checkpoint ",
                     checkpoint);
  }
  host_->runner_metrics().StageLost(label);
  LogWarning("job ", job_id_, ": stage ", stage, " lost its last replica and its state");
  AddEvent(v1::JobHistoryEvent::KIND_STAGE_LOST, iteration, worker,
           absl::StrCat("stage ", stage, " lost its last replica (worker ", worker,
                        ") and its state; elastic.on_stage_loss ", v1::StageLossAction_Name(action),
                        ": ", what));
}

std::optional<JobEnd> RunnerStageLoss::Recover() {
  if (lost_stages_.empty()) return std::nullopt;
  const v1::StageLossAction action = spec_.elastic().on_stage_loss();
  if (action == v1::STAGE_LOSS_REINITIALIZE) return std::nullopt;
  auto empty = [this] {
    for (int s : lost_stages_) {
      if (plan_.assignment().stage_nodes[s].empty()) return true;
    }
    return false;
  };
  if (empty()) {
    const std::string why =
        absl::StrCat("stage ", absl::StrJoin(lost_stages_, ", "), " lost its state; ",
                     action == v1::STAGE_LOSS_PAUSE ? "waiting for a worker holding it"
                                                    : "waiting for a worker to roll back with");
    if (auto e = elastic_->Pause(next_iteration_, why, empty); e) return e;
  }
  if (action == v1::STAGE_LOSS_PAUSE) return std::nullopt;
  return Rollback();
}

std::optional<JobEnd> RunnerStageLoss::Rollback() {
  const std::string checkpoint = checkpoints_.last();
  uint64_t to = 0;
  if (!checkpoint.empty()) {
    auto done = RunnerCheckpoints::IterationOf(checkpoint);
    if (!done.ok()) {
      return Failed(absl::StrCat("rolling back after a stage loss: ", done.status().message()));
    }
    to = *done;
  }
  const uint64_t from = next_iteration_;
  membership_.BumpEpoch();  // a new epoch: every member builds again
  plan_.RebuildAssignment();
  plan_.ForgetRoutes();
  last_checksum_.clear();
  RecordStages();
  std::set<std::string> waiting;
  for (const auto& [id, s] : members()) {
    waiting.insert(id);
    if (!link_.SendTo(id, AssignmentFor(id, s, to, "", checkpoint))) {
      return Failed(
          absl::StrCat("rolling back after a stage loss: worker ", id, " has no open session"));
    }
  }
  if (auto e = AwaitStageReady(waiting, "stage rebuilds (rollback) of "); e) return e;
  next_iteration_ = to;
  lost_stages_.clear();
  record_.RestartProgressAt(to, spec_.iterations());
  iteration_->Started(to);
  AddEvent(v1::JobHistoryEvent::KIND_ROLLED_BACK, to, "",
           absl::StrCat("rolled back from iteration ", from, " to ",
                        checkpoint.empty()
                            ? "iteration 0 (no checkpoint: fresh parameters in every stage)"
                            : absl::StrCat("checkpoint ", checkpoint, " (iteration ", to, ")"),
                        " on ", members().size(), " workers"));
  return std::nullopt;
}

void RunnerStageLoss::Readmit(const std::string& worker, const v1::JobStatus& status) {
  const int stage = static_cast<int>(status.stage());
  auto holder = holders_.find(stage);
  if (holder == holders_.end() || holder->second != worker || !lost_stages_.count(stage)) return;
  if (status.completed_iterations() != next_iteration_) {
    LogWarning("job ", job_id_, ": worker ", worker, " is back with stage ", stage, " after ",
               status.completed_iterations(), " iterations; the job is at ", next_iteration_);
    return;
  }
  std::optional<v1::WorkerInfo> info;
  for (const v1::WorkerInfo& w : host_->registry().List(false)) {
    if (w.worker_id() == worker && w.session_open()) info = w;
  }
  if (!info) return;
  holders_.erase(holder);
  membership_.Admit(*info);
  membership_.Set(worker, stage);
  membership_.BumpEpoch();
  if (absl::Status s = plan_.BuildCostModel(); !s.ok()) {
    LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
  }
  plan_.RebuildAssignment();
  plan_.ForgetRoutes();
  lost_stages_.erase(stage);
  host_->runner_metrics().MembersChanged(1);
  link_.AbortIteration(next_iteration_, "a lost stage's worker is back");
  RecordStages();
  AddEvent(v1::JobHistoryEvent::KIND_WORKER_JOINED, next_iteration_, worker,
           absl::StrCat("worker ", worker, " came back holding stage ", stage,
                        "'s state at iteration ", next_iteration_));
}

}  // namespace detour
