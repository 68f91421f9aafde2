// The skippipe path scheduler (skippipe.md §4.2): routes for every
// microbatch of an iteration that satisfy the convergence rules and minimise
// the simulated iteration time, avoiding forward collisions on nodes.
//
// Method (docs/SCHEDULER.md §"Path search"):
//  1. Two starting route sets: time-aware prioritised planning (each
//     microbatch, in order of its release, takes the route that ends its
//     backward first given the compute already reserved on every node — the
//     reservations are the collision constraints) and the network-aware but
//     time-blind routes of the skip-no-collision baseline. The event
//     simulator scores both; the better one is kept.
//  2. Local search scored by the simulator (with link contention and memory
//     slots): re-home a visit to another replica, exchange stage visits
//     between two microbatches, reorder two visits within the swap limits,
//     or exchange the routes of two microbatches of one data node. A move is
//     kept only if the simulated iteration improves.
// Every move preserves the rules, so each intermediate plan is valid.
// Deterministic for a given seed: no clocks, no threads, portable RNG.
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
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

struct PathSchedulerOptions {
  uint64_t seed = 0;
  // Simulator evaluations for the local search; < 0 = sized to the problem
  // (about 4e6 simulated events in all, 200 to 3000 evaluations).
  int max_evaluations = -1;
  // Nodes per stage the route search considers (the most promising).
  int max_candidates = 8;
  sim::Contention contention = sim::Contention::kSenderUplink;
};

struct PathSchedulerStats {
  int evaluations = 0;
  int accepted = 0;
  // Objective (simulated seconds) of the timed and the static start, and at
  // the end.
  double timed_start = 0;
  double static_start = 0;
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

 private:
  // Simulated objective; infinity for plans that deadlock.
  double Objective(const std::vector<sim::Route>& routes, int64_t* events = nullptr);

  const sim::CostModel& cost_;
  const sim::StageAssignment& assignment_;
  const RouteRules& rules_;
  PathSchedulerOptions options_;
  PathSchedulerStats stats_;
  sim::Plan scratch_;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_PATH_SCHEDULER_H_
