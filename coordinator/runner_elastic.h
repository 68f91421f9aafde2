// The elastic decisions of a running job (docs/RUNTIME.md §"Elastic
// training"), made at iteration boundaries: idle workers join where the job
// lacks capacity (Grow, Join: with a live replica's state or the newest
// checkpoint's), one worker moves from a stage with spare replicas to a thin,
// slow or empty one when the planner predicts a gain that repays the move
// (Reassign, stage_reassignment.h), and a job whose members cannot train
// pauses until workers fill the gaps (Pause). A part of JobRunner
// (runner_part.h); the runner's thread only.
#ifndef DETOUR_COORDINATOR_RUNNER_ELASTIC_H_
#define DETOUR_COORDINATOR_RUNNER_ELASTIC_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/time/time.h"
#include "coordinator/runner_part.h"
#include "coordinator/stage_reassignment.h"

namespace detour {

class RunnerElastic : private RunnerPart {
 public:
  RunnerElastic(RunnerShared* shared, RunnerLoop* loop);

  // Training starts: stage moves are judged after the next membership
  // change or cost update.
  void Started();

  // The live members cannot train: abort the iteration, wait for workers to
  // fill the gaps (pause_timeout_s), then run the iteration again.
  // `blocked` (optional): the pause also lasts while it holds (a lost
  // stage waits for a worker, elastic.on_stage_loss).
  std::optional<JobEnd> Pause(uint64_t iteration, const std::string& why,
                              const std::function<bool()>& blocked = nullptr);
  // At an iteration boundary: idle workers join where the job lacks
  // capacity, the empty stages first, then the stage whose new replica the
  // planner predicts the shortest iteration for.
  std::optional<JobEnd> Grow();
  // At an iteration boundary after a membership change or a re-plan with
  // measured speeds: moves one worker to another stage when it pays, or to a
  // stage left empty.
  std::optional<JobEnd> Reassign();

 private:
  int ChooseStage(const v1::WorkerInfo& w, const std::map<int, int>& deficit);
  std::optional<JobEnd> Join(const v1::WorkerInfo& w, int stage, const StageMove* move = nullptr);
  std::string MoveReason(const StageMove& m) const;

  // Stage reassignment: the epoch and cost model last judged, and the
  // iteration time predicted before the move being made.
  uint64_t reassign_epoch_ = 0;
  uint64_t reassign_costs_ = 0;
  double move_baseline_s_ = 0;
  // Each worker's last stage move (MoveMustSettle).
  std::map<std::string, MadeMove> made_moves_;
  static constexpr int kMoveCandidates = 4;
  static constexpr absl::Duration kMovePause = absl::Seconds(1);
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_ELASTIC_H_
