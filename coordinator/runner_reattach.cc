#include "coordinator/runner_reattach.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
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
  const absl::Time deadline = Now() + options().assign_timeout;
  while (status.size() < members().size() && Now() < deadline) {
    RunnerEvent ev = Wait(
        deadline, [&] { return "workers to re-attach"; }, /*detect_loss=*/false);
    if (ev.end && StopRequested()) return ev.end;
    if (ev.end) break;  // timed out: the missing ones are lost
    for (auto& [worker, m] : ev.messages) {
      if (m.has_job_status() && m.job_status().job_id() == job_id_ &&
          membership_.IsMember(worker)) {
        status[worker] = m.job_status();
      }
    }
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
  for (const auto& [id, s] : members()) membership_.mutable_node_order().push_back(id);
  std::set<uint64_t> completed;
  for (const auto& [id, st] : status) {
    if (membership_.IsMember(id)) completed.insert(st.completed_iterations());
  }
  if (members().empty() || completed.size() != 1) {
    return Failed(absl::StrCat("coordinator restarted; ",
                               members().empty() ? "no worker of the job came back"
                                                 : "the workers stopped at different "
                                                   "iterations",
                               "; resume the job from its last checkpoint (detourctl resume ",
                               job_id_, ")"));
  }
  next_iteration_ = *completed.begin();
  if (absl::Status s = plan_.BuildCostModel(); !s.ok()) return Failed(s.message());
  plan_.RebuildAssignment();
  host_->runner_metrics().MembersChanged(static_cast<int>(members().size()));
  if (auto e = ConfigureKfac(); e) return e;
  // Whatever iteration was in flight is run again from its start.
  link_.AbortIteration(next_iteration_, "the coordinator restarted; the iteration runs again");
  for (const std::string& id : missing) {
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
             absl::StrCat("worker ", id, " did not come back after the coordinator restarted"));
  }
  AddEvent(v1::JobHistoryEvent::KIND_REATTACHED, next_iteration_, "",
           absl::StrCat("re-attached ", members().size(),
                        " workers after a coordinator "
                        "restart; continuing at iteration ",
                        next_iteration_));
  if (std::string why = plan_.Infeasible(); !why.empty()) {
    if (auto e = elastic_->Pause(next_iteration_, why); e) return e;
  }
  RecordStages();
  return std::nullopt;
}

}  // namespace detour
