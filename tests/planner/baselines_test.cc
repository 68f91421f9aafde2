#include "coordinator/planner/baselines.h"

#include <gtest/gtest.h>

#include "common/sim/event_simulator.h"
#include "coordinator/planner/route_validator.h"
#include "coordinator/planner/stage_assignment.h"
#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

class BaselinesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    e_ = testing::LoadExample();
    auto cost = sim::CostModel::Create(e_.cluster, e_.job);
    ASSERT_TRUE(cost.ok()) << cost.status();
    cost_ = std::make_unique<sim::CostModel>(*cost);
    rules_ = RulesFromPipeline(e_.job.pipeline());
    auto a = AssignStages(*cost_, rules_, 3);
    ASSERT_TRUE(a.ok()) << a.status();
    plan_.assignment = *a;
  }
  testing::Example e_;
  std::unique_ptr<sim::CostModel> cost_;
  RouteRules rules_;
  sim::Plan plan_;
};

TEST_F(BaselinesTest, FullPipelineUsesFixedColumns) {
  RouteRules full = RulesFromPipeline(e_.job.pipeline(), /*full=*/true);
  auto routes = FullPipelineRoutes(*cost_, plan_.assignment, full);
  ASSERT_TRUE(routes.ok()) << routes.status();
  plan_.routes = *routes;
  EXPECT_TRUE(ValidateRoutes(*cost_, plan_, full).ok()) << ValidateRoutes(*cost_, plan_, full);
  ASSERT_EQ(routes->size(), 30u);
  // Every microbatch of a data node follows the same column, stages in order.
  for (const sim::Route& r : *routes) {
    EXPECT_EQ(r.stages, std::vector<int>({0, 1, 2, 3, 4, 5}));
    const sim::Route& first = (*routes)[r.microbatch / 6 * 6];
    EXPECT_EQ(r.nodes, first.nodes);
  }
  // Five data nodes over three columns: loads 2, 2, 1.
  std::map<int, int> column_load;
  for (int i = 0; i < 5; ++i) ++column_load[(*routes)[i * 6].nodes[1]];
  std::vector<int> loads;
  for (auto& [node, load] : column_load) loads.push_back(load);
  std::sort(loads.begin(), loads.end());
  EXPECT_EQ(loads, std::vector<int>({1, 2, 2}));
}

TEST_F(BaselinesTest, RandomSkipIsValidAndSeeded) {
  auto a = RandomSkipRoutes(*cost_, plan_.assignment, rules_, 1);
  auto b = RandomSkipRoutes(*cost_, plan_.assignment, rules_, 1);
  auto c = RandomSkipRoutes(*cost_, plan_.assignment, rules_, 2);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  plan_.routes = *a;
  EXPECT_TRUE(ValidateRoutes(*cost_, plan_, rules_).ok()) << ValidateRoutes(*cost_, plan_, rules_);
  auto nodes = [](const std::vector<sim::Route>& rs) {
    std::vector<std::vector<int>> out;
    for (const auto& r : rs) out.push_back(r.nodes);
    return out;
  };
  EXPECT_EQ(nodes(*a), nodes(*b));
  EXPECT_NE(nodes(*a), nodes(*c));
}

TEST_F(BaselinesTest, SkipNoCollisionIsValidAndCheaperStatically) {
  auto snc = SkipNoCollisionRoutes(*cost_, plan_.assignment, rules_);
  auto rnd = RandomSkipRoutes(*cost_, plan_.assignment, rules_, 3);
  ASSERT_TRUE(snc.ok() && rnd.ok());
  plan_.routes = *snc;
  EXPECT_TRUE(ValidateRoutes(*cost_, plan_, rules_).ok()) << ValidateRoutes(*cost_, plan_, rules_);
  double snc_cost = 0, rnd_cost = 0;
  for (const auto& r : *snc) snc_cost += StaticRouteCost(*cost_, r);
  for (const auto& r : *rnd) rnd_cost += StaticRouteCost(*cost_, r);
  EXPECT_LT(snc_cost, 0.9 * rnd_cost);
}

// Needs no cluster (the fixture's stage assignment takes minutes under ASan).
TEST(BaselineQuotasTest, QuotasSpreadTheRemainder) {
  RouteRules r;
  r.num_stages = 4;
  r.visited_stages = 3;
  r.data_nodes = 1;
  r.microbatches_per_data_node = 5;  // 10 visits over 3 stages.
  EXPECT_EQ(StageQuotas(r, {0, 1, 3, 2}), std::vector<int>({0, 3, 4, 3}));
}

}  // namespace
}  // namespace detour::planner
