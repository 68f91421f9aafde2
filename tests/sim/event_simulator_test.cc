#include "common/sim/event_simulator.h"

#include <gtest/gtest.h>

#include "tests/sim/sim_test_util.h"

namespace detour::sim {
namespace {

using testing::UniformTables;

constexpr double kEps = 1e-9;

Route MakeRoute(int microbatch, std::vector<int> nodes, std::vector<int> stages) {
  Route r;
  r.microbatch = microbatch;
  r.nodes = std::move(nodes);
  r.stages = std::move(stages);
  return r;
}

CostModel Model(CostTables t) {
  auto m = CostModel::FromTables(std::move(t));
  EXPECT_TRUE(m.ok()) << m.status();
  return *std::move(m);
}

// One node, one stage: every microbatch runs F, loss, B back to back
// (backward/loss first, so microbatch 0 finishes before 1 starts).
TEST(EventSimulatorTest, SingleNodeIsSequential) {
  CostModel cost = Model(UniformTables(1, 1, 1.0, 2.0, 0.5, 0, 0, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0}};
  for (int m = 0; m < 3; ++m) plan.routes.push_back(MakeRoute(m, {0}, {0}));
  SimOptions options;
  options.queue_policy = QueuePolicy::kBackwardFirst;
  auto r = Simulate(cost, plan, options);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->pipeline_time_s, 3 * 3.5, kEps);
  EXPECT_NEAR(r->iteration_time_s, 3 * 3.5, kEps);
  EXPECT_NEAR(r->utilization, 1.0, kEps);
  EXPECT_NEAR(r->routes[0].end_s, 3.5, kEps);
  EXPECT_NEAR(r->routes[1].start_s, 3.5, kEps);
  EXPECT_NEAR(r->routes[2].loss_end_s, 7.0 + 1.5, kEps);
  ASSERT_EQ(r->compute[0].size(), 9u);
  EXPECT_TRUE(r->idle[0].empty());
}

// The same in arrival order: the three forwards (ready at 0) run first, then
// each loss and backward in the order it became ready: L0 3-3.5, L1 -4,
// L2 -4.5, B0 -6.5, B1 -8.5, B2 -10.5.
TEST(EventSimulatorTest, SingleNodeInArrivalOrder) {
  CostModel cost = Model(UniformTables(1, 1, 1.0, 2.0, 0.5, 0, 0, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0}};
  for (int m = 0; m < 3; ++m) plan.routes.push_back(MakeRoute(m, {0}, {0}));
  auto r = Simulate(cost, plan);  // kArrival is the default
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->pipeline_time_s, 10.5, kEps);
  EXPECT_NEAR(r->routes[0].end_s, 6.5, kEps);
  EXPECT_NEAR(r->routes[1].start_s, 1.0, kEps);
  EXPECT_NEAR(r->routes[2].loss_end_s, 4.5, kEps);
  EXPECT_NEAR(r->routes[2].end_s, 10.5, kEps);
  // F1, F2 wait 1 and 2 s; L0..L2 (ready 1, 2, 3) wait 2, 1.5, 1; B0..B2
  // (ready 3.5, 4, 4.5) wait 1, 2.5, 4.
  EXPECT_EQ(r->collisions, 8);
  EXPECT_NEAR(r->queue_wait_s, 1 + 2 + 2 + 1.5 + 1 + 1 + 2.5 + 4, kEps);
}

// Two nodes, one microbatch, latency 0.1 s and 0.1 s serialisation:
// F0 0-1 | xfer 1-1.2 | F1 1.2-3.2 | xfer -3.4 | L 3.4-3.9 | xfer -4.1 |
// B1 4.1-8.1 | xfer -8.3 | B0 8.3-10.3.
TEST(EventSimulatorTest, TwoNodesOneMicrobatch) {
  CostTables t = UniformTables(2, 2, 1.0, 2.0, 0.5, 0.1, 0.1, 3);
  t.forward_s[1][1] = 2.0;
  t.backward_s[1][1] = 4.0;
  CostModel cost = Model(t);
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1}};
  plan.routes.push_back(MakeRoute(0, {0, 1}, {0, 1}));
  auto r = Simulate(cost, plan);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->pipeline_time_s, 10.3, kEps);
  EXPECT_NEAR(r->routes[0].loss_end_s, 3.9, kEps);
  ASSERT_EQ(r->compute[1].size(), 2u);
  EXPECT_NEAR(r->compute[1][0].start_s, 1.2, kEps);
  EXPECT_NEAR(r->compute[1][1].start_s, 4.1, kEps);
  // Node 1 idles before, between and after its two tasks.
  ASSERT_EQ(r->idle[1].size(), 3u);
  EXPECT_NEAR(r->idle[1][0].second, 1.2, kEps);
  EXPECT_NEAR(r->idle[1][1].first, 3.2, kEps);
  EXPECT_NEAR(r->idle[1][2].first, 8.1, kEps);
  EXPECT_NEAR(r->idle[1][2].second, 10.3, kEps);
  // Busy 1+0.5+2 on node 0, 6 on node 1, of 2 × 10.3.
  EXPECT_NEAR(r->utilization, 9.5 / 20.6, kEps);
  EXPECT_EQ(r->sends[0].size(), 2u);  // Activation out, gradient out.
  EXPECT_EQ(r->sends[1].size(), 2u);
}

// Two microbatches from two data nodes meet on node 2 (no network delay):
// node 2 runs F(0) 1-2, F(1) 2-3, B(0) 3-5, B(1) 5-7; data node 1 finishes
// its backward at 9 instead of the uncontended 6.5.
TEST(EventSimulatorTest, CollidingMicrobatchesQueue) {
  CostModel cost = Model(UniformTables(3, 2, 1.0, 2.0, 0.5, 0, 0, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0, 1}, {2}};
  plan.routes.push_back(MakeRoute(0, {0, 2}, {0, 1}));
  plan.routes.push_back(MakeRoute(1, {1, 2}, {0, 1}));
  auto r = Simulate(cost, plan);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->routes[0].end_s, 7.0, kEps);
  EXPECT_NEAR(r->routes[1].end_s, 9.0, kEps);
  EXPECT_NEAR(r->pipeline_time_s, 9.0, kEps);

  Plan alone = plan;
  alone.routes.pop_back();
  auto r1 = Simulate(cost, alone);
  ASSERT_TRUE(r1.ok());
  EXPECT_NEAR(r1->pipeline_time_s, 6.5, kEps);
}

// One data node sends two activations (3 s serialisation, 0.5 s latency) to
// two replicas of stage 1. Its uplink carries one transfer at a time, so the
// second waits for the first: hand-computed 23.5 s; without contention 22.5.
TEST(EventSimulatorTest, ContendedUplink) {
  CostModel cost = Model(UniformTables(3, 2, 1.0, 2.0, 0.5, 0.5, 3.0, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1, 2}};
  plan.routes.push_back(MakeRoute(0, {0, 1}, {0, 1}));
  plan.routes.push_back(MakeRoute(1, {0, 2}, {0, 1}));

  SimOptions uplink;
  uplink.contention = Contention::kSenderUplink;
  auto r = Simulate(cost, plan, uplink);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->pipeline_time_s, 23.5, kEps);
  ASSERT_EQ(r->sends[0].size(), 4u);
  EXPECT_NEAR(r->sends[0][1].start_s, 4.0, kEps);  // Waited for the first.

  SimOptions none;
  none.contention = Contention::kNone;
  auto r2 = Simulate(cost, plan, none);
  ASSERT_TRUE(r2.ok());
  EXPECT_NEAR(r2->pipeline_time_s, 22.5, kEps);

  // Different destinations: per-link contention sees no conflict.
  SimOptions link;
  link.contention = Contention::kPerLink;
  auto r3 = Simulate(cost, plan, link);
  ASSERT_TRUE(r3.ok());
  EXPECT_NEAR(r3->pipeline_time_s, 22.5, kEps);
}

// Per-link contention: two microbatches on the same link serialise.
TEST(EventSimulatorTest, ContendedLinkSameDestination) {
  // Data nodes 0 and 1 never share a link; 0 -> 2 twice does.
  CostModel cost = Model(UniformTables(3, 2, 1.0, 2.0, 0.5, 0.0, 3.0, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {2}};
  plan.routes.push_back(MakeRoute(0, {0, 2}, {0, 1}));
  plan.routes.push_back(MakeRoute(1, {0, 2}, {0, 1}));
  SimOptions link;
  link.contention = Contention::kPerLink;
  auto r = Simulate(cost, plan, link);
  ASSERT_TRUE(r.ok());
  // F 0-1, F 1-2 on node 0; link 0->2 carries mb0 1-4 and mb1 4-7.
  ASSERT_EQ(r->compute[2].size(), 4u);
  EXPECT_NEAR(r->compute[2][0].start_s, 4.0, kEps);
  EXPECT_NEAR(r->compute[2][1].start_s, 7.0, kEps);
}

// With one memory slot on the data node the second microbatch cannot start
// before the first has finished its backward there.
TEST(EventSimulatorTest, MemorySlotExhaustion) {
  CostTables t = UniformTables(2, 2, 1.0, 2.0, 0.5, 0, 0, 3);
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1}};
  plan.routes.push_back(MakeRoute(0, {0, 1}, {0, 1}));
  plan.routes.push_back(MakeRoute(1, {0, 1}, {0, 1}));

  auto roomy = Simulate(Model(t), plan);
  ASSERT_TRUE(roomy.ok());
  EXPECT_NEAR(roomy->pipeline_time_s, 9.0, kEps);

  t.memory_slots[0] = 1;
  auto tight = Simulate(Model(t), plan);
  ASSERT_TRUE(tight.ok());
  EXPECT_NEAR(tight->routes[1].start_s, 6.5, kEps);
  EXPECT_NEAR(tight->pipeline_time_s, 13.0, kEps);
}

// Ring all-reduce after the pipeline: 2 replicas, 1e7 gradient bytes, 1 MB/s,
// 0.2 s latency: 2·1·(0.2 + 0.5e7/1e6) = 10.4 s after the stage's last backward.
TEST(EventSimulatorTest, AllReduceEndsTheIteration) {
  CostTables t = UniformTables(3, 2, 1.0, 2.0, 0.5, 0.2, 1.0, 3);
  t.stage_gradient_bytes = {0, 1e7};
  CostModel cost = Model(t);
  EXPECT_NEAR(cost.AllReduceTime({1, 2}, 1), 10.4, kEps);
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1, 2}};
  plan.routes.push_back(MakeRoute(0, {0, 1}, {0, 1}));
  auto r = Simulate(cost, plan);
  ASSERT_TRUE(r.ok());
  // F0 0-1, xfer -2.2, F1 -3.2, xfer -4.4, L -4.9, xfer -6.1, B1 -8.1.
  EXPECT_NEAR(r->stage_done_s[1], 8.1, kEps);
  EXPECT_NEAR(r->allreduce_s[1], 10.4, kEps);
  EXPECT_NEAR(r->pipeline_time_s, 8.1 + 1.2 + 2.0, kEps);
  EXPECT_NEAR(r->iteration_time_s, 8.1 + 10.4, kEps);
  EXPECT_NEAR(r->allreduce_s[0], 0.0, kEps);  // A single data node.
}

// Two microbatches visiting stages 1 and 2 in opposite orders, one slot
// each: each would hold the slot the other needs, but microbatch 1's visit
// to stage 1 is a swap and starts without a slot, so both finish.
// mb1: F n1 0-1, F n3 1-2 (slot), F n2 2-3 (swap), L n1 -3.5, B n2 -5.5,
// B n3 -7.5 (frees n3), B n1 -9.5. mb0: F n0 0-1, F n2 1-2 (slot), waits for
// n3's slot until 7.5: F n3 -8.5, L n0 -9, B n3 -11, B n2 -13, B n0 -15.
TEST(EventSimulatorTest, SwapVisitsNeverDeadlockOnSlots) {
  CostModel cost = Model(UniformTables(4, 3, 1.0, 2.0, 0.5, 0, 0, 1));
  Plan plan;
  plan.assignment.stage_nodes = {{0, 1}, {2}, {3}};
  plan.routes.push_back(MakeRoute(0, {0, 2, 3}, {0, 1, 2}));
  plan.routes.push_back(MakeRoute(1, {1, 3, 2}, {0, 2, 1}));
  for (QueuePolicy policy : {QueuePolicy::kArrival, QueuePolicy::kBackwardFirst}) {
    SimOptions options;
    options.queue_policy = policy;
    auto r = Simulate(cost, plan, options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->routes[1].end_s, 9.5, kEps);
    EXPECT_NEAR(r->pipeline_time_s, 15.0, kEps);
  }
}

TEST(EventSimulatorTest, RejectsRouteDisagreeingWithAssignment) {
  CostModel cost = Model(UniformTables(3, 2, 1.0, 2.0, 0.5, 0, 0, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1, 2}};
  plan.routes.push_back(MakeRoute(0, {0, 1}, {0, 2}));
  EXPECT_EQ(Simulate(cost, plan).status().code(), absl::StatusCode::kInvalidArgument);
  plan.routes[0] = MakeRoute(0, {1, 0}, {1, 0});
  EXPECT_EQ(Simulate(cost, plan).status().code(), absl::StatusCode::kInvalidArgument);
  plan.routes[0] = MakeRoute(0, {0, 7}, {0, 1});
  EXPECT_EQ(Simulate(cost, plan).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(EventSimulatorTest, TimelineCanBeSkipped) {
  CostModel cost = Model(UniformTables(2, 2, 1.0, 2.0, 0.5, 0.1, 0.1, 3));
  Plan plan;
  plan.assignment.stage_nodes = {{0}, {1}};
  plan.routes.push_back(MakeRoute(0, {0, 1}, {0, 1}));
  SimOptions fast;
  fast.record_timeline = false;
  auto r = Simulate(cost, plan, fast);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->compute.empty());
  EXPECT_NEAR(r->pipeline_time_s, 1 + 0.2 + 1 + 0.2 + 0.5 + 0.2 + 2 + 0.2 + 2, kEps);
  EXPECT_GT(r->events, 0);
}

}  // namespace
}  // namespace detour::sim
