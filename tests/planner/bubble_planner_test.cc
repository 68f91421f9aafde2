// K-FAC bubble planner: hand-built cases (refresh interval, spill, serial,
// fixed interval, serial placement, sync, overlapping refreshes, errors) and a
// property test over random timelines and workloads (dependencies, the
// overlap rules 1 and 2 of docs/KFAC.md §Planner, intervals).
// (The property test: bubble_planner_property_test.cc.)
#include "coordinator/planner/bubble_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/kfac_workload.h"
#include "tests/planner/bubble_test_util.h"
#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

using Kind = v1::BubbleTask::Kind;
using BK = BusyInterval::Kind;

using testing::BubbleTaskName;
using testing::Cost;
using testing::Spec;

// One node, one microbatch: forward [0,1), backward [1,2), iteration end `end`.
struct OneNode {
  KfacWorkload workload;
  sim::Plan plan;
  IterationTimeline timeline;
};

OneNode MakeOneNode(const KfacLayerCost& cost, double end) {
  OneNode o;
  KfacNodeWork w;
  w.node_id = "n0";
  w.stage = 0;
  w.layers = {0};
  w.costs = {cost};
  o.workload.nodes = {w};
  o.plan.assignment.stage_nodes = {{0}};
  o.plan.routes.push_back({0, {0}, {0}});
  o.timeline.end_s = end;
  o.timeline.nodes.resize(1);
  o.timeline.nodes[0].busy = {{0, 1, BK::kForward, 0}, {1, 2, BK::kBackward, 0}};
  return o;
}

int Count(const IterationBubbles& it, Kind kind, bool serial) {
  int n = 0;
  for (const auto& t : it.tasks) n += t.kind() == kind && t.serial() == serial;
  return n;
}

TEST(BubblePlannerTest, EstimateFollowsFlopFormulas) {
  v1::ModelShape shape;
  shape.set_d_model(4);
  shape.set_num_heads(2);
  shape.set_num_kv_heads(1);  // k, v: 4 -> 2
  shape.set_ffn_dim(8);
  const KfacLayerCost c = EstimateKfacLayerCost(shape, 10, 2.0);
  // A: inputs of q/k/v (4), o (4), gate/up (4), down (8).
  EXPECT_DOUBLE_EQ(c.curvature_a_s, 2 * 10 * (16 + 16 + 16 + 64) / 2.0);
  // B: outputs q 4, k 2, v 2, o 4, gate 8, up 8, down 4.
  EXPECT_DOUBLE_EQ(c.curvature_b_s, 2 * 10 * (16 + 4 + 4 + 16 + 64 + 64 + 16) / 2.0);
  ASSERT_EQ(c.invert_a_s.size(), 7u);
  ASSERT_EQ(c.invert_b_s.size(), 7u);
  EXPECT_DOUBLE_EQ(c.invert_a_s[0], 64 / 2.0);
  EXPECT_DOUBLE_EQ(c.invert_a_s[6], 512 / 2.0);
  EXPECT_DOUBLE_EQ(c.invert_b_s[1], 8 / 2.0);
  EXPECT_DOUBLE_EQ(c.invert_b_s[4], 512 / 2.0);
  // 2(fo² fi + fo fi²) per projection.
  auto pre = [](double fi, double fo) { return 2 * (fo * fo * fi + fo * fi * fi); };
  EXPECT_DOUBLE_EQ(c.precondition_s,
                   (2 * pre(4, 4) + 2 * pre(4, 2) + 2 * pre(4, 8) + pre(8, 4)) / 2.0);
  EXPECT_EQ(c.sync_s, 0);
  EXPECT_EQ(KfacModules().size(), 7u);
  EXPECT_EQ(KfacModules()[4], "gate");
}

TEST(BubblePlannerTest, EverythingFitsRefreshesEveryIteration) {
  OneNode o = MakeOneNode(Cost(0.5, 0.5, 0.25, 0.1), 12);
  auto p = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(p.ok()) << p.status();
  for (uint64_t i = 0; i < 3; ++i) {
    auto it = p->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(it.ok()) << it.status();
    ASSERT_TRUE(it->activate_refresh.has_value());
    EXPECT_EQ(*it->activate_refresh, i);
    EXPECT_EQ(Count(*it, v1::BubbleTask::KIND_CURVATURE_A, false), 1);
    EXPECT_EQ(Count(*it, v1::BubbleTask::KIND_CURVATURE_B, false), 1);
    EXPECT_EQ(Count(*it, v1::BubbleTask::KIND_INVERT_A, false), 7);
    EXPECT_EQ(Count(*it, v1::BubbleTask::KIND_INVERT_B, false), 7);
    EXPECT_DOUBLE_EQ(it->serial_s[0], 0);
    EXPECT_DOUBLE_EQ(it->bubble_s[0], 1 + 14 * 0.25);
    EXPECT_DOUBLE_EQ(it->iteration_time_s, 12.1);  // + preconditioning
    EXPECT_DOUBLE_EQ(it->utilization_before, 2.0 / 12);
    EXPECT_DOUBLE_EQ(it->utilization_after, (2 + 4.5 + 0.1) / 12.1);
    // The only gap starts at 2, after the backward.
    EXPECT_EQ(it->tasks[0].kind(), v1::BubbleTask::KIND_CURVATURE_A);
    EXPECT_DOUBLE_EQ(it->tasks[0].planned_start_s(), 2);
    EXPECT_EQ(it->tasks[0].num_parts(), 1u);
  }
  EXPECT_EQ(p->completed_refreshes(), 3u);
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{1, 1, 1}));
  EXPECT_DOUBLE_EQ(p->mean_refresh_interval(), 1);
}

TEST(BubblePlannerTest, WorkNeedingThreeIterationsGivesIntervalThree) {
  // Gap [2, 12): A and B (1 s each) then 5 inversions of 1.5 s; then 5 or 6
  // per iteration. Refresh 1 collects its curvature (the only microbatch is
  // refresh 0's in iteration 0) at the start of iteration 1 — curvature
  // before inversions: a microbatch's data lives one iteration — and inverts
  // right after refresh 0's last inversion of the layer (rule 2'), in the
  // iteration refresh 0 is activated in.
  OneNode o = MakeOneNode(Cost(1, 1, 1.5), 12);
  auto p = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(p.ok());
  std::vector<std::map<uint64_t, std::vector<double>>> inversions;  // refresh -> starts
  std::vector<std::pair<int, double>> next_curvature;               // (kind, start) of refresh 1
  for (uint64_t i = 0; i < 3; ++i) {
    auto it = p->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(it.ok());
    inversions.emplace_back();
    EXPECT_EQ(it->activate_refresh.has_value(), i == 2) << i;
    EXPECT_DOUBLE_EQ(it->serial_s[0], 0);
    for (const auto& t : it->tasks) {
      EXPECT_EQ(t.num_parts(), 1u);  // no shape: items are never split
      if (t.kind() >= v1::BubbleTask::KIND_INVERT_A) {
        inversions.back()[t.refresh()].push_back(t.planned_start_s());
      } else if (t.refresh() == 1) {
        next_curvature.push_back({t.kind(), t.planned_start_s()});
      }
    }
  }
  using Starts = std::map<uint64_t, std::vector<double>>;
  EXPECT_EQ(inversions[0], (Starts{{0, {4, 5.5, 7, 8.5, 10}}}));
  EXPECT_EQ(inversions[1], (Starts{{0, {4, 5.5, 7, 8.5, 10}}}));
  EXPECT_EQ(inversions[2], (Starts{{0, {2, 3.5, 5, 6.5}}, {1, {8, 9.5}}}));
  EXPECT_EQ(next_curvature,
            (std::vector<std::pair<int, double>>{{v1::BubbleTask::KIND_CURVATURE_A, 2},
                                                 {v1::BubbleTask::KIND_CURVATURE_B, 3}}));
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{3}));
  // Refresh 1 goes on inverting; refresh 2 collects its curvature first.
  auto it = p->PlanIteration(3, o.plan, o.timeline);
  ASSERT_TRUE(it.ok());
  EXPECT_EQ(it->tasks[0].refresh(), 2u);
  EXPECT_EQ(it->tasks[0].kind(), v1::BubbleTask::KIND_CURVATURE_A);
  EXPECT_DOUBLE_EQ(it->tasks[0].planned_start_s(), 2);
  EXPECT_EQ(it->tasks[2].refresh(), 1u);
  EXPECT_EQ(it->tasks[2].kind(), v1::BubbleTask::KIND_INVERT_A);
  EXPECT_DOUBLE_EQ(it->tasks[2].planned_start_s(), 4);
  for (uint64_t i = 4; i < 8; ++i) ASSERT_TRUE(p->PlanIteration(i, o.plan, o.timeline).ok());
  // 23 s of work per refresh, 10 s of gap per iteration: refresh 1 has 12
  // inversions left after iteration 2 (3 iterations), refresh 2 only 9 as
  // refresh 1 ends early in iteration 5 (2 iterations).
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{3, 3, 2}));
}

TEST(BubblePlannerTest, TooLargeItemSpillsThenGoesSerial) {
  // Inversions of 20 s never fit the 10 s gap: they wait serial_after (2)
  // iterations, then run serially at step end.
  OneNode o = MakeOneNode(Cost(1, 1, 20), 12);
  auto p = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(p.ok());
  auto it0 = p->PlanIteration(0, o.plan, o.timeline);
  ASSERT_TRUE(it0.ok());
  EXPECT_EQ(Count(*it0, v1::BubbleTask::KIND_CURVATURE_A, false), 1);
  EXPECT_EQ(Count(*it0, v1::BubbleTask::KIND_INVERT_A, true), 0);
  EXPECT_FALSE(it0->activate_refresh.has_value());
  EXPECT_DOUBLE_EQ(it0->iteration_time_s, 12);
  auto it1 = p->PlanIteration(1, o.plan, o.timeline);
  ASSERT_TRUE(it1.ok());
  EXPECT_EQ(Count(*it1, v1::BubbleTask::KIND_INVERT_A, true), 7);
  EXPECT_EQ(Count(*it1, v1::BubbleTask::KIND_INVERT_B, true), 7);
  EXPECT_DOUBLE_EQ(it1->serial_s[0], 280);
  EXPECT_DOUBLE_EQ(it1->iteration_time_s, 292);
  ASSERT_TRUE(it1->activate_refresh.has_value());
  EXPECT_EQ(*it1->activate_refresh, 0u);
  // Serial tasks run back to back from the iteration's end.
  double t = 12;
  for (const auto& task : it1->tasks) {
    if (!task.serial()) continue;
    EXPECT_DOUBLE_EQ(task.planned_start_s(), t);
    t += task.planned_duration_s();
  }
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{2}));
}

TEST(BubblePlannerTest, SlackCanPushWorkOutOfAGap) {
  // 10 s gap, one 9.6 s A: fits without slack, not with 5%.
  OneNode o = MakeOneNode(Cost(0, 0, 0), 12);
  o.workload.nodes[0].costs[0].curvature_a_s = 9.6;
  auto tight = BubblePlanner::Create(o.workload, Spec(0.05));
  auto loose = BubblePlanner::Create(o.workload, Spec(0.0));
  ASSERT_TRUE(tight.ok() && loose.ok());
  auto a = tight->PlanIteration(0, o.plan, o.timeline);
  auto b = loose->PlanIteration(0, o.plan, o.timeline);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(Count(*a, v1::BubbleTask::KIND_CURVATURE_A, false), 0);
  EXPECT_EQ(Count(*b, v1::BubbleTask::KIND_CURVATURE_A, false), 1);
}

TEST(BubblePlannerTest, FixedIntervalForcesSerialRemainder) {
  OneNode o = MakeOneNode(Cost(1, 1, 1.5), 12);  // needs 3 iterations
  auto p = BubblePlanner::Create(o.workload, Spec(0, /*interval=*/2));
  ASSERT_TRUE(p.ok());
  auto it0 = p->PlanIteration(0, o.plan, o.timeline);
  auto it1 = p->PlanIteration(1, o.plan, o.timeline);
  ASSERT_TRUE(it0.ok() && it1.ok());
  EXPECT_FALSE(it0->activate_refresh.has_value());
  ASSERT_TRUE(it1->activate_refresh.has_value());
  // 5 + 6 in the bubbles, the other 3 serial.
  EXPECT_EQ(Count(*it1, v1::BubbleTask::KIND_INVERT_A, false) +
                Count(*it1, v1::BubbleTask::KIND_INVERT_B, false),
            6);
  EXPECT_EQ(Count(*it1, v1::BubbleTask::KIND_INVERT_A, true) +
                Count(*it1, v1::BubbleTask::KIND_INVERT_B, true),
            3);
  EXPECT_DOUBLE_EQ(it1->serial_s[0], 4.5);
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{2}));
}

TEST(BubblePlannerTest, FixedIntervalWaitsWhenWorkIsDoneEarly) {
  OneNode o = MakeOneNode(Cost(0.5, 0.5, 0.25), 12);  // fits in one
  auto p = BubblePlanner::Create(o.workload, Spec(0, /*interval=*/3));
  ASSERT_TRUE(p.ok());
  for (uint64_t i = 0; i < 6; ++i) {
    auto it = p->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(it.ok());
    EXPECT_EQ(it->activate_refresh.has_value(), i % 3 == 2) << i;
    // Refresh r+1 joins in the last iteration of refresh r's window (2, 5):
    // its curvature there, its inversions right after r's activation (3).
    EXPECT_EQ(it->tasks.empty(), i == 1 || i == 4) << i;
    for (const auto& t : it->tasks) {
      EXPECT_EQ(t.refresh(), (i + 1) / 3) << i;
      const bool curvature = t.kind() <= v1::BubbleTask::KIND_CURVATURE_B;
      if (i == 2 || i == 5) {
        EXPECT_TRUE(curvature) << i;
      }
      if (i == 3) {
        EXPECT_FALSE(curvature) << i;
      }
    }
  }
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{3, 3}));
}

TEST(BubblePlannerTest, SerialPlacementPutsEverythingAtStepEnd) {
  OneNode o = MakeOneNode(Cost(0.5, 0.5, 0.25), 12);
  v1::KfacSpec k = Spec();
  k.set_placement(v1::KFAC_PLACEMENT_SERIAL);
  auto p = BubblePlanner::Create(o.workload, k);
  ASSERT_TRUE(p.ok());
  for (uint64_t i = 0; i < 2; ++i) {
    auto it = p->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(it.ok());
    ASSERT_EQ(it->tasks.size(), 16u);
    for (const auto& t : it->tasks) {
      EXPECT_TRUE(t.serial());
      EXPECT_GE(t.planned_start_s(), 12);
    }
    EXPECT_EQ(it->tasks[0].kind(), v1::BubbleTask::KIND_CURVATURE_A);
    EXPECT_DOUBLE_EQ(it->serial_s[0], 4.5);
    EXPECT_DOUBLE_EQ(it->bubble_s[0], 0);
    ASSERT_TRUE(it->activate_refresh.has_value());
    EXPECT_EQ(*it->activate_refresh, i);
  }
  // With a fixed interval: the work of a refresh in its last iteration.
  k.set_refresh_interval(2);
  auto q = BubblePlanner::Create(o.workload, k);
  ASSERT_TRUE(q.ok());
  auto a = q->PlanIteration(0, o.plan, o.timeline);
  auto b = q->PlanIteration(1, o.plan, o.timeline);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(a->tasks.empty());
  EXPECT_EQ(b->tasks.size(), 16u);
  EXPECT_TRUE(b->activate_refresh.has_value());
}

TEST(BubblePlannerTest, CurvatureWaitsForItsMicrobatch) {
  // Two microbatches; gaps before F1 ends exist but only mb 0's A may go there.
  KfacWorkload w;
  w.nodes.push_back({"n0", 0, {3}, {Cost(1, 1, 0.1)}});
  sim::Plan plan;
  plan.routes = {{0, {0}, {0}}, {1, {0}, {0}}};
  IterationTimeline tl;
  tl.end_s = 30;
  tl.nodes.resize(1);
  tl.nodes[0].busy = {{0, 1, BK::kForward, 0},
                      {5, 6, BK::kForward, 1},
                      {10, 11, BK::kBackward, 0},
                      {20, 21, BK::kBackward, 1}};
  auto p = BubblePlanner::Create(w, Spec(0, 0, 2));
  ASSERT_TRUE(p.ok());
  auto it = p->PlanIteration(0, plan, tl);
  ASSERT_TRUE(it.ok());
  std::map<std::pair<int, int>, double> start;  // (kind, mb) -> start
  for (const auto& t : it->tasks) {
    if (t.kind() <= v1::BubbleTask::KIND_CURVATURE_B) {
      start[{t.kind(), static_cast<int>(t.microbatch())}] = t.planned_start_s();
    }
    EXPECT_EQ(t.layer(), 3u);
  }
  EXPECT_DOUBLE_EQ((start[{1, 0}]), 1);
  EXPECT_DOUBLE_EQ((start[{1, 1}]), 6);
  EXPECT_DOUBLE_EQ((start[{2, 0}]), 11);
  EXPECT_DOUBLE_EQ((start[{2, 1}]), 21);
  // Inversions only after the last curvature (B of mb 1 ends at 22).
  for (const auto& t : it->tasks) {
    if (t.kind() >= v1::BubbleTask::KIND_INVERT_A) {
      EXPECT_GE(t.planned_start_s(), 22);
    }
  }
  EXPECT_TRUE(it->activate_refresh.has_value());
}

TEST(BubblePlannerTest, LeadingBubbleTakesThePreviousRefreshsInversions) {
  // Leading bubble [0, 4), forward [4, 5), gap [5, 6), backward [6, 7), gap
  // [7, 12). A, B and each of the 14 inversions take 0.5 s (7 s in all).
  OneNode o = MakeOneNode(Cost(0.5, 0.5, 0.5), 12);
  o.timeline.nodes[0].busy = {{4, 5, BK::kForward, 0}, {6, 7, BK::kBackward, 0}};
  auto p = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(p.ok());
  // Iteration 0: nothing can use the leading bubble (refresh 0's curvature
  // needs this iteration's forward and backward); A at 5, B at 7, then 9 of
  // the 14 inversions up to 12.
  auto it0 = p->PlanIteration(0, o.plan, o.timeline);
  ASSERT_TRUE(it0.ok());
  EXPECT_FALSE(it0->activate_refresh.has_value());
  EXPECT_EQ(Count(*it0, v1::BubbleTask::KIND_INVERT_A, false) +
                Count(*it0, v1::BubbleTask::KIND_INVERT_B, false),
            9);
  for (const auto& t : it0->tasks) {
    EXPECT_EQ(t.refresh(), 0u);
    EXPECT_GE(t.planned_start_s(), 5);
  }
  // Iteration 1: refresh 0's last 5 inversions fill the leading bubble
  // [0, 2.5); refresh 1's curvature runs after the forward and the backward,
  // and its inversions follow (rule 2': refresh 0's inversions of the layer
  // are all placed) in [7.5, 12); refresh 0 is activated at this step.
  auto it1 = p->PlanIteration(1, o.plan, o.timeline);
  ASSERT_TRUE(it1.ok());
  ASSERT_TRUE(it1->activate_refresh.has_value());
  EXPECT_EQ(*it1->activate_refresh, 0u);
  ASSERT_EQ(it1->tasks.size(), 16u);
  for (int i = 0; i < 5; ++i) {
    const auto& t = it1->tasks[i];
    EXPECT_EQ(t.refresh(), 0u) << i;
    EXPECT_GE(t.kind(), v1::BubbleTask::KIND_INVERT_A) << i;
    EXPECT_DOUBLE_EQ(t.planned_start_s(), 0.5 * i) << i;
  }
  EXPECT_EQ(it1->tasks[5].refresh(), 1u);
  EXPECT_EQ(it1->tasks[5].kind(), v1::BubbleTask::KIND_CURVATURE_A);
  EXPECT_DOUBLE_EQ(it1->tasks[5].planned_start_s(), 5);
  EXPECT_EQ(it1->tasks[6].refresh(), 1u);
  EXPECT_EQ(it1->tasks[6].kind(), v1::BubbleTask::KIND_CURVATURE_B);
  EXPECT_DOUBLE_EQ(it1->tasks[6].planned_start_s(), 7);
  for (int i = 7; i < 16; ++i) {
    EXPECT_EQ(it1->tasks[i].refresh(), 1u) << i;
    EXPECT_GE(it1->tasks[i].kind(), v1::BubbleTask::KIND_INVERT_A) << i;
    EXPECT_DOUBLE_EQ(it1->tasks[i].planned_start_s(), 7.5 + 0.5 * (i - 7)) << i;
  }
  EXPECT_DOUBLE_EQ(it1->bubble_s[0], 8);
  // Iteration 2 on: the leading bubble takes the front's last 5 inversions,
  // the next refresh its curvature and 9 inversions from 7.5: a refresh
  // every iteration (the planner before rule 2' needed the same, with idle
  // time; before overlapping refreshes, every second).
  for (uint64_t i = 2; i < 5; ++i) {
    auto it = p->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(it.ok());
    ASSERT_TRUE(it->activate_refresh.has_value()) << i;
    EXPECT_EQ(*it->activate_refresh, i - 1);
    std::map<uint64_t, int> per_refresh;
    for (const auto& t : it->tasks) {
      ++per_refresh[t.refresh()];
      EXPECT_FALSE(t.serial());
      if (t.refresh() == i - 1) {
        EXPECT_LT(t.planned_start_s(), 2.5);
      }
      if (t.refresh() == i) {
        EXPECT_GE(t.planned_start_s(), 5);
      }
    }
    EXPECT_EQ(per_refresh, (std::map<uint64_t, int>{{i - 1, 5}, {i, 11}})) << i;
    EXPECT_DOUBLE_EQ(it->bubble_s[0], 8);
  }
  EXPECT_EQ(p->refresh_intervals(), (std::vector<int>{2, 1, 1, 1}));
}

TEST(BubblePlannerTest, SyncRunsOnAllReplicasAtOnceBeforeInversions) {
  KfacWorkload w;
  w.nodes.push_back({"a", 1, {0}, {Cost(1, 1, 0.5, 0, 0.25)}});
  w.nodes.push_back({"b", 1, {0}, {Cost(3, 1, 0.5, 0, 0.25)}});
  sim::Plan plan;
  plan.routes = {{0, {0}, {1}}, {1, {1}, {1}}};
  IterationTimeline tl;
  tl.end_s = 20;
  tl.nodes.resize(2);
  tl.nodes[0].busy = {{0, 1, BK::kForward, 0}, {2, 3, BK::kBackward, 0}};
  // b's only gap after its forward is too short for A (3 s) until 10.
  tl.nodes[1].busy = {{0, 1, BK::kForward, 1}, {2, 3, BK::kBackward, 1}, {5, 10, BK::kOther, -1}};
  v1::KfacSpec k = Spec();
  k.set_sync_factors(true);
  auto p = BubblePlanner::Create(w, k);
  ASSERT_TRUE(p.ok());
  auto it0 = p->PlanIteration(0, plan, tl);
  ASSERT_TRUE(it0.ok());
  std::vector<double> sync_start;
  for (const auto& t : it0->tasks) {
    EXPECT_NE(t.kind(), v1::BubbleTask::KIND_INVERT_A) << "inversion before the sync";
    if (t.kind() == v1::BubbleTask::KIND_SYNC_FACTORS) {
      EXPECT_TRUE(t.serial());
      sync_start.push_back(t.planned_start_s());
    }
  }
  ASSERT_EQ(sync_start.size(), 2u);
  EXPECT_DOUBLE_EQ(sync_start[0], 20);
  EXPECT_DOUBLE_EQ(sync_start[1], 20);
  EXPECT_FALSE(it0->activate_refresh.has_value());
  auto it1 = p->PlanIteration(1, plan, tl);
  ASSERT_TRUE(it1.ok());
  EXPECT_EQ(Count(*it1, v1::BubbleTask::KIND_INVERT_A, false), 14);
  EXPECT_EQ(Count(*it1, v1::BubbleTask::KIND_SYNC_FACTORS, true), 0);
  EXPECT_TRUE(it1->activate_refresh.has_value());
}

TEST(BubblePlannerTest, SyncIsPricedFromTheSharedWorkloadAndTheLinks) {
  // The runtime sends each replica's pending factors (4 A sums, 7 B sums, 2
  // counts, fp32) to every other replica alongside the gradients: the
  // factors add their bytes over the group's slowest link.
  sim::CostTables t = testing::UniformModel(4, 2).tables();
  t.bandwidth_bytes_per_s[2][1] = 2e6;  // the slowest link within {0, 1, 2}
  t.bandwidth_bytes_per_s[3][0] = 1e3;  // outside the group: irrelevant
  auto cost = sim::CostModel::FromTables(t);
  ASSERT_TRUE(cost.ok());
  v1::ModelShape shape;
  shape.set_d_model(64);
  shape.set_num_heads(4);
  shape.set_num_kv_heads(2);
  shape.set_ffn_dim(160);
  const kfac::BlockWorkload block(shape);
  // A: 64² ×3 (q/k/v, o, gate/up inputs) + 160² (down); B: 64², 32², 32², 64²,
  // 160², 160², 64²; two counts.
  const int64_t elems = 3 * 4096 + 25600 + 4096 + 1024 + 1024 + 4096 + 25600 + 25600 + 4096 + 2;
  EXPECT_EQ(block.FactorSyncElements(), elems);
  EXPECT_DOUBLE_EQ(StageSyncSeconds(*cost, {0, 1, 2}, block, kfac::ReplicaSync::kFactors),
                   4.0 * elems / 2e6);
  // Preconditioning replicas and lone stages send no factors.
  EXPECT_EQ(StageSyncSeconds(*cost, {0, 1, 2}, block, kfac::ReplicaSync::kPreconditioned), 0);
  EXPECT_EQ(StageSyncSeconds(*cost, {1}, block, kfac::ReplicaSync::kFactors), 0);
  // What the estimate leaves to the links.
  EXPECT_EQ(EstimateKfacLayerCost(block, 10, 1e9).sync_s, 0);
}

TEST(BubblePlannerTest, SyncTimeIsOnTheCriticalPathOnlyWhenFactorsAreSynced) {
  // Two replicas of one stage; 2 s of factor sync per layer when synced.
  KfacWorkload w;
  w.nodes.push_back({"a", 1, {0}, {Cost(1, 1, 0.5, 0.1, 2.0)}});
  w.nodes.push_back({"b", 1, {0}, {Cost(1, 1, 0.5, 0.1, 2.0)}});
  sim::Plan plan;
  plan.routes = {{0, {0}, {1}}, {1, {1}, {1}}};
  IterationTimeline tl;
  tl.end_s = 20;
  tl.nodes.resize(2);
  for (int n = 0; n < 2; ++n) {
    tl.nodes[n].busy = {{0, 1, BK::kForward, n}, {2, 3, BK::kBackward, n}};
  }
  for (bool factors : {true, false}) {
    SCOPED_TRACE(factors ? "factors" : "preconditioned");
    v1::KfacSpec k = Spec();
    k.set_sync_factors(factors);
    k.set_replica_sync(factors ? v1::KFAC_REPLICA_SYNC_FACTORS
                               : v1::KFAC_REPLICA_SYNC_PRECONDITIONED);
    auto p = BubblePlanner::Create(w, k);
    ASSERT_TRUE(p.ok());
    auto it0 = p->PlanIteration(0, plan, tl);
    ASSERT_TRUE(it0.ok());
    const int syncs = Count(*it0, v1::BubbleTask::KIND_SYNC_FACTORS, true);
    if (factors) {
      EXPECT_EQ(syncs, 2);
      // 20 s pipeline + 2 s sync + 0.1 s preconditioning.
      EXPECT_NEAR(it0->iteration_time_s, 22.1, 1e-9);
      EXPECT_FALSE(it0->activate_refresh.has_value());  // inversions wait for the sync
    } else {
      EXPECT_EQ(syncs, 0);
      // Everything fits the gaps: only the preconditioning is added, and the
      // refresh completes in its first iteration.
      EXPECT_NEAR(it0->iteration_time_s, 20.1, 1e-9);
      EXPECT_TRUE(it0->activate_refresh.has_value());
    }
  }
}

TEST(BubblePlannerTest, Errors) {
  OneNode o = MakeOneNode(Cost(1, 1, 1), 12);
  KfacWorkload bad = o.workload;
  bad.nodes[0].layers = {0, 1};
  auto p = BubblePlanner::Create(bad, Spec());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("n0"), std::string::npos) << p.status();
  bad = o.workload;
  bad.nodes[0].costs[0].invert_b_s.pop_back();
  EXPECT_EQ(BubblePlanner::Create(bad, Spec()).status().code(), absl::StatusCode::kInvalidArgument);
  bad = o.workload;
  bad.nodes[0].costs[0].curvature_a_s = -1;
  EXPECT_EQ(BubblePlanner::Create(bad, Spec()).status().code(), absl::StatusCode::kInvalidArgument);

  auto q = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(q.ok());
  IterationTimeline two = o.timeline;
  two.nodes.resize(2);
  auto r = q->PlanIteration(0, o.plan, two);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("2 nodes"), std::string::npos) << r.status();
  ASSERT_TRUE(q->PlanIteration(4, o.plan, o.timeline).ok());
  EXPECT_EQ(q->PlanIteration(4, o.plan, o.timeline).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(BubblePlannerTest, UpdateCostsRetimesLaterWork) {
  // Everything fits at first; after the costs grow tenfold the inversions no
  // longer fit the one 10 s gap, so a refresh takes longer.
  OneNode o = MakeOneNode(Cost(0.5, 0.5, 0.25), 12);
  auto p = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(p.ok()) << p.status();
  auto first = p->PlanIteration(0, o.plan, o.timeline);
  ASSERT_TRUE(first.ok());
  EXPECT_DOUBLE_EQ(first->bubble_s[0], 1 + 14 * 0.25);

  KfacWorkload slower = o.workload;
  slower.nodes[0].costs = {Cost(0.5, 0.5, 2.5)};
  ASSERT_TRUE(p->UpdateCosts(slower).ok());
  auto second = p->PlanIteration(1, o.plan, o.timeline);
  ASSERT_TRUE(second.ok());
  for (const v1::BubbleTask& t : second->tasks) {
    if (t.kind() == v1::BubbleTask::KIND_INVERT_A || t.kind() == v1::BubbleTask::KIND_INVERT_B) {
      EXPECT_DOUBLE_EQ(t.planned_duration_s(), 2.5);
    }
  }

  // Nodes, stages and layers cannot change; a refused update changes nothing.
  KfacWorkload moved = slower;
  moved.nodes[0].layers = {3};
  EXPECT_EQ(p->UpdateCosts(moved).code(), absl::StatusCode::kInvalidArgument);
  KfacWorkload negative = slower;
  negative.nodes[0].costs[0].curvature_b_s = -1;
  EXPECT_EQ(p->UpdateCosts(negative).code(), absl::StatusCode::kInvalidArgument);
  KfacWorkload renamed = slower;
  renamed.nodes[0].node_id = "other";
  EXPECT_EQ(p->UpdateCosts(renamed).code(), absl::StatusCode::kInvalidArgument);
}

// What a task does, without its refresh number (a label that differs
// between a planner that ran on and a new one).
std::vector<std::tuple<int, std::string, uint32_t, std::string, uint32_t, double, bool>> Work(
    const IterationBubbles& it) {
  std::vector<std::tuple<int, std::string, uint32_t, std::string, uint32_t, double, bool>> out;
  for (const v1::BubbleTask& t : it.tasks) {
    out.emplace_back(t.kind(), t.node(), t.layer(), t.module(), t.microbatch(), t.planned_start_s(),
                     t.serial());
  }
  return out;
}

TEST(BubblePlannerTest, CloseWindowLeavesTheStateOfANewPlanner) {
  // A refresh needs three iterations (WorkNeedingThreeIterationsGivesIntervalThree)
  // and the next one collects curvature meanwhile. Iteration 1 ends with a
  // checkpoint: refresh 0 finishes there (serially) and is activated, refresh
  // 1 is abandoned; from iteration 2 the planner plans exactly what a new
  // planner starting at iteration 2 plans (what a resumed job does).
  OneNode o = MakeOneNode(Cost(1, 1, 1.5), 12);
  auto ran = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(ran.ok());
  ASSERT_TRUE(ran->PlanIteration(0, o.plan, o.timeline).ok());
  EXPECT_FALSE(ran->last_activated_refresh().has_value());
  auto closing = ran->PlanIteration(1, o.plan, o.timeline, /*close_window=*/true);
  ASSERT_TRUE(closing.ok());
  ASSERT_TRUE(closing->activate_refresh.has_value());
  EXPECT_EQ(*closing->activate_refresh, 0u);
  EXPECT_GT(Count(*closing, v1::BubbleTask::KIND_INVERT_A, true) +
                Count(*closing, v1::BubbleTask::KIND_INVERT_B, true),
            0);
  for (const v1::BubbleTask& t : closing->tasks) {
    EXPECT_EQ(t.refresh(), 0u) << "a younger refresh placed work in a closing iteration";
  }
  EXPECT_EQ(ran->refresh_intervals(), (std::vector<int>{2}));
  EXPECT_EQ(ran->last_activated_refresh(), std::optional<uint64_t>(0));

  auto fresh = BubblePlanner::Create(o.workload, Spec());
  ASSERT_TRUE(fresh.ok());
  for (uint64_t i = 2; i < 9; ++i) {
    auto a = ran->PlanIteration(i, o.plan, o.timeline);
    auto b = fresh->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(Work(*a), Work(*b)) << "iteration " << i;
    // The abandoned refresh's number goes to the next one (the workers'
    // state holds what it finalised as the next refresh's): the straight
    // run's refreshes are the resumed one's shifted by the last activation.
    ASSERT_EQ(a->tasks.size(), b->tasks.size());
    for (size_t k = 0; k < a->tasks.size(); ++k) {
      EXPECT_EQ(a->tasks[k].refresh(), b->tasks[k].refresh() + 1) << i;
    }
    EXPECT_EQ(a->activate_refresh.has_value(), b->activate_refresh.has_value()) << i;
  }
  // The same with a fixed interval, closing off its cadence.
  auto fixed = BubblePlanner::Create(o.workload, Spec(0, 4));
  ASSERT_TRUE(fixed.ok());
  for (uint64_t i = 0; i < 6; ++i) {
    auto it = fixed->PlanIteration(i, o.plan, o.timeline, /*close_window=*/i == 5);
    ASSERT_TRUE(it.ok());
    EXPECT_EQ(it->activate_refresh.has_value(), i == 3 || i == 5) << i;
  }
  auto fixed_fresh = BubblePlanner::Create(o.workload, Spec(0, 4));
  ASSERT_TRUE(fixed_fresh.ok());
  for (uint64_t i = 6; i < 14; ++i) {
    auto a = fixed->PlanIteration(i, o.plan, o.timeline);
    auto b = fixed_fresh->PlanIteration(i, o.plan, o.timeline);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(Work(*a), Work(*b)) << "iteration " << i;
    EXPECT_EQ(a->activate_refresh.has_value(), b->activate_refresh.has_value()) << i;
  }
}

TEST(BubblePlannerTest, SetWorkloadFollowsMembership) {
  // n0 holds stage 1 (layer 0), n1 stage 2 (layer 1). Every microbatch
  // visits both.
  KfacWorkload w;
  w.nodes.push_back({"n0", 1, {0}, {Cost(0.5, 0.5, 0.25)}});
  w.nodes.push_back({"n1", 2, {1}, {Cost(0.5, 0.5, 0.25)}});
  sim::Plan plan;
  plan.routes = {{0, {0, 1}, {1, 2}}};
  auto timeline = [](int nodes) {
    IterationTimeline tl;
    tl.end_s = 12;
    tl.nodes.resize(nodes);
    // Busy with microbatches 0 and 1 (only those routed through a node count).
    for (auto& n : tl.nodes) {
      n.busy = {{0, 1, BK::kForward, 0},
                {1, 2, BK::kForward, 1},
                {2, 3, BK::kBackward, 0},
                {3, 4, BK::kBackward, 1}};
    }
    return tl;
  };
  auto p = BubblePlanner::Create(w, Spec(0, 0, 1));
  ASSERT_TRUE(p.ok());
  auto first = p->PlanIteration(0, plan, timeline(2));
  ASSERT_TRUE(first.ok());
  uint64_t newest = 0;
  for (const auto& t : first->tasks) newest = std::max(newest, t.refresh());
  // A third worker joins stage 2: a timeline of three nodes is refused
  // until the workload says so.
  sim::Plan joined = plan;
  joined.routes.push_back({1, {0, 2}, {1, 2}});
  EXPECT_EQ(p->PlanIteration(1, joined, timeline(3)).status().code(),
            absl::StatusCode::kInvalidArgument);
  KfacWorkload bigger = w;
  bigger.nodes.push_back({"n2", 2, {1}, {Cost(0.5, 0.5, 0.25)}});
  ASSERT_TRUE(p->SetWorkload(bigger).ok());
  auto second = p->PlanIteration(2, joined, timeline(3));
  ASSERT_TRUE(second.ok()) << second.status();
  std::set<std::string> nodes;
  for (const auto& t : second->tasks) {
    nodes.insert(t.node());
    EXPECT_GT(t.refresh(), newest) << "refresh numbers go on after a membership change";
  }
  // The abandoned numbers are skipped: the refresh activated last is not
  // completed_refreshes() - 1.
  ASSERT_TRUE(second->activate_refresh.has_value());
  EXPECT_EQ(p->last_activated_refresh(), second->activate_refresh);
  EXPECT_GT(*p->last_activated_refresh() + 1, p->completed_refreshes());
  EXPECT_EQ(nodes, (std::set<std::string>{"n0", "n1", "n2"}));
  EXPECT_TRUE(second->activate_refresh.has_value());
  // n1 is lost (no layers): it gets no work, and refreshes still complete.
  KfacWorkload lost = bigger;
  lost.nodes[1].stage = -1;
  lost.nodes[1].layers.clear();
  lost.nodes[1].costs.clear();
  ASSERT_TRUE(p->SetWorkload(lost).ok());
  sim::Plan without = plan;
  without.routes = {{0, {0, 2}, {1, 2}}};
  for (uint64_t i = 3; i < 5; ++i) {
    auto it = p->PlanIteration(i, without, timeline(3));
    ASSERT_TRUE(it.ok());
    for (const auto& t : it->tasks) EXPECT_NE(t.node(), "n1");
    EXPECT_TRUE(it->activate_refresh.has_value()) << i;
  }
  // A bad workload is refused and changes nothing.
  KfacWorkload bad = lost;
  bad.nodes[0].costs[0].invert_a_s.pop_back();
  EXPECT_EQ(p->SetWorkload(bad).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(p->PlanIteration(5, without, timeline(3)).ok());
}

TEST(BubblePlannerTest, TimelineFromSimulation) {
  sim::SimResult r;
  r.iteration_time_s = 9;
  r.compute.resize(2);
  r.compute[0] = {{0, 1, sim::ActivityKind::kForward, 0, 0, -1},
                  {1, 2, sim::ActivityKind::kLoss, 0, 0, -1},
                  {2, 3, sim::ActivityKind::kBackward, 0, 0, -1},
                  {4, 8, sim::ActivityKind::kAllReduce, -1, 0, -1}};
  const IterationTimeline t = TimelineFromSimulation(r);
  EXPECT_EQ(t.end_s, 9);
  ASSERT_EQ(t.nodes.size(), 2u);
  ASSERT_EQ(t.nodes[0].busy.size(), 4u);
  EXPECT_EQ(t.nodes[0].busy[1].kind, BK::kLoss);
  EXPECT_EQ(t.nodes[0].busy[2].kind, BK::kBackward);
  EXPECT_EQ(t.nodes[0].busy[2].microbatch, 0);
  EXPECT_EQ(t.nodes[0].busy[3].kind, BK::kOther);
  EXPECT_TRUE(t.nodes[1].busy.empty());
}

TEST(BubblePlannerTest, TimelineFromReports) {
  std::vector<v1::TimingReport> reports(3);
  reports[0].set_node("b");
  reports[0].set_iteration_time_s(5);
  auto add = [](v1::TimingReport& r, v1::TaskTiming::Kind k, int mb, double s, double d) {
    v1::TaskTiming* t = r.add_tasks();
    t->set_kind(k);
    t->set_microbatch(mb);
    t->set_start_s(s);
    t->set_duration_s(d);
  };
  add(reports[0], v1::TaskTiming::KIND_BACKWARD, 2, 3, 1);
  add(reports[0], v1::TaskTiming::KIND_FORWARD, 2, 0, 1);
  add(reports[0], v1::TaskTiming::KIND_BUBBLE, 0, 1, 1);
  add(reports[0], v1::TaskTiming::KIND_OPTIMIZER, 0, 4.5, 0.5);
  reports[1].set_node("zzz");
  reports[1].set_iteration_time_s(100);
  reports[2].set_node("a");
  reports[2].set_iteration_time_s(7);
  add(reports[2], v1::TaskTiming::KIND_LOSS, 1, 1, 1);
  const IterationTimeline t = TimelineFromReports(reports, {"a", "b", "c"});
  EXPECT_EQ(t.end_s, 7);
  ASSERT_EQ(t.nodes.size(), 3u);
  ASSERT_EQ(t.nodes[1].busy.size(), 3u);
  EXPECT_EQ(t.nodes[1].busy[0].kind, BK::kForward);
  EXPECT_EQ(t.nodes[1].busy[0].microbatch, 2);
  EXPECT_EQ(t.nodes[1].busy[1].kind, BK::kBackward);
  EXPECT_EQ(t.nodes[1].busy[2].kind, BK::kOther);
  ASSERT_EQ(t.nodes[0].busy.size(), 1u);
  EXPECT_EQ(t.nodes[0].busy[0].kind, BK::kLoss);
  EXPECT_TRUE(t.nodes[2].busy.empty());
}

}  // namespace
}  // namespace detour::planner
