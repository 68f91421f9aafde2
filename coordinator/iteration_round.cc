#include "coordinator/iteration_round.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/reattach_point.h"

namespace detour {

IterationRound::IterationRound(uint64_t iteration, int total_microbatches,
                               std::map<std::string, int> members, uint64_t epoch)
    : iteration_(iteration),
      total_(total_microbatches),
      members_(std::move(members)),
      epoch_(epoch) {}

void IterationRound::SetMembers(std::map<std::string, int> members, uint64_t epoch) {
  members_ = std::move(members);
  epoch_ = epoch;
  norms_.clear();
  for (auto it = results_.begin(); it != results_.end();) {
    it = members_.count(it->first) ? std::next(it) : results_.erase(it);
  }
}

bool IterationRound::AddNorm(const std::string& worker, const v1::GradientNorm& norm) {
  if (!members_.count(worker) || norm.iteration() != iteration_ || norm.epoch() != epoch_) {
    return false;
  }
  norms_[worker] = norm;
  return true;
}

bool IterationRound::NormsComplete() const { return MissingNorms().empty(); }

std::vector<std::string> IterationRound::MissingNorms() const {
  std::vector<std::string> missing;
  for (const auto& [id, stage] : members_) {
    if (!norms_.count(id)) missing.push_back(id);
  }
  return missing;
}

absl::StatusOr<double> IterationRound::SquaredNorm() const {
  std::map<int, double> by_stage;
  for (const auto& [id, n] : norms_) by_stage.emplace(members_.at(id), n.squared_norm());
  double squared = 0;
  for (const auto& [stage, sq] : by_stage) {
    // A non-finite gradient is never stepped on: the parameters (and the
    // last checkpoint) stay as they were.
    if (!(sq >= 0) || !std::isfinite(sq)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the gradient of stage ", stage, " became non-finite at iteration ",
                       iteration_, " (squared norm ", sq, "); the step was not applied"));
    }
    squared += sq;
  }
  return squared;
}

void IterationRound::AddResult(const std::string& worker, const v1::IterationResult& result) {
  if (!members_.count(worker) || result.iteration() != iteration_) return;
  results_[worker] = result;
}

bool IterationRound::ResultsComplete() const { return MissingResults().empty(); }

std::vector<std::string> IterationRound::MissingResults() const {
  std::vector<std::string> missing;
  for (const auto& [id, stage] : members_) {
    if (!results_.count(id)) missing.push_back(id);
  }
  return missing;
}

void IterationRound::Drop(uint32_t microbatch) { dropped_.insert(microbatch); }

absl::Status IterationRound::Check() const {
  std::map<std::string, uint64_t> checksums;
  std::map<std::string, int> stages;
  std::map<uint32_t, int> completions;
  for (const auto& [id, r] : results_) {
    checksums[id] = r.parameter_checksum();
    stages[id] = static_cast<int>(r.stage());
    if (r.stage() == 0) {
      for (uint32_t mb : r.microbatches()) ++completions[mb];
    }
  }
  if (absl::Status agree =
          CheckReplicasAgree(checksums, stages, absl::StrCat("diverged at iteration ", iteration_));
      !agree.ok()) {
    return agree;
  }
  for (const auto& [mb, n] : completions) {
    if (mb >= static_cast<uint32_t>(total_)) {
      return absl::FailedPreconditionError(absl::StrCat("microbatch ", mb, " of iteration ",
                                                        iteration_, " is not in the plan (", total_,
                                                        " microbatches)"));
    }
  }
  for (int mb = 0; mb < total_; ++mb) {
    const uint32_t id = static_cast<uint32_t>(mb);
    const int n = completions.count(id) ? completions.at(id) : 0;
    const bool dropped = dropped_.count(id) > 0;
    if (dropped ? n != 0 : n != 1) {
      return absl::FailedPreconditionError(absl::StrCat("microbatch ", mb, " of iteration ",
                                                        iteration_, " completed ", n, " times",
                                                        dropped ? " although it was dropped" : ""));
    }
  }
  return absl::OkStatus();
}

double IterationRound::loss_sum() const {
  double sum = 0;
  for (const auto& [id, r] : results_) {
    if (r.stage() == 0) sum += r.loss_sum();
  }
  return sum;
}

uint64_t IterationRound::tokens() const {
  uint64_t sum = 0;
  for (const auto& [id, r] : results_) {
    if (r.stage() == 0) sum += r.tokens();
  }
  return sum;
}

int IterationRound::completed() const {
  int n = 0;
  for (const auto& [id, r] : results_) {
    if (r.stage() == 0) n += r.microbatches_size();
  }
  return n;
}

}  // namespace detour
