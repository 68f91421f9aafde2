// Checks a set of routes against the convergence rules of skippipe.md §2 and
// explains every violation in words ("microbatch 7: visits stage 3 twice").
// Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_ROUTE_VALIDATOR_H_
#define DETOUR_COORDINATOR_PLANNER_ROUTE_VALIDATOR_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

struct Violation {
  int microbatch = -1;  // -1: about the plan as a whole.
  std::string message;
};

// Every violation found, in order: assignment, microbatch set, each route
// (start/end on one data node, path length P, stages once each, jump and
// swap limits), equal visits per non-zero stage (±1), visits per node
// within NodeVisitCaps (memory × rounds: rule 6). Memory slots cannot
// deadlock (common/sim/queue_policy.h), so no simulation is needed.
std::vector<Violation> FindViolations(const sim::CostModel& cost, const sim::Plan& plan,
                                      const RouteRules& rules);

// OK, or INVALID_ARGUMENT listing the first violations ("N violations: ...").
absl::Status ValidateRoutes(const sim::CostModel& cost, const sim::Plan& plan,
                            const RouteRules& rules);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_ROUTE_VALIDATOR_H_
