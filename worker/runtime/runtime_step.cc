#include "worker/runtime/runtime_step.h"

#include <torch/torch.h>

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "common/timing.h"
#include "worker/model/checkpoint.h"
#include "worker/runtime/stage_state.h"

namespace detour {

void RuntimeStep::OnStep(const v1::StepCommand& step) {
  if (it_ == nullptr || step.job_id() != job_id_ || step.iteration() != it_->plan.iteration() ||
      it_->phase != IterationPhase::kWaitingStep || step.epoch() != epoch_) {
    LogWarning("dropping step command for ", step.job_id(), " iteration ", step.iteration(),
               " epoch ", step.epoch());
    return;
  }
  RunningIteration& it = *it_;
  // K-FAC work of the iteration that found no idle time, and the serial
  // items, run now: the step may activate what they compute.
  if (!bubbles_part_->Drain([](const v1::BubbleTask&) { return true; }, true)) return;
  if (kfac_ != nullptr && it.plan.kfac_activate_refresh() > 0) {
    kfac_->Activate(static_cast<int64_t>(it.plan.kfac_activate_refresh() - 1));
    LogDebug("job ", job_id_, ": K-FAC refresh ", it.plan.kfac_activate_refresh() - 1,
             " active from iteration ", it.plan.iteration());
  }
  const absl::Time start = absl::Now();
  auto ready = StepStage(spec_, it.plan.iteration(), step.squared_norm(), stage_.get(),
                         optimizer_.get(), kfac_.get());
  if (!ready.ok()) return Fail(ready.status());
  const bool fault_now = options_.fault.kind != JobRuntimeOptions::FaultInjection::Kind::kNone &&
                         it.plan.iteration() == options_.fault.iteration;
  if (fault_now && options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kDiverge) {
    LogWarning("job ", job_id_,
               ": --inject_fault: nudging a parameter after the step of "
               "iteration ",
               it.plan.iteration());
    torch::NoGradGuard no_grad;
    std::vector<model::NamedTensor> params = stage_->Parameters();
    if (!params.empty()) params.front().second.add_(1e-3);
  }
  if (!ready->empty()) {
    LogInfo("job ", job_id_, ": K-FAC: every replica of stage ", stage_index_,
            " preconditions layer(s) ", absl::StrJoin(*ready, ","),
            " with its own factors from iteration ", it.plan.iteration() + 1);
  }
  reducer_.Clear();
  Record(v1::TaskTiming::KIND_OPTIMIZER, 0, start);
  const double duration = absl::ToDoubleSeconds(absl::Now() - it.received);
  it.timing.set_iteration_time_s(duration);
  it.timing.set_bubble_delay_max_s(it.max_delay_s);
  PublishUtilization(it, duration);
  v1::WorkerMessage timing;
  *timing.mutable_timing() = it.timing;
  Send(std::move(timing));

  v1::WorkerMessage result;
  v1::IterationResult* r = result.mutable_result();
  r->set_job_id(job_id_);
  r->set_iteration(it.plan.iteration());
  r->set_loss_sum(it.tracker->completed_loss());
  r->set_tokens(it.tracker->completed_tokens());
  for (uint32_t mb : it.tracker->Completed()) r->add_microbatches(mb);
  if (fault_now && r->microbatches_size() > 0) {
    if (options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kDuplicateMicrobatch) {
      LogWarning("job ", job_id_, ": --inject_fault: reporting microbatch ", r->microbatches(0),
                 " twice");
      r->add_microbatches(r->microbatches(0));
    } else if (options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kMissingMicrobatch) {
      LogWarning("job ", job_id_, ": --inject_fault: leaving microbatch ",
                 r->microbatches(r->microbatches_size() - 1), " out of the result");
      r->mutable_microbatches()->RemoveLast();
    }
  }
  r->set_parameter_checksum(ParameterChecksum(stage_->Parameters()));
  r->set_stage(stage_index_);
  r->set_duration_s(duration);
  r->set_epoch(epoch_);
  if (it.plan.checkpoint() && reducer_.rank() == 0) {
    // One replica per stage writes: replicas are identical.
    auto entry = model::WriteStageFile(it.plan.checkpoint_dir(), *stage_, *optimizer_, kfac_.get());
    if (!entry.ok()) return Fail(Annotate(entry.status(), "writing the checkpoint"));
    *r->mutable_checkpoint() = CheckpointFileOf(*entry);
  }
  completed_ = it.plan.iteration() + 1;
  it_.reset();
  admission_.SetIteration(completed_);
  metrics_.IterationDone();
  Send(std::move(result));
}

void RuntimeStep::OnCommit(const v1::CommitCheckpoint& commit) {
  if (commit.job_id() != job_id_ || stage_ == nullptr) return;
  const model::CheckpointManifest manifest = ManifestOf(commit, stage_->config(), spec_);
  absl::Status written = model::WriteManifest(commit.dir(), manifest);
  if (!written.ok()) return Fail(Annotate(written, "writing the checkpoint manifest"));
  v1::WorkerMessage m;
  m.mutable_checkpoint_committed()->set_job_id(job_id_);
  m.mutable_checkpoint_committed()->set_iteration(commit.iteration());
  m.mutable_checkpoint_committed()->set_dir(commit.dir());
  Send(std::move(m));
}

void RuntimeStep::PublishUtilization(const RunningIteration& it, double duration) {
  if (duration <= 0) return;
  const BusySeconds busy = SumBusy(it.timing);
  metrics_.Utilization(busy.pipeline / duration, (busy.pipeline + busy.kfac) / duration, duration);
}

}  // namespace detour
