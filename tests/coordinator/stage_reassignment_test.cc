// Stage reassignment's decision rule: which moves are judged (capacities),
// what a move costs, and when the predicted gain repays it within the
// horizon — exact hand-computed cases.
#include "coordinator/stage_reassignment.h"

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace detour {
namespace {

// Per worker: seconds per microbatch (forward + backward), the same on
// every stage.
StageSeconds Seconds(std::map<std::string, double> per_worker) {
  return [per_worker](const std::string& w, int) { return per_worker.at(w); };
}

TEST(StageReassignment, ThinSlowStageDrawsAReplicaFromAFastPair) {
  // Stage 1: a, b (1 s each: capacity 2); stage 2: s alone, 4 s (0.25).
  // Moving a or b raises min(2, 0.25) to min(1, 1.25) = 1.
  const std::vector<std::vector<std::string>> stages = {{"d"}, {"a", "b"}, {"s"}};
  auto moves = CandidateMoves(stages, Seconds({{"d", 1}, {"a", 1}, {"b", 1}, {"s", 4}}), 10);
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0].worker, "a");
  EXPECT_EQ(moves[1].worker, "b");
  for (const StageMove& m : moves) {
    EXPECT_EQ(m.from, 1);
    EXPECT_EQ(m.to, 2);
    EXPECT_FALSE(m.fills_empty_stage);
    EXPECT_DOUBLE_EQ(m.capacity_gain, 1 - 0.25);
  }
  EXPECT_EQ(CandidateMoves(stages, Seconds({{"d", 1}, {"a", 1}, {"b", 1}, {"s", 4}}), 1).size(),
            1u);
}

TEST(StageReassignment, BalancedOrSymmetricStagesDoNotMove) {
  // 2 vs 1 equal workers: moving one gives 1 vs 2, the minimum stays 1.
  EXPECT_TRUE(CandidateMoves({{"d"}, {"a", "b"}, {"c"}},
                             Seconds({{"d", 1}, {"a", 1}, {"b", 1}, {"c", 1}}), 10)
                  .empty());
  // 2 vs 2.
  EXPECT_TRUE(CandidateMoves({{"d"}, {"a", "b"}, {"c", "e"}},
                             Seconds({{"d", 1}, {"a", 1}, {"b", 1}, {"c", 1}, {"e", 1}}), 10)
                  .empty());
  // 3 vs 1 equal workers: 2 vs 2 raises the minimum from 1 to 2.
  auto moves = CandidateMoves({{"d"}, {"a", "b", "c"}, {"e"}},
                              Seconds({{"d", 1}, {"a", 1}, {"b", 1}, {"c", 1}, {"e", 1}}), 10);
  ASSERT_EQ(moves.size(), 3u);
  EXPECT_DOUBLE_EQ(moves[0].capacity_gain, 1);
  // Stage 1: fast (4 per s) and slow (0.25 per s); stage 2: e (0.5 per s).
  // Moving the fast one would leave stage 1 at 0.25, below the 0.5 the
  // minimum was: not judged. Moving the slow one raises it to 0.75.
  moves = CandidateMoves({{"d"}, {"fast", "slow"}, {"e"}},
                         Seconds({{"d", 1}, {"fast", 0.25}, {"slow", 4}, {"e", 2}}), 10);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].worker, "slow");
  EXPECT_DOUBLE_EQ(moves[0].capacity_gain, 0.25);
}

TEST(StageReassignment, DataNodesNeverMoveAndEmptyStagesAlwaysQualify) {
  // Two data nodes, stage 2 empty: only a stage-1 replica may fill it.
  auto moves = CandidateMoves({{"d0", "d1"}, {"a", "b"}, {}},
                              Seconds({{"d0", 1}, {"d1", 1}, {"a", 1}, {"b", 1}}), 10);
  ASSERT_EQ(moves.size(), 2u);
  for (const StageMove& m : moves) {
    EXPECT_NE(m.worker.front(), 'd');
    EXPECT_TRUE(m.fills_empty_stage);
    EXPECT_EQ(m.to, 2);
    EXPECT_DOUBLE_EQ(m.capacity_gain, 1);
  }
  // A stage with one worker never gives it up, even to an empty stage.
  EXPECT_TRUE(CandidateMoves({{"d"}, {"a"}, {}}, Seconds({{"d", 1}, {"a", 1}}), 10).empty());
}

TEST(StageReassignment, CostIsTheStateOverTheLinkPlusAPause) {
  // 1000 parameters: 4 B x 3 (parameters, two AdamW moments) + 500 K-FAC values.
  EXPECT_DOUBLE_EQ(StageStateBytes(1000, 0), 12000);
  EXPECT_DOUBLE_EQ(StageStateBytes(1000, 500), 14000);
  EXPECT_DOUBLE_EQ(MoveCostSeconds(12000, 0.05, 6000, 1.0), 1.0 + 0.05 + 2.0);
  // From a checkpoint (no donor link): the pause alone.
  EXPECT_DOUBLE_EQ(MoveCostSeconds(12000, 0.05, 0, 1.0), 1.0);
}

StageMove Judged(const std::string& w, double predicted, double cost, bool empty = false) {
  StageMove m;
  m.worker = w;
  m.from = 1;
  m.to = 2;
  m.predicted_iteration_s = predicted;
  m.cost_s = cost;
  m.fills_empty_stage = empty;
  return m;
}

TEST(StageReassignment, MovesOnlyWhenTheGainRepaysTheCostWithinTheHorizon) {
  // 0.5 s -> 0.4 s saves 0.1 s per iteration: 20 iterations repay 1.9 s but
  // not 2.1 s.
  EXPECT_TRUE(ChooseMove(0.5, {Judged("a", 0.4, 1.9)}, 20).has_value());
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.4, 2.1)}, 20).has_value());
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.4, 1.9)}, 19).has_value());
  // Disabled by a zero horizon; a slower prediction never moves.
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.1, 0)}, 0).has_value());
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.6, 0)}, 1000).has_value());
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.5, 0)}, 1000).has_value());
  // A gain under kMinMoveGain (5%) of the iteration is noise, free or not.
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.49, 0)}, 1000).has_value());
  EXPECT_FALSE(ChooseMove(0.5, {Judged("a", 0.48, 0)}, 1000).has_value());
  EXPECT_TRUE(ChooseMove(0.5, {Judged("a", 0.47, 0)}, 1000).has_value());
  // The largest net gain wins: a saves 0.2 x 10 - 1.5 = 0.5, b 0.1 x 10 - 0 = 1.
  auto best = ChooseMove(0.5, {Judged("a", 0.3, 1.5), Judged("b", 0.4, 0)}, 10);
  ASSERT_TRUE(best.has_value());
  EXPECT_EQ(best->worker, "b");
  // A prediction the planner could not make is never chosen.
  EXPECT_FALSE(
      ChooseMove(0.5, {Judged("a", std::numeric_limits<double>::infinity(), 0)}, 10).has_value());
}

TEST(StageReassignment, InfeasibleMembershipOrEmptyStageMovesAnyway) {
  const double inf = std::numeric_limits<double>::infinity();
  // The membership cannot train: any plannable move pays; the faster wins.
  auto best = ChooseMove(inf, {Judged("a", 0.9, 5), Judged("b", 0.7, 50)}, 1);
  ASSERT_TRUE(best.has_value());
  EXPECT_EQ(best->worker, "b");
  // Filling an empty stage beats a better prediction elsewhere, and needs
  // no gain.
  best = ChooseMove(
      0.5, {Judged("a", 0.1, 0), Judged("e1", 0.8, 3, true), Judged("e2", 0.6, 9, true)}, 1);
  ASSERT_TRUE(best.has_value());
  EXPECT_EQ(best->worker, "e2");
  EXPECT_FALSE(ChooseMove(0.5, {Judged("e", 0.6, 1, true)}, 0).has_value());
}

TEST(StageReassignment, AMovedWorkerSettlesForItsHorizonWhileTheMembershipStands) {
  // w moved at boundary 17, judged over 20 iterations; epoch 9 after it.
  const std::map<std::string, MadeMove> made = {{"w", MadeMove{17, 20, 9}}};
  StageMove back;
  back.worker = "w";
  back.from = 5;
  back.to = 4;
  // The same workers, three iterations on: the move back waits (it was the
  // back-and-forth elastic_churn.py measured), up to the horizon's end.
  EXPECT_TRUE(MoveMustSettle(back, made, 20, 9));
  EXPECT_TRUE(MoveMustSettle(back, made, 36, 9));
  EXPECT_FALSE(MoveMustSettle(back, made, 37, 9));
  // A loss or a join since (a new epoch): judged again.
  EXPECT_FALSE(MoveMustSettle(back, made, 20, 10));
  // Another worker, or a move into an empty stage: never waits.
  StageMove other = back;
  other.worker = "v";
  EXPECT_FALSE(MoveMustSettle(other, made, 20, 9));
  StageMove fill = back;
  fill.fills_empty_stage = true;
  EXPECT_FALSE(MoveMustSettle(fill, made, 20, 9));
  // A record from a later boundary than now (a restarted count) holds nothing.
  EXPECT_FALSE(MoveMustSettle(back, made, 10, 9));
}

}  // namespace
}  // namespace detour
