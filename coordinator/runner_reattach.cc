#include "coordinator/runner_reattach.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "coordinator/reattach_point.h"
#include "coordinator/runner_elastic.h"

namespace detour {

RunnerReattach::RunnerReattach(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic)
    : RunnerPart(shared, loop), elastic_(elastic) {}

std::optional<JobEnd> RunnerReattach::Run() {
  auto stored = host_->jobs().Get(job_id_);
  if (!stored.ok()) return Failed(std::string(stored.status().message()));
  membership_.set_epoch(stored->epoch() + 1);
  for (int s = 0; s < stored->stages_size(); ++s) {
    for (const std::string& id : stored->stages(s).nodes()) membership_.Set(id, s);
  }
  if (members().empty()) {
    return Failed("coordinator restarted before the job's stages were assigned; resume it");
  }
  record_.SetState(v1::JOB_STATE_RUNNING, absl::StrCat("re-attaching to ", members().size(),
                                                       " workers after a coordinator restart"));
  // Workers re-register and report what they hold (JobStatus) once their
  // session reopens.
  std::map<std::string, v1::JobStatus> status;
  // Members back whose heartbeat names no part of this job (the old
  // coordinator told them to drop it, or they restarted): nothing will come
  // from them, so they are not waited for.
  std::set<std::string> empty_handed;
  auto note_empty_handed = [&] {
    for (const v1::WorkerInfo& w : host_->registry().List(false)) {
      if (membership_.IsMember(w.worker_id()) && !status.count(w.worker_id()) && w.session_open() &&
          w.heartbeats() > 0 && w.job_id() != job_id_) {
        empty_handed.insert(w.worker_id());
      }
    }
  };
  note_empty_handed();
  const absl::Time deadline = Now() + options().assign_timeout;
  while (status.size() + empty_handed.size() < members().size() && Now() < deadline) {
    RunnerEvent ev = Wait(
        deadline, [&] { return "workers to re-attach"; }, /*detect_loss=*/false,
        /*return_on_change=*/true);
    if (ev.end && StopRequested()) return ev.end;
    if (ev.end) break;  // timed out: the missing ones are lost
    for (auto& [worker, m] : ev.messages) {
      if (m.has_job_status() && m.job_status().job_id() == job_id_ &&
          membership_.IsMember(worker)) {
        status[worker] = m.job_status();
        empty_handed.erase(worker);
      }
    }
    note_empty_handed();
  }
  for (const v1::WorkerInfo& w : host_->registry().List(true)) {
    if (membership_.IsMember(w.worker_id())) membership_.mutable_infos()[w.worker_id()] = w;
  }
  std::vector<std::string> missing;
  for (const auto& [id, stage] : std::map<std::string, int>(members())) {
    if (status.count(id) && membership_.infos().count(id)) continue;
    missing.push_back(id);
    host_->Unreserve(job_id_, id);
    membership_.Remove(id);
  }
  for (auto it = status.begin(); it != status.end();) {
    it = membership_.IsMember(it->first) ? std::next(it) : status.erase(it);
  }
  // The stored epoch may lag the workers' (stage-list writes are not
  // retried): the new one is above every epoch in play.
  uint64_t top = stored->epoch();
  for (const auto& [id, st] : status) top = std::max(top, st.epoch());
  if (stored->has_pending_step()) top = std::max(top, stored->pending_step().epoch());
  if (top + 1 > epoch()) membership_.set_epoch(top + 1);
  auto point =
      FindReattachPoint(status, stored->has_pending_step() ? &stored->pending_step() : nullptr);
  std::vector<std::string> behind;  // laggards that did not apply the step
  if (point.ok() && !point->laggards.empty()) {
    if (auto e = CatchUp(stored->pending_step(), point->laggards, &status, &behind); e) return e;
  }
  std::map<std::string, uint64_t> checksums;
  for (const auto& [id, st] : status) checksums[id] = st.parameter_checksum();
  absl::Status agree =
      point.ok()
          ? CheckReplicasAgree(checksums, members(),
                               absl::StrCat("differ after iteration ", point->next_iteration))
          : point.status();
  if (!agree.ok()) {
    const std::string why =
        status.empty() && !empty_handed.empty()
            ? absl::StrCat("no worker of the job came back holding its part (",
                           absl::StrJoin(empty_handed, ", "), " came back without it)")
            : std::string(agree.message());
    return Failed(absl::StrCat("coordinator restarted; ", why,
                               "; resume the job from its last checkpoint (detourctl resume ",
                               job_id_, ")"));
  }
  for (const auto& [id, s] : members()) membership_.mutable_node_order().push_back(id);
  next_iteration_ = point->next_iteration;
  if (absl::Status s = plan_.BuildCostModel(); !s.ok()) return Failed(s.message());
  plan_.RebuildAssignment();
  host_->runner_metrics().MembersChanged(static_cast<int>(members().size()));
  if (auto e = ConfigureKfac(); e) return e;
  // Whatever iteration was in flight is run again from its start.
  link_.AbortIteration(next_iteration_, "the coordinator restarted; the iteration runs again");
  for (const std::string& id : missing) {
    AddEvent(
        v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
        empty_handed.count(id)
            ? absl::StrCat("worker ", id,
                           " came back after the coordinator restarted without its part of "
                           "the job")
            : absl::StrCat("worker ", id, " did not come back after the coordinator restarted"));
  }
  for (const std::string& id : behind) {
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
             absl::StrCat("worker ", id, " did not apply the step of iteration ",
                          next_iteration_ - 1, " that the old coordinator had not sent it"));
  }
  const size_t caught_up = point->laggards.size() - behind.size();
  AddEvent(v1::JobHistoryEvent::KIND_REATTACHED, next_iteration_, "",
           absl::StrCat("re-attached ", members().size(),
                        " workers after a coordinator "
                        "restart; continuing at iteration ",
                        next_iteration_,
                        caught_up == 0 ? ""
                                       : absl::StrCat(" (", caught_up,
                                                      " of them first applied the step of "
                                                      "iteration ",
                                                      next_iteration_ - 1,
                                                      ", which the coordinator had died "
                                                      "sending)")));
  if (std::string why = plan_.Infeasible(); !why.empty()) {
    if (auto e = elastic_->Pause(next_iteration_, why); e) return e;
  }
  RecordStages();
  return std::nullopt;
}

std::optional<JobEnd> RunnerReattach::CatchUp(const v1::PendingStep& pending,
                                              const std::vector<std::string>& laggards,
                                              std::map<std::string, v1::JobStatus>* status,
                                              std::vector<std::string>* behind) {
  LogInfo("job ", job_id_, ": workers ", absl::StrJoin(laggards, ", "),
          " did not get the step of iteration ", pending.iteration(),
          " before the coordinator restarted; sending it to them");
  // A laggard whose session closed meanwhile is waited for too: the link
  // replays the step when it reopens.
  std::set<std::string> waiting(laggards.begin(), laggards.end());
  const v1::CoordinatorMessage step = StepMessage(job_id_, pending);
  for (const std::string& id : laggards) link_.SendTo(id, step);
  bool checkpoint = false;
  const absl::Time deadline = Now() + options().assign_timeout;
  while (!waiting.empty() && Now() < deadline) {
    RunnerEvent ev = Wait(
        deadline,
        [&] {
          return absl::StrCat("the step of iteration ", pending.iteration(), " on ",
                              absl::StrJoin(waiting, ", "));
        },
        /*detect_loss=*/false);
    if (ev.end && StopRequested()) return ev.end;
    for (auto& [worker, m] : ev.messages) {
      if (!m.has_result() || m.result().job_id() != job_id_ ||
          m.result().iteration() != pending.iteration() || !waiting.count(worker)) {
        continue;
      }
      v1::JobStatus& st = (*status)[worker];
      st.set_completed_iterations(pending.iteration() + 1);
      st.set_parameter_checksum(m.result().parameter_checksum());
      st.set_in_iteration(false);
      checkpoint = checkpoint || m.result().has_checkpoint();
      waiting.erase(worker);
    }
    if (ev.end) break;  // timed out, or a member failed: whoever is left is behind
  }
  if (checkpoint) {
    // Its stage files are written, but the old coordinator's results of the
    // workers that stepped before it died are gone: no manifest.
    AddEvent(v1::JobHistoryEvent::KIND_CHECKPOINT_SKIPPED, pending.iteration() + 1, "",
             absl::StrCat("the checkpoint after iteration ", pending.iteration(),
                          " was not completed: the coordinator restarted during its step; the "
                          "previous one stays the newest"));
  }
  for (const std::string& id : waiting) {
    LogWarning("job ", job_id_, ": worker ", id, " did not apply the step of iteration ",
               pending.iteration());
    status->erase(id);
    behind->push_back(id);
    host_->Unreserve(job_id_, id);
    membership_.Remove(id);
  }
  return std::nullopt;
}

}  // namespace detour
