#include "coordinator/planner/route_validator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

using ::testing::HasSubstr;

sim::Route R(int mb, std::vector<int> nodes, std::vector<int> stages) {
  sim::Route r;
  r.microbatch = mb;
  r.nodes = std::move(nodes);
  r.stages = std::move(stages);
  return r;
}

class RouteValidatorTest : public ::testing::Test {
 protected:
  RouteValidatorTest() : cost_(testing::UniformModel(6, 4)) {
    rules_.num_stages = 4;
    rules_.visited_stages = 3;
    rules_.data_nodes = 2;
    rules_.microbatches_per_data_node = 1;
    rules_.max_jump = 2;
    rules_.max_swaps = 1;
    rules_.max_swap_distance = 1;
    rules_.max_total_swap_distance = 2;
    plan_.assignment.stage_nodes = {{0, 1}, {2}, {3}, {4}};
    plan_.routes = {R(0, {0, 2, 3}, {0, 1, 2}), R(1, {1, 3, 4}, {0, 2, 3})};
  }

  // The single violation message of the current plan.
  std::string OnlyViolation() {
    std::vector<Violation> v = FindViolations(cost_, plan_, rules_);
    EXPECT_EQ(v.size(), 1u);
    std::string all;
    for (const auto& x : v) all += x.message + "\n";
    return all;
  }

  sim::CostModel cost_;
  RouteRules rules_;
  sim::Plan plan_;
};

TEST_F(RouteValidatorTest, ValidPlanPasses) {
  EXPECT_TRUE(FindViolations(cost_, plan_, rules_).empty());
  EXPECT_TRUE(ValidateRoutes(cost_, plan_, rules_).ok());
}

TEST_F(RouteValidatorTest, MustStartOnDataNode) {
  plan_.routes[1] = R(1, {2, 3, 4}, {1, 2, 3});
  auto v = FindViolations(cost_, plan_, rules_);
  ASSERT_FALSE(v.empty());
  EXPECT_THAT(v[0].message, HasSubstr("not on a data node"));
  EXPECT_EQ(v[0].microbatch, 1);
}

TEST_F(RouteValidatorTest, StageVisitedTwice) {
  plan_.routes[0] = R(0, {0, 2, 2}, {0, 1, 1});
  auto v = FindViolations(cost_, plan_, rules_);
  ASSERT_FALSE(v.empty());
  EXPECT_THAT(v[0].message, HasSubstr("visits stage 1 twice"));
}

TEST_F(RouteValidatorTest, JumpTooFar) {
  plan_.routes[0] = R(0, {0, 4, 3}, {0, 3, 2});
  plan_.routes[1] = R(1, {1, 2, 3}, {0, 1, 2});
  EXPECT_THAT(OnlyViolation(), HasSubstr("max_jump 2"));
}

TEST_F(RouteValidatorTest, SwapsCountedAndLimited) {
  plan_.routes[0] = R(0, {0, 3, 2}, {0, 2, 1});
  EXPECT_TRUE(FindViolations(cost_, plan_, rules_).empty());  // One swap of 1 is fine.
  rules_.max_swaps = 0;
  EXPECT_THAT(OnlyViolation(), HasSubstr("max_swaps 0"));
  rules_.max_swaps = 1;
  rules_.max_jump = 3;
  plan_.routes[0] = R(0, {0, 4, 2}, {0, 3, 1});  // Back by 2.
  plan_.routes[1] = R(1, {1, 3, 4}, {0, 2, 3});
  EXPECT_THAT(OnlyViolation(), HasSubstr("max_swap_distance 1"));
}

TEST_F(RouteValidatorTest, PathLengthFollowsSkipRatio) {
  plan_.routes[0] = R(0, {0, 2}, {0, 1});
  auto v = FindViolations(cost_, plan_, rules_);
  ASSERT_FALSE(v.empty());
  EXPECT_THAT(v[0].message, HasSubstr("visits 2 stages, the skip ratio asks for 3"));
}

TEST_F(RouteValidatorTest, NoOtherDataNode) {
  plan_.routes[0] = R(0, {0, 1, 2}, {0, 0, 1});
  auto v = FindViolations(cost_, plan_, rules_);
  ASSERT_FALSE(v.empty());
  EXPECT_THAT(v[0].message, HasSubstr("visits data node n1 besides its own"));
}

TEST_F(RouteValidatorTest, UnequalVisits) {
  rules_.microbatches_per_data_node = 2;
  plan_.routes = {R(0, {0, 2, 3}, {0, 1, 2}), R(1, {0, 2, 3}, {0, 1, 2}),
                  R(2, {1, 2, 3}, {0, 1, 2}), R(3, {1, 2, 3}, {0, 1, 2})};
  EXPECT_THAT(OnlyViolation(), HasSubstr("stage visits differ by more than one (stage:visits "
                                         "1:4 2:4 3:0)"));
}

TEST_F(RouteValidatorTest, UnknownNodeAndWrongStage) {
  plan_.routes[0] = R(0, {0, 17, 3}, {0, 1, 2});
  EXPECT_THAT(FindViolations(cost_, plan_, rules_)[0].message,
              HasSubstr("node index 17 is not in the cluster"));
  plan_.routes[0] = R(0, {0, 2, 3}, {0, 2, 2});
  EXPECT_THAT(FindViolations(cost_, plan_, rules_)[0].message,
              HasSubstr("node n2 holds stage 1, the route says 2"));
}

TEST_F(RouteValidatorTest, MicrobatchSetMustBeComplete) {
  plan_.routes.pop_back();
  auto v = FindViolations(cost_, plan_, rules_);
  ASSERT_GE(v.size(), 2u);
  EXPECT_THAT(v[0].message, HasSubstr("1 routes for 2 microbatches"));
  EXPECT_THAT(v[1].message, HasSubstr("data node n1 starts 0 microbatches, not 1"));
  plan_.routes.push_back(R(0, {1, 3, 4}, {0, 2, 3}));
  EXPECT_THAT(FindViolations(cost_, plan_, rules_)[0].message,
              HasSubstr("microbatch 0 has more than one route"));
}

// Rule 6 as a count: no node gets more visits than its cap (here set to 1;
// two replicas of stage 1 can take its two visits, but not both on n2).
TEST_F(RouteValidatorTest, NodeVisitCapIsEnforced) {
  rules_.max_visits_per_node = 1;
  plan_.assignment.stage_nodes = {{0, 1}, {2, 5}, {3}, {4}};
  plan_.routes = {R(0, {0, 2, 3}, {0, 1, 2}), R(1, {1, 2, 4}, {0, 1, 3})};
  EXPECT_THAT(OnlyViolation(), HasSubstr("node n2 (stage 1) gets 2 visits, more than its cap 1"));
  plan_.routes[1] = R(1, {1, 5, 4}, {0, 1, 3});
  EXPECT_TRUE(FindViolations(cost_, plan_, rules_).empty());
  // A cap the replicas cannot meet at all names the field.
  plan_.assignment.stage_nodes = {{0, 1}, {2}, {3, 5}, {4}};
  plan_.routes = {R(0, {0, 2, 3}, {0, 1, 2}), R(1, {1, 2, 4}, {0, 1, 3})};
  absl::Status s = ValidateRoutes(cost_, plan_, rules_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("pipeline.max_visits_per_node: 1 visits per node"));
  // Derived caps (memory slots × rounds) allow the same plan.
  rules_.max_visits_per_node = 0;
  EXPECT_TRUE(ValidateRoutes(cost_, plan_, rules_).ok());
}

}  // namespace
}  // namespace detour::planner
