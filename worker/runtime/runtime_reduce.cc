#include "worker/runtime/runtime_reduce.h"

#include <ATen/ATen.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/model/torch_status.h"

namespace detour {

void RuntimeReduce::MaybeFinishLocal() {
  RunningIteration& it = *it_;
  if (it.phase != IterationPhase::kRunning || !it.tracker->LocalWorkDone()) return;
  // What is still kept apart (microbatches frozen after their loss ran
  // here) joins the sum, in order.
  if (absl::Status s = stage_->FoldGradients(); !s.ok()) return Fail(s);
  it.phase = IterationPhase::kReducing;
  const bool precondition = kfac_ != nullptr && kfac_->replicas_precondition();
  // Share this replica's summed gradient with the other replicas.
  if (group_.size() > 1 || precondition) {
    // Factors to sync need all of this iteration's curvature first.
    if (!bubbles_->sync_layers().empty() &&
        !bubbles_part_->Drain(BubbleSchedule::IsCurvature, false)) {
      return;
    }
    auto flat = FlatGradients(it.tracker->visits() > 0, bubbles_->sync_layers());
    if (!flat.ok()) return Fail(flat.status());
    if (precondition) {
      // This replica's own factors precondition its own gradient; the
      // votes say which layers every replica could precondition.
      it.raw_local = *flat;
      auto payload = model::GuardTorch("preconditioning", [&]() -> absl::StatusOr<at::Tensor> {
        at::Tensor pre = flat->clone();
        RETURN_IF_ERROR(kfac_->PreconditionFlat(stage_->Parameters(), &pre));
        return at::cat({pre, kfac_->ReadyVotes()}).contiguous();
      });
      if (!payload.ok()) return Fail(payload.status());
      flat = *std::move(payload);
    }
    reducer_.SetLocal(*flat, it.tracker->visits());
    const int rank = reducer_.rank();
    for (const std::string& peer : reducer_.Others()) {
      SendTensor(peer, v1::DIRECTION_ALLREDUCE, static_cast<uint32_t>(rank),
                 static_cast<uint32_t>(it.tracker->visits()), *flat, epoch_);
      if (it_ == nullptr) return;
    }
  } else {
    reducer_.SetLocal(at::Tensor(), it.tracker->visits());
  }
  TryReduce();
}

void RuntimeReduce::Offer(const v1::FrameHeader& h, const at::Tensor& t) {
  std::string why;
  if (!reducer_.Offer(h.sender(), h.epoch(), t, static_cast<int>(h.hop()), &why)) {
    metrics_.UnexpectedFrame();
    LogWarning("job ", job_id_, ": dropping ", why);
    return;
  }
  TryReduce();
}

absl::Status RuntimeReduce::PutLocalBack() {
  RunningIteration& it = *it_;
  if (it.reduced) {
    RETURN_IF_ERROR(Unflatten(it.raw_local.defined() ? it.raw_local : reducer_.local()->payload,
                              it.tracker->visits() > 0));
    if (it.tracker->visits() == 0) stage_->ZeroGrad();
  } else if (it.scaled != 1.0) {
    RETURN_IF_ERROR(stage_->ScaleGradients(1.0 / it.scaled));
  }
  it.reduced = false;
  it.scaled = 1.0;
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> RuntimeReduce::FlatGradients(bool visited,
                                                        const std::vector<int>& sync_layers) {
  return model::GuardTorch("flattening gradients", [&]() -> absl::StatusOr<at::Tensor> {
    std::vector<at::Tensor> parts;
    for (const auto& [name, p] : stage_->Parameters()) {
      at::Tensor g = visited && p.grad().defined() ? p.grad() : at::zeros_like(p);
      parts.push_back(g.detach().to(at::kCPU).to(at::kFloat).reshape({-1}));
    }
    for (int layer : sync_layers) {
      for (const at::Tensor& f : kfac_->PendingFactorTensors(layer)) {
        parts.push_back(f.detach().to(at::kCPU).to(at::kFloat).reshape({-1}));
      }
    }
    return at::cat(parts).contiguous();
  });
}

absl::Status RuntimeReduce::Unflatten(const at::Tensor& flat, bool grads) {
  return model::GuardTorch("unflattening gradients", [&]() -> absl::Status {
    int64_t tail = flat_numel_;
    for (int layer : bubbles_->sync_layers()) {
      for (at::Tensor& f : kfac_->PendingFactorTensors(layer)) {
        f.copy_(flat.narrow(0, tail, f.numel()).view(f.sizes()).to(f.device()));
        tail += f.numel();
      }
    }
    if (!grads) return absl::OkStatus();
    int64_t offset = 0;
    for (const auto& [name, p] : stage_->Parameters()) {
      at::Tensor slice = flat.narrow(0, offset, p.numel()).view(p.sizes()).to(p.device());
      offset += p.numel();
      if (p.grad().defined()) {
        p.mutable_grad().copy_(slice);
      } else {
        p.mutable_grad() = slice.clone();
      }
    }
    return absl::OkStatus();
  });
}

void RuntimeReduce::TryReduce() {
  RunningIteration& it = *it_;
  if (it.phase != IterationPhase::kReducing || !reducer_.Ready()) return;
  const absl::Time start = absl::Now();
  const int total_visits = reducer_.TotalVisits();
  const bool precondition = kfac_ != nullptr && kfac_->replicas_precondition();
  if (group_.size() > 1 || precondition) {
    // Sum in rank order so every replica computes the identical result.
    const auto inputs = reducer_.InRankOrder();
    const int64_t numel = inputs.front()->payload.numel();
    at::Tensor sum;
    absl::Status s = model::GuardTorch("all-reduce", [&]() -> absl::Status {
      for (size_t r = 0; r < inputs.size(); ++r) {
        const at::Tensor& part = inputs[r]->payload;
        if (part.numel() != numel) {
          return absl::InvalidArgumentError(
              absl::StrCat("all-reduce from ", reducer_.members()[r], " has ", part.numel(),
                           " values, expected ", numel, " (gradients + K-FAC factors of layers ",
                           absl::StrJoin(bubbles_->sync_layers(), ","), ")"));
        }
        sum = sum.defined() ? sum + part : part.clone();
      }
      if (precondition) {
        const int64_t votes = sum.numel() - flat_numel_;
        RETURN_IF_ERROR(
            kfac_->AgreeReady(sum.narrow(0, flat_numel_, votes), static_cast<int>(inputs.size())));
      }
      return absl::OkStatus();
    });
    if (s.ok() && !CheckFrameValues(sum).ok()) {
      // The sum is checked in one pass; only a bad one has its inputs
      // checked, to name the replicas that sent bad values. They are
      // reported and the round waits for the coordinator to exclude them
      // (the survivors then reduce again). Bad values of this replica's own
      // are its own training diverging: that fails the job, as before.
      std::vector<std::pair<std::string, absl::Status>> senders;
      for (size_t r = 0; r < inputs.size(); ++r) {
        const std::string& from = reducer_.members()[r];
        if (from == me_) continue;
        if (absl::Status bad = CheckFrameValues(inputs[r]->payload); !bad.ok()) {
          senders.emplace_back(from, bad);
        }
      }
      if (senders.empty()) {
        s = absl::InvalidArgumentError(
            absl::StrCat("the replicas' summed gradients: ", CheckFrameValues(sum).message()));
      }
      for (const auto& bad : senders) {
        ReportBadFrame(bad.first, v1::DIRECTION_ALLREDUCE, 0, epoch_, bad.second);
      }
      if (!senders.empty()) return;
    }
    if (s.ok()) s = Unflatten(sum, total_visits > 0);
    if (!s.ok()) return Fail(s);
    it.reduced = true;
  }
  Record(v1::TaskTiming::KIND_ALLREDUCE, 0, start);
  const double scale = model::GradNormalizationScale(spec_.pipeline().grad_normalization(),
                                                     total_visits, it.tracker->live_microbatches());
  if (scale != 1.0 && scale != 0.0) {
    absl::Status s = stage_->ScaleGradients(scale);
    if (!s.ok()) return Fail(s);
    it.scaled = scale;
  }
  // The clipping norm is over raw gradients: preconditioned ones are left
  // out (they get the same clip factor).
  std::set<std::string> preconditioned;
  if (precondition) preconditioned = kfac_->PreconditionedParameters();
  auto sq = stage_->SquaredGradNorm(preconditioned.empty() ? nullptr : &preconditioned);
  if (!sq.ok()) return Fail(sq.status());
  it.phase = IterationPhase::kWaitingStep;
  v1::WorkerMessage m;
  v1::GradientNorm* n = m.mutable_grad_norm();
  n->set_job_id(job_id_);
  n->set_iteration(it.plan.iteration());
  n->set_stage(stage_index_);
  n->set_squared_norm(*sq);
  n->set_epoch(epoch_);
  Send(std::move(m));
}

}  // namespace detour
