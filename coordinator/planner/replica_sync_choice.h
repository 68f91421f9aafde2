// KFAC_REPLICA_SYNC_AUTO: which replica synchronisation a K-FAC job gets,
// chosen from the shared cost model (docs/KFAC.md, "Replicas").
//
// Both schemes keep replicas bit-identical. FACTORS all-reduces the pending
// Kronecker factors, so every replica inverts factors from all replicas'
// curvature microbatches: the better curvature estimate, measured to reach
// AdamW's loss in about half the wall time of PRECONDITIONED on a small model
// (docs/BENCHMARKS.md, "Time to AdamW's final loss"). It costs the factor
// bytes over the stage's slowest link, which for a large model over WAN
// links is most of an iteration (geo20, 1.5B: +31%). PRECONDITIONED sends no
// factor bytes. The choice: plan the same iterations with each scheme and
// take FACTORS when its mean modelled iteration is at most
// kAutoFactorsTolerance above PRECONDITIONED's.
//
// Thread-compatible; no LibTorch.
#ifndef DETOUR_COORDINATOR_PLANNER_REPLICA_SYNC_CHOICE_H_
#define DETOUR_COORDINATOR_PLANNER_REPLICA_SYNC_CHOICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/kfac_workload.h"
#include "common/sim/plan.h"
#include "coordinator/planner/bubble_planner.h"
#include "detour/v1/spec.pb.h"

namespace detour::planner {

// FACTORS is chosen when its modelled iteration is at most this fraction
// above PRECONDITIONED's: the whole budget for K-FAC's overhead.
inline constexpr double kAutoFactorsTolerance = 0.05;

struct ReplicaSyncChoice {
  kfac::ReplicaSync sync = kfac::ReplicaSync::kPreconditioned;
  double pipeline_s = 0;        // the iteration without K-FAC (timeline.end_s)
  double factors_s = 0;         // mean modelled iteration with K-FAC: FACTORS
  double preconditioned_s = 0;  // the same with PRECONDITIONED
  int iterations = 0;           // iterations planned with each scheme
  std::string reason;           // one sentence naming the choice and the numbers
};

// Plans the same iteration (`plan`, `timeline`) with a bubble planner per
// scheme, in lockstep, until each has completed `refreshes` refreshes or
// `max_iterations` iterations ran, and compares the mean
// IterationBubbles::iteration_time_s. `workload` carries the FACTORS price
// in every KfacLayerCost::sync_s (StageSyncSeconds with kFactors); the
// PRECONDITIONED run zeroes it. `kfac` is the job's (defaulted) KfacSpec;
// its replica_sync and sync_factors are replaced per run. INVALID_ARGUMENT
// for what BubblePlanner::Create or PlanIteration refuse, refreshes or
// max_iterations < 1.
absl::StatusOr<ReplicaSyncChoice> ChooseReplicaSync(const KfacWorkload& workload,
                                                    const v1::KfacSpec& kfac, const sim::Plan& plan,
                                                    const IterationTimeline& timeline,
                                                    int refreshes = 3, int max_iterations = 64);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_REPLICA_SYNC_CHOICE_H_
