#include "coordinator/planner/path_scheduler.h"

#include <algorithm>
#include <cmath>
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
namespace {

// How unevenly `routes` load the nodes: the sum over nodes of their visits
// squared (for a stage's number of visits, least when its replicas share
// them evenly). It breaks ties between route sets the objective scores
// alike: where the model cannot tell an even split from one replica taking
// every microbatch (compute too small next to the links, or a bottleneck
// elsewhere), the plan spreads them, leaving each replica slack for what the
// model does not see.
double Unevenness(const std::vector<sim::Route>& routes) {
  std::vector<double> visits;
  for (const sim::Route& r : routes) {
    for (int node : r.nodes) {
      if (node < 0) continue;
      if (static_cast<size_t>(node) >= visits.size()) visits.resize(node + 1, 0);
      ++visits[node];
    }
  }
  double sum = 0;
  for (double v : visits) sum += v * v;
  return sum;
}

// Scores closer than this (relative) are a tie.
constexpr double kTieTolerance = 1e-9;

// Whether `value` beats `best`: lower, or tied and more even. A tie never
// beats the warm start (`best_is_warm`): the routes a job runs on stay unless
// something is predicted faster, since new routes start cold.
bool Beats(double value, double unevenness, double best, double best_unevenness,
           bool best_is_warm) {
  if (best == kInf) return value < kInf;
  const double tie = kTieTolerance * std::max(std::abs(best), 1e-12);
  if (value < best - tie) return true;
  return !best_is_warm && value <= best + tie && unevenness < best_unevenness;
}

}  // namespace

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
  double best_unevenness = kInf;
  bool best_is_warm = false;
  auto consider = [&](absl::StatusOr<std::vector<sim::Route>> routes, double* slot,
                      bool warm = false) {
    if (!routes.ok()) return routes.status();
    if (absl::Status valid = ValidateRoutes(cost_, sim::Plan{assignment_, *routes}, rules_);
        !valid.ok()) {
      return absl::InternalError(
          absl::StrCat("a starting route set breaks the rules: ", valid.message()));
    }
    const double v = Objective(*routes);
    *slot = v;
    const double unevenness = Unevenness(*routes);
    if (Beats(v, unevenness, best_value, best_unevenness, best_is_warm) ||
        (warm && v <= best_value * (1 + kTieTolerance))) {
      best_value = v;
      best_unevenness = unevenness;
      best_is_warm = warm;
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
    consider(*options_.initial_routes, &stats_.warm_start, /*warm=*/true).IgnoreError();
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
        const double unevenness =
            candidate <= best_value * (1 + kTieTolerance) + 1e-12 ? Unevenness(current) : kInf;
        if (Beats(candidate, unevenness, best_value, best_unevenness, best_is_warm)) {
          best_value = candidate;
          best_unevenness = unevenness;
          best_is_warm = false;
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
