// The job runtime's Prometheus families (docs/METRICS.md), registered once
// per worker; every recording helper is a no-op without a registry.
// Thread-safe (the metrics library is), except LinkTransfer and ForgetLinks,
// which only the runtime's executor thread calls (their cache is unlocked so
// that a transfer costs no lock).
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_METRICS_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_METRICS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

#include "common/metrics/metrics.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/plan.pb.h"

namespace detour {

class RuntimeMetrics {
 public:
  // `registry` may be null (nothing is recorded). `region` and `device` go
  // into detour_worker_info.
  explicit RuntimeMetrics(metrics::Registry* registry, std::string region = "",
                          std::string device = "");

  // Peers with a link series of their own; the rest share peer="other".
  static constexpr size_t kMaxLinkPeers = 64;
  // A worker that completed no iteration for this long, or 3 x its last
  // iteration's wall time if longer, counts as idle: busy fractions read 0.
  static constexpr absl::Duration kMinIdleAfter = absl::Seconds(10);

  void Task(v1::TaskTiming::Kind kind, double seconds);
  void Transfer(v1::Direction direction, double seconds);
  void IterationDone();
  void LateFrame();
  void UnexpectedFrame();
  // Busy fractions of the last iteration, which took `iteration_seconds`;
  // 0 when the worker goes idle (IdleCheck) or leaves its job.
  void Utilization(double pipeline, double pipeline_and_kfac, double iteration_seconds = 0);
  // Zeroes the busy fractions when no iteration completed for the idle
  // window (kMinIdleAfter). Called periodically (every heartbeat).
  void IdleCheck(absl::Time now);
  // detour_worker_info: this worker's id (once registered), and the job and
  // stage it holds ("" when idle). Each replaces the previous series.
  void SetWorkerId(const std::string& worker_id);
  void Holding(const std::string& job_id, const std::string& stage);
  // `bytes` sent to `peer` and acknowledged after `seconds` (executor thread).
  void LinkTransfer(const std::string& peer, uint64_t bytes, double seconds);
  // The job's peers are gone: their link series are removed (executor
  // thread, or after it stopped).
  void ForgetLinks();
  void KfacTask(const v1::BubbleTask& task, const std::string& placement, double seconds);
  void KfacDelay(double seconds);
  // Elastic training: microbatches frozen by a membership change, state
  // tensors sent to / received from a joining replica.
  void Frozen(int microbatches);
  void StateBytes(bool sent, uint64_t bytes);

 private:
  metrics::HistogramFamily* task_ = nullptr;
  metrics::HistogramFamily* transfer_ = nullptr;
  metrics::Counter* busy_ = nullptr;
  metrics::Counter* iterations_ = nullptr;
  metrics::Counter* late_frames_ = nullptr;
  metrics::Counter* unexpected_frames_ = nullptr;
  metrics::GaugeFamily* utilization_ = nullptr;
  metrics::CounterFamily* kfac_tasks_ = nullptr;
  metrics::CounterFamily* kfac_seconds_ = nullptr;
  metrics::Histogram* kfac_delay_ = nullptr;
  metrics::Counter* frozen_ = nullptr;
  metrics::CounterFamily* state_bytes_ = nullptr;

  const std::string region_;
  const std::string device_;
  metrics::GaugeFamily* info_ = nullptr;
  absl::Mutex info_mu_;
  std::string worker_id_ ABSL_GUARDED_BY(info_mu_);
  std::string job_id_ ABSL_GUARDED_BY(info_mu_);
  std::string stage_ ABSL_GUARDED_BY(info_mu_);
  std::vector<std::string> info_labels_ ABSL_GUARDED_BY(info_mu_);
  void PublishInfo() ABSL_EXCLUSIVE_LOCKS_REQUIRED(info_mu_);

  absl::Mutex utilization_mu_;
  absl::Time last_utilization_ ABSL_GUARDED_BY(utilization_mu_) = absl::InfinitePast();
  absl::Duration idle_after_ ABSL_GUARDED_BY(utilization_mu_) = kMinIdleAfter;
  bool busy_shown_ ABSL_GUARDED_BY(utilization_mu_) = false;

  struct Link {
    metrics::Counter* bytes = nullptr;
    metrics::Counter* seconds = nullptr;
    metrics::Counter* transfers = nullptr;
    metrics::Gauge* bandwidth = nullptr;
  };
  Link* LinkFor(const std::string& peer);
  metrics::CounterFamily* link_bytes_ = nullptr;
  metrics::CounterFamily* link_seconds_ = nullptr;
  metrics::CounterFamily* link_transfers_ = nullptr;
  metrics::GaugeFamily* link_bandwidth_ = nullptr;
  std::map<std::string, Link> links_;  // executor thread only
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_METRICS_H_
