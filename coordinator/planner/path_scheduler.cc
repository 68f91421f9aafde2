#include "coordinator/planner/path_scheduler.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "coordinator/planner/baselines.h"
#include "coordinator/planner/route_sets.h"
#include "coordinator/planner/lane_routes.h"
#include "coordinator/planner/route_builder.h"
#include "coordinator/planner/route_moves.h"
#include "coordinator/planner/route_validator.h"

namespace detour::planner {

PathScheduler::PathScheduler(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                             const RouteRules& rules, const PathSchedulerOptions& options)
    : cost_(cost),
      assignment_(assignment),
      rules_(rules),
      options_(options),
      evaluator_(cost, EvaluatorOptions{options.objective, options.contention, options.queue_policy,
                                        options.robust}) {}

double PathScheduler::Objective(const std::vector<sim::Route>& routes) {
  return evaluator_.Score(assignment_, routes);
}

absl::StatusOr<std::vector<sim::Route>> PathScheduler::Run() {
  const auto started = std::chrono::steady_clock::now();
  stats_ = PathSchedulerStats();
  stats_.timed_start = stats_.static_start = stats_.lane_start = stats_.warm_start = kInf;

  std::vector<sim::Route> best;
  double best_value = kInf;
  auto consider = [&](absl::StatusOr<std::vector<sim::Route>> routes, double* slot) {
    if (!routes.ok()) return routes.status();
    if (absl::Status valid = ValidateRoutes(cost_, sim::Plan{assignment_, *routes}, rules_);
        !valid.ok()) {
      return absl::InternalError(
          absl::StrCat("a starting route set breaks the rules: ", valid.message()));
    }
    const double v = Objective(*routes);
    *slot = v;
    if (v < best_value) {
      best_value = v;
      best = *std::move(routes);
    }
    return absl::OkStatus();
  };
  // The timed start must exist (it fails only when the rules admit no route
  // set); the others are optional.
  RETURN_IF_ERROR(
      consider(BuildRouteSet(cost_, assignment_, rules_, RouteBuilder::Mode::kTimed, options_.seed,
                             /*wave_memory_cap=*/false, options_.max_candidates),
               &stats_.timed_start));
  // The baselines' routes start too, so the result is never worse than them
  // by the search's own measure.
  consider(SkipNoCollisionRoutes(cost_, assignment_, rules_), &stats_.static_start).IgnoreError();
  double random_start = kInf;
  consider(RandomSkipRoutes(cost_, assignment_, rules_, options_.seed), &random_start)
      .IgnoreError();
  // Lanes per data node, per memory slot, per wave.
  for (const LaneOptions& lo : LaneVariants(rules_, options_.seed, /*restarts=*/12)) {
    auto sets = LaneRouteSets(cost_, assignment_, rules_, lo);
    if (!sets.ok()) continue;
    for (std::vector<sim::Route>& lanes : *sets) {
      double value = kInf;
      consider(std::move(lanes), &value).IgnoreError();
      stats_.lane_start = std::min(stats_.lane_start, value);
    }
  }
  if (options_.initial_routes != nullptr &&
      ValidateRoutes(cost_, sim::Plan{assignment_, *options_.initial_routes}, rules_).ok()) {
    consider(*options_.initial_routes, &stats_.warm_start).IgnoreError();
  }
  if (best_value == kInf) {
    return absl::FailedPreconditionError("no starting route set can be simulated");
  }

  // Visit caps of the quotas the starts realised (all starts share them).
  std::vector<int> stage_visits(rules_.num_stages, 0);
  for (const sim::Route& r : best) {
    for (size_t i = 1; i < r.stages.size(); ++i) ++stage_visits[r.stages[i]];
  }
  ASSIGN_OR_RETURN(std::vector<int> caps, NodeVisitCaps(rules_, cost_, assignment_, stage_visits));

  const int events_per_sim =
      std::max<int>(1, 6 * rules_.total_microbatches() * std::max(1, rules_.visited_stages));
  const int budget = options_.max_evaluations >= 0
                         ? options_.max_evaluations
                         : static_cast<int>(std::clamp(1.5e7 / events_per_sim, 300.0, 20000.0));
  const int first_evaluation = evaluator_.evaluations();
  std::vector<sim::Route> current = best;
  double current_value = best_value;
  // Phase 1 moves whole lanes (when the best start has any), phase 2 single
  // microbatches; each gets half the budget when both run.
  std::vector<std::vector<int>> lanes = LanesOf(best);
  const bool lane_phase = lanes.size() < best.size();
  int phase_budget = lane_phase ? budget / 2 : budget;
  for (int phase = lane_phase ? 1 : 2; phase <= 2; ++phase) {
    if (phase == 2) {
      current = best;
      current_value = best_value;
      phase_budget = budget - (evaluator_.evaluations() - first_evaluation);
    }
    RouteMoves search(cost_, assignment_, rules_, current,
                      phase == 1 ? lanes : Singletons(current.size()), caps,
                      options_.seed ^ (0xA5A5A5A55A5A5A5Aull + phase));
    // Late acceptance: a candidate is kept when it beats the current plan
    // or the plan of `history.size()` steps ago, which lets the search cross
    // plateaus and small ridges that stop a pure descent.
    std::vector<double> history(std::clamp(phase_budget / 40, 8, 400), current_value);
    const int phase_start = evaluator_.evaluations();
    int step = 0;
    int attempts = 0;
    while (evaluator_.evaluations() - phase_start < phase_budget &&
           attempts < 20 * phase_budget + 100) {
      ++attempts;
      if (options_.time_budget_s > 0 && (attempts & 15) == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() >
              options_.time_budget_s) {
        break;
      }
      if (!search.Propose()) continue;
      double& slot = history[step % history.size()];
      const double threshold = std::max(current_value, slot);
      const double candidate = evaluator_.Score(assignment_, current, threshold);
      if (candidate <= threshold) {
        search.Keep();
        if (candidate < current_value - 1e-12) ++stats_.accepted;
        current_value = candidate;
        if (candidate < best_value) {
          best_value = candidate;
          best = current;
        }
      } else {
        search.Undo();
      }
      slot = current_value;
      ++step;
    }
  }
  stats_.evaluations = evaluator_.evaluations() - first_evaluation;
  stats_.final_objective = best_value;
  std::sort(best.begin(), best.end(),
            [](const sim::Route& a, const sim::Route& b) { return a.microbatch < b.microbatch; });
  return best;
}

}  // namespace detour::planner
