// Baseline route planners to judge the skippipe scheduler against, on the
// same cluster, assignment and number of microbatches (skippipe.md §4.3):
//  * full pipeline: fixed node columns, every stage in order (DT-FM style);
//  * random skip: valid skip routes that ignore the network;
//  * skip without collision avoidance: each microbatch takes its cheapest
//    valid route by static link and compute costs, blind to the others.
// All three honour the visit quotas (equal stage visits ±1) and, where they
// can, each node's memory slots per wave of microbatches. Deterministic for a
// given seed. Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_BASELINES_H_
#define DETOUR_COORDINATOR_PLANNER_BASELINES_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_builder.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

// `rules` should come from RulesFromPipeline(pipeline, /*full=*/true).
// Columns are formed greedily so that consecutive stages of one column are
// well connected; data nodes spread evenly over the columns.
absl::StatusOr<std::vector<sim::Route>> FullPipelineRoutes(const sim::CostModel& cost,
                                                           const sim::StageAssignment& assignment,
                                                           const RouteRules& rules);

absl::StatusOr<std::vector<sim::Route>> RandomSkipRoutes(const sim::CostModel& cost,
                                                         const sim::StageAssignment& assignment,
                                                         const RouteRules& rules, uint64_t seed);

absl::StatusOr<std::vector<sim::Route>> SkipNoCollisionRoutes(
    const sim::CostModel& cost, const sim::StageAssignment& assignment, const RouteRules& rules);

// Time-blind price of a route: compute on every node plus each hop's
// transfer both ways (activation forward, gradient back), plus the loss.
double StaticRouteCost(const sim::CostModel& cost, const sim::Route& route);

// Builds every microbatch's route one at a time with `mode`, keeping visit
// quotas feasible and (if `wave_memory_cap`) at most memory_slots
// microbatches of one wave per node. kTimed processes microbatches in order
// of their estimated release (a data node's slot frees when its earlier
// microbatch ends); the others in wave order. FAILED_PRECONDITION when the
// rules admit no route (e.g. max_jump too small for the skip ratio).
absl::StatusOr<std::vector<sim::Route>> BuildRouteSet(const sim::CostModel& cost,
                                                      const sim::StageAssignment& assignment,
                                                      const RouteRules& rules,
                                                      RouteBuilder::Mode mode, uint64_t seed,
                                                      bool wave_memory_cap, int max_candidates = 8);

// Moves visits from over-visited stages (quota[s] < 0) to under-visited ones
// (quota[s] > 0) by replacing a stage in some route (onto the replica with
// the fewest visits), keeping its order valid. FAILED_PRECONDITION when the
// jump limit leaves no such move.
absl::Status RebalanceVisits(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                             const RouteRules& rules, std::vector<int>& quota,
                             std::vector<sim::Route>& routes);

// Capacity of each stage (sum over replicas of 1 / (forward + backward)),
// used to hand out the visit remainder. Entry 0 is the data nodes'.
std::vector<double> StageCapacities(const sim::CostModel& cost,
                                    const sim::StageAssignment& assignment);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_BASELINES_H_
