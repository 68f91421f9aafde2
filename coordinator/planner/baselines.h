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
#include "coordinator/planner/route_rules.h"
#include "coordinator/planner/route_sets.h"

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

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_BASELINES_H_
