#include "coordinator/planner/route_builder.h"

#include <gtest/gtest.h>

#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

TEST(CalendarTest, FindsFirstGapThatFits) {
  Calendar c;
  EXPECT_DOUBLE_EQ(c.EarliestFit(3, 1), 3);
  c.Reserve(2, 2);  // [2, 4)
  c.Reserve(5, 1);  // [5, 6)
  EXPECT_DOUBLE_EQ(c.EarliestFit(0, 2), 0);
  EXPECT_DOUBLE_EQ(c.EarliestFit(1, 2), 6);  // [1,3) overlaps; [4,5) too short.
  EXPECT_DOUBLE_EQ(c.EarliestFit(3, 1), 4);  // [4,5) fits.
  EXPECT_DOUBLE_EQ(c.EarliestFit(4.5, 1), 6);
  EXPECT_DOUBLE_EQ(c.busy_s(), 3);
}

class RouteBuilderTest : public ::testing::Test {
 protected:
  RouteBuilderTest() : cost_(testing::UniformModel(7, 4)) {
    rules_.num_stages = 4;
    rules_.visited_stages = 3;
    rules_.max_jump = 2;
    assignment_.stage_nodes = {{0}, {1, 2}, {3, 4}, {5, 6}};
    req_.data_node = 0;
    req_.allowed.assign(4, 1);
    req_.required.assign(4, 0);
  }
  sim::CostModel cost_;
  RouteRules rules_;
  sim::StageAssignment assignment_;
  RouteRequest req_;
};

TEST_F(RouteBuilderTest, HonoursRequiredAndForbiddenStages) {
  RouteBuilder b(cost_, assignment_, rules_, RouteBuilder::Mode::kStatic, 0);
  req_.required[3] = 1;
  auto r = b.Build(req_);
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->stages.size(), 3u);
  EXPECT_EQ(r->stages.back(), 3);
  req_.required[3] = 0;
  req_.allowed[1] = 0;
  r = b.Build(req_);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->stages, std::vector<int>({0, 2, 3}));
  // Two visits are needed but only stage 3 is left.
  req_.allowed[2] = 0;
  EXPECT_FALSE(b.Build(req_).has_value());
}

TEST_F(RouteBuilderTest, StaticPrefersCheapLinks) {
  sim::CostTables t = cost_.tables();
  t.latency_s[0][2] = t.latency_s[2][0] = 0.001;  // n2 is next door.
  auto cost = sim::CostModel::FromTables(t);
  ASSERT_TRUE(cost.ok());
  RouteBuilder b(*cost, assignment_, rules_, RouteBuilder::Mode::kStatic, 0);
  auto r = b.Build(req_);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->nodes[1], 2);
}

TEST_F(RouteBuilderTest, TimedAvoidsReservedNodes) {
  RouteBuilder b(cost_, assignment_, rules_, RouteBuilder::Mode::kTimed, 0);
  auto first = b.Build(req_);
  ASSERT_TRUE(first.has_value());
  b.Commit(*first);
  auto second = b.Build(req_);
  ASSERT_TRUE(second.has_value());
  // No compute of the second overlaps the first's on any node.
  for (const auto& [n2, i2] : second->reservations) {
    for (const auto& [n1, i1] : first->reservations) {
      if (n1 != n2) continue;
      const bool overlap =
          i2.first < i1.first + i1.second - 1e-9 && i1.first < i2.first + i2.second - 1e-9;
      EXPECT_FALSE(overlap) << "node " << n1 << " at " << i2.first;
    }
  }
  // The data node is busy with the first forward until 1 s.
  EXPECT_GE(second->reservations[0].second.first, 1.0);
  EXPECT_GT(second->score, first->score);
}

TEST_F(RouteBuilderTest, RandomIsDeterministicPerSeed) {
  std::vector<std::vector<int>> a, b, c;
  for (int seed : {1, 1, 2}) {
    RouteBuilder builder(cost_, assignment_, rules_, RouteBuilder::Mode::kRandom, seed);
    auto& out = seed == 2 ? c : (a.empty() ? a : b);
    for (int i = 0; i < 20; ++i) out.push_back(builder.Build(req_)->nodes);
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

}  // namespace
}  // namespace detour::planner
