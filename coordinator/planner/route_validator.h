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

struct ValidatorOptions {
  // Also simulate the plan to prove it cannot deadlock on memory slots
  // (rule 6 in the presence of swaps).
  bool check_memory_deadlock = true;
};

// Every violation found, in order: assignment, microbatch set, each route
// (start/end on one data node, path length P, stages once each, jump and
// swap limits), equal visits per non-zero stage (±1), memory.
std::vector<Violation> FindViolations(const sim::CostModel& cost, const sim::Plan& plan,
                                      const RouteRules& rules,
                                      const ValidatorOptions& options = ValidatorOptions());

// OK, or INVALID_ARGUMENT listing the first violations ("N violations: ...").
absl::Status ValidateRoutes(const sim::CostModel& cost, const sim::Plan& plan,
                            const RouteRules& rules,
                            const ValidatorOptions& options = ValidatorOptions());

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_ROUTE_VALIDATOR_H_
