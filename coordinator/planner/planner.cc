#include "coordinator/planner/planner.h"

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
    case v1::SCHEDULER_FULL:
      return "full";
    case v1::SCHEDULER_RANDOM:
      return "random";
    case v1::SCHEDULER_SKIP_NO_COLLISION:
      return "skip-no-collision";
    default:
      return "skippipe";
  }
}

absl::StatusOr<v1::SchedulerKind> ParseSchedulerName(absl::string_view name) {
  for (v1::SchedulerKind k : {v1::SCHEDULER_SKIPPIPE, v1::SCHEDULER_FULL, v1::SCHEDULER_RANDOM,
                              v1::SCHEDULER_SKIP_NO_COLLISION}) {
    if (name == SchedulerName(k) || name == v1::SchedulerKind_Name(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown scheduler \"", name, "\" (skippipe, full, random, skip-no-collision)"));
}

RouteRules RulesFor(const v1::PipelineSpec& pipeline, v1::SchedulerKind scheduler) {
  return RulesFromPipeline(pipeline, scheduler == v1::SCHEDULER_FULL);
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
    return absl::InvalidArgumentError(absl::StrFormat(
        "cost model has %d stages, the job %d", cost.num_stages(), rules.num_stages));
  }
  if (options.assignment) {
    out.plan.assignment = *options.assignment;
  } else {
    // The assignment is scored for the job's own skip ratio, so every
    // scheduler (the full baseline included) runs on the same nodes.
    AssignmentOptions ao;
    ao.seed = options.seed;
    ASSIGN_OR_RETURN(out.plan.assignment,
                     AssignStages(cost, RulesFromPipeline(job.pipeline()),
                                  static_cast<int>(job.pipeline().replicas_per_stage()), ao));
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
      po.contention = options.sim.contention;
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
  ASSIGN_OR_RETURN(out.result, sim::Simulate(cost, out.plan, options.sim));
  return out;
}

}  // namespace detour::planner
