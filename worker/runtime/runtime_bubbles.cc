#include "worker/runtime/runtime_bubbles.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/model/torch_status.h"

namespace detour {

const v1::BubbleTask* RuntimeBubbles::Next() {
  if (it_ == nullptr || kfac_ == nullptr) return nullptr;
  return bubbles_->Next(*it_->tracker, it_->phase != IterationPhase::kRunning,
                        /*waiting_step=*/false);
}

bool RuntimeBubbles::Run(const v1::BubbleTask* task, bool at_step_end) {
  RunningIteration& it = *it_;
  const v1::BubbleTask t = bubbles_->Remove(task);
  const absl::Time start = absl::Now();
  bubble_running_.store(true, std::memory_order_release);
  absl::Status s = model::GuardTorch("K-FAC", [&]() -> absl::Status {
    const int layer = static_cast<int>(t.layer());
    // num_parts 0: a plan from before parts (one whole item).
    const int parts = static_cast<int>(std::max<uint32_t>(1, t.num_parts()));
    const int part = static_cast<int>(t.part());
    switch (t.kind()) {
      case v1::BubbleTask::KIND_CURVATURE_A:
        return kfac_->CurvatureA(layer, t.microbatch(), part, parts);
      case v1::BubbleTask::KIND_CURVATURE_B:
        return kfac_->CurvatureB(layer, t.microbatch(), part, parts);
      case v1::BubbleTask::KIND_INVERT_A:
        return kfac_->InvertA(layer, t.module(), part, parts, static_cast<int64_t>(t.refresh()));
      case v1::BubbleTask::KIND_INVERT_B:
        return kfac_->InvertB(layer, t.module(), part, parts, static_cast<int64_t>(t.refresh()));
      default: return absl::OkStatus();
    }
  });
  bubble_running_.store(false, std::memory_order_release);
  const absl::Time end = absl::Now();
  if (BubbleSchedule::IsInversion(t)) {
    bubbles_->Inverted(t);
    // A layer no curvature microbatch ever reached (skip routes) has no
    // factor to invert yet: it stays with AdamW until one does.
    if (s.code() == absl::StatusCode::kFailedPrecondition &&
        !(t.kind() == v1::BubbleTask::KIND_INVERT_A
              ? kfac_->FactorA(static_cast<int>(t.layer()), t.module())
              : kfac_->FactorB(static_cast<int>(t.layer()), t.module()))
             .defined()) {
      LogWarning("job ", job_id_, ": ", BubbleSchedule::Name(t), " skipped: ", s.message());
      s = absl::OkStatus();
    }
  }
  const int64_t arrived = arrived_during_bubble_ns_.exchange(0);
  if (arrived != 0) {
    const double delay = std::max(0.0, (absl::ToUnixNanos(end) - arrived) * 1e-9);
    it.max_delay_s = std::max(it.max_delay_s, delay);
    metrics_.KfacDelay(delay);
  }
  if (!s.ok()) {
    Fail(Annotate(s, BubbleSchedule::Name(t)));
    return false;
  }
  Record(v1::TaskTiming::KIND_BUBBLE, t.microbatch(), start);
  metrics_.KfacTask(t,
                    t.serial()    ? "serial"
                    : at_step_end ? "overdue"
                                  : "bubble",
                    absl::ToDoubleSeconds(end - start));
  return true;
}

bool RuntimeBubbles::Drain(const std::function<bool(const v1::BubbleTask&)>& wanted,
                           bool factors_final) {
  while (true) {
    const v1::BubbleTask* next = nullptr;
    switch (bubbles_->NextToDrain(*it_->tracker, factors_final, wanted, &next)) {
      case BubbleSchedule::Drain::kDone: return true;
      case BubbleSchedule::Drain::kStuck:
        Fail(absl::FailedPreconditionError(absl::StrCat(
            "K-FAC task ", BubbleSchedule::Name(*next),
            " cannot run: its input never came (the plan is inconsistent with the routes)")));
        return false;
      case BubbleSchedule::Drain::kTask:
        if (!Run(next, /*at_step_end=*/true)) return false;
    }
  }
}

}  // namespace detour
