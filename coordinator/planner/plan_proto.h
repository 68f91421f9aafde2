// Conversion between the planner's index form (sim::Route, node positions)
// and the wire form (detour.v1.Route, node ids) that IterationPlan carries.
// Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_PLAN_PROTO_H_
#define DETOUR_COORDINATOR_PLANNER_PLAN_PROTO_H_

#include <vector>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "detour/v1/plan.pb.h"

namespace detour::planner {

v1::Route ToProtoRoute(const sim::CostModel& cost, const sim::Route& route);

// INVALID_ARGUMENT naming the microbatch and the unknown node id, or a
// nodes/stages length mismatch.
absl::StatusOr<sim::Route> FromProtoRoute(const sim::CostModel& cost, const v1::Route& route);

// The assignment the routes imply: every node at the stage the routes say it
// holds (conflicting claims are INVALID_ARGUMENT). Stages nobody visits stay
// empty.
absl::StatusOr<sim::StageAssignment> AssignmentFromRoutes(const sim::CostModel& cost,
                                                          const std::vector<sim::Route>& routes);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_PLAN_PROTO_H_
