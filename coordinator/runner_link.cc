#include "coordinator/runner_link.h"

#include <utility>

#include "common/log.h"

namespace detour {

RunnerLink::RunnerLink(Sender send, std::string job_id, RunnerMembership* membership,
                       const Clock* clock)
    : send_(std::move(send)), job_id_(std::move(job_id)), membership_(membership), clock_(clock) {}

bool RunnerLink::SendTo(const std::string& id, const v1::CoordinatorMessage& m) {
  sent_[id].push_back(m);
  absl::Status s = send_(id, m);
  if (!s.ok()) {
    LogWarning("job ", job_id_, ": cannot reach worker ", id, ": ", s.message());
    membership_->Suspect(id, "its session is closed", clock_->Now());
  }
  return s.ok();
}

void RunnerLink::SendToAll(const v1::CoordinatorMessage& m) {
  for (const auto& [id, stage] : membership_->members()) SendTo(id, m);
}

void RunnerLink::AbortIteration(uint64_t iteration, const std::string& reason) {
  v1::CoordinatorMessage abort;
  abort.mutable_abort()->set_job_id(job_id_);
  abort.mutable_abort()->set_iteration(iteration);
  abort.mutable_abort()->set_reason(reason);
  SendToAll(abort);
}

void RunnerLink::SendPlan(const v1::CoordinatorMessage& m) {
  if (m.plan().bubble_tasks().empty()) return SendToAll(m);
  std::map<std::string, std::vector<const v1::BubbleTask*>> mine;
  for (const v1::BubbleTask& t : m.plan().bubble_tasks()) mine[t.node()].push_back(&t);
  v1::CoordinatorMessage own = m;
  for (const auto& [id, stage] : membership_->members()) {
    own.mutable_plan()->clear_bubble_tasks();
    for (const v1::BubbleTask* t : mine[id]) *own.mutable_plan()->add_bubble_tasks() = *t;
    SendTo(id, own);
  }
}

void RunnerLink::SendOnce(const std::string& id, const v1::CoordinatorMessage& m) {
  send_(id, m).IgnoreError();
}

void RunnerLink::Replay(const std::string& worker) {
  auto sent = sent_.find(worker);
  if (sent == sent_.end()) return;
  LogInfo("job ", job_id_, ": worker ", worker, " reconnected; repeating ", sent->second.size(),
          " message(s)");
  for (const v1::CoordinatorMessage& m : sent->second) send_(worker, m).IgnoreError();
}

v1::Peer PeerOf(const std::string& id, const v1::WorkerInfo& info) {
  v1::Peer p;
  p.set_worker_id(id);
  p.set_address(info.address());
  p.set_data_address(info.data_address());
  p.set_region(info.region());
  return p;
}

std::vector<v1::Peer> MemberPeers(const RunnerMembership& membership) {
  std::vector<v1::Peer> peers;
  for (const auto& [id, stage] : membership.members()) {
    v1::Peer p = PeerOf(id, membership.infos().at(id));
    p.set_stage(stage);
    peers.push_back(std::move(p));
  }
  return peers;
}

}  // namespace detour
