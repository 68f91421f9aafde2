#include "coordinator/planner/plan_evaluator.h"

#include <algorithm>

namespace detour::planner {
namespace {

sim::QueuePolicy Other(sim::QueuePolicy p) {
  return p == sim::QueuePolicy::kArrival ? sim::QueuePolicy::kBackwardFirst
                                         : sim::QueuePolicy::kArrival;
}

}  // namespace

double PlanEvaluator::Score(const sim::StageAssignment& assignment,
                            const std::vector<sim::Route>& routes, double threshold) {
  ++evaluations_;
  // The plan is copied: the simulator takes a Plan, and a copy is cheap next
  // to a simulation.
  scratch_.assignment = assignment;
  scratch_.routes = routes;
  sim::SimOptions sim_options;
  sim_options.contention = options_.contention;
  sim_options.queue_policy = options_.queue_policy;
  sim_options.record_timeline = false;
  auto main_of = [&](const sim::SimResult& r) {
    return options_.objective == Objective::kPipeline
               ? r.pipeline_time_s
               : r.iteration_time_s + kPipelineShare * r.pipeline_time_s;
  };
  absl::StatusOr<sim::SimResult> r = sim::Simulate(cost_, scratch_, sim_options);
  if (!r.ok()) return std::numeric_limits<double>::infinity();
  double mean_end = 0;
  for (const sim::RouteTiming& t : r->routes) mean_end += t.end_s;
  if (!r->routes.empty()) mean_end /= r->routes.size();
  const double tie = 1e-3 * mean_end + 1e-4 * r->queue_wait_s;
  double main = main_of(*r);
  if (options_.robust && main + tie <= threshold) {
    sim_options.queue_policy = Other(options_.queue_policy);
    absl::StatusOr<sim::SimResult> other = sim::Simulate(cost_, scratch_, sim_options);
    if (!other.ok()) return std::numeric_limits<double>::infinity();
    main += kOtherPolicyWeight * std::max(0.0, main_of(*other) - main);
  }
  return main + tie;
}

}  // namespace detour::planner
