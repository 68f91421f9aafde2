// Lanes: each data node's microbatches split into a few groups, every group
// following one path, different groups' paths sharing nodes only where the
// visit caps force it. This is the structure of the reference's
// collision-aware agents (one agent per data node, its microbatches in
// step): a node serves one lane, so microbatches of different data nodes
// never meet on it, and a data node's own microbatches pass it staggered by
// their start times. The path search starts from the best lane set and
// refines it per microbatch.
//
// Built greedily: microbatches in rounds (the k-th of every data node, the
// hardest-connected data nodes first), a microbatch reusing its group's path
// while that keeps the visit quotas and node caps, else taking the cheapest
// route by static cost with nodes of other lanes priced up. Several data
// node orders are tried; the lane set with the shortest estimated slowest
// slot chain (a data node's memory slot runs its microbatches one after
// another) wins. Valid under the rules (quotas, order, caps). Deterministic
// for a seed. Each lane set is then improved by lane-level moves (whole
// lanes re-homed, exchanged, reordered) judged by the same estimate.
// Thread-safe (pure function).
#ifndef DETOUR_COORDINATOR_PLANNER_LANE_ROUTES_H_
#define DETOUR_COORDINATOR_PLANNER_LANE_ROUTES_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

struct LaneOptions {
  uint64_t seed = 0;
  // Groups (lanes) per data node; microbatch k joins group k mod groups
  // (one lane per memory slot of the data node when groups = its slots), or
  // with `by_wave` group k / ceil(M / groups) (one lane per wave: a slot's
  // consecutive microbatches take different lanes, so a long lane can pair
  // with a short one).
  int groups_per_data_node = 1;
  bool by_wave = false;
  // Data node orders tried.
  int restarts = 12;
  // Lane-level moves (route_moves.h) tried on each lane set, kept when they
  // shorten the estimated slowest slot chain.
  int improve_steps = 200;
};

// The lane shapes worth trying for `rules`: one lane per data node, one per
// memory slot, one per wave (duplicates dropped).
std::vector<LaneOptions> LaneVariants(const RouteRules& rules, uint64_t seed, int restarts);

// Every distinct lane set the restarts built, best estimate first (the
// caller may judge them by simulation). FAILED_PRECONDITION when none
// satisfies the rules.
absl::StatusOr<std::vector<std::vector<sim::Route>>> LaneRouteSets(
    const sim::CostModel& cost, const sim::StageAssignment& assignment, const RouteRules& rules,
    const LaneOptions& options = {});

// The lane set with the best estimate; routes ordered by microbatch id.
absl::StatusOr<std::vector<sim::Route>> LaneRoutes(const sim::CostModel& cost,
                                                   const sim::StageAssignment& assignment,
                                                   const RouteRules& rules,
                                                   const LaneOptions& options = {});

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_LANE_ROUTES_H_
