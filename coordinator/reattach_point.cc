#include "coordinator/reattach_point.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace detour {

absl::StatusOr<ReattachPoint> FindReattachPoint(const std::map<std::string, v1::JobStatus>& status,
                                                const v1::PendingStep* pending) {
  if (status.empty()) return absl::FailedPreconditionError("no worker of the job came back");
  uint64_t low = status.begin()->second.completed_iterations(), high = low;
  for (const auto& [id, s] : status) {
    low = std::min(low, s.completed_iterations());
    high = std::max(high, s.completed_iterations());
  }
  ReattachPoint point;
  point.next_iteration = high;
  if (low == high) return point;
  auto apart = [&](const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the workers stopped at different iterations (", low, " and ", high, ") and ", why));
  };
  if (high - low > 1) return apart("no step joins them");
  if (pending == nullptr || pending->iteration() != low) {
    return apart(absl::StrCat("the record holds no step of iteration ", low));
  }
  if (!std::isfinite(pending->squared_norm()) || pending->squared_norm() < 0) {
    return apart(absl::StrCat("the record's step of iteration ", low, " holds a squared norm of ",
                              pending->squared_norm()));
  }
  for (const auto& [id, s] : status) {
    if (s.completed_iterations() != low) continue;
    if (!s.in_iteration()) return apart(absl::StrCat("worker ", id, " is not waiting for a step"));
    if (s.epoch() != pending->epoch()) {
      return apart(absl::StrCat("worker ", id, " is at epoch ", s.epoch(), ", the step's is ",
                                pending->epoch()));
    }
    point.laggards.push_back(id);
  }
  return point;
}

v1::CoordinatorMessage StepMessage(const std::string& job_id, const v1::PendingStep& pending) {
  v1::CoordinatorMessage m;
  v1::StepCommand* step = m.mutable_step();
  step->set_job_id(job_id);
  step->set_iteration(pending.iteration());
  step->set_squared_norm(pending.squared_norm());
  step->set_epoch(pending.epoch());
  step->set_completed_microbatches(pending.completed_microbatches());
  return m;
}

absl::Status CheckReplicasAgree(const std::map<std::string, uint64_t>& checksums,
                                const std::map<std::string, int>& stages,
                                const std::string& differ) {
  std::map<int, std::pair<std::string, uint64_t>> first;
  for (const auto& [id, checksum] : checksums) {
    auto stage = stages.find(id);
    if (stage == stages.end()) continue;
    auto [it, fresh] = first.emplace(stage->second, std::make_pair(id, checksum));
    if (!fresh && it->second.second != checksum) {
      return absl::FailedPreconditionError(absl::StrCat("replicas of stage ", stage->second, " ",
                                                        differ, " (worker ", id, " differs from ",
                                                        it->second.first, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace detour
