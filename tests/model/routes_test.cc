#include "worker/model/routes.h"

#include <algorithm>
#include <set>

#include <gtest/gtest.h>

#include "common/spec.h"

namespace detour::model {
namespace {

v1::PipelineSpec Pipeline(int stages, double skip, int swaps) {
  v1::JobSpec spec;
  spec.mutable_pipeline()->set_num_stages(stages);
  spec.mutable_pipeline()->set_skip_ratio(skip);
  spec.mutable_pipeline()->set_max_swaps(swaps);
  spec.mutable_model()->set_preset("tiny");
  ApplyJobDefaults(&spec);
  return spec.pipeline();
}

// Property test over seeds and shapes: the constraints of skippipe.md §2.
TEST(GenerateRoutesTest, HonoursTheConvergenceGuidelines) {
  struct Case {
    int stages;
    double skip;
    int swaps;
  };
  for (const Case& c : std::vector<Case>{{4, 0.0, 0},
                                         {4, 0.25, 0},
                                         {4, 0.25, 1},
                                         {6, 1.0 / 3, 0},
                                         {6, 1.0 / 3, 2},
                                         {8, 0.25, 2},
                                         {8, 0.5, 1}}) {
    const v1::PipelineSpec p = Pipeline(c.stages, c.skip, c.swaps);
    const int visited = VisitedStages(p);
    int swaps_seen = 0;
    for (uint64_t seed = 0; seed < 20; ++seed) {
      for (int mbs : {1, 5, 12}) {
        auto routes = GenerateRoutes(p, mbs, seed, seed * 3);
        ASSERT_TRUE(routes.ok()) << routes.status();
        ASSERT_EQ(routes->size(), static_cast<size_t>(mbs));
        std::vector<int> visits(c.stages, 0);
        int any_swap = 0;
        for (const auto& r : *routes) {
          ASSERT_TRUE(CheckRoute(r, c.stages).ok());
          ASSERT_EQ(r.stages_size(), visited);
          int frontier = 0, swaps = 0;
          for (int i = 1; i < r.stages_size(); ++i) {
            const int s = static_cast<int>(r.stages(i));
            ++visits[s];
            if (s > frontier) {
              EXPECT_LE(s - frontier, static_cast<int>(p.max_jump()));
              frontier = s;
            } else {
              ++swaps;
              EXPECT_LE(frontier - s, static_cast<int>(p.max_swap_distance()));
            }
          }
          EXPECT_LE(swaps, c.swaps);
          any_swap += swaps;
        }
        const auto [lo, hi] = std::minmax_element(visits.begin() + 1, visits.end());
        if (c.stages > 1) {
          EXPECT_LE(*hi - *lo, 1) << "stages " << c.stages;
        }
        swaps_seen += any_swap;
      }
    }
    if (c.swaps > 0) {
      EXPECT_GT(swaps_seen, 0) << "stages " << c.stages;
    } else {
      EXPECT_EQ(swaps_seen, 0);
    }
  }
}

TEST(GenerateRoutesTest, DeterministicPerSeedAndIteration) {
  const v1::PipelineSpec p = Pipeline(6, 1.0 / 3, 1);
  auto a = GenerateRoutes(p, 8, 1, 2);
  auto b = GenerateRoutes(p, 8, 1, 2);
  auto c = GenerateRoutes(p, 8, 1, 3);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  bool all_same = true;
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ((*a)[i].DebugString(), (*b)[i].DebugString());
    all_same &= (*a)[i].DebugString() == (*c)[i].DebugString();
  }
  EXPECT_FALSE(all_same);
}

TEST(CheckRouteTest, RefusesInvalidRoutes) {
  EXPECT_TRUE(CheckRoute(MakeRoute(0, {0, 2, 1}), 3).ok());
  EXPECT_FALSE(CheckRoute(MakeRoute(0, {1, 2}), 3).ok());
  EXPECT_FALSE(CheckRoute(MakeRoute(0, {0, 1, 1}), 3).ok());
  EXPECT_FALSE(CheckRoute(MakeRoute(0, {0, 3}), 3).ok());
  EXPECT_FALSE(CheckRoute(MakeRoute(0, {0, 0}), 3).ok());
  v1::Route r = MakeRoute(0, {0, 1});
  r.add_nodes("extra");
  EXPECT_FALSE(CheckRoute(r, 3).ok());
}

TEST(ParseRoutesJsonTest, PlanOrArray) {
  auto plan = ParseRoutesJson(R"({"iteration": 3, "routes": [
      {"microbatch": 0, "dataNode": "d0", "nodes": ["d0", "w1"], "stages": [0, 1]},
      {"microbatch": 1, "data_node": "d0", "stages": [0, 2]}]})");
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 2u);
  EXPECT_EQ((*plan)[1].stages(1), 2u);
  // The shape `detour-sim plan --json` writes: extra report fields ignored.
  auto sim = ParseRoutesJson(R"({"scheduler": "skippipe", "stages": [["d0", "d1"], ["w1"]],
      "routes": [{"microbatch": 0, "data_node": "d0", "nodes": ["d0", "w1"],
                  "stages": [0, 1], "start_s": 0.0, "end_s": 1.5}],
      "nodes": [{"id": "d0", "stage": 0}]})");
  ASSERT_TRUE(sim.ok()) << sim.status();
  ASSERT_EQ(sim->size(), 1u);
  EXPECT_EQ((*sim)[0].nodes(1), "w1");
  auto array = ParseRoutesJson(R"([{"microbatch": 4, "stages": [0, 3, 1]}])");
  ASSERT_TRUE(array.ok());
  EXPECT_EQ((*array)[0].microbatch(), 4u);
  EXPECT_FALSE(ParseRoutesJson("{not json").ok());
}

}  // namespace
}  // namespace detour::model
