// The skippipe path scheduler (skippipe.md §4.2): routes for every
// microbatch of an iteration that satisfy the convergence rules, spread the
// visits evenly over each stage's replicas (per-node visit caps) and
// minimise the simulated iteration, avoiding collisions on nodes.
//
// Method (docs/SCHEDULER.md §"Path search"):
//  1. Starting route sets: time-aware prioritised planning (each microbatch,
//     in order of its release, takes the route that ends its backward first
//     given the compute already reserved on every node — the reservations
//     are the collision constraints), the routes of the skip-no-collision
//     and random baselines (so the result never loses to them by the
//     search's measure), lanes (each data node's
//     microbatches share a few node-disjoint paths, as the reference's
//     collision-aware agents do), and optionally a warm start (the previous
//     iteration's routes). The event simulator scores each; the best starts
//     the search.
//  2. Late-acceptance local search scored by the simulator (with link
//     contention and memory slots), under the workers' queue policy and —
//     unless turned off — the other one too, a quarter of what a plan would
//     lose under it counting against it: a plan that only looks good under
//     one order of a node's ready work would not hold on real workers, where
//     near-simultaneous arrivals come in either order. Phase 1 moves whole
//     lanes, phase 2 single microbatches. Moves: re-home a visit to another replica,
//     exchange the nodes of two visits of one stage, exchange stage visits
//     between two microbatches, reorder two visits within the swap limits,
//     exchange the routes of two microbatches of one data node, and swap two
//     replicas' roles (for all microbatches or one data node's).
// Every move preserves the rules (order, quotas, node visit caps), so each
// intermediate plan is valid. Deterministic for a given seed unless a time
// budget cuts the search short: no clocks decide otherwise, no threads,
// portable RNG.
// Thread-compatible: use one instance per planning call. Does not own
// `cost`, `assignment` or `rules`, which must outlive it.
#ifndef DETOUR_COORDINATOR_PLANNER_PATH_SCHEDULER_H_
#define DETOUR_COORDINATOR_PLANNER_PATH_SCHEDULER_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/plan.h"
#include "coordinator/planner/plan_evaluator.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

struct PathSchedulerOptions {
  uint64_t seed = 0;
  // Simulations for the local search; < 0 = sized to the problem (about
  // 1.5e7 simulated events in all, 300 to 20000 evaluations).
  int max_evaluations = -1;
  // Wall-clock cap on the search in seconds; 0 = none. When it cuts the
  // search short the result depends on the machine's speed.
  double time_budget_s = 0;
  // Nodes per stage the route builder considers (the most promising).
  int max_candidates = 8;
  sim::Contention contention = sim::Contention::kSenderUplink;
  // The workers' queue policy; with `robust` the other policy is simulated
  // too and a quarter of its excess counts.
  sim::QueuePolicy queue_policy = sim::QueuePolicy::kArrival;
  bool robust = true;
  Objective objective = Objective::kIteration;
  // Optional warm start, e.g. the previous iteration's routes; ignored when
  // it breaks the rules.
  const std::vector<sim::Route>* initial_routes = nullptr;
};

struct PathSchedulerStats {
  int evaluations = 0;
  int accepted = 0;
  // Objective (simulated seconds) of each start (infinity when absent), and
  // at the end. static_start: the skip-no-collision baseline's routes.
  double timed_start = 0;
  double static_start = 0;
  double lane_start = 0;
  double warm_start = 0;
  double final_objective = 0;
};

class PathScheduler {
 public:
  PathScheduler(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                const RouteRules& rules, const PathSchedulerOptions& options = {});

  // Routes ordered by microbatch id. FAILED_PRECONDITION when the rules admit
  // no route set.
  absl::StatusOr<std::vector<sim::Route>> Run();

  const PathSchedulerStats& stats() const { return stats_; }

  // The score of a route set (PlanEvaluator; lower is better).
  double Objective(const std::vector<sim::Route>& routes);

 private:
  const sim::CostModel& cost_;
  const sim::StageAssignment& assignment_;
  const RouteRules& rules_;
  PathSchedulerOptions options_;
  PathSchedulerStats stats_;
  PlanEvaluator evaluator_;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_PATH_SCHEDULER_H_
