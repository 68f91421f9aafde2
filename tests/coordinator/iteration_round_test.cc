// The coordinator's per-iteration checks: norms of the current epoch, the
// replica check (it must be able to fail), microbatches exactly once or
// dropped.
#include "coordinator/iteration_round.h"

#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::GradientNorm Norm(int stage, double sq, uint64_t epoch = 0) {
  v1::GradientNorm n;
  n.set_iteration(4);
  n.set_stage(stage);
  n.set_squared_norm(sq);
  n.set_epoch(epoch);
  return n;
}

v1::IterationResult Result(int stage, uint64_t checksum, std::vector<uint32_t> mbs = {},
                           double loss = 0) {
  v1::IterationResult r;
  r.set_iteration(4);
  r.set_stage(stage);
  r.set_parameter_checksum(checksum);
  for (uint32_t mb : mbs) r.add_microbatches(mb);
  r.set_loss_sum(loss);
  return r;
}

// d0, d1: data nodes; a, b: replicas of stage 1.
IterationRound Round() {
  return IterationRound(4, 4, {{"d0", 0}, {"d1", 0}, {"a", 1}, {"b", 1}}, 0);
}

TEST(IterationRound, StepsOnOneNormPerStageOfTheCurrentEpoch) {
  IterationRound r = Round();
  EXPECT_TRUE(r.AddNorm("d0", Norm(0, 1)));
  EXPECT_TRUE(r.AddNorm("d1", Norm(0, 1)));
  EXPECT_FALSE(r.AddNorm("x", Norm(1, 4)));     // not a member
  EXPECT_FALSE(r.AddNorm("a", Norm(1, 4, 3)));  // another epoch
  EXPECT_TRUE(r.AddNorm("a", Norm(1, 4)));
  EXPECT_FALSE(r.NormsComplete());
  EXPECT_THAT(r.MissingNorms(), ElementsAre("b"));
  EXPECT_TRUE(r.AddNorm("b", Norm(1, 4)));
  ASSERT_TRUE(r.NormsComplete());
  EXPECT_DOUBLE_EQ(*r.SquaredNorm(), 5.0);  // 1 (stage 0) + 4 (stage 1)
}

TEST(IterationRound, ANonFiniteNormIsNeverSteppedOn) {
  IterationRound r = Round();
  r.AddNorm("d0", Norm(0, std::numeric_limits<double>::quiet_NaN()));
  EXPECT_THAT(r.SquaredNorm().status().message(), HasSubstr("stage 0 became non-finite"));
}

TEST(IterationRound, AMembershipChangeVoidsTheNorms) {
  IterationRound r = Round();
  r.AddNorm("d0", Norm(0, 1));
  r.AddNorm("a", Norm(1, 1));
  r.SetMembers({{"d0", 0}, {"a", 1}}, 1);
  EXPECT_THAT(r.MissingNorms(), ElementsAre("a", "d0"));
  EXPECT_FALSE(r.AddNorm("d0", Norm(0, 1, 0)));
  EXPECT_TRUE(r.AddNorm("d0", Norm(0, 1, 1)));
}

TEST(IterationRound, DivergedReplicasAreDetected) {
  IterationRound r = Round();
  r.AddResult("d0", Result(0, 7, {0, 1}));
  r.AddResult("d1", Result(0, 7, {2, 3}));
  r.AddResult("a", Result(1, 9));
  r.AddResult("b", Result(1, 10));
  ASSERT_TRUE(r.ResultsComplete());
  const absl::Status s = r.Check();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("replicas of stage 1 diverged"));
}

TEST(IterationRound, EveryMicrobatchExactlyOnceOrDropped) {
  {
    IterationRound r = Round();
    r.AddResult("d0", Result(0, 7, {0, 1}, 2.0));
    r.AddResult("d1", Result(0, 7, {2, 3}, 4.0));
    r.AddResult("a", Result(1, 9));
    r.AddResult("b", Result(1, 9));
    EXPECT_TRUE(r.Check().ok());
    EXPECT_DOUBLE_EQ(r.loss_sum(), 6.0);
    EXPECT_EQ(r.completed(), 4);
  }
  {
    IterationRound r = Round();  // microbatch 1 twice, 3 never
    r.AddResult("d0", Result(0, 7, {0, 1}));
    r.AddResult("d1", Result(0, 7, {1, 2}));
    r.AddResult("a", Result(1, 9));
    r.AddResult("b", Result(1, 9));
    EXPECT_THAT(r.Check().message(), HasSubstr("microbatch 1 of iteration 4 completed 2 times"));
  }
  {
    IterationRound r = Round();  // 3 missing but dropped: fine
    r.Drop(3);
    r.AddResult("d0", Result(0, 7, {0, 1}));
    r.AddResult("d1", Result(0, 7, {2}));
    r.AddResult("a", Result(1, 9));
    r.AddResult("b", Result(1, 9));
    EXPECT_TRUE(r.Check().ok()) << r.Check();
    r.Drop(2);  // dropped AND completed: a bug somewhere
    EXPECT_THAT(r.Check().message(), HasSubstr("although it was dropped"));
  }
  {
    IterationRound r = Round();  // a microbatch the plan never had
    r.AddResult("d0", Result(0, 7, {0, 1, 9}));
    r.AddResult("d1", Result(0, 7, {2, 3}));
    r.AddResult("a", Result(1, 9));
    r.AddResult("b", Result(1, 9));
    EXPECT_THAT(r.Check().message(), HasSubstr("not in the plan"));
  }
}

}  // namespace
}  // namespace detour
