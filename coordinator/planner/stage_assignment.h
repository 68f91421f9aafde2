// Node-to-stage assignment: which nodes become data nodes (stage 0) and which
// replicas form each other stage. Heterogeneity-aware: it minimises a score
// that adds (1) the slowest stage's compute load given its replicas' speeds
// and the visits the skip ratio sends it, (2) the slowest stage's ring
// all-reduce, and (3) the expected network time of a microbatch's round
// trips, where each hop goes to the nearest replica of the next stage.
// Search: several seeded random starts, each improved by pairwise node swaps
// (between stages and with unused nodes) under a fixed trial budget; the best
// wins. Deterministic for a given seed. Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_STAGE_ASSIGNMENT_H_
#define DETOUR_COORDINATOR_PLANNER_STAGE_ASSIGNMENT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

struct AssignmentOptions {
  uint64_t seed = 0;
  // Random starts and swap trials per start; 0 = sized to the cluster so that
  // 1000 nodes stay within seconds.
  int restarts = 0;
  int trials_per_restart = 0;
};

// Needs data_nodes + (S-1)·replicas_per_stage nodes; spare nodes stay unused.
// FAILED_PRECONDITION when the cluster is too small.
absl::StatusOr<sim::StageAssignment> AssignStages(const sim::CostModel& cost,
                                                  const RouteRules& rules,
                                                  int replicas_per_stage,
                                                  const AssignmentOptions& options = {});

// The score AssignStages minimises, in seconds (lower is better).
double AssignmentScore(const sim::CostModel& cost, const RouteRules& rules,
                       const sim::StageAssignment& assignment);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_STAGE_ASSIGNMENT_H_
