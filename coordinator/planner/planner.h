// Plans one iteration end to end — what the coordinator calls: assign nodes
// to stages (or reuse an assignment), build every microbatch's route with the
// chosen scheduler, check the routes against the rules and simulate them.
//
//   ASSIGN_OR_RETURN(sim::CostModel cost, sim::CostModel::Create(cluster, job));
//   PlannerOptions options;
//   options.seed = job.seed();
//   ASSIGN_OR_RETURN(PlannedIteration it, PlanIteration(cost, job, options));
//   // it.plan.assignment, it.plan.routes (ToProtoRoute for the wire),
//   // it.result.iteration_time_s (IterationPlan.predicted_time_s)
//
// Thread-safe (no shared state); deterministic for a given seed except for
// planning_time_s.
#ifndef DETOUR_COORDINATOR_PLANNER_PLANNER_H_
#define DETOUR_COORDINATOR_PLANNER_PLANNER_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/plan.h"
#include "coordinator/planner/path_scheduler.h"
#include "detour/v1/spec.pb.h"

namespace detour::planner {

struct PlannerOptions {
  // SCHEDULER_UNSPECIFIED = the job's pipeline.scheduler (default skippipe).
  v1::SchedulerKind scheduler = v1::SCHEDULER_UNSPECIFIED;
  uint64_t seed = 0;
  // Reuse this assignment instead of computing one (the coordinator keeps
  // the assignment fixed while a job runs and re-plans only routes).
  std::optional<sim::StageAssignment> assignment;
  // skippipe local-search budget; < 0 = automatic.
  int max_evaluations = -1;
  sim::SimOptions sim;
};

struct PlannedIteration {
  v1::SchedulerKind scheduler = v1::SCHEDULER_SKIPPIPE;
  sim::Plan plan;
  // Simulation of the plan (with timeline when options.sim asks for it).
  sim::SimResult result;
  // Wall time of assignment + route search (not the final simulation).
  double planning_time_s = 0;
  PathSchedulerStats search;  // skippipe only
};

// `job` must be defaulted (LoadJobSpec / NormalizeJobSpec). Errors:
// FAILED_PRECONDITION (cluster too small, rules admit no routes),
// INVALID_ARGUMENT (inconsistent assignment), INTERNAL (a planner produced
// routes that break the rules — a bug).
absl::StatusOr<PlannedIteration> PlanIteration(const sim::CostModel& cost, const v1::JobSpec& job,
                                               const PlannerOptions& options);

// Rules a scheduler's routes must follow (full: every stage, in order).
RouteRules RulesFor(const v1::PipelineSpec& pipeline, v1::SchedulerKind scheduler);

// "skippipe", "full", "random", "skip-no-collision".
std::string SchedulerName(v1::SchedulerKind kind);
// Accepts the names above and the enum names (SCHEDULER_FULL, ...).
absl::StatusOr<v1::SchedulerKind> ParseSchedulerName(absl::string_view name);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_PLANNER_H_
