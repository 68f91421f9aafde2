// K-FAC bubble planner: hand-built cases (refresh interval, spill, serial,
// fixed interval, serial placement, sync, overlapping refreshes, errors) and a
// property test over random timelines and workloads (dependencies, the
// overlap rules 1 and 2 of docs/KFAC.md §Planner, intervals).
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
#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

using Kind = v1::BubbleTask::Kind;
using BK = BusyInterval::Kind;

KfacLayerCost Cost(double a, double b, double inv, double precondition = 0, double sync = 0) {
  KfacLayerCost c;
  c.curvature_a_s = a;
  c.curvature_b_s = b;
  c.invert_a_s.assign(7, inv);
  c.invert_b_s.assign(7, inv);
  c.precondition_s = precondition;
  c.sync_s = sync;
  return c;
}

v1::KfacSpec Spec(double slack = 0, uint32_t interval = 0, uint32_t curvature_mbs = 1) {
  v1::KfacSpec k;
  k.set_slack(slack);
  k.set_refresh_interval(interval);
  k.set_curvature_microbatches(curvature_mbs);
  k.set_placement(v1::KFAC_PLACEMENT_BUBBLES);
  return k;
}

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

std::string BubbleTaskName(const v1::BubbleTask& t) {
  return absl::StrCat(v1::BubbleTask::Kind_Name(t.kind()), " layer ", t.layer(), " ", t.module(),
                      " mb ", t.microbatch(), " part ", t.part(), "/", t.num_parts(), " refresh ",
                      t.refresh());
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

// ---------------------------------------------------------------------------
// Property test.

struct RandomCase {
  KfacWorkload workload;
  v1::KfacSpec kfac;
  sim::Plan plan;
  std::vector<IterationTimeline> timelines;  // one per iteration
};

RandomCase MakeRandom(uint64_t seed, int iterations) {
  std::mt19937_64 rng(seed);
  auto uni = [&](double lo, double hi) { return std::uniform_real_distribution<>(lo, hi)(rng); };
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<>(lo, hi)(rng); };
  RandomCase c;
  const int stages = pick(1, 3);
  const int replicas = pick(1, 3);
  const int num_mbs = pick(1, 5);
  int layer = 0;
  for (int s = 0; s < stages; ++s) {
    const int layers = pick(1, 3);
    std::vector<int> ids;
    for (int l = 0; l < layers; ++l) ids.push_back(layer++);
    std::vector<KfacLayerCost> costs;
    // Half the cases give the blocks a shape, so items split into parts
    // under the cap (wide factors: inversions of 6 or 8 units).
    kfac::BlockShape shape;
    if (pick(0, 1)) {
      shape.d_model = pick(0, 1) ? 64 : 2048;
      shape.kv_dim = shape.d_model / (pick(0, 1) ? 1 : 2);
      shape.ffn_dim = pick(0, 1) ? 3 * shape.d_model : 1500;
    }
    for (int l = 0; l < layers; ++l) {
      KfacLayerCost k = Cost(uni(0, 2), uni(0, 2), 0, uni(0, 0.2), uni(0, 0.5));
      for (double& v : k.invert_a_s) v = pick(0, 9) == 0 ? uni(5, 30) : uni(0, 2);
      for (double& v : k.invert_b_s) v = uni(0, 2);
      k.shape = shape;
      costs.push_back(k);
    }
    for (int r = 0; r < replicas; ++r) {
      c.workload.nodes.push_back({absl::StrCat("s", s, "r", r), s, ids, costs});
    }
  }
  if (pick(0, 3) == 0) c.workload.nodes.push_back({"idle", -1, {}, {}});
  const int n = static_cast<int>(c.workload.nodes.size());
  c.kfac = Spec(pick(0, 1) ? 0.05 : uni(0, 0.3), pick(0, 3) == 0 ? pick(1, 4) : 0, pick(1, 3));
  c.kfac.set_sync_factors(pick(0, 1) == 1);
  if (pick(0, 2) != 0) c.kfac.set_max_granule_ms(uni(100, 3000));
  if (pick(0, 7) == 0) c.kfac.set_placement(v1::KFAC_PLACEMENT_SERIAL);
  // Routes: each microbatch visits a random subset of the block nodes.
  for (int mb = 0; mb < num_mbs; ++mb) {
    sim::Route r;
    r.microbatch = mb;
    for (int i = 0; i < n; ++i) {
      if (!c.workload.nodes[i].layers.empty() && pick(0, 3) != 0) {
        r.nodes.push_back(i);
        r.stages.push_back(c.workload.nodes[i].stage);
      }
    }
    c.plan.routes.push_back(r);
  }
  for (int it = 0; it < iterations; ++it) {
    IterationTimeline tl;
    tl.nodes.resize(n);
    double end = 0;
    for (int i = 0; i < n; ++i) {
      // Forwards in microbatch order, each backward somewhere after its forward.
      std::vector<std::pair<BK, int>> ops;
      for (const auto& r : c.plan.routes) {
        if (std::find(r.nodes.begin(), r.nodes.end(), i) == r.nodes.end()) continue;
        ops.push_back({BK::kForward, r.microbatch});
      }
      std::vector<std::pair<BK, int>> order = ops;
      for (const auto& f : ops) {
        size_t after = 0;
        while (order[after] != f) ++after;
        const size_t pos = std::uniform_int_distribution<size_t>(after + 1, order.size())(rng);
        order.insert(order.begin() + pos, {BK::kBackward, f.second});
      }
      double t = uni(0, 3);
      for (const auto& [kind, mb] : order) {
        const double d = uni(0.1, 2);
        tl.nodes[i].busy.push_back({t, t + d, kind, mb});
        t += d + (pick(0, 2) == 0 ? 0 : uni(0, 4));
      }
      if (pick(0, 1)) {
        const double d = uni(0.1, 2);
        tl.nodes[i].busy.push_back({t, t + d, BK::kOther, -1});
        t += d;
      }
      end = std::max(end, t);
    }
    tl.end_s = end + uni(0, 2);
    c.timelines.push_back(tl);
  }
  return c;
}

TEST(BubblePlannerTest, PropertiesOverRandomTimelines) {
  constexpr int kIterations = 12;
  int activations_total = 0, serial_total = 0, bubble_total = 0, overlapping_total = 0,
      split_total = 0;
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    RandomCase c = MakeRandom(seed, kIterations);
    auto planner = BubblePlanner::Create(c.workload, c.kfac);
    ASSERT_TRUE(planner.ok()) << planner.status();
    const int n = static_cast<int>(c.workload.nodes.size());
    const double slack = 1 + c.kfac.slack();
    std::map<std::string, int> index;
    for (int i = 0; i < n; ++i) index[c.workload.nodes[i].node_id] = i;

    // (iteration, time) of every task end, per refresh / node / layer.
    using When = std::pair<uint64_t, double>;
    // a no later than b, up to rounding of sums of durations.
    auto before = [](const When& a, const When& b) {
      return a.first < b.first || (a.first == b.first && a.second <= b.second + 1e-9);
    };
    struct Track {
      When last_curvature{0, -1};
      When first_inversion{1u << 30, 0};
      double first_inversion_end = 0;  // in first_inversion's iteration
      When sync{0, -1};
      When first_sync{1u << 30, 0};
      When last_inversion{0, -1};
      int inversions = 0, curv_a = 0, curv_b = 0, syncs = 0;  // whole items
    };
    // Every part placed, per item (refresh, node, layer, kind, module, mb).
    struct Part {
      uint32_t part, num_parts;
      uint64_t iteration;
      double start, end;
    };
    std::map<std::tuple<uint64_t, int, uint32_t, int, std::string, uint32_t>, std::vector<Part>>
        parts;
    std::map<std::tuple<uint64_t, int, uint32_t>, Track> track;
    std::map<uint64_t, uint64_t> activated;  // refresh -> iteration
    std::map<uint64_t, uint64_t> last_task_iteration;
    uint64_t expected_refresh = 0;
    int overlapping = 0;  // iterations with tasks of two refreshes
    for (uint64_t it = 0; it < kIterations; ++it) {
      const IterationTimeline& tl = c.timelines[it];
      auto out = planner->PlanIteration(it, c.plan, tl);
      ASSERT_TRUE(out.ok()) << out.status();
      std::vector<std::vector<std::pair<double, double>>> used(n);
      for (const v1::BubbleTask& t : out->tasks) {
        ASSERT_TRUE(index.count(t.node())) << t.node();
        const int node = index[t.node()];
        const double s = t.planned_start_s(), d = t.planned_duration_s();
        EXPECT_GE(d, 0);
        ASSERT_GE(t.num_parts(), 1u);
        ASSERT_LT(t.part(), t.num_parts());
        split_total += t.num_parts() > 1;
        if (t.num_parts() > 1) {
          ASSERT_GT(c.kfac.max_granule_ms(), 0) << "split without a cap";
        }
        // Under the cap, unless the item is split as finely as it can be.
        const KfacLayerCost& lc =
            c.workload.nodes[node]
                .costs[std::find(c.workload.nodes[node].layers.begin(),
                                 c.workload.nodes[node].layers.end(), static_cast<int>(t.layer())) -
                       c.workload.nodes[node].layers.begin()];
        if (!t.serial() && c.kfac.max_granule_ms() > 0 && lc.shape.d_model > 0 &&
            t.kind() != v1::BubbleTask::KIND_SYNC_FACTORS) {
          const kfac::BlockWorkload block(lc.shape);
          const int m = kfac::ModuleIndex(t.module());
          const size_t units =
              t.kind() == v1::BubbleTask::KIND_CURVATURE_A ? 4
              : t.kind() == v1::BubbleTask::KIND_CURVATURE_B
                  ? 7
                  : kfac::InversionUnitWeights(
                        t.kind() == v1::BubbleTask::KIND_INVERT_A ? block.f_in(m) : block.f_out(m))
                        .size();
          if (t.num_parts() < units) {
            EXPECT_LE(d, c.kfac.max_granule_ms() * 1e-3 * (1 + 1e-9))
                << BubbleTaskName(t) << " exceeds the cap";
          }
        }
        parts[{t.refresh(), node, t.layer(), static_cast<int>(t.kind()), t.module(),
               t.microbatch()}]
            .push_back({t.part(), t.num_parts(), it, s, s + d});
        // At most two refreshes in flight: the oldest not activated, and the
        // next one (not with serial placement).
        EXPECT_GE(t.refresh(), expected_refresh);
        EXPECT_LE(t.refresh(),
                  expected_refresh + (c.kfac.placement() == v1::KFAC_PLACEMENT_SERIAL ? 0 : 1));
        // Rule 2 (fixed interval): inversions of q only after q-1's
        // activation iteration. Rule 2' (adaptive): after q-1's inversions
        // of the layer on the node (checked at the end).
        if (t.refresh() > 0 && t.kind() >= v1::BubbleTask::KIND_INVERT_A &&
            c.kfac.refresh_interval() > 0) {
          ASSERT_TRUE(activated.count(t.refresh() - 1))
              << "inversion of refresh " << t.refresh() << " before " << t.refresh() - 1
              << " was activated";
          EXPECT_LT(activated.at(t.refresh() - 1), it);
        }
        last_task_iteration[t.refresh()] = it;
        if (t.serial()) {
          ++serial_total;
          EXPECT_GE(s, tl.end_s - 1e-9);
        } else {
          ++bubble_total;
          EXPECT_NE(c.kfac.placement(), v1::KFAC_PLACEMENT_SERIAL);
          EXPECT_GE(s, -1e-9);
          EXPECT_LE(s + d * slack, tl.end_s + 1e-9);
          for (const BusyInterval& b : tl.nodes[node].busy) {
            EXPECT_TRUE(s + d * slack <= b.start_s + 1e-9 || s >= b.end_s - 1e-9)
                << "task at " << s << " overlaps busy " << b.start_s << "-" << b.end_s;
          }
          used[node].push_back({s, s + d * slack});
        }
        // Dependencies on the node's own pipeline work.
        if (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
            t.kind() == v1::BubbleTask::KIND_CURVATURE_B) {
          const BK want =
              t.kind() == v1::BubbleTask::KIND_CURVATURE_A ? BK::kForward : BK::kBackward;
          double after = -1;
          for (const BusyInterval& b : tl.nodes[node].busy) {
            if (b.kind == want && b.microbatch == static_cast<int>(t.microbatch())) {
              after = b.end_s;
            }
          }
          ASSERT_GE(after, 0) << "curvature of a microbatch that did not run on the node";
          EXPECT_GE(s, after - 1e-9);
        }
        Track& tr = track[{t.refresh(), node, t.layer()}];
        const When end{it, s + d};
        const When start{it, s};
        switch (t.kind()) {
          case v1::BubbleTask::KIND_CURVATURE_A:
          case v1::BubbleTask::KIND_CURVATURE_B:
            tr.last_curvature = std::max(tr.last_curvature, end);
            if (t.part() + 1 == t.num_parts()) {
              (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ? tr.curv_a : tr.curv_b)++;
            }
            break;
          case v1::BubbleTask::KIND_SYNC_FACTORS:
            EXPECT_TRUE(t.serial());
            tr.sync = std::max(tr.sync, end);
            tr.first_sync = std::min(tr.first_sync, start);
            ++tr.syncs;
            break;
          case v1::BubbleTask::KIND_INVERT_A:
          case v1::BubbleTask::KIND_INVERT_B:
            if (start < tr.first_inversion) {
              tr.first_inversion = start;
              tr.first_inversion_end = s + d;
            }
            tr.last_inversion = std::max(tr.last_inversion, end);
            if (t.part() + 1 == t.num_parts()) ++tr.inversions;
            break;
          default: ADD_FAILURE() << "unexpected kind " << t.kind();
        }
      }
      // Rule 1, per task: curvature of q on (node, layer) only after q-1's
      // first inversion there (same iteration: from its end). The sync of q
      // only once that holds on every replica of the stage, and (the worker
      // holds inversions of a syncing layer until the all-reduce) not in an
      // iteration with bubble inversions of q-1 for the layer.
      std::set<uint64_t> refreshes;
      for (const v1::BubbleTask& t : out->tasks) {
        refreshes.insert(t.refresh());
        if (t.refresh() == 0) continue;
        const int node = index[t.node()];
        auto first_inversion_done = [&](int m, double at) {
          auto prev = track.find({t.refresh() - 1, m, t.layer()});
          // Any inversion task (a first part) of the previous refresh.
          if (prev == track.end() || prev->second.first_inversion.first == (1u << 30)) {
            return false;
          }
          const Track& p = prev->second;
          return p.first_inversion.first < it ||
                 (p.first_inversion.first == it && p.first_inversion_end <= at + 1e-9);
        };
        if (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
            t.kind() == v1::BubbleTask::KIND_CURVATURE_B) {
          EXPECT_TRUE(first_inversion_done(node, t.planned_start_s()))
              << "curvature of refresh " << t.refresh() << " layer " << t.layer() << " on "
              << t.node() << " at " << it << "/" << t.planned_start_s()
              << " before the first inversion of refresh " << t.refresh() - 1;
        }
        if (t.kind() == v1::BubbleTask::KIND_SYNC_FACTORS) {
          for (int m = 0; m < n; ++m) {
            if (c.workload.nodes[m].stage != c.workload.nodes[node].stage) continue;
            EXPECT_TRUE(first_inversion_done(m, t.planned_start_s()))
                << "sync of refresh " << t.refresh() << " before rule 1 holds on replica " << m;
            for (const v1::BubbleTask& o : out->tasks) {
              EXPECT_FALSE(o.refresh() + 1 == t.refresh() && o.layer() == t.layer() &&
                           !o.serial() && o.kind() >= v1::BubbleTask::KIND_INVERT_A &&
                           index[o.node()] == m)
                  << "bubble inversion of the previous refresh while syncing layer " << t.layer();
            }
          }
        }
      }
      overlapping += refreshes.size() > 1;
      // No two bubble tasks of a node overlap.
      for (auto& u : used) {
        std::sort(u.begin(), u.end());
        for (size_t i = 1; i < u.size(); ++i) EXPECT_LE(u[i - 1].second, u[i].first + 1e-9);
      }
      if (out->activate_refresh) {
        EXPECT_EQ(*out->activate_refresh, expected_refresh);
        EXPECT_FALSE(activated.count(*out->activate_refresh)) << "activated twice";
        activated[*out->activate_refresh] = it;
        ++expected_refresh;
        ++activations_total;
      }
      EXPECT_GE(out->utilization_after, 0);
      EXPECT_LE(out->utilization_after, 1 + 1e-9);
      EXPECT_GE(out->iteration_time_s, tl.end_s);
    }
    // Every activated refresh: dependencies held, all items present.
    for (const auto& [key, tr] : track) {
      const auto& [refresh, node_binding, layer] = key;
      // A plain copy: lambdas below capture it (clang 14 cannot capture
      // structured bindings).
      const auto node = node_binding;
      if (!activated.count(refresh)) continue;
      const bool needs_sync =
          c.kfac.sync_factors() &&
          std::count_if(c.workload.nodes.begin(), c.workload.nodes.end(), [&](const auto& w) {
            return w.stage == c.workload.nodes[node].stage && !w.layers.empty();
          }) > 1;
      EXPECT_EQ(tr.inversions, 14) << "refresh " << refresh << " node " << node;
      EXPECT_LE(tr.curv_a, static_cast<int>(c.kfac.curvature_microbatches()));
      EXPECT_LE(tr.curv_b, static_cast<int>(c.kfac.curvature_microbatches()));
      EXPECT_EQ(tr.syncs, needs_sync ? 1 : 0);
      if (tr.curv_a + tr.curv_b > 0) {
        EXPECT_TRUE(before(tr.last_curvature, tr.first_inversion)) << "inversion before curvature";
      }
      if (needs_sync) {
        EXPECT_TRUE(before(tr.sync, tr.first_inversion)) << "inversion before sync";
        // Sync after every replica's curvature of the layer.
        for (const auto& [k2, t2] : track) {
          if (std::get<0>(k2) == refresh && std::get<2>(k2) == layer &&
              c.workload.nodes[std::get<1>(k2)].stage == c.workload.nodes[node].stage) {
            EXPECT_TRUE(before(t2.last_curvature, tr.first_sync));
          }
        }
      }
      EXPECT_LE(last_task_iteration[refresh], activated.at(refresh));
    }
    // An item's parts: each once, in order, each after the previous one;
    // a curvature microbatch's all in one iteration (its data lives there).
    for (const auto& [key, list] : parts) {
      const int kind = std::get<3>(key);
      for (size_t i = 0; i < list.size(); ++i) {
        const Part& p = list[i];
        EXPECT_EQ(p.num_parts, list[0].num_parts);
        // Items not finished by the end of the run may lack their last parts.
        EXPECT_EQ(p.part, i % p.num_parts) << "part order, kind " << kind;
        if (i > 0 && p.part > 0) {
          const Part& q = list[i - 1];
          EXPECT_TRUE(q.iteration < p.iteration ||
                      (q.iteration == p.iteration && q.end <= p.start + 1e-9))
              << "part " << p.part << " before part " << q.part;
          if (kind <= v1::BubbleTask::KIND_CURVATURE_B) {
            EXPECT_EQ(q.iteration, p.iteration);
          }
        }
      }
    }
    // Rule 2': the next refresh's inversions of a layer on a node after all
    // of the previous refresh's there.
    if (c.kfac.refresh_interval() == 0) {
      for (const auto& [key, list] : parts) {
        const auto& [refresh, node, layer, kind, module, mb] = key;
        if (refresh == 0 || kind < v1::BubbleTask::KIND_INVERT_A) continue;
        auto prev = track.find({refresh - 1, node, layer});
        if (prev == track.end()) continue;
        for (const Part& p : list) {
          EXPECT_TRUE(before(prev->second.last_inversion, When{p.iteration, p.start}))
              << "inversion of refresh " << refresh << " layer " << layer << " on node " << node
              << " (kind " << kind << " " << module << " part " << p.part << ") at iteration "
              << p.iteration << " time " << p.start << " before refresh " << refresh - 1
              << "'s last, iteration " << prev->second.last_inversion.first << " end "
              << prev->second.last_inversion.second;
        }
      }
    }
    overlapping_total += overlapping;
    // Intervals add up: refresh r spans (activation r-1, activation r].
    const std::vector<int>& intervals = planner->refresh_intervals();
    ASSERT_EQ(intervals.size(), activated.size());
    for (size_t r = 0; r < intervals.size(); ++r) {
      const uint64_t start = r == 0 ? 0 : activated[r - 1] + 1;
      EXPECT_EQ(static_cast<uint64_t>(intervals[r]), activated[r] - start + 1);
      if (c.kfac.refresh_interval() > 0) {
        EXPECT_EQ(intervals[r], static_cast<int>(c.kfac.refresh_interval()));
      }
    }
  }
  // The random cases exercise both paths, and overlapping refreshes.
  EXPECT_GT(activations_total, 300);
  EXPECT_GT(overlapping_total, 300);
  EXPECT_GT(serial_total, 0);
  EXPECT_GT(bubble_total, 0);
  EXPECT_GT(split_total, 1000);  // parts are exercised
}

}  // namespace
}  // namespace detour::planner
