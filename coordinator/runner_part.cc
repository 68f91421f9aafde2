#include "coordinator/runner_part.h"

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

}  // namespace detour
