// A running job's checkpoints: when one is due, where it goes, which stage
// files a commit names, and pruning to the newest keep_last. The directories
// are <checkpoint_root>/<job>/iter-NNNNNN, written by the workers; the
// coordinator only lists and removes them and reads a manifest's iteration.
// Thread-compatible (the job runner's thread).
#ifndef DETOUR_COORDINATOR_RUNNER_CHECKPOINTS_H_
#define DETOUR_COORDINATOR_RUNNER_CHECKPOINTS_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

class RunnerCheckpoints {
 public:
  RunnerCheckpoints(std::string root, std::string job_id);

  // Lists the job's existing checkpoint directories (a resumed job keeps
  // pruning them); `last` is the job record's newest one.
  void Load(const std::string& last);

  // Iterations done when the checkpoint in `dir` was taken, from its
  // manifest (whose presence marks it complete); FAILED_PRECONDITION naming
  // the manifest's error otherwise.
  static absl::StatusOr<uint64_t> IterationOf(const std::string& dir);

  // Whether the plan of `iteration` (0-based) takes a checkpoint: every
  // policy.every_iterations and after the last iteration, unless disabled
  // or a stage has no worker (it has no file to write).
  static bool Due(const v1::CheckpointPolicy& policy, uint64_t iteration, uint64_t iterations,
                  bool stage_empty);
  // Where the checkpoint after `iterations_done` goes.
  std::string Dir(uint64_t iterations_done) const;

  // The CommitCheckpoint for `dir` over the stage files the results name
  // (one per stage). `stages` says how many distinct stages wrote one.
  v1::CommitCheckpoint Commit(uint64_t iterations_done, const std::string& dir,
                              const std::map<std::string, v1::IterationResult>& results,
                              int* stages) const;

  // `dir` was committed: it is the newest; the oldest beyond `keep_last`
  // (at least 1) are removed from disk.
  void Committed(const std::string& dir, uint32_t keep_last);

  // The newest committed checkpoint ("" = none).
  const std::string& last() const { return last_; }

 private:
  const std::string root_;
  const std::string job_id_;
  std::deque<std::string> dirs_;  // newest last
  std::string last_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_CHECKPOINTS_H_
