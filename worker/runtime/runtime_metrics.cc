#include "worker/runtime/runtime_metrics.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"

namespace detour {

RuntimeMetrics::RuntimeMetrics(metrics::Registry* m, std::string region, std::string device)
    : region_(std::move(region)), device_(std::move(device)) {
  if (m == nullptr) return;
  if (auto f = m->AddGauge("detour_worker_info",
                           "Always 1: this worker's id, region and device, and the job and "
                           "stage it holds (empty when idle). Join on instance.",
                           {"worker_id", "region", "device", "job_id", "stage"}, 4);
      f.ok()) {
    info_ = *f;
  }
  // kMaxLinkPeers + "other", with room for a job's series while the
  // previous job's are being removed.
  const size_t links = 2 * (kMaxLinkPeers + 1);
  if (auto f =
          m->AddCounter("detour_worker_link_sent_bytes",
                        "Tensor bytes sent to each peer and acknowledged by it.", {"peer"}, links);
      f.ok()) {
    link_bytes_ = *f;
  }
  if (auto f = m->AddCounter("detour_worker_link_transfer_seconds",
                             "Seconds from handing each tensor to gRPC to the peer's "
                             "acknowledgement, summed per peer (transfers may overlap).",
                             {"peer"}, links);
      f.ok()) {
    link_seconds_ = *f;
  }
  if (auto f = m->AddCounter("detour_worker_link_transfers",
                             "Tensors sent to each peer and acknowledged by it.", {"peer"}, links);
      f.ok()) {
    link_transfers_ = *f;
  }
  if (auto f = m->AddGauge("detour_worker_link_bandwidth_bytes_per_second",
                           "Achieved bandwidth to each peer: bytes over time to the "
                           "acknowledgement, moving average over the recent transfers.",
                           {"peer"}, links);
      f.ok()) {
    link_bandwidth_ = *f;
  }
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

void RuntimeMetrics::Utilization(double pipeline, double pipeline_and_kfac,
                                 double iteration_seconds) {
  if (utilization_ == nullptr) return;
  absl::MutexLock lock(&utilization_mu_);
  last_utilization_ = absl::Now();
  idle_after_ = std::max(kMinIdleAfter, 3 * absl::Seconds(iteration_seconds));
  busy_shown_ = pipeline > 0 || pipeline_and_kfac > 0;
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

namespace detour {

void RuntimeMetrics::IdleCheck(absl::Time now) {
  if (utilization_ == nullptr) return;
  absl::MutexLock lock(&utilization_mu_);
  if (!busy_shown_ || now - last_utilization_ < idle_after_) return;
  busy_shown_ = false;
  for (const char* work : {"pipeline", "pipeline_and_kfac"}) {
    if (auto g = utilization_->WithLabels({work}); g.ok()) (*g)->Set(0);
  }
}

void RuntimeMetrics::SetWorkerId(const std::string& worker_id) {
  if (info_ == nullptr) return;
  absl::MutexLock lock(&info_mu_);
  worker_id_ = worker_id;
  PublishInfo();
}

void RuntimeMetrics::Holding(const std::string& job_id, const std::string& stage) {
  if (info_ == nullptr) return;
  absl::MutexLock lock(&info_mu_);
  job_id_ = job_id;
  stage_ = stage;
  PublishInfo();
}

void RuntimeMetrics::PublishInfo() {
  std::vector<std::string> labels = {worker_id_, region_, device_, job_id_, stage_};
  if (labels == info_labels_) return;
  if (!info_labels_.empty()) (void)info_->Remove(info_labels_);
  info_labels_.clear();
  if (auto g = info_->WithLabels(labels); g.ok()) {
    (*g)->Set(1);
    info_labels_ = std::move(labels);
  }
}

RuntimeMetrics::Link* RuntimeMetrics::LinkFor(const std::string& peer) {
  if (link_bytes_ == nullptr) return nullptr;
  auto it = links_.find(peer);
  if (it != links_.end()) return &it->second;
  const std::string label = links_.size() < kMaxLinkPeers ? peer : "other";
  if (label != peer) {
    if (auto other = links_.find("other"); other != links_.end()) return &other->second;
  }
  Link link;
  if (auto c = link_bytes_->WithLabels({label}); c.ok()) link.bytes = *c;
  if (auto c = link_seconds_->WithLabels({label}); c.ok()) link.seconds = *c;
  if (auto c = link_transfers_->WithLabels({label}); c.ok()) link.transfers = *c;
  if (auto g = link_bandwidth_->WithLabels({label}); g.ok()) link.bandwidth = *g;
  return &links_.emplace(label, link).first->second;
}

void RuntimeMetrics::LinkTransfer(const std::string& peer, uint64_t bytes, double seconds) {
  Link* link = LinkFor(peer);
  if (link == nullptr) return;
  if (link->bytes != nullptr) (void)link->bytes->IncrementBy(static_cast<double>(bytes));
  if (link->seconds != nullptr && seconds >= 0) (void)link->seconds->IncrementBy(seconds);
  if (link->transfers != nullptr) link->transfers->Increment();
  if (link->bandwidth != nullptr && seconds > 0) {
    const double rate = static_cast<double>(bytes) / seconds;
    const double previous = link->bandwidth->Value();
    link->bandwidth->Set(previous > 0 ? 0.8 * previous + 0.2 * rate : rate);
  }
}

void RuntimeMetrics::ForgetLinks() {
  for (const auto& [label, link] : links_) {
    (void)link_bytes_->Remove({label});
    (void)link_seconds_->Remove({label});
    (void)link_transfers_->Remove({label});
    (void)link_bandwidth_->Remove({label});
  }
  links_.clear();
}

}  // namespace detour
