// KFAC_REPLICA_SYNC_AUTO (coordinator/planner/replica_sync_choice.h): the
// choice follows the modelled factor all-reduce against the bubbles, and
// its numbers are those of the bubble planner run with each scheme.
#include "coordinator/planner/replica_sync_choice.h"

#include <gtest/gtest.h>

#include <string>

#include "coordinator/planner/bubble_planner.h"

namespace detour::planner {
namespace {

using BK = BusyInterval::Kind;

KfacLayerCost Cost(double sync_s) {
  KfacLayerCost c;
  c.curvature_a_s = 1;
  c.curvature_b_s = 1;
  c.invert_a_s.assign(7, 0.5);
  c.invert_b_s.assign(7, 0.5);
  c.precondition_s = 0.1;
  c.sync_s = sync_s;
  return c;
}

// Two replicas of one stage, one microbatch each: forward [0,1), backward
// [2,3), then a gap to the iteration's end at 20 s, which holds all of the
// curvature and inversions; `sync_s` per layer of factor all-reduce.
struct Replicas {
  KfacWorkload workload;
  sim::Plan plan;
  IterationTimeline timeline;
};

Replicas MakeReplicas(double sync_s) {
  Replicas r;
  r.workload.nodes.push_back({"a", 1, {0}, {Cost(sync_s)}});
  r.workload.nodes.push_back({"b", 1, {0}, {Cost(sync_s)}});
  r.plan.routes = {{0, {0}, {1}}, {1, {1}, {1}}};
  r.timeline.end_s = 20;
  r.timeline.nodes.resize(2);
  for (int n = 0; n < 2; ++n) {
    r.timeline.nodes[n].busy = {{0, 1, BK::kForward, n}, {2, 3, BK::kBackward, n}};
  }
  return r;
}

v1::KfacSpec Spec() {
  v1::KfacSpec k;
  k.set_slack(0);
  k.set_curvature_microbatches(1);
  k.set_placement(v1::KFAC_PLACEMENT_BUBBLES);
  k.set_replica_sync(v1::KFAC_REPLICA_SYNC_AUTO);
  return k;
}

// Mean iteration time of `iterations` planned iterations with one scheme.
double MeanIteration(const Replicas& r, bool factors, int iterations) {
  v1::KfacSpec k = Spec();
  k.set_replica_sync(factors ? v1::KFAC_REPLICA_SYNC_FACTORS
                             : v1::KFAC_REPLICA_SYNC_PRECONDITIONED);
  k.set_sync_factors(factors);
  KfacWorkload w = r.workload;
  if (!factors) {
    for (KfacNodeWork& n : w.nodes) n.costs[0].sync_s = 0;
  }
  auto p = BubblePlanner::Create(w, k);
  EXPECT_TRUE(p.ok()) << p.status();
  double sum = 0;
  for (int i = 0; i < iterations; ++i) {
    auto it = p->PlanIteration(i, r.plan, r.timeline);
    EXPECT_TRUE(it.ok()) << it.status();
    sum += it->iteration_time_s;
  }
  return sum / iterations;
}

TEST(ReplicaSyncChoiceTest, CheapFactorsAreSynced) {
  for (double sync_s : {0.0, 0.05}) {
    SCOPED_TRACE(sync_s);
    const Replicas r = MakeReplicas(sync_s);
    auto c = ChooseReplicaSync(r.workload, Spec(), r.plan, r.timeline);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->sync, kfac::ReplicaSync::kFactors);
    EXPECT_DOUBLE_EQ(c->pipeline_s, 20);
    EXPECT_GE(c->factors_s, c->preconditioned_s);
    EXPECT_LE(c->factors_s, c->preconditioned_s * (1 + kAutoFactorsTolerance));
    EXPECT_NE(c->reason.find("K-FAC replica sync FACTORS"), std::string::npos) << c->reason;
    EXPECT_NE(c->reason.find("within the 5%"), std::string::npos) << c->reason;
  }
}

TEST(ReplicaSyncChoiceTest, ExpensiveFactorsArePreconditionedInstead) {
  // 4 s of factor sync per refresh against a 20 s iteration.
  const Replicas r = MakeReplicas(4.0);
  auto c = ChooseReplicaSync(r.workload, Spec(), r.plan, r.timeline);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sync, kfac::ReplicaSync::kPreconditioned);
  EXPECT_GT(c->factors_s, c->preconditioned_s * (1 + kAutoFactorsTolerance));
  EXPECT_NE(c->reason.find("K-FAC replica sync PRECONDITIONED"), std::string::npos) << c->reason;
  EXPECT_NE(c->reason.find("more than the 5%"), std::string::npos) << c->reason;
}

TEST(ReplicaSyncChoiceTest, NumbersAreTheBubblePlannersOwn) {
  // The choice compares what the coordinator's bubble planner would plan
  // with each scheme, priced from the same workload: nothing is free.
  for (double sync_s : {0.05, 1.0, 4.0}) {
    SCOPED_TRACE(sync_s);
    const Replicas r = MakeReplicas(sync_s);
    auto c = ChooseReplicaSync(r.workload, Spec(), r.plan, r.timeline, /*refreshes=*/3);
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_GE(c->iterations, 3);  // one refresh per iteration at best
    EXPECT_NEAR(c->factors_s, MeanIteration(r, true, c->iterations), 1e-12);
    EXPECT_NEAR(c->preconditioned_s, MeanIteration(r, false, c->iterations), 1e-12);
    // Preconditioning: every step pays it; all else fits the gaps.
    EXPECT_NEAR(c->preconditioned_s, 20.1, 1e-9);
  }
  // The iteration cap bounds the work.
  const Replicas r = MakeReplicas(1.0);
  auto capped = ChooseReplicaSync(r.workload, Spec(), r.plan, r.timeline, 1000, 2);
  ASSERT_TRUE(capped.ok()) << capped.status();
  EXPECT_EQ(capped->iterations, 2);
}

TEST(ReplicaSyncChoiceTest, BadInputIsNamed) {
  const Replicas r = MakeReplicas(1.0);
  auto zero = ChooseReplicaSync(r.workload, Spec(), r.plan, r.timeline, 0);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("refreshes"), std::string::npos) << zero.status();
  Replicas bad = MakeReplicas(-1.0);
  auto negative = ChooseReplicaSync(bad.workload, Spec(), bad.plan, bad.timeline);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument) << negative.status();
  // A timeline of another node count than the workload.
  Replicas other = MakeReplicas(1.0);
  other.timeline.nodes.resize(3);
  auto mismatch = ChooseReplicaSync(other.workload, Spec(), other.plan, other.timeline);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument) << mismatch.status();
}

}  // namespace
}  // namespace detour::planner
