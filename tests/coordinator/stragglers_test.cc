// Straggler detection from measured forward times: against the fastest
// other replica, or against the job's median when a stage has no replicas.
#include "coordinator/stragglers.h"

#include <limits>

#include "gtest/gtest.h"

namespace detour {
namespace {

TEST(Stragglers, ReplicaFourTimesSlowerIsNamedWithItsReference) {
  // Predictions differ per stage; what counts is measured / predicted.
  const std::vector<ForwardSample> samples = {
      {"d", 0, 0.010, 0.005},  // 2x its prediction, like everyone
      {"a", 1, 0.020, 0.010},
      {"b", 1, 0.080, 0.010},  // 4x its replica a
      {"c", 2, 0.040, 0.020},
  };
  const auto slow = FindSlowdowns(samples, 1.5);
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].worker, "b");
  EXPECT_EQ(slow[0].stage, 1);
  EXPECT_DOUBLE_EQ(slow[0].factor, 4);
  EXPECT_EQ(slow[0].replica, "a");
  // Below the threshold: nobody.
  EXPECT_TRUE(FindSlowdowns(samples, 4.5).empty());
}

TEST(Stragglers, UnreplicatedWorkerAgainstTheJobMedian) {
  // Slowness 1, 1, 3: the lower median is 1, so c is 3x slower than the job.
  std::vector<ForwardSample> samples = {
      {"d", 0, 0.01, 0.01}, {"a", 1, 0.01, 0.01}, {"c", 2, 0.03, 0.01}};
  auto slow = FindSlowdowns(samples, 1.5);
  ASSERT_EQ(slow.size(), 1u);
  EXPECT_EQ(slow[0].worker, "c");
  EXPECT_DOUBLE_EQ(slow[0].factor, 3);
  EXPECT_EQ(slow[0].replica, "");
  // Fewer than three samples give no median to compare with.
  samples.pop_back();
  samples[1].measured_s = 0.05;
  EXPECT_TRUE(FindSlowdowns(samples, 1.5).empty());
}

TEST(Stragglers, UnusableSamplesAreIgnoredAndTheSlowestComesFirst) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<ForwardSample> samples = {
      {"a", 1, 0.01, 0.01}, {"b", 1, 0.02, 0.01}, {"c", 1, 0.05, 0.01},
      {"x", 1, 0, 0.01},    {"y", 1, nan, 0.01},  {"z", 1, 0.001, 0},
  };
  const auto slow = FindSlowdowns(samples, 1.5);
  ASSERT_EQ(slow.size(), 2u);
  EXPECT_EQ(slow[0].worker, "c");
  EXPECT_DOUBLE_EQ(slow[0].factor, 5);
  EXPECT_EQ(slow[1].worker, "b");
  EXPECT_DOUBLE_EQ(slow[1].factor, 2);
}

}  // namespace
}  // namespace detour
