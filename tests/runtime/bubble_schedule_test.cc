// The worker's choice of the next K-FAC bubble task: readiness after the
// microbatch's forward / backward, curvature of one factor in plan order
// (whatever order the microbatches arrive in), inversions after their
// layer's curvature, checks of the plan's tasks.
#include "worker/runtime/bubble_schedule.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/iteration_tracker.h"

namespace detour {
namespace {

using Kind = v1::BubbleTask::Kind;

v1::Route MakeRoute(uint32_t mb, std::vector<std::string> nodes) {
  v1::Route r;
  r.set_microbatch(mb);
  r.set_data_node(nodes.front());
  for (size_t i = 0; i < nodes.size(); ++i) {
    r.add_nodes(nodes[i]);
    r.add_stages(static_cast<uint32_t>(i));
  }
  return r;
}

v1::BubbleTask Task(Kind kind, uint32_t layer, uint32_t mb, const std::string& module = "",
                    bool serial = false) {
  v1::BubbleTask t;
  t.set_kind(kind);
  t.set_node("w");
  t.set_layer(layer);
  t.set_microbatch(mb);
  t.set_module(module);
  t.set_serial(serial);
  return t;
}

// d (stage 0) and w (stage 1, layer 1): microbatches 0 and 1 visit both.
// The plan lists w's A curvature of microbatch 1 before microbatch 0's.
v1::IterationPlan Plan() {
  v1::IterationPlan plan;
  plan.set_iteration(3);
  *plan.add_routes() = MakeRoute(0, {"d", "w"});
  *plan.add_routes() = MakeRoute(1, {"d", "w"});
  *plan.add_bubble_tasks() = Task(v1::BubbleTask::KIND_CURVATURE_A, 1, 1);
  *plan.add_bubble_tasks() = Task(v1::BubbleTask::KIND_CURVATURE_A, 1, 0);
  *plan.add_bubble_tasks() = Task(v1::BubbleTask::KIND_CURVATURE_B, 1, 0);
  *plan.add_bubble_tasks() = Task(v1::BubbleTask::KIND_INVERT_A, 1, 0, "q");
  return plan;
}

TEST(BubbleSchedule, CurvatureOfOneFactorRunsInPlanOrder) {
  const v1::IterationPlan plan = Plan();
  BubbleSchedule schedule(/*kfac=*/true, 1, 2);
  std::vector<uint32_t> capture;
  ASSERT_TRUE(schedule.Take(plan, "w", /*replicated=*/false, &capture).ok());
  EXPECT_EQ(capture, (std::vector<uint32_t>{1, 0}));
  IterationTracker tracker(plan, "w");
  EXPECT_EQ(schedule.Next(tracker, false, false), nullptr);
  // Microbatch 0 arrives first: its A waits for microbatch 1's, planned
  // before it, so the sum is formed in the same order in every run.
  tracker.ForwardRan(0);
  EXPECT_EQ(schedule.Next(tracker, false, false), nullptr);
  tracker.ForwardRan(1);
  const v1::BubbleTask* next = schedule.Next(tracker, false, false);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->microbatch(), 1u);
  EXPECT_EQ(schedule.Remove(next).kind(), v1::BubbleTask::KIND_CURVATURE_A);
  next = schedule.Next(tracker, false, false);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->kind(), v1::BubbleTask::KIND_CURVATURE_A);
  EXPECT_EQ(next->microbatch(), 0u);
  schedule.Remove(next);
  // The other kind is not held back by A's order; the inversion waits for
  // the layer's last curvature.
  EXPECT_EQ(schedule.Next(tracker, false, false), nullptr);
  tracker.BackwardRan(0, 1);
  next = schedule.Next(tracker, false, false);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->kind(), v1::BubbleTask::KIND_CURVATURE_B);
  schedule.Remove(next);
  next = schedule.Next(tracker, false, false);
  ASSERT_NE(next, nullptr);
  EXPECT_EQ(next->kind(), v1::BubbleTask::KIND_INVERT_A);
  schedule.Remove(next);
  EXPECT_TRUE(schedule.empty());
}

TEST(BubbleSchedule, DrainingAtTheStepFollowsThePlanOrderToo) {
  const v1::IterationPlan plan = Plan();
  BubbleSchedule schedule(true, 1, 2);
  std::vector<uint32_t> capture;
  ASSERT_TRUE(schedule.Take(plan, "w", false, &capture).ok());
  IterationTracker tracker(plan, "w");
  tracker.ForwardRan(0);
  tracker.ForwardRan(1);
  tracker.BackwardRan(0, 1);
  tracker.BackwardRan(1, 1);
  std::vector<uint32_t> a_order;
  auto all = [](const v1::BubbleTask&) { return true; };
  while (true) {
    const v1::BubbleTask* next = nullptr;
    const BubbleSchedule::Drain d = schedule.NextToDrain(tracker, true, all, &next);
    if (d == BubbleSchedule::Drain::kDone) break;
    ASSERT_EQ(d, BubbleSchedule::Drain::kTask);
    const v1::BubbleTask t = schedule.Remove(next);
    if (t.kind() == v1::BubbleTask::KIND_CURVATURE_A) a_order.push_back(t.microbatch());
  }
  EXPECT_EQ(a_order, (std::vector<uint32_t>{1, 0}));
}

TEST(BubbleSchedule, RefusesTasksItCannotRun) {
  v1::IterationPlan plan = Plan();
  std::vector<uint32_t> capture;
  // A layer the stage does not hold.
  BubbleSchedule other_layers(true, 2, 3);
  EXPECT_EQ(other_layers.Take(plan, "w", false, &capture).code(),
            absl::StatusCode::kInvalidArgument);
  // K-FAC work for a job without K-FAC.
  BubbleSchedule adamw(false, 1, 2);
  EXPECT_EQ(adamw.Take(plan, "w", false, &capture).code(), absl::StatusCode::kInvalidArgument);
  // A microbatch without a route.
  *plan.add_bubble_tasks() = Task(v1::BubbleTask::KIND_CURVATURE_B, 1, 9);
  BubbleSchedule schedule(true, 1, 2);
  EXPECT_EQ(schedule.Take(plan, "w", false, &capture).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace detour
