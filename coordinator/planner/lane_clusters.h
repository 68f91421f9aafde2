// A constructive node-to-stage assignment for partial pipelines: the nodes
// are cut into one tight geographic cluster per data node (a lane), each
// cluster's best-connected member becomes its data node, and stage labels
// are dealt round-robin over the clusters so that every stage gets exactly
// replicas_per_stage nodes and every lane holds as many different stages as
// it can. Within a lane the labels go to the members in the order that
// makes the lane's round trip (data node, ascending stages, back) cheapest.
// A route of that lane then never leaves its cluster — the structure the
// reference's collision-aware paths have, built from the network instead of
// found by search. It starts the assignment search (stage_assignment.h).
//
// Deterministic for a seed (variant 0 is seed-independent). Thread-safe
// (pure function).
#ifndef DETOUR_COORDINATOR_PLANNER_LANE_CLUSTERS_H_
#define DETOUR_COORDINATOR_PLANNER_LANE_CLUSTERS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

// Needs data_nodes + (S-1)·replicas nodes (FAILED_PRECONDITION otherwise);
// with more, the best-connected ones are used. `variant` > 0 draws the first
// cluster seed and breaks ties at random.
absl::StatusOr<sim::StageAssignment> LaneClusterAssignment(const sim::CostModel& cost,
                                                           const RouteRules& rules, int replicas,
                                                           uint64_t seed, int variant);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_LANE_CLUSTERS_H_
