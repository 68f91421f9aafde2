#include "coordinator/planner/planner.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "coordinator/planner/baselines.h"
#include "coordinator/planner/route_validator.h"
#include "coordinator/planner/stage_assignment.h"

namespace detour::planner {

std::string SchedulerName(v1::SchedulerKind kind) {
  switch (kind) {
    case v1::SCHEDULER_FULL: return "full";
    case v1::SCHEDULER_RANDOM: return "random";
    case v1::SCHEDULER_SKIP_NO_COLLISION: return "skip-no-collision";
    default: return "skippipe";
  }
}

absl::StatusOr<v1::SchedulerKind> ParseSchedulerName(absl::string_view name) {
  for (v1::SchedulerKind k : {v1::SCHEDULER_SKIPPIPE, v1::SCHEDULER_FULL, v1::SCHEDULER_RANDOM,
                              v1::SCHEDULER_SKIP_NO_COLLISION}) {
    if (name == SchedulerName(k) || name == v1::SchedulerKind_Name(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown scheduler \"", name, "\" (skippipe, full, random, skip-no-collision)"));
}

Objective ObjectiveOf(const v1::PipelineSpec& pipeline) {
  return pipeline.plan_objective() == v1::PLAN_OBJECTIVE_PIPELINE ? Objective::kPipeline
                                                                  : Objective::kIteration;
}

sim::QueuePolicy QueuePolicyOf(const v1::PipelineSpec& pipeline) {
  return pipeline.queue_policy() == v1::QUEUE_POLICY_BACKWARD_FIRST
             ? sim::QueuePolicy::kBackwardFirst
             : sim::QueuePolicy::kArrival;
}

absl::StatusOr<sim::StageAssignment> PinnedAssignment(const sim::CostModel& cost,
                                                      const v1::PipelineSpec& pipeline) {
  sim::StageAssignment a;
  for (int s = 0; s < pipeline.assignment_size(); ++s) {
    std::vector<int> nodes;
    for (const std::string& id : pipeline.assignment(s).nodes()) {
      const int n = cost.NodeIndex(id);
      if (n < 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("pipeline.assignment[", s, "]: node \"", id, "\" is not in the cluster"));
      }
      nodes.push_back(n);
    }
    a.stage_nodes.push_back(std::move(nodes));
  }
  return a;
}

RouteRules RulesFor(const v1::PipelineSpec& pipeline, v1::SchedulerKind scheduler) {
  return RulesFromPipeline(pipeline, scheduler == v1::SCHEDULER_FULL);
}

absl::Status SimulatePlanned(const sim::CostModel& cost, const v1::JobSpec& job,
                             const sim::SimOptions& options, PlannedIteration& it) {
  sim::SimOptions sim_options = options;
  sim_options.queue_policy = QueuePolicyOf(job.pipeline());
  ASSIGN_OR_RETURN(it.result, sim::Simulate(cost, it.plan, sim_options));
  sim_options.queue_policy = sim_options.queue_policy == sim::QueuePolicy::kArrival
                                 ? sim::QueuePolicy::kBackwardFirst
                                 : sim::QueuePolicy::kArrival;
  sim_options.record_timeline = false;
  ASSIGN_OR_RETURN(sim::SimResult other, sim::Simulate(cost, it.plan, sim_options));
  it.other_policy_pipeline_s = other.pipeline_time_s;
  it.other_policy_iteration_s = other.iteration_time_s;
  return absl::OkStatus();
}

absl::StatusOr<PlannedIteration> PlanIteration(const sim::CostModel& cost, const v1::JobSpec& job,
                                               const PlannerOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  PlannedIteration out;
  out.scheduler = options.scheduler != v1::SCHEDULER_UNSPECIFIED ? options.scheduler
                  : job.pipeline().scheduler() != v1::SCHEDULER_UNSPECIFIED
                      ? job.pipeline().scheduler()
                      : v1::SCHEDULER_SKIPPIPE;
  const RouteRules rules = RulesFor(job.pipeline(), out.scheduler);
  if (cost.num_stages() != rules.num_stages) {
    return absl::InvalidArgumentError(absl::StrFormat("cost model has %d stages, the job %d",
                                                      cost.num_stages(), rules.num_stages));
  }
  std::vector<sim::Route> quick_routes;
  if (options.assignment) {
    out.plan.assignment = *options.assignment;
  } else if (job.pipeline().assignment_size() > 0) {
    ASSIGN_OR_RETURN(out.plan.assignment, PinnedAssignment(cost, job.pipeline()));
  } else {
    // The assignment is scored for the job's own skip ratio, so every
    // scheduler (the full baseline included) runs on the same nodes.
    AssignmentOptions ao;
    ao.seed = options.seed;
    // Only the skippipe search reuses the quick plan; the baselines are
    // judged on the assignment alone.
    ao.plan_evaluations = options.assignment_evaluations;
    ao.time_budget_s = options.time_budget_s > 0 ? 0.6 * options.time_budget_s : 0;
    ao.evaluator =
        EvaluatorOptions{options.objective ? *options.objective : ObjectiveOf(job.pipeline()),
                         options.sim.contention, QueuePolicyOf(job.pipeline()), options.robust};
    ASSIGN_OR_RETURN(out.plan.assignment,
                     AssignStages(cost, RulesFromPipeline(job.pipeline()),
                                  static_cast<int>(job.pipeline().replicas_per_stage()), ao,
                                  &out.assignment_search, &quick_routes));
  }
  switch (out.scheduler) {
    case v1::SCHEDULER_FULL: {
      ASSIGN_OR_RETURN(out.plan.routes, FullPipelineRoutes(cost, out.plan.assignment, rules));
      break;
    }
    case v1::SCHEDULER_RANDOM: {
      ASSIGN_OR_RETURN(out.plan.routes,
                       RandomSkipRoutes(cost, out.plan.assignment, rules, options.seed));
      break;
    }
    case v1::SCHEDULER_SKIP_NO_COLLISION: {
      ASSIGN_OR_RETURN(out.plan.routes, SkipNoCollisionRoutes(cost, out.plan.assignment, rules));
      break;
    }
    default: {
      PathSchedulerOptions po;
      po.seed = options.seed;
      po.max_evaluations = options.max_evaluations;
      po.time_budget_s =
          options.time_budget_s > 0
              ? std::max(0.05, options.time_budget_s - std::chrono::duration<double>(
                                                           std::chrono::steady_clock::now() - start)
                                                           .count())
              : 0;
      po.contention = options.sim.contention;
      po.queue_policy = QueuePolicyOf(job.pipeline());
      po.robust = options.robust;
      po.objective = options.objective ? *options.objective : ObjectiveOf(job.pipeline());
      po.initial_routes = options.initial_routes;
      if (po.initial_routes == nullptr && !quick_routes.empty()) po.initial_routes = &quick_routes;
      PathScheduler scheduler(cost, out.plan.assignment, rules, po);
      ASSIGN_OR_RETURN(out.plan.routes, scheduler.Run());
      out.search = scheduler.stats();
      break;
    }
  }
  out.planning_time_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (absl::Status s = ValidateRoutes(cost, out.plan, rules); !s.ok()) {
    return absl::InternalError(
        absl::StrCat(SchedulerName(out.scheduler), " planner broke the rules: ", s.message()));
  }
  RETURN_IF_ERROR(SimulatePlanned(cost, job, options.sim, out));
  return out;
}

}  // namespace detour::planner
