#include "worker/runtime/runtime_metrics.h"

#include "absl/strings/ascii.h"

namespace detour {

RuntimeMetrics::RuntimeMetrics(metrics::Registry* m) {
  if (m == nullptr) return;
  if (auto f = m->AddHistogram("detour_worker_task_seconds",
                               "Compute time of pipeline tasks on this worker.",
                               metrics::DefaultLatencyBuckets(), {"kind"});
      f.ok()) {
    task_ = *f;
  }
  if (auto f = m->AddHistogram("detour_worker_transfer_seconds",
                               "Time from handing a tensor to gRPC to the peer's "
                               "acknowledgement.",
                               metrics::DefaultLatencyBuckets(), {"direction"});
      f.ok()) {
    transfer_ = *f;
  }
  auto counter = [&](const char* name, const char* help) {
    return metrics::OptionalCounter(m, name, help);
  };
  busy_ = counter("detour_worker_busy_seconds",
                  "Seconds spent computing pipeline and optimiser tasks.");
  iterations_ = counter("detour_worker_iterations", "Iterations completed.");
  late_frames_ = counter("detour_worker_frames_late",
                         "Tensors for an old or unknown iteration, or of a replaced route, "
                         "dropped.");
  unexpected_frames_ = counter("detour_worker_frames_unexpected",
                               "Tensors not matching the plan (hop, duplicate), dropped.");
  frozen_ = counter("detour_worker_microbatches_frozen",
                    "Microbatches this worker stopped because their route crossed a lost "
                    "worker.");
  if (auto f = m->AddGauge("detour_worker_busy_fraction",
                           "Busy fraction of the last iteration's wall time: work=\"pipeline\" "
                           "counts forward, backward and loss; work=\"pipeline_and_kfac\" "
                           "adds K-FAC curvature and inversion work. 0 while idle.",
                           {"work"});
      f.ok()) {
    utilization_ = *f;
  }
  if (auto f = m->AddCounter("detour_worker_kfac_tasks",
                             "K-FAC tasks run, by kind and placement: bubble (while idle), "
                             "serial (planned at step end), overdue (planned in a bubble, "
                             "run at step end because no idle time came).",
                             {"kind", "placement"});
      f.ok()) {
    kfac_tasks_ = *f;
  }
  if (auto f = m->AddCounter("detour_worker_kfac_seconds", "Seconds of K-FAC work, by placement.",
                             {"placement"});
      f.ok()) {
    kfac_seconds_ = *f;
  }
  if (auto f = m->AddHistogram("detour_worker_kfac_delay_seconds",
                               "How long pipeline work that arrived during a K-FAC bubble "
                               "task waited for it to finish.",
                               metrics::DefaultLatencyBuckets());
      f.ok()) {
    if (auto h = (*f)->WithLabels({}); h.ok()) kfac_delay_ = *h;
  }
  if (auto f = m->AddCounter("detour_worker_state_transfer_bytes",
                             "Bytes of stage state sent to or received from a joining replica.",
                             {"direction"});
      f.ok()) {
    state_bytes_ = *f;
  }
}

void RuntimeMetrics::Task(v1::TaskTiming::Kind kind, double seconds) {
  if (busy_ != nullptr) (void)busy_->IncrementBy(seconds);
  if (task_ == nullptr) return;
  auto h = task_->WithLabels({absl::AsciiStrToLower(v1::TaskTiming::Kind_Name(kind).substr(5))});
  if (h.ok()) (*h)->Observe(seconds);
}

void RuntimeMetrics::Transfer(v1::Direction direction, double seconds) {
  if (transfer_ == nullptr) return;
  auto h = transfer_->WithLabels({direction == v1::DIRECTION_FORWARD    ? "forward"
                                  : direction == v1::DIRECTION_BACKWARD ? "backward"
                                  : direction == v1::DIRECTION_STATE    ? "state"
                                                                        : "allreduce"});
  if (h.ok()) (*h)->Observe(seconds);
}

void RuntimeMetrics::IterationDone() {
  if (iterations_ != nullptr) iterations_->Increment();
}
void RuntimeMetrics::LateFrame() {
  if (late_frames_ != nullptr) late_frames_->Increment();
}
void RuntimeMetrics::UnexpectedFrame() {
  if (unexpected_frames_ != nullptr) unexpected_frames_->Increment();
}

void RuntimeMetrics::Utilization(double pipeline, double pipeline_and_kfac) {
  if (utilization_ == nullptr) return;
  if (auto g = utilization_->WithLabels({"pipeline"}); g.ok()) (*g)->Set(pipeline);
  if (auto g = utilization_->WithLabels({"pipeline_and_kfac"}); g.ok()) {
    (*g)->Set(pipeline_and_kfac);
  }
}

void RuntimeMetrics::KfacTask(const v1::BubbleTask& task, const std::string& placement,
                              double seconds) {
  if (kfac_tasks_ != nullptr) {
    auto c = kfac_tasks_->WithLabels(
        {absl::AsciiStrToLower(v1::BubbleTask::Kind_Name(task.kind()).substr(5)), placement});
    if (c.ok()) (*c)->Increment();
  }
  if (kfac_seconds_ != nullptr) {
    auto c = kfac_seconds_->WithLabels({placement});
    if (c.ok()) (void)(*c)->IncrementBy(seconds);
  }
}

void RuntimeMetrics::KfacDelay(double seconds) {
  if (kfac_delay_ != nullptr) kfac_delay_->Observe(seconds);
}

void RuntimeMetrics::Frozen(int microbatches) {
  if (frozen_ != nullptr && microbatches > 0) (void)frozen_->IncrementBy(microbatches);
}

void RuntimeMetrics::StateBytes(bool sent, uint64_t bytes) {
  if (state_bytes_ == nullptr) return;
  auto c = state_bytes_->WithLabels({sent ? "sent" : "received"});
  if (c.ok()) (void)(*c)->IncrementBy(static_cast<double>(bytes));
}

}  // namespace detour
