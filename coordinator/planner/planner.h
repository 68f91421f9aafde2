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
#include "coordinator/planner/stage_assignment.h"
#include "detour/v1/spec.pb.h"

namespace detour::planner {

struct PlannerOptions {
  // SCHEDULER_UNSPECIFIED = the job's pipeline.scheduler (default skippipe).
  v1::SchedulerKind scheduler = v1::SCHEDULER_UNSPECIFIED;
  uint64_t seed = 0;
  // Reuse this assignment instead of computing one (the coordinator keeps
  // the assignment fixed while a job runs and re-plans only routes).
  std::optional<sim::StageAssignment> assignment;
  // skippipe local-search budget in simulations; < 0 = automatic.
  int max_evaluations = -1;
  // Partitions the assignment search judges by their plan; < 0 =
  // automatic, 0 = the proxy score alone.
  int assignment_evaluations = -1;
  // Wall-clock cap on the whole planning (assignment 60%, routes the rest),
  // seconds; 0 = none (deterministic).
  double time_budget_s = 0;
  // Judge plans under both queue policies (PathSchedulerOptions::robust).
  bool robust = true;
  // Overrides the job's pipeline.plan_objective when set.
  std::optional<Objective> objective;
  // Warm start for the skippipe search (e.g. the last iteration's routes).
  const std::vector<sim::Route>* initial_routes = nullptr;
  // Simulation of the result; queue_policy is taken from the job.
  sim::SimOptions sim;
};

struct PlannedIteration {
  v1::SchedulerKind scheduler = v1::SCHEDULER_SKIPPIPE;
  sim::Plan plan;
  // Simulation of the plan under the job's queue policy (with timeline when
  // options.sim asks for it), and its times under the other policy.
  sim::SimResult result;
  double other_policy_pipeline_s = 0;
  double other_policy_iteration_s = 0;
  // Wall time of assignment + route search (not the final simulation).
  double planning_time_s = 0;
  PathSchedulerStats search;          // skippipe only
  AssignmentStats assignment_search;  // when the assignment was searched
};

// `job` must be defaulted (LoadJobSpec / NormalizeJobSpec). Errors:
// FAILED_PRECONDITION (cluster too small, rules admit no routes),
// INVALID_ARGUMENT (inconsistent assignment), INTERNAL (a planner produced
// routes that break the rules — a bug).
absl::StatusOr<PlannedIteration> PlanIteration(const sim::CostModel& cost, const v1::JobSpec& job,
                                               const PlannerOptions& options);

// Simulates it.plan under the job's queue policy into it.result (timeline as
// `options` asks) and under the other policy into it.other_policy_*.
absl::Status SimulatePlanned(const sim::CostModel& cost, const v1::JobSpec& job,
                             const sim::SimOptions& options, PlannedIteration& it);

// The job's plan objective and the workers' queue policy, as the planner
// and simulator name them.
Objective ObjectiveOf(const v1::PipelineSpec& pipeline);
sim::QueuePolicy QueuePolicyOf(const v1::PipelineSpec& pipeline);

// The assignment pinned by pipeline.assignment, as node indices of `cost`.
// FAILED_PRECONDITION naming a node the cluster does not have.
absl::StatusOr<sim::StageAssignment> PinnedAssignment(const sim::CostModel& cost,
                                                      const v1::PipelineSpec& pipeline);

// Rules a scheduler's routes must follow (full: every stage, in order).
RouteRules RulesFor(const v1::PipelineSpec& pipeline, v1::SchedulerKind scheduler);

// "skippipe", "full", "random", "skip-no-collision".
std::string SchedulerName(v1::SchedulerKind kind);
// Accepts the names above and the enum names (SCHEDULER_FULL, ...).
absl::StatusOr<v1::SchedulerKind> ParseSchedulerName(absl::string_view name);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_PLANNER_H_
