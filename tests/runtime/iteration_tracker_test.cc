// The worker's per-iteration book-keeping: expected tensors, owed work, and
// what freezing and amending routes around lost workers does.
#include "worker/runtime/iteration_tracker.h"

#include <algorithm>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using Verdict = IterationTracker::Verdict;

v1::Route MakeRoute(uint32_t mb, std::vector<std::string> nodes, uint64_t epoch = 0) {
  v1::Route r;
  r.set_microbatch(mb);
  r.set_data_node(nodes.front());
  for (size_t i = 0; i < nodes.size(); ++i) {
    r.add_nodes(nodes[i]);
    r.add_stages(static_cast<uint32_t>(i));
  }
  r.set_epoch(epoch);
  return r;
}

// d0 and d1 are data nodes; a and b hold stage 1, c stage 2.
v1::IterationPlan Plan() {
  v1::IterationPlan plan;
  plan.set_iteration(7);
  *plan.add_routes() = MakeRoute(0, {"d0", "a", "c"});
  *plan.add_routes() = MakeRoute(1, {"d0", "b", "c"});
  *plan.add_routes() = MakeRoute(2, {"d1", "a", "c"});
  return plan;
}

// A frame as the plan has it sent: from the node before `hop` (forward) or
// after it (backward; the last node's from the data node).
v1::FrameHeader Frame(uint32_t mb, v1::Direction d, uint32_t hop, uint64_t epoch = 0) {
  v1::FrameHeader h;
  const v1::IterationPlan plan = Plan();
  const v1::Route& r = plan.routes(static_cast<int>(mb % 3));
  const int n = r.nodes_size();
  const int from =
      d == v1::DIRECTION_FORWARD ? static_cast<int>(hop) - 1 : static_cast<int>(hop) + 1;
  h.set_sender(from >= 0 && from < n ? r.nodes(from) : r.data_node());
  h.set_microbatch(mb);
  h.set_direction(d);
  h.set_hop(hop);
  h.set_epoch(epoch);
  return h;
}

// The peers whose connections a worker opens when a plan arrives: its
// neighbours on each of its routes, both ways, and its replicas.
TEST(PlanSendTargets, NeighboursOnEveryRouteAndTheReplicaGroup) {
  const v1::IterationPlan plan = Plan();
  using V = std::vector<std::string>;
  // d0 sends activations to a and b; c's go back to it and its gradients go
  // to c (the last stage).
  EXPECT_EQ(PlanSendTargets(plan, "d0", {}), (V{"a", "b", "c"}));
  EXPECT_EQ(PlanSendTargets(plan, "a", {"a", "b"}), (V{"b", "c", "d0", "d1"}));
  EXPECT_EQ(PlanSendTargets(plan, "c", {}), (V{"a", "b", "d0", "d1"}));
  EXPECT_EQ(PlanSendTargets(plan, "d1", {}), (V{"a", "c"}));
  EXPECT_EQ(PlanSendTargets(plan, "spare", {}), V{});
}

TEST(IterationTracker, AcceptsOnlyThisNodesHopsOnce) {
  IterationTracker a(Plan(), "a");
  EXPECT_EQ(a.Accept(Frame(0, v1::DIRECTION_FORWARD, 1)).verdict, Verdict::kRun);
  EXPECT_EQ(a.Accept(Frame(0, v1::DIRECTION_FORWARD, 1)).verdict, Verdict::kUnexpected);
  EXPECT_EQ(a.Accept(Frame(1, v1::DIRECTION_FORWARD, 1)).verdict, Verdict::kUnexpected);  // b's
  EXPECT_EQ(a.Accept(Frame(0, v1::DIRECTION_FORWARD, 2)).verdict, Verdict::kUnexpected);  // c's
  EXPECT_EQ(a.Accept(Frame(9, v1::DIRECTION_FORWARD, 1)).verdict, Verdict::kUnexpected);
  const auto back = a.Accept(Frame(0, v1::DIRECTION_BACKWARD, 1));
  EXPECT_EQ(back.verdict, Verdict::kRun);
  EXPECT_EQ(back.hop, 1);

  IterationTracker d0(Plan(), "d0");
  const auto loss = d0.Accept(Frame(0, v1::DIRECTION_FORWARD, 3));
  EXPECT_EQ(loss.verdict, Verdict::kRun);
  EXPECT_TRUE(loss.loss);
  EXPECT_THAT(d0.Own(), ElementsAre(0, 1));
}

// A member cannot stand in for another on a route: a copy of a hop's tensor
// from anyone but the node the route has send it is not taken, even when it
// comes first, and the real one still is.
TEST(IterationTracker, AcceptsAHopOnlyFromTheNodeTheRouteHasSendIt) {
  auto from = [](v1::FrameHeader h, const std::string& sender) {
    h.set_sender(sender);
    return h;
  };
  IterationTracker a(Plan(), "a");
  // mb 0 is d0 -> a -> c: its forward hop 1 comes from d0, its backward hop
  // 1 from c.
  EXPECT_EQ(a.Accept(from(Frame(0, v1::DIRECTION_FORWARD, 1), "b")).verdict, Verdict::kUnexpected);
  EXPECT_EQ(a.Accept(from(Frame(0, v1::DIRECTION_FORWARD, 1), "d1")).verdict, Verdict::kUnexpected);
  EXPECT_EQ(a.Accept(Frame(0, v1::DIRECTION_FORWARD, 1)).verdict, Verdict::kRun);
  EXPECT_EQ(a.Accept(from(Frame(0, v1::DIRECTION_BACKWARD, 1), "d0")).verdict,
            Verdict::kUnexpected);
  EXPECT_EQ(a.Accept(Frame(0, v1::DIRECTION_BACKWARD, 1)).verdict, Verdict::kRun);
  // The loss's forward comes from the last node only; the last node's
  // backward from the data node only.
  IterationTracker d0(Plan(), "d0");
  EXPECT_EQ(d0.Accept(from(Frame(0, v1::DIRECTION_FORWARD, 3), "a")).verdict, Verdict::kUnexpected);
  EXPECT_EQ(d0.Accept(Frame(0, v1::DIRECTION_FORWARD, 3)).verdict, Verdict::kRun);
  IterationTracker c(Plan(), "c");
  EXPECT_EQ(c.Accept(from(Frame(0, v1::DIRECTION_BACKWARD, 2), "a")).verdict, Verdict::kUnexpected);
  EXPECT_EQ(c.Accept(Frame(0, v1::DIRECTION_BACKWARD, 2)).verdict, Verdict::kRun);
  // A hop past the route's end is nobody's.
  EXPECT_EQ(c.Accept(from(Frame(0, v1::DIRECTION_BACKWARD, 0xffffffffu), "d0")).verdict,
            Verdict::kUnexpected);
}

// The first microbatch still owing a backward here: gradients of those
// below it are final and may join the stage's sum, in order.
TEST(IterationTracker, FirstBackwardOwedSkipsWhatRanAndWhatFroze) {
  IterationTracker c(Plan(), "c");
  EXPECT_EQ(c.FirstBackwardOwed(), 0u);
  c.BackwardRan(1, 2);
  EXPECT_EQ(c.FirstBackwardOwed(), 0u);  // 1 ran out of order
  c.BackwardRan(0, 2);
  EXPECT_EQ(c.FirstBackwardOwed(), 2u);
  c.Freeze({"d1"}, 1);  // 2 crossed the lost data node
  EXPECT_EQ(c.FirstBackwardOwed(), std::nullopt);
  IterationTracker b(Plan(), "b");
  EXPECT_EQ(b.FirstBackwardOwed(), 1u);  // b visits microbatch 1 only
}

TEST(IterationTracker, LocalWorkIsDoneWhenEveryOwedBackwardRan) {
  IterationTracker a(Plan(), "a");
  EXPECT_FALSE(a.LocalWorkDone());
  a.ForwardRan(0);
  a.BackwardRan(0, 1);
  EXPECT_FALSE(a.LocalWorkDone());  // microbatch 2 still owed
  a.ForwardRan(2);
  a.BackwardRan(2, 1);
  EXPECT_TRUE(a.LocalWorkDone());
  EXPECT_EQ(a.visits(), 2);
  EXPECT_THAT(a.Completed(), IsEmpty());  // not a data node

  IterationTracker d1(Plan(), "d1");
  d1.ForwardRan(2);
  d1.LossRan(2, 1.5, 32);
  d1.BackwardRan(2, 0);
  EXPECT_TRUE(d1.LocalWorkDone());
  EXPECT_THAT(d1.Completed(), ElementsAre(2));
  EXPECT_DOUBLE_EQ(d1.completed_loss(), 1.5);
  EXPECT_EQ(d1.completed_tokens(), 32u);
}

TEST(IterationTracker, FreezeStopsWhatCrossesTheLostWorkerAndReportsWhatRan) {
  IterationTracker d0(Plan(), "d0");
  d0.ForwardRan(0);
  d0.ForwardRan(1);
  d0.LossRan(1, 2.0, 32);  // mb 1's backward started here
  const auto frozen = d0.Freeze({"c"}, 1);
  // Every route through c freezes, d1's microbatch 2 too: its tensors must
  // not be taken any more either.
  EXPECT_THAT(frozen.microbatches, ElementsAre(0, 1, 2));
  EXPECT_THAT(frozen.backward_ran, ElementsAre(1));
  EXPECT_EQ(d0.route(0), nullptr);
  EXPECT_EQ(d0.epoch(), 1u);
  // Frozen routes' tensors are stale; a newer route's are early.
  EXPECT_EQ(d0.Accept(Frame(0, v1::DIRECTION_FORWARD, 3)).verdict, Verdict::kStale);
  EXPECT_EQ(d0.Accept(Frame(0, v1::DIRECTION_FORWARD, 2, 1)).verdict, Verdict::kEarly);
  // Nothing is owed for frozen microbatches, but re-runs may still come.
  EXPECT_FALSE(d0.LocalWorkDone());
  ASSERT_TRUE(d0.Amend(1, {}).ok());
  EXPECT_TRUE(d0.LocalWorkDone());
  EXPECT_EQ(d0.live_microbatches(), 0);
}

TEST(IterationTracker, CompletedMicrobatchesAreNotFrozen) {
  IterationTracker d1(Plan(), "d1");
  d1.ForwardRan(2);
  d1.LossRan(2, 1.0, 32);
  d1.BackwardRan(2, 0);
  const auto frozen = d1.Freeze({"a"}, 1);
  EXPECT_THAT(frozen.microbatches, ElementsAre(0));  // d0's, through a
  EXPECT_THAT(frozen.completed, ElementsAre(2));
  EXPECT_THAT(d1.Completed(), ElementsAre(2));
}

TEST(IterationTracker, AmendedRoutesRunAgainUnderTheirEpoch) {
  IterationTracker b(Plan(), "b");
  b.Freeze({"a"}, 1);  // mb 0 and 2 freeze; b owed only mb 1
  ASSERT_TRUE(b.Amend(1, {MakeRoute(0, {"d0", "b", "c"}, 1)}).ok());
  EXPECT_NE(b.route(0), nullptr);
  EXPECT_EQ(b.Accept(Frame(0, v1::DIRECTION_FORWARD, 1, 0)).verdict, Verdict::kStale);
  EXPECT_EQ(b.Accept(Frame(0, v1::DIRECTION_FORWARD, 1, 1)).verdict, Verdict::kRun);
  EXPECT_FALSE(b.LocalWorkDone());
  b.ForwardRan(0);
  b.BackwardRan(0, 1);
  b.ForwardRan(1);
  b.BackwardRan(1, 1);
  EXPECT_TRUE(b.LocalWorkDone());
  EXPECT_EQ(b.live_microbatches(), 2);  // mb 2 stays dropped
}

TEST(IterationTracker, AmendmentsThatWouldCountTwiceAreRefused) {
  IterationTracker d0(Plan(), "d0");
  d0.ForwardRan(0);
  d0.LossRan(0, 1.0, 32);
  d0.Freeze({"c"}, 1);
  // Its loss (and the head's backward) ran here: running it again counts it
  // twice.
  EXPECT_EQ(d0.Amend(1, {MakeRoute(0, {"d0", "a"}, 1)}).code(),
            absl::StatusCode::kFailedPrecondition);
  // Not frozen, wrong epoch, through a lost worker.
  IterationTracker a(Plan(), "a");
  a.Freeze({"b"}, 2);
  EXPECT_EQ(a.Amend(2, {MakeRoute(0, {"d0", "a"}, 2)}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Amend(2, {MakeRoute(1, {"d0", "a"}, 1)}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Amend(2, {MakeRoute(1, {"d0", "b"}, 2)}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a.Amend(3, {}).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(IterationTracker, RepeatedFreezesReportCumulatively) {
  IterationTracker a(Plan(), "a");
  a.ForwardRan(0);
  a.BackwardRan(0, 1);
  auto first = a.Freeze({"c"}, 1);
  EXPECT_THAT(first.backward_ran, ElementsAre(0));
  ASSERT_TRUE(a.Amend(1, {}).ok());
  auto second = a.Freeze({"b"}, 2);
  EXPECT_THAT(second.microbatches, IsEmpty());  // already frozen
  EXPECT_THAT(second.backward_ran, ElementsAre(0));
}

}  // namespace
}  // namespace detour
