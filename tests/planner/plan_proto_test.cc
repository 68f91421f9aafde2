#include "coordinator/planner/plan_proto.h"

#include <gtest/gtest.h>

#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

TEST(PlanProtoTest, RoundTrip) {
  sim::CostModel cost = testing::UniformModel(4, 3);
  sim::Route r;
  r.microbatch = 5;
  r.nodes = {1, 3, 2};
  r.stages = {0, 2, 1};
  v1::Route p = ToProtoRoute(cost, r);
  EXPECT_EQ(p.data_node(), "n1");
  ASSERT_EQ(p.nodes_size(), 3);
  EXPECT_EQ(p.nodes(1), "n3");
  auto back = FromProtoRoute(cost, p);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->microbatch, 5);
  EXPECT_EQ(back->nodes, r.nodes);
  EXPECT_EQ(back->stages, r.stages);
  auto a = AssignmentFromRoutes(cost, {r});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->stage_nodes, (std::vector<std::vector<int>>{{1}, {2}, {3}}));
}

TEST(PlanProtoTest, UnknownNodeAndMismatchesAreErrors) {
  sim::CostModel cost = testing::UniformModel(4, 3);
  v1::Route p;
  p.set_microbatch(2);
  p.add_nodes("n0");
  p.add_nodes("ghost");
  p.add_stages(0);
  p.add_stages(1);
  auto r = FromProtoRoute(cost, p);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("unknown node \"ghost\""), std::string::npos);
  p.add_stages(2);
  EXPECT_FALSE(FromProtoRoute(cost, p).ok());
  sim::Route x{0, {0, 1}, {0, 1}}, y{1, {2, 1}, {0, 2}};
  EXPECT_FALSE(AssignmentFromRoutes(cost, {x, y}).ok());
}

}  // namespace
}  // namespace detour::planner
