// What the coordinator collects of one iteration from the job's workers and
// the checks it makes before the iteration counts: one gradient norm per live
// worker of the current membership epoch (then the step), one result per live
// worker, replicas of a stage identical, and every microbatch completed
// exactly once — or dropped, when a lost worker took part of it along.
//
// No threads, no I/O: the job runner feeds it messages; unit-tested
// (tests/coordinator/iteration_round_test.cc).
#ifndef DETOUR_COORDINATOR_ITERATION_ROUND_H_
#define DETOUR_COORDINATOR_ITERATION_ROUND_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "detour/v1/control_service.pb.h"

namespace detour {

class IterationRound {
 public:
  // `members`: worker id -> stage, of the membership `epoch`.
  IterationRound(uint64_t iteration, int total_microbatches, std::map<std::string, int> members,
                 uint64_t epoch);

  uint64_t iteration() const { return iteration_; }
  uint64_t epoch() const { return epoch_; }
  const std::map<std::string, int>& members() const { return members_; }

  // Workers were lost: the norms of the old epoch are void (the survivors
  // reduce again). Results already in stay (a worker that stepped).
  void SetMembers(std::map<std::string, int> members, uint64_t epoch);

  // False when the norm is not of a member or of another epoch (ignored).
  bool AddNorm(const std::string& worker, const v1::GradientNorm& norm);
  bool NormsComplete() const;
  // Members whose norm is missing.
  std::vector<std::string> MissingNorms() const;
  // The sum over stages of their squared norms (replicas agree: one per
  // stage). FAILED_PRECONDITION naming the stage when one is not finite.
  absl::StatusOr<double> SquaredNorm() const;

  void AddResult(const std::string& worker, const v1::IterationResult& result);
  bool ResultsComplete() const;
  std::vector<std::string> MissingResults() const;
  const std::map<std::string, v1::IterationResult>& results() const { return results_; }

  // Microbatches given up: part of their backward ran on a lost worker, or
  // they belonged to a lost data node after its step.
  void Drop(uint32_t microbatch);
  const std::set<uint32_t>& dropped() const { return dropped_; }

  // The checks, once results are complete: replicas of a stage report the
  // same parameter checksum, and every microbatch in [0, total) completed
  // exactly once across the data nodes or was dropped (never both).
  // FAILED_PRECONDITION naming the stage, worker or microbatch otherwise.
  absl::Status Check() const;

  // Data nodes' summed loss and tokens over completed microbatches, and how
  // many completed.
  double loss_sum() const;
  uint64_t tokens() const;
  int completed() const;

 private:
  const uint64_t iteration_;
  const int total_;
  std::map<std::string, int> members_;
  uint64_t epoch_;
  std::map<std::string, v1::GradientNorm> norms_;
  std::map<std::string, v1::IterationResult> results_;
  std::set<uint32_t> dropped_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_ITERATION_ROUND_H_
