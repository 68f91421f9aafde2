#include "worker/runtime/runtime_membership.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"

namespace detour {

void RuntimeMembership::OnMembership(const v1::MembershipChange& change) {
  if (change.job_id() != job_id_ || it_ == nullptr || change.iteration() != it_->plan.iteration()) {
    LogWarning("dropping membership change for ", change.job_id(), " iteration ",
               change.iteration());
    return;
  }
  RunningIteration& it = *it_;
  if (change.epoch() <= it.tracker->epoch()) {
    LogDebug("job ", job_id_, ": membership epoch ", change.epoch(), " again");
    return;
  }
  const std::set<std::string> lost(change.lost().begin(), change.lost().end());
  if (lost.count(me_)) {
    return Fail(absl::AbortedError("the coordinator counts this worker as lost"));
  }
  if (absl::Status s = reduce_->PutLocalBack(); !s.ok()) return Fail(s);
  const IterationTracker::Frozen frozen = it.tracker->Freeze(lost, change.epoch());
  for (uint32_t mb : frozen.microbatches) {
    core_->WithQueue([&](WorkQueue& queue) { queue.DropMicrobatch(it.plan.iteration(), mb); });
    stage_->Drop(mb);
    if (kfac_ != nullptr) kfac_->DropCapture(mb);
    bubbles_->DropMicrobatch(mb);
  }
  metrics_.Frozen(static_cast<int>(frozen.microbatches.size()));
  epoch_ = change.epoch();
  std::vector<std::string> group = GroupOf(change.replica_groups(), stage_index_);
  if (!group.empty()) group_ = std::move(group);
  std::string why;
  if (!reducer_.Restart(epoch_, group_, me_, &why)) return Fail(absl::InvalidArgumentError(why));
  admission_.SetEpoch(epoch_);
  it.phase = IterationPhase::kRunning;
  LogInfo("job ", job_id_, ": iteration ", it.plan.iteration(), " epoch ", epoch_, ": lost ",
          absl::StrJoin(lost, ", "), "; froze ", frozen.microbatches.size(), " microbatch(es)",
          frozen.backward_ran.empty() ? ""
                                      : absl::StrCat(" (backward ran here for ",
                                                     absl::StrJoin(frozen.backward_ran, ","), ")"));
  v1::WorkerMessage ack;
  v1::MembershipAck* a = ack.mutable_membership_ack();
  a->set_job_id(job_id_);
  a->set_iteration(it.plan.iteration());
  a->set_epoch(epoch_);
  for (uint32_t mb : frozen.backward_ran) a->add_backward_ran(mb);
  for (uint32_t mb : frozen.completed) a->add_completed(mb);
  Send(std::move(ack));
}

void RuntimeMembership::OnReroute(const v1::RouteAmendment& amendment) {
  if (amendment.job_id() != job_id_ || it_ == nullptr ||
      amendment.iteration() != it_->plan.iteration()) {
    return;
  }
  RunningIteration& it = *it_;
  if (!it.tracker->awaiting_amendment() && amendment.epoch() == it.tracker->epoch()) return;
  std::vector<v1::Route> routes(amendment.routes().begin(), amendment.routes().end());
  if (absl::Status s = it.tracker->Amend(amendment.epoch(), routes); !s.ok()) return Fail(s);
  admission_.AddRoutes(me_, routes);
  std::vector<uint32_t> own;
  core_->WithQueue([&](WorkQueue& queue) {
    for (const v1::Route& r : routes) {
      queue.SetRoute(r.microbatch(), {r.stages().begin(), r.stages().end()}, r.epoch());
      if (r.data_node() == me_) own.push_back(r.microbatch());
    }
  });
  if (absl::Status s = pipeline_->LoadMicrobatches(own); !s.ok()) return Fail(s);
  pipeline_->QueueStarts(own);
  pipeline_->OfferEarly();
  reduce_->MaybeFinishLocal();
}

}  // namespace detour
