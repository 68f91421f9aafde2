#include "coordinator/planner/stage_assignment.h"

#include <gtest/gtest.h>

#include <set>

#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

RouteRules Rules(int stages, int data, int visited, int m = 4) {
  RouteRules r;
  r.num_stages = stages;
  r.data_nodes = data;
  r.visited_stages = visited;
  r.microbatches_per_data_node = m;
  return r;
}

TEST(StageAssignmentTest, ShapesAndDistinctNodes) {
  sim::CostModel cost = testing::UniformModel(12, 4);
  auto a = AssignStages(cost, Rules(4, 2, 3), 3);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->num_stages(), 4);
  EXPECT_EQ(a->stage_nodes[0].size(), 2u);
  std::set<int> seen;
  for (int s = 1; s < 4; ++s) EXPECT_EQ(a->stage_nodes[s].size(), 3u);
  for (const auto& nodes : a->stage_nodes) {
    for (int n : nodes) EXPECT_TRUE(seen.insert(n).second) << n;
  }
  EXPECT_EQ(seen.size(), 11u);
}

TEST(StageAssignmentTest, TooSmallClusterIsRefused) {
  sim::CostModel cost = testing::UniformModel(5, 3);
  auto a = AssignStages(cost, Rules(3, 2, 3), 2);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(a.status().message().find("= 6"), std::string::npos) << a.status();
}

TEST(StageAssignmentTest, DeterministicForASeed) {
  auto e = testing::LoadExample();
  auto cost = sim::CostModel::Create(e.cluster, e.job);
  ASSERT_TRUE(cost.ok()) << cost.status();
  RouteRules rules = RulesFromPipeline(e.job.pipeline());
  AssignmentOptions o;
  o.seed = 7;
  auto a = AssignStages(*cost, rules, 3, o);
  auto b = AssignStages(*cost, rules, 3, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->stage_nodes, b->stage_nodes);
  // Better than a plain cut of the node list.
  sim::StageAssignment naive;
  naive.stage_nodes.resize(rules.num_stages);
  int next = 0;
  for (int s = 0; s < rules.num_stages; ++s) {
    const int count = s == 0 ? rules.data_nodes : 3;
    for (int i = 0; i < count; ++i) naive.stage_nodes[s].push_back(next++);
  }
  EXPECT_LT(AssignmentScore(*cost, rules, *a), AssignmentScore(*cost, rules, naive));
}

// A node ten times slower than the rest is the one left out.
TEST(StageAssignmentTest, SlowNodeStaysUnused) {
  sim::CostTables t = testing::UniformModel(6, 3).tables();
  for (int s = 0; s < 3; ++s) {
    t.forward_s[4][s] = 10;
    t.backward_s[4][s] = 20;
  }
  auto cost = sim::CostModel::FromTables(t);
  ASSERT_TRUE(cost.ok());
  for (uint64_t seed : {0, 1, 2}) {
    AssignmentOptions o;
    o.seed = seed;
    auto a = AssignStages(*cost, Rules(3, 1, 2), 2, o);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->NodeStages(6)[4], -1) << "seed " << seed;
  }
}

// Two far-apart regions and heavy gradients: each stage's replicas end up in
// one region so that the all-reduce stays local.
TEST(StageAssignmentTest, ReplicasStayTogetherWhenAllReduceDominates) {
  sim::CostTables t = testing::UniformModel(8, 3).tables();
  for (int a = 0; a < 8; ++a) {
    for (int b = 0; b < 8; ++b) {
      const bool same = (a < 4) == (b < 4);
      t.latency_s[a][b] = same ? 0.001 : 0.2;
      t.bandwidth_bytes_per_s[a][b] = same ? 1e10 : 1e8;
    }
  }
  t.stage_gradient_bytes = {1e10, 1e10, 1e10};
  auto cost = sim::CostModel::FromTables(t);
  ASSERT_TRUE(cost.ok());
  auto a = AssignStages(*cost, Rules(3, 2, 3), 2);
  ASSERT_TRUE(a.ok());
  for (const auto& nodes : a->stage_nodes) {
    ASSERT_EQ(nodes.size(), 2u);
    EXPECT_EQ(nodes[0] < 4, nodes[1] < 4) << nodes[0] << " " << nodes[1];
  }
}

}  // namespace
}  // namespace detour::planner
