#include "coordinator/timing_estimates.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace detour {

TimingEstimates::TimingEstimates(metrics::Registry* metrics) {
  if (metrics == nullptr) return;
  if (auto f = metrics->AddHistogram("detour_coordinator_task_seconds",
                                     "Compute task durations reported by workers.",
                                     metrics::DefaultLatencyBuckets(), {"stage", "kind"});
      f.ok()) {
    task_seconds_ = *f;
  }
  if (auto f =
          metrics->AddHistogram("detour_coordinator_transfer_seconds",
                                "Activation and gradient transfer durations reported by workers.",
                                metrics::DefaultLatencyBuckets(), {"direction", "peer_region"});
      f.ok()) {
    transfer_seconds_ = *f;
  }
}

void TimingEstimates::Add(const v1::TimingReport& report,
                          const std::map<std::string, std::string>& regions,
                          const std::map<std::string, int>& stage_of) {
  auto stage = stage_of.find(report.node());
  const std::string stage_label = stage == stage_of.end() ? "?" : absl::StrCat(stage->second);
  absl::MutexLock lock(&mu_);
  for (const v1::TaskTiming& t : report.tasks()) {
    auto [it, fresh] = compute_.try_emplace(
        {report.node(), stage == stage_of.end() ? -1 : stage->second, t.kind()}, t.duration_s());
    if (!fresh) it->second = (1 - kAlpha) * it->second + kAlpha * t.duration_s();
    if (task_seconds_ != nullptr) {
      const std::string kind = absl::AsciiStrToLower(v1::TaskTiming::Kind_Name(t.kind()).substr(5));
      if (auto h = task_seconds_->WithLabels({stage_label, kind}); h.ok()) {
        (*h)->Observe(t.duration_s());
      }
    }
  }
  for (const v1::TransferTiming& t : report.transfers()) {
    // The link estimate is for activations and their gradients (one size);
    // all-reduce payloads are larger and say little about the pipeline.
    if (!t.allreduce()) {
      auto [it, fresh] = transfer_.try_emplace({report.node(), t.peer()}, t.duration_s());
      if (!fresh) it->second = (1 - kAlpha) * it->second + kAlpha * t.duration_s();
      ++transfer_reports_[{report.node(), t.peer()}];
    }
    if (transfer_seconds_ != nullptr) {
      auto region = regions.find(t.peer());
      if (auto h =
              transfer_seconds_->WithLabels({t.allreduce() ? "allreduce"
                                             : t.forward() ? "forward"
                                                           : "backward",
                                             region == regions.end() ? "unknown" : region->second});
          h.ok()) {
        (*h)->Observe(t.duration_s());
      }
    }
  }
}

double TimingEstimates::Compute(const std::string& node, int stage,
                                v1::TaskTiming::Kind kind) const {
  absl::MutexLock lock(&mu_);
  auto it = compute_.find({node, stage, kind});
  return it == compute_.end() ? 0 : it->second;
}

double TimingEstimates::Transfer(const std::string& from, const std::string& to) const {
  absl::MutexLock lock(&mu_);
  auto it = transfer_.find({from, to});
  return it == transfer_.end() ? 0 : it->second;
}

uint64_t TimingEstimates::TransferReports(const std::string& from, const std::string& to) const {
  absl::MutexLock lock(&mu_);
  auto it = transfer_reports_.find({from, to});
  return it == transfer_reports_.end() ? 0 : it->second;
}

}  // namespace detour
