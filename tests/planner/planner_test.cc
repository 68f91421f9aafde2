#include "coordinator/planner/planner.h"

#include <gtest/gtest.h>

#include "coordinator/planner/plan_proto.h"
#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

class PlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    e_ = testing::LoadExample();
    auto cost = sim::CostModel::Create(e_.cluster, e_.job);
    ASSERT_TRUE(cost.ok()) << cost.status();
    cost_ = std::make_unique<sim::CostModel>(*cost);
  }
  testing::Example e_;
  std::unique_ptr<sim::CostModel> cost_;
};

TEST_F(PlannerTest, SchedulerComesFromJobUnlessOverridden) {
  PlannerOptions o;
  o.max_evaluations = 50;
  auto it = PlanIteration(*cost_, e_.job, o);
  ASSERT_TRUE(it.ok()) << it.status();
  EXPECT_EQ(it->scheduler, v1::SCHEDULER_SKIPPIPE);
  EXPECT_EQ(it->search.evaluations, 50);
  EXPECT_EQ(it->plan.routes.size(), 30u);
  EXPECT_GT(it->result.iteration_time_s, it->result.pipeline_time_s);
  EXPECT_GT(it->planning_time_s, 0);
  o.scheduler = v1::SCHEDULER_FULL;
  auto full = PlanIteration(*cost_, e_.job, o);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->plan.routes[0].stages.size(), 6u);
}

TEST_F(PlannerTest, KeepsAGivenAssignmentAndIsDeterministic) {
  PlannerOptions o;
  o.seed = 3;
  o.max_evaluations = 100;
  auto a = PlanIteration(*cost_, e_.job, o);
  ASSERT_TRUE(a.ok());
  auto b = PlanIteration(*cost_, e_.job, o);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->plan.assignment.stage_nodes, b->plan.assignment.stage_nodes);
  EXPECT_EQ(a->result.iteration_time_s, b->result.iteration_time_s);

  sim::StageAssignment mine;
  mine.stage_nodes = {{0, 1, 2, 3, 4}, {5, 6, 7},    {8, 9, 10},
                      {11, 12, 13},    {14, 15, 16}, {17, 18, 19}};
  o.assignment = mine;
  auto c = PlanIteration(*cost_, e_.job, o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->plan.assignment.stage_nodes, mine.stage_nodes);
  for (const sim::Route& r : c->plan.routes) {
    const v1::Route wire = ToProtoRoute(*cost_, r);
    EXPECT_EQ(wire.data_node(), wire.nodes(0));
    EXPECT_LE(r.nodes[0], 4);
  }
}

TEST_F(PlannerTest, InconsistentAssignmentIsRefused) {
  PlannerOptions o;
  sim::StageAssignment bad;
  bad.stage_nodes = {{0}, {1}};
  o.assignment = bad;
  EXPECT_EQ(PlanIteration(*cost_, e_.job, o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SchedulerNameTest, ParsesNamesAndEnumNames) {
  EXPECT_EQ(*ParseSchedulerName("skip-no-collision"), v1::SCHEDULER_SKIP_NO_COLLISION);
  EXPECT_EQ(*ParseSchedulerName("SCHEDULER_FULL"), v1::SCHEDULER_FULL);
  EXPECT_EQ(SchedulerName(v1::SCHEDULER_RANDOM), "random");
  EXPECT_EQ(SchedulerName(v1::SCHEDULER_UNSPECIFIED), "skippipe");
  EXPECT_FALSE(ParseSchedulerName("fastest").ok());
}

}  // namespace
}  // namespace detour::planner
