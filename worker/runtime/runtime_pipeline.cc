#include "worker/runtime/runtime_pipeline.h"

#include <ATen/ATen.h>

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"

namespace detour {

void RuntimePipeline::OnPlan(const v1::IterationPlan& plan) {
  if (plan.job_id() != job_id_ || stage_ == nullptr) {
    LogWarning("dropping plan for job ", plan.job_id(), " (holding ",
               job_id_.empty() ? "none" : job_id_, ")");
    return;
  }
  if (it_ != nullptr || plan.iteration() < completed_) {
    if (it_ == nullptr || it_->plan.iteration() != plan.iteration()) {
      LogWarning("dropping plan for iteration ", plan.iteration(), " (",
                 it_ != nullptr ? absl::StrCat("iteration ", it_->plan.iteration(), " is running")
                                : absl::StrCat(completed_, " iterations are done"),
                 ")");
    }
    return;
  }
  if (!state_from_.empty()) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("a plan arrived before the stage state from ", state_from_)));
  }
  replay_.clear();
  std::vector<std::string> group = GroupOf(plan.replica_groups(), stage_index_);
  if (!group.empty()) group_ = std::move(group);
  if (plan.epoch() != epoch_) {
    // Workers were lost or joined since the last plan.
    epoch_ = plan.epoch();
    if (plan.peers_size() > 0) SetPeers(plan.peers());
  }
  std::string why;
  if (!reducer_.Restart(epoch_, group_, me_, &why)) {
    return Fail(absl::InvalidArgumentError(why));
  }
  it_ = std::make_unique<RunningIteration>();
  RunningIteration& it = *it_;
  it.plan = plan;
  it.received = absl::Now();
  it.timing.set_job_id(job_id_);
  it.timing.set_iteration(plan.iteration());
  it.timing.set_node(me_);
  it.tracker = std::make_unique<IterationTracker>(it.plan, me_);
  // Connections to the peers of this plan open now, while the first
  // microbatches compute; over a long round trip the handshakes of a new
  // pair (TCP, TLS, every stripe) cost seconds.
  if (transport_ != nullptr) transport_->Prepare(PlanSendTargets(it.plan, me_, group_));
  admission_.SetRoutes(me_, {plan.routes().begin(), plan.routes().end()});
  admission_.SetPosition(plan.iteration(), epoch_);
  const std::vector<uint32_t> own = it.tracker->Own();
  if (absl::Status s = LoadMicrobatches(own); !s.ok()) return Fail(s);
  // The coordinator's refresh numbering (it restarts after a resume or a
  // coordinator restart; a joining replica's state is relative to it).
  if (kfac_ != nullptr && plan.kfac_refresh_base() > 0) {
    kfac_->RebaseRefreshes(static_cast<int64_t>(plan.kfac_refresh_base()) - 2);
  }
  std::vector<uint32_t> capture;
  if (absl::Status s = bubbles_->Take(it.plan, me_, group_.size() > 1, &capture); !s.ok()) {
    return Fail(s);
  }
  for (uint32_t mb : capture) {
    if (!kfac_->captured(mb)) kfac_->Capture(mb);
  }
  // The data node's microbatches queue up as forwards that need a slot:
  // the queue starts each when the policy picks it and a slot is free.
  const int slots = options_.memory_slots > 0 ? options_.memory_slots
                                              : static_cast<int>(spec_.pipeline().memory_slots());
  const sim::QueuePolicy policy = spec_.pipeline().queue_policy() == v1::QUEUE_POLICY_BACKWARD_FIRST
                                      ? sim::QueuePolicy::kBackwardFirst
                                      : sim::QueuePolicy::kArrival;
  core_->WithQueue([&](WorkQueue& queue) {
    queue.BeginIteration(plan.iteration(), it.tracker->RouteStages(), slots, policy);
  });
  QueueStarts(own);
  OfferEarly();
  reduce_->MaybeFinishLocal();
}

absl::Status RuntimePipeline::LoadMicrobatches(const std::vector<uint32_t>& own) {
  RunningIteration& it = *it_;
  if (own.empty()) return absl::OkStatus();
  if (it.microbatches.empty()) {
    ASSIGN_OR_RETURN(it.microbatches, model::IterationMicrobatches(spec_, train_tokens_,
                                                                   it.plan.iteration(), device_));
  }
  for (uint32_t mb : own) {
    if (mb >= it.microbatches.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("plan names microbatch ", mb, " beyond the iteration's data"));
    }
  }
  return absl::OkStatus();
}

void RuntimePipeline::QueueStarts(const std::vector<uint32_t>& own) {
  const uint64_t iteration = it_->plan.iteration();
  core_->WithQueue([&](WorkQueue& queue) {
    for (uint32_t mb : own) {
      WorkQueue::Pipeline w;
      w.iteration = iteration;
      w.microbatch = mb;
      const v1::Route* r = it_->tracker->route(mb);
      w.epoch = r != nullptr ? r->epoch() : 0;
      queue.PushPipeline(w, [this, iteration, mb] { StartMicrobatch(iteration, mb); });
    }
  });
}

void RuntimePipeline::OfferEarly() {
  std::vector<std::pair<v1::FrameHeader, at::Tensor>> early;
  early.swap(early_);
  for (auto& [h, t] : early) {
    if (it_ != nullptr && h.iteration() == it_->plan.iteration()) {
      core_->Enqueue(h, t);
    } else if (it_ == nullptr || h.iteration() == it_->plan.iteration() + 1) {
      early_.emplace_back(h, t);
    }
  }
}

void RuntimePipeline::StartMicrobatch(uint64_t iteration, uint32_t mb) {
  if (it_ == nullptr || it_->plan.iteration() != iteration) return;
  if (it_->tracker->route(mb) == nullptr) return;  // frozen meanwhile
  RunForward(mb, 0, it_->microbatches[mb].tokens);
}

void RuntimePipeline::RunForward(uint32_t mb, int pos, const at::Tensor& input) {
  RunningIteration& it = *it_;
  const v1::Route& r = *it.tracker->route(mb);
  const absl::Time start = absl::Now();
  auto out = stage_->Forward(mb, input);
  if (!out.ok()) return Fail(out.status());
  Record(v1::TaskTiming::KIND_FORWARD, mb, start);
  it.tracker->ForwardRan(mb);
  if (pos + 1 < r.nodes_size()) {
    SendTensor(r.nodes(pos + 1), v1::DIRECTION_FORWARD, mb, pos + 1, *out, r.epoch());
  } else if (r.nodes_size() == 1) {
    RunLoss(mb, *out);  // the route visits stage 0 only
  } else {
    SendTensor(r.data_node(), v1::DIRECTION_FORWARD, mb, r.nodes_size(), *out, r.epoch());
  }
}

void RuntimePipeline::RunLoss(uint32_t mb, const at::Tensor& hidden) {
  RunningIteration& it = *it_;
  const v1::Route& r = *it.tracker->route(mb);
  const absl::Time start = absl::Now();
  auto loss = stage_->LossAndBackward(mb, hidden, it.microbatches[mb].targets);
  if (!loss.ok()) return Fail(loss.status());
  Record(v1::TaskTiming::KIND_LOSS, mb, start);
  it.tracker->LossRan(mb, loss->loss, static_cast<uint64_t>(loss->tokens));
  const int last = r.nodes_size() - 1;
  if (last == 0) {
    RunBackward(mb, 0, loss->grad_hidden);
  } else {
    SendTensor(r.nodes(last), v1::DIRECTION_BACKWARD, mb, last, loss->grad_hidden, r.epoch());
  }
}

void RuntimePipeline::RunBackward(uint32_t mb, int pos, const at::Tensor& grad) {
  RunningIteration& it = *it_;
  const v1::Route& r = *it.tracker->route(mb);
  const absl::Time start = absl::Now();
  auto gin = stage_->Backward(mb, grad);
  if (!gin.ok()) return Fail(gin.status());
  Record(v1::TaskTiming::KIND_BACKWARD, mb, start);
  it.tracker->BackwardRan(mb, pos);
  core_->WithQueue([&](WorkQueue& queue) { queue.Release(it.plan.iteration(), mb); });
  // Every microbatch below the first one still owed here is done: their
  // gradients join the stage's sum, in order.
  if (absl::Status s = stage_->FoldGradients(it.tracker->FirstBackwardOwed()); !s.ok()) {
    return Fail(s);
  }
  if (pos > 0) SendTensor(r.nodes(pos - 1), v1::DIRECTION_BACKWARD, mb, pos - 1, *gin, r.epoch());
}

void RuntimePipeline::OnTensor(const v1::FrameHeader& h, at::Tensor t) {
  if (it_ == nullptr || h.iteration() != it_->plan.iteration()) {
    if (it_ == nullptr || h.iteration() == it_->plan.iteration() + 1) {
      KeepEarly(h, t);
    } else {
      metrics_.LateFrame();
    }
    return;
  }
  RunningIteration& it = *it_;
  if (h.direction() == v1::DIRECTION_ALLREDUCE) return reduce_->Offer(h, t);
  const IterationTracker::Incoming in = it.tracker->Accept(h);
  switch (in.verdict) {
    case IterationTracker::Verdict::kRun: break;
    case IterationTracker::Verdict::kEarly: KeepEarly(h, t); return;
    case IterationTracker::Verdict::kStale: metrics_.LateFrame(); return;
    case IterationTracker::Verdict::kUnexpected:
      metrics_.UnexpectedFrame();
      LogWarning("dropping unexpected ", v1::Direction_Name(h.direction()), " tensor mb ",
                 h.microbatch(), " hop ", h.hop(), " epoch ", h.epoch(), " from ", h.sender());
      return;
  }
  at::Tensor x = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
  // A member's NaN or huge activation would fail the job on a non-finite
  // gradient: the frame is dropped and its sender reported instead.
  if (absl::Status bad = CheckFrameValues(x); !bad.ok()) {
    return ReportBadFrame(h.sender(), h.direction(), h.microbatch(), h.epoch(), bad);
  }
  if (device_ != c10::Device(c10::kCPU)) x = x.to(device_);
  if (h.direction() == v1::DIRECTION_FORWARD) {
    if (in.loss) {
      RunLoss(h.microbatch(), x);
    } else {
      RunForward(h.microbatch(), in.hop, x);
    }
  } else {
    RunBackward(h.microbatch(), in.hop, x);
  }
  if (it_ != nullptr) reduce_->MaybeFinishLocal();
}

void RuntimePipeline::KeepEarly(const v1::FrameHeader& h, const at::Tensor& t) {
  // Every frame here passed FrameAdmission, which bounds the bytes each
  // sender holds on this worker and refuses, visibly to the sender, a frame
  // past them. No second bound may drop one here: the sender was told it
  // arrived, and a real frame dropped among a flood was waited for forever.
  early_.emplace_back(h, t);
}

}  // namespace detour
