#include "coordinator/planner/route_rules.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace detour::planner {
namespace {

using ::testing::HasSubstr;

RouteRules Rules() {
  RouteRules r;
  r.num_stages = 8;
  r.visited_stages = 5;
  r.data_nodes = 2;
  r.microbatches_per_data_node = 3;
  r.max_jump = 3;
  r.max_swaps = 2;
  r.max_swap_distance = 1;
  r.max_total_swap_distance = 2;
  return r;
}

TEST(RouteRulesTest, JumpsAreMeasuredFromTheFrontier) {
  RouteRules r = Rules();
  EXPECT_EQ(CheckStageOrder(r, {0, 3, 6, 7}), "");
  EXPECT_THAT(CheckStageOrder(r, {0, 4, 5}), HasSubstr("(4 > max_jump 3)"));
  EXPECT_EQ(CheckStageOrder(r, {0, 3, 2, 6}), "");  // 6 - frontier 3 = 3.
  EXPECT_THAT(CheckStageOrder(r, {0, 3, 2, 7}), HasSubstr("frontier stage 3 to stage 7"));
}

TEST(RouteRulesTest, SwapLimits) {
  RouteRules r = Rules();
  EXPECT_EQ(CheckStageOrder(r, {0, 2, 1, 3}), "");
  EXPECT_EQ(CheckStageOrder(r, {0, 3, 2, 5, 4}), "");
  EXPECT_THAT(CheckStageOrder(r, {0, 3, 2, 5, 4, 7, 6}), HasSubstr("max_swaps 2"));
  EXPECT_THAT(CheckStageOrder(r, {0, 3, 1}), HasSubstr("max_swap_distance 1"));
  r.max_swap_distance = 2;
  EXPECT_EQ(CheckStageOrder(r, {0, 3, 1}), "");
  EXPECT_THAT(CheckStageOrder(r, {0, 3, 1, 5, 4}), HasSubstr("max_total_swap_distance 2"));
  r.max_swaps = 0;
  EXPECT_THAT(CheckStageOrder(r, {0, 2, 1}), HasSubstr("max_swaps 0"));
}

TEST(RouteRulesTest, QuotasSumToAllVisits) {
  RouteRules r = Rules();  // 6 microbatches × 4 visits = 24 over 7 stages.
  std::vector<int> q = StageQuotas(r, {0, 1, 1, 5, 1, 4, 1, 3});
  EXPECT_EQ(q, std::vector<int>({0, 3, 3, 4, 3, 4, 3, 4}));
  r.visited_stages = 1;
  EXPECT_EQ(StageQuotas(r, {}), std::vector<int>(8, 0));
}

TEST(RouteRulesTest, RulesFromPipeline) {
  v1::PipelineSpec p;
  p.set_num_stages(6);
  p.set_skip_ratio(0.33);
  p.set_data_nodes(5);
  p.set_microbatches_per_data_node(6);
  p.set_max_jump(3);
  p.set_max_swaps(1);
  p.set_max_swap_distance(1);
  p.set_max_total_swap_distance(2);
  RouteRules skip = RulesFromPipeline(p);
  EXPECT_EQ(skip.visited_stages, 4);
  EXPECT_EQ(skip.total_microbatches(), 30);
  EXPECT_EQ(skip.max_swaps, 1);
  RouteRules full = RulesFromPipeline(p, /*full=*/true);
  EXPECT_EQ(full.visited_stages, 6);
  EXPECT_EQ(full.max_jump, 1);
  EXPECT_EQ(full.max_swaps, 0);
  EXPECT_EQ(MicrobatchId(skip, 2, 3), 15);
}

TEST(RngTest, ReproducibleAndInRange) {
  Rng a(9), b(9), c(10);
  bool differs = false;
  for (int i = 0; i < 1000; ++i) {
    const uint64_t x = a.Next();
    EXPECT_EQ(x, b.Next());
    differs |= x != c.Next();
    const int u = a.Uniform(7);
    b.Uniform(7);
    EXPECT_GE(u, 0);
    EXPECT_LT(u, 7);
    const double r = a.UniformReal();
    b.UniformReal();
    EXPECT_GE(r, 0.0);
    EXPECT_LT(r, 1.0);
  }
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace detour::planner
