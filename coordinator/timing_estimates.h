// Running estimates of per-node compute times and per-link transfer times,
// from workers' TimingReports: the input of adaptive re-planning. Exported as
// Prometheus histograms with bounded labels (stage, task kind, direction,
// peer region — never microbatch ids). Thread-safe.
#ifndef DETOUR_COORDINATOR_TIMING_ESTIMATES_H_
#define DETOUR_COORDINATOR_TIMING_ESTIMATES_H_

#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "detour/v1/plan.pb.h"

namespace detour {

class TimingEstimates {
 public:
  // Weight of a new observation in the exponential moving averages.
  static constexpr double kAlpha = 0.3;

  explicit TimingEstimates(metrics::Registry* metrics);

  // `regions` maps node ids to regions (for the peer-region label);
  // `stage_of` maps node ids to the stage they hold.
  void Add(const v1::TimingReport& report, const std::map<std::string, std::string>& regions,
           const std::map<std::string, int>& stage_of);

  // Mean seconds of `kind` tasks on `node` while it held `stage`; 0 when
  // never seen. Per stage: stages differ in work (the embedding, the head),
  // and a worker that moves between stages (stage reassignment) must not be
  // judged on the new stage by the old one's times.
  double Compute(const std::string& node, int stage, v1::TaskTiming::Kind kind) const;
  // Mean seconds of an activation-sized transfer (a forward activation or
  // its gradient; all-reduce payloads excluded) from `from` to `to`; 0 when
  // never seen. Latency and bandwidth are not separable from one transfer
  // size: the planner keeps the link's latency and fits its bandwidth.
  double Transfer(const std::string& from, const std::string& to) const;
  // How many reports held such a transfer from `from` to `to` (0 = none):
  // a link whose count has not grown since it was last read carried no
  // activation since, whatever its mean says.
  uint64_t TransferReports(const std::string& from, const std::string& to) const;

 private:
  mutable absl::Mutex mu_;
  // (node, stage, kind) -> seconds; a node of no known stage is kept under -1.
  std::map<std::tuple<std::string, int, int>, double> compute_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, double> transfer_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, uint64_t> transfer_reports_ ABSL_GUARDED_BY(mu_);
  metrics::HistogramFamily* task_seconds_ = nullptr;
  metrics::HistogramFamily* transfer_seconds_ = nullptr;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_TIMING_ESTIMATES_H_
