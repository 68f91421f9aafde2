// Node-to-stage assignment: which nodes become data nodes (stage 0) and which
// replicas form each other stage. Two levels (docs/SCHEDULER.md §"Node-to-
// stage assignment"):
//  1. A proxy score, cheap enough for thousands of trials: (1) the slowest
//     stage's compute load given its replicas' speeds and the visits the
//     skip ratio sends it, (2) the slowest stage's ring all-reduce, and (3)
//     the expected network time of a microbatch's round trips, where each
//     hop goes to the nearest replica of the next stage. Several seeded
//     starts, each improved by pairwise node swaps.
//  2. A search scored by the plan itself: each candidate partition gets
//     quick routes (lanes and time-aware prioritised planning) that the
//     simulator judges with the planner's objective (PlanEvaluator), so data
//     node placement, the replica groups' all-reduce, node speeds, the WAN
//     links, collisions and memory all count as they will in the plan.
//     Late-acceptance local search over partitions: swap two nodes between
//     groups (stages, data nodes, unused), or two stages' labels; it starts
//     from the best proxy partitions and the lane clusters
//     (lane_clusters.h). The best few distinct partitions then get a short
//     route search each, and the best plan decides.
// Deterministic for a given seed unless a time budget cuts the search short.
// Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_STAGE_ASSIGNMENT_H_
#define DETOUR_COORDINATOR_PLANNER_STAGE_ASSIGNMENT_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/plan_evaluator.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

struct AssignmentOptions {
  uint64_t seed = 0;
  // Proxy search: starts and swap trials per start; 0 = sized to the
  // cluster so that 1000 nodes stay within seconds.
  int restarts = 0;
  int trials_per_restart = 0;
  // Plan-scored search: candidate partitions judged; < 0 = sized to the
  // problem (a few seconds at 20 nodes), 0 = the proxy search alone.
  int plan_evaluations = -1;
  // Wall-clock cap on the plan-scored search in seconds; 0 = none.
  double time_budget_s = 0;
  // How plans are judged (the route search's objective).
  EvaluatorOptions evaluator;
};

struct AssignmentStats {
  int proxy_trials = 0;
  // Partitions judged by their quick plan, and the scores (seconds) of the
  // best proxy partition's quick plan and of the result's.
  int plan_evaluations = 0;
  double proxy_plan_score = 0;
  // Best partitions given a short route search, and the best result.
  int refined = 0;
  double final_plan_score = 0;
};

// Needs data_nodes + (S-1)·replicas_per_stage nodes; spare nodes stay unused.
// FAILED_PRECONDITION when the cluster is too small. `quick_routes`, if
// given, receives the quick plan of the result (a warm start for the route
// search; empty when only the proxy ran).
absl::StatusOr<sim::StageAssignment> AssignStages(const sim::CostModel& cost,
                                                  const RouteRules& rules, int replicas_per_stage,
                                                  const AssignmentOptions& options = {},
                                                  AssignmentStats* stats = nullptr,
                                                  std::vector<sim::Route>* quick_routes = nullptr);

// The quick plan of `assignment` (the plan-scored search's measure): the
// best of lane routes and time-aware routes, judged by `evaluator`; score
// infinity (and no routes) when no route set fits the rules.
struct QuickPlan {
  double score = 0;
  std::vector<sim::Route> routes;
};
QuickPlan QuickPlanFor(const sim::CostModel& cost, const RouteRules& rules,
                       const sim::StageAssignment& assignment, PlanEvaluator& evaluator,
                       uint64_t seed);

// The score AssignStages minimises, in seconds (lower is better).
double AssignmentScore(const sim::CostModel& cost, const RouteRules& rules,
                       const sim::StageAssignment& assignment);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_STAGE_ASSIGNMENT_H_
