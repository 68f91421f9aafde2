#include "coordinator/runner_part.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "coordinator/planner/replica_sync_choice.h"

namespace detour {

RunnerShared::RunnerShared(RunnerHost* host_in, std::string job_id_in, v1::JobSpec spec_in)
    : host(host_in),
      job_id(std::move(job_id_in)),
      spec(std::move(spec_in)),
      plan(job_id, &spec, &host_in->options().network, &membership),
      checkpoints(host_in->options().checkpoint_root, job_id),
      link([host_in](const std::string& worker,
                     const v1::CoordinatorMessage& m) { return host_in->Send(worker, m); },
           job_id, &membership, &host_in->clock()),
      record(&host_in->jobs(), job_id) {}

RunnerPart::RunnerPart(RunnerShared* s, RunnerLoop* loop)
    : host_(s->host),
      job_id_(s->job_id),
      spec_(s->spec),
      membership_(s->membership),
      plan_(s->plan),
      checkpoints_(s->checkpoints),
      link_(s->link),
      record_(s->record),
      next_iteration_(s->next_iteration),
      last_checksum_(s->last_checksum),
      lost_stages_(s->lost_stages),
      loop_(loop) {}

void RunnerPart::AddEvent(v1::JobHistoryEvent::Kind kind, uint64_t iteration,
                          const std::string& worker, const std::string& message) {
  record_.AddEvent(kind, iteration, worker, message, epoch());
}

void RunnerPart::RecordStages() {
  std::vector<std::vector<std::string>> stages;
  for (int s = 0; s < plan_.assignment().num_stages(); ++s) {
    stages.push_back(plan_.StageMembers(s));
  }
  record_.Stages(stages, epoch(), members().size());
}

void RunnerPart::AddReplicaGroups(
    google::protobuf::RepeatedPtrField<v1::ReplicaGroup>* groups) const {
  for (int s = 0; s < plan_.assignment().num_stages(); ++s) {
    v1::ReplicaGroup* g = groups->Add();
    g->set_stage(s);
    for (const std::string& id : plan_.StageMembers(s)) g->add_nodes(id);
  }
}

std::optional<JobEnd> RunnerPart::AwaitStageReady(std::set<std::string> waiting, const char* what) {
  const absl::Time deadline = Now() + options().assign_timeout;
  while (!waiting.empty()) {
    RunnerEvent ev =
        Wait(deadline, [&] { return absl::StrCat(what, absl::StrJoin(waiting, ", ")); });
    if (ev.end) return ev.end;
    // A worker lost while building fails the job: there is nothing to
    // recover yet.
    if (!ev.lost.empty()) {
      return Failed(
          absl::StrCat("worker ", absl::StrJoin(ev.lost, ", "), " lost while building its stage"));
    }
    for (auto& [worker, m] : ev.messages) {
      if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_) waiting.erase(worker);
    }
  }
  LogInfo("job ", job_id_, ": all ", members().size(), " stages built");
  return std::nullopt;
}

// optimizer.kfac.replica_sync AUTO: FACTORS or PRECONDITIONED for the
// whole job, from the cost model on the first plan's timeline
// (planner::ChooseReplicaSync). The choice goes into spec_ (the workers'
// assignments carry it), into the stored job's spec before any worker
// holds a stage (a resumed or re-attached job keeps it), and into the
// history with both modelled iteration times.
std::optional<JobEnd> RunnerPart::ResolveReplicaSync() {
  v1::KfacSpec* k = spec_.mutable_optimizer()->mutable_kfac();
  if (!kfac() || k->replica_sync() != v1::KFAC_REPLICA_SYNC_AUTO) return std::nullopt;
  if (!plan_.first_plan()) {
    // A re-attached job's stored spec holds the choice made before its
    // stages were recorded; without a first plan there is nothing to judge.
    return Failed("K-FAC replica sync: AUTO was never resolved for this job; resume it");
  }
  const planner::PlannedIteration& first = *plan_.first_plan();
  auto choice =
      planner::ChooseReplicaSync(plan_.KfacWorkload(kfac::ReplicaSync::kFactors), *k, first.plan,
                                 planner::TimelineFromSimulation(first.result));
  if (!choice.ok()) {
    return Failed(absl::StrCat("K-FAC replica sync choice: ", choice.status().message()));
  }
  const bool factors = choice->sync == kfac::ReplicaSync::kFactors;
  const v1::KfacReplicaSync chosen =
      factors ? v1::KFAC_REPLICA_SYNC_FACTORS : v1::KFAC_REPLICA_SYNC_PRECONDITIONED;
  k->set_replica_sync(chosen);
  k->set_sync_factors(factors);
  absl::Status recorded = record_.ReplicaSync(chosen, factors);
  recorded = record_.Hold(recorded, [this] { return StopRequested(); });
  if (!recorded.ok()) {
    return Failed(absl::StrCat("cannot write the job record: ", recorded.message()));
  }
  LogInfo("job ", job_id_, ": ", choice->reason);
  AddEvent(v1::JobHistoryEvent::KIND_CONFIGURED, next_iteration_, "", choice->reason);
  return std::nullopt;
}

std::optional<JobEnd> RunnerPart::ConfigureKfac() {
  if (auto e = ResolveReplicaSync(); e) return e;
  if (absl::Status s = plan_.CreateBubblePlanner(); !s.ok()) {
    return Failed(absl::StrCat("K-FAC bubble planner: ", s.message()));
  }
  return std::nullopt;
}

}  // namespace detour
