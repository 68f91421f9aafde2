// The job runtime's Prometheus families (docs/METRICS.md), registered once
// per worker; every recording helper is a no-op without a registry.
// Thread-safe (the metrics library is).
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_METRICS_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_METRICS_H_

#include <string>

#include "common/metrics/metrics.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/plan.pb.h"

namespace detour {

class RuntimeMetrics {
 public:
  // `registry` may be null (nothing is recorded).
  explicit RuntimeMetrics(metrics::Registry* registry);

  void Task(v1::TaskTiming::Kind kind, double seconds);
  void Transfer(v1::Direction direction, double seconds);
  void IterationDone();
  void LateFrame();
  void UnexpectedFrame();
  // Busy fractions of the last iteration; 0 when the worker goes idle.
  void Utilization(double pipeline, double pipeline_and_kfac);
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
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_METRICS_H_
