// Whole route sets, one route per microbatch, built under a pipeline's
// rules: the building blocks of the production scheduler (path_scheduler.h,
// lane_routes.h, stage_assignment.h) and of the baselines (baselines.h).
// Deterministic for a given seed. Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_ROUTE_SETS_H_
#define DETOUR_COORDINATOR_PLANNER_ROUTE_SETS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_builder.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

// INVALID_ARGUMENT unless `assignment` has the rules' stages, a node on every
// stage, the rules' data nodes, and 1 <= visited stages <= stages.
absl::Status CheckRouteShape(const sim::StageAssignment& assignment, const RouteRules& rules);

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

#endif  // DETOUR_COORDINATOR_PLANNER_ROUTE_SETS_H_
