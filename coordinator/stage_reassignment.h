// Stage reassignment of a running job (docs/RUNTIME.md §"Elastic training"):
// which moves of a worker from one stage to another are worth judging with
// the planner, what a move costs, and whether the best judged move pays for
// moving the stage's weights within a bounded number of iterations. The job
// runner plans each candidate (a quick route search over the membership with
// the move made) and applies at most one move per iteration boundary.
//
// Pure functions; thread-safe.
#ifndef DETOUR_COORDINATOR_STAGE_REASSIGNMENT_H_
#define DETOUR_COORDINATOR_STAGE_REASSIGNMENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace detour {

// One possible move of `worker` from stage `from` to stage `to`.
struct StageMove {
  std::string worker;
  int from = 0;
  int to = 0;
  // The target stage has no worker (its layers train on no route now).
  bool fills_empty_stage = false;
  // How much the move raises min(capacity(from), capacity(to)), in
  // microbatches per second (CandidateMoves).
  double capacity_gain = 0;
  // Set by the caller before ChooseMove: the iteration time the planner
  // predicts with the move made (infinity when it cannot plan it), and what
  // the move costs once, in seconds the job stands still (MoveCostSeconds).
  double predicted_iteration_s = 0;
  double cost_s = 0;
};

// Seconds `worker` needs for one microbatch's forward and backward of
// `stage` (> 0).
using StageSeconds = std::function<double(const std::string& worker, int stage)>;

// Moves worth planning, given the live workers of every stage (index =
// stage; stage 0 holds the data nodes, which never move). A stage's capacity
// is the sum over its workers of 1 / seconds(worker, stage). A move of a
// worker of stage s >= 1 that has at least two workers to a stage t >= 1,
// t != s, qualifies when it raises min(capacity(s), capacity(t)) — an empty
// stage has capacity 0, so every move into one qualifies. Ordered by that
// raise, largest first (ties: worker id, then target stage); at most
// `limit`.
std::vector<StageMove> CandidateMoves(const std::vector<std::vector<std::string>>& stages,
                                      const StageSeconds& seconds, int limit);

// Bytes a donor streams for a stage of `parameters` values: the fp32
// parameters and AdamW's two moments, plus `kfac_values` fp32 values of
// K-FAC state (0 without K-FAC).
double StageStateBytes(double parameters, double kfac_values);

// What a move costs, in seconds the job stands still: the stage state over
// the donor's link (latency + bytes / bandwidth), plus `pause_s` (the worker
// builds the new stage at an iteration boundary). A move without a donor
// (an empty stage, filled from the newest checkpoint) costs `pause_s`:
// pass bandwidth 0.
double MoveCostSeconds(double state_bytes, double latency_s, double bandwidth_bytes_per_s,
                       double pause_s);

// The least gain a move is made for, as a fraction of the current predicted
// iteration. Predictions come from measured speeds that drift between
// re-plans; on benchmarks/runtime/elastic_churn.py's emulated cluster a
// move predicted to gain 1-3% was followed by iterations 10-30% off the
// prediction, and by a chain of further small moves. Below 5% a move is
// more likely to follow that noise than a real imbalance.
inline constexpr double kMinMoveGain = 0.05;

// The move to make, or none. A move that fills an empty stage is made
// whatever the prediction (the stage's layers would train on no route
// otherwise): the one with the shortest predicted iteration among those.
// Otherwise a move must shorten the predicted iteration by at least
// kMinMoveGain of it and repay its cost within `horizon` iterations,
// (current_iteration_s - predicted_iteration_s) x horizon > cost_s, and the
// one with the largest net gain (that product minus the cost) is chosen. A
// non-finite current time (the membership cannot train) makes any move with
// a finite prediction pay. None when `horizon` is 0.
std::optional<StageMove> ChooseMove(double current_iteration_s,
                                    const std::vector<StageMove>& judged, uint64_t horizon);

// The last move made of a worker: at iteration boundary `iteration`, judged
// to repay within `horizon` iterations; `epoch` is the membership's epoch
// right after it (a loss or a join makes a new one).
struct MadeMove {
  uint64_t iteration = 0;
  uint64_t horizon = 0;
  uint64_t epoch = 0;
};

// Whether `m` waits instead of being judged: its worker moved less than that
// move's horizon ago (made.at(worker); `iteration` is the boundary now) and
// the membership is still the one the move made (`epoch`). A move was judged
// to pay over its horizon; moving the same worker again before, with the
// same workers, would follow the noise of re-measured speeds, not a change —
// a worker moved back and forth, each move predicted to gain, was measured
// in benchmarks/runtime/elastic_churn.py. A move that fills an empty stage
// never waits; the caller also judges every move when the workers left
// cannot train at all.
bool MoveMustSettle(const StageMove& m, const std::map<std::string, MadeMove>& made,
                    uint64_t iteration, uint64_t epoch);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_STAGE_REASSIGNMENT_H_
