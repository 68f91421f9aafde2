// The worker's choice of the next K-FAC bubble task: which tasks of a plan it
// takes (and refuses), and the readiness rules — curvature after its
// microbatch's forward/backward, curvature of one factor in plan order
// (whatever order the microbatches arrive in), an inversion's parts in
// order, the next refresh's inversions of a layer after the previous
// refresh's.
#include "worker/runtime/bubble_schedule.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/iteration_tracker.h"

namespace detour {
namespace {

using Kind = v1::BubbleTask::Kind;

// Node "a" holds layers 2 and 3 of a block of width 2048 (ffn 3000): A and
// B inversions of q are 2048 wide, 16 units each (8 blocks).
kfac::BlockShape Shape() {
  kfac::BlockShape s;
  s.d_model = 2048;
  s.kv_dim = 2048;
  s.ffn_dim = 3000;
  return s;
}

v1::BubbleTask Task(Kind kind, uint32_t layer, const std::string& module, uint32_t mb,
                    uint64_t refresh, uint32_t part = 0, uint32_t num_parts = 1) {
  v1::BubbleTask t;
  t.set_kind(kind);
  t.set_node("a");
  t.set_layer(layer);
  t.set_module(module);
  t.set_microbatch(mb);
  t.set_refresh(refresh);
  t.set_part(part);
  t.set_num_parts(num_parts);
  return t;
}

v1::IterationPlan Plan(const std::vector<v1::BubbleTask>& tasks) {
  v1::IterationPlan plan;
  plan.set_iteration(3);
  for (uint32_t mb = 0; mb < 2; ++mb) {
    v1::Route* r = plan.add_routes();
    r->set_microbatch(mb);
    r->set_data_node("d");
    r->add_nodes("d");
    r->add_stages(0);
    r->add_nodes("a");
    r->add_stages(1);
  }
  for (const v1::BubbleTask& t : tasks) *plan.add_bubble_tasks() = t;
  return plan;
}

TEST(BubbleSchedule, RefusesTasksItCannotRun) {
  struct Case {
    v1::BubbleTask task;
    std::string expect;
  };
  for (const Case& c : std::vector<Case>{
           {Task(v1::BubbleTask::KIND_INVERT_A, 5, "q", 0, 0), "does not hold"},
           {Task(v1::BubbleTask::KIND_CURVATURE_A, 2, "", 9, 0), "no route"},
           {Task(v1::BubbleTask::KIND_INVERT_A, 2, "w9", 0, 0), "names no projection"},
           {Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 0, 3, 3), "part 3 of 3"},
           {Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 0, 0, 17), "17 parts for an item of 16"},
           {Task(v1::BubbleTask::KIND_CURVATURE_A, 2, "", 0, 0, 0, 5), "5 parts for an item of 4"},
           {Task(v1::BubbleTask::KIND_CURVATURE_B, 2, "", 0, 0, 0, 8), "8 parts for an item of 7"},
       }) {
    BubbleSchedule schedule(true, 2, 4, Shape());
    std::vector<uint32_t> capture;
    absl::Status s = schedule.Take(Plan({c.task}), "a", false, &capture);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(s.message().find(c.expect), std::string::npos) << s;
  }
  // A job without K-FAC takes none; another node's tasks are not ours.
  BubbleSchedule none(false, 2, 4, Shape());
  std::vector<uint32_t> capture;
  EXPECT_FALSE(
      none.Take(Plan({Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 0)}), "a", false, &capture)
          .ok());
  EXPECT_TRUE(
      none.Take(Plan({Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 0)}), "b", false, &capture)
          .ok());
  // The finest split and plans from before parts (num_parts 0) are fine.
  BubbleSchedule ok(true, 2, 4, Shape());
  EXPECT_TRUE(ok.Take(Plan({Task(v1::BubbleTask::KIND_INVERT_B, 2, "q", 0, 0, 15, 16),
                            Task(v1::BubbleTask::KIND_CURVATURE_B, 3, "", 1, 0, 6, 7),
                            Task(v1::BubbleTask::KIND_INVERT_A, 3, "down", 0, 0, 0, 0)}),
                      "a", false, &capture)
                  .ok());
  EXPECT_EQ(capture, (std::vector<uint32_t>{1}));
}

TEST(BubbleSchedule, PartsAndRefreshesRunInOrder) {
  // Refresh 4's curvature of layer 2 (mb 0, A in 2 parts), its inversion of
  // q's A in 3 parts, and refresh 5's inversion of layer 2 (which may not
  // run before refresh 4's) and of layer 3 (independent).
  const std::vector<v1::BubbleTask> tasks = {
      Task(v1::BubbleTask::KIND_CURVATURE_A, 2, "", 0, 4, 1, 2),
      Task(v1::BubbleTask::KIND_CURVATURE_A, 2, "", 0, 4, 0, 2),
      Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 5, 0, 1),
      Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 4, 1, 3),
      Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 4, 0, 3),
      Task(v1::BubbleTask::KIND_INVERT_A, 2, "q", 0, 4, 2, 3),
      Task(v1::BubbleTask::KIND_INVERT_B, 3, "up", 0, 5, 0, 1),
  };
  const v1::IterationPlan plan = Plan(tasks);
  BubbleSchedule schedule(true, 2, 4, Shape());
  std::vector<uint32_t> capture;
  ASSERT_TRUE(schedule.Take(plan, "a", false, &capture).ok());
  IterationTracker tracker(plan, "a");
  std::vector<std::string> ran;
  auto run_all = [&] {
    while (const v1::BubbleTask* t = schedule.Next(tracker, false, false)) {
      ran.push_back(BubbleSchedule::Name(*t));
      const v1::BubbleTask done = schedule.Remove(t);
      if (BubbleSchedule::IsInversion(done)) schedule.Inverted(done);
    }
  };
  // Before mb 0's forward only refresh 5's layer-3 inversion is ready.
  run_all();
  EXPECT_EQ(ran, (std::vector<std::string>{"invert_b(layer 3 up, refresh 5)"}));
  tracker.ForwardRan(0);
  ran.clear();
  run_all();
  EXPECT_EQ(ran, (std::vector<std::string>{
                     "curvature_a(layer 2 mb 0 part 2/2, refresh 4)",
                     "curvature_a(layer 2 mb 0 part 1/2, refresh 4)",
                     "invert_a(layer 2 q part 1/3, refresh 4)",
                     "invert_a(layer 2 q part 2/3, refresh 4)",
                     "invert_a(layer 2 q part 3/3, refresh 4)",
                     "invert_a(layer 2 q, refresh 5)",
                 }));
  EXPECT_TRUE(schedule.empty());
}

// Curvature of one factor in plan order (one node "w", whole items).
namespace plan_order {

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

TEST(BubbleSchedule, RefusesLayersJobsAndMicrobatchesItCannotRun) {
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

}  // namespace plan_order

}  // namespace
}  // namespace detour
