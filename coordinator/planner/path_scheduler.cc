#include "coordinator/planner/path_scheduler.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "common/status.h"
#include "coordinator/planner/baselines.h"
#include "coordinator/planner/route_builder.h"

namespace detour::planner {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Sorts a route's visits after the data node by stage (drops reorderings).
void SortVisits(sim::Route& r) {
  std::vector<std::pair<int, int>> visits;
  for (size_t i = 1; i < r.stages.size(); ++i) visits.push_back({r.stages[i], r.nodes[i]});
  std::sort(visits.begin(), visits.end());
  for (size_t i = 0; i < visits.size(); ++i) {
    r.stages[i + 1] = visits[i].first;
    r.nodes[i + 1] = visits[i].second;
  }
}

int PositionOfStage(const sim::Route& r, int stage) {
  for (size_t i = 1; i < r.stages.size(); ++i) {
    if (r.stages[i] == stage) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

PathScheduler::PathScheduler(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                             const RouteRules& rules, const PathSchedulerOptions& options)
    : cost_(cost), assignment_(assignment), rules_(rules), options_(options) {}

double PathScheduler::Objective(const std::vector<sim::Route>& routes, int64_t* events) {
  if (&routes != &scratch_.routes) scratch_.routes = routes;
  sim::SimOptions sim_options;
  sim_options.contention = options_.contention;
  sim_options.record_timeline = false;
  absl::StatusOr<sim::SimResult> r = sim::Simulate(cost_, scratch_, sim_options);
  if (!r.ok()) return kInf;
  if (events) *events = r->events;
  double mean_end = 0;
  for (const sim::RouteTiming& t : r->routes) mean_end += t.end_s;
  if (!r->routes.empty()) mean_end /= r->routes.size();
  // The iteration first, the pipeline (what the reference reports) second,
  // and earlier microbatch completion as a tie-breaker on plateaus.
  return r->iteration_time_s + r->pipeline_time_s + 1e-3 * mean_end;
}

absl::StatusOr<std::vector<sim::Route>> PathScheduler::Run() {
  stats_ = PathSchedulerStats();
  scratch_.assignment = assignment_;
  ASSIGN_OR_RETURN(std::vector<sim::Route> timed,
                   BuildRouteSet(cost_, assignment_, rules_, RouteBuilder::Mode::kTimed,
                                 options_.seed, /*wave_memory_cap=*/false,
                                 options_.max_candidates));
  ASSIGN_OR_RETURN(std::vector<sim::Route> fixed,
                   BuildRouteSet(cost_, assignment_, rules_, RouteBuilder::Mode::kStatic,
                                 options_.seed, /*wave_memory_cap=*/true,
                                 options_.max_candidates));
  int64_t events = 0;
  stats_.timed_start = Objective(timed, &events);
  stats_.static_start = Objective(fixed);
  double current = stats_.timed_start;
  std::vector<sim::Route> start = std::move(timed);
  if (stats_.static_start < current) {
    current = stats_.static_start;
    start = std::move(fixed);
  }
  scratch_.routes = std::move(start);
  std::vector<sim::Route>& routes = scratch_.routes;
  if (current == kInf) {
    return absl::FailedPreconditionError("no starting route set runs without deadlock");
  }

  const int budget =
      options_.max_evaluations >= 0
          ? options_.max_evaluations
          : static_cast<int>(std::clamp(4e6 / std::max<int64_t>(events, 1), 200.0, 3000.0));
  const int num_routes = static_cast<int>(routes.size());
  const bool can_swap = rules_.max_swaps > 0;
  const int visits = rules_.visited_stages - 1;
  Rng rng(options_.seed ^ 0xA5A5A5A55A5A5A5Aull);
  // Microbatches of each data node, for the route exchange move.
  std::vector<std::vector<int>> by_data(cost_.num_nodes());
  for (int r = 0; r < num_routes; ++r) by_data[routes[r].nodes[0]].push_back(r);

  int attempts = 0;
  while (stats_.evaluations < budget && attempts < 8 * budget + 100 && num_routes > 0 &&
         visits > 0) {
    ++attempts;
    const int kind = rng.Uniform(100);
    int r1 = rng.Uniform(num_routes);
    int r2 = -1;
    sim::Route saved1 = routes[r1];
    sim::Route saved2;
    bool valid = true;
    if (kind < 40) {
      // Re-home one visit to another replica of its stage.
      const int pos = 1 + rng.Uniform(visits);
      const auto& replicas = assignment_.stage_nodes[routes[r1].stages[pos]];
      if (replicas.size() < 2) continue;
      int node = replicas[rng.Uniform(static_cast<int>(replicas.size()))];
      if (node == routes[r1].nodes[pos]) continue;
      routes[r1].nodes[pos] = node;
    } else if (kind < 65) {
      // Exchange a stage visit (with its node) between two microbatches.
      r2 = rng.Uniform(num_routes);
      if (r2 == r1) continue;
      saved2 = routes[r2];
      std::vector<int> only1, only2;
      for (int i = 1; i <= visits; ++i) {
        if (PositionOfStage(routes[r2], routes[r1].stages[i]) < 0) only1.push_back(i);
        if (PositionOfStage(routes[r1], routes[r2].stages[i]) < 0) only2.push_back(i);
      }
      if (only1.empty()) continue;
      const int p1 = only1[rng.Uniform(static_cast<int>(only1.size()))];
      const int p2 = only2[rng.Uniform(static_cast<int>(only2.size()))];
      std::swap(routes[r1].stages[p1], routes[r2].stages[p2]);
      std::swap(routes[r1].nodes[p1], routes[r2].nodes[p2]);
      SortVisits(routes[r1]);
      SortVisits(routes[r2]);
      valid = CheckStageOrder(rules_, routes[r1].stages).empty() &&
              CheckStageOrder(rules_, routes[r2].stages).empty();
    } else if (kind < 80) {
      // Reorder two consecutive visits (creates or removes a swap).
      if (!can_swap || visits < 2) continue;
      const int pos = 1 + rng.Uniform(visits - 1);
      std::swap(routes[r1].stages[pos], routes[r1].stages[pos + 1]);
      std::swap(routes[r1].nodes[pos], routes[r1].nodes[pos + 1]);
      valid = CheckStageOrder(rules_, routes[r1].stages).empty();
    } else {
      // Exchange the routes of two microbatches of one data node (changes
      // which of them runs in an earlier wave).
      const auto& mine = by_data[routes[r1].nodes[0]];
      if (mine.size() < 2) continue;
      r2 = mine[rng.Uniform(static_cast<int>(mine.size()))];
      if (r2 == r1) continue;
      saved2 = routes[r2];
      std::swap(routes[r1].nodes, routes[r2].nodes);
      std::swap(routes[r1].stages, routes[r2].stages);
    }
    double candidate = kInf;
    if (valid) {
      ++stats_.evaluations;
      candidate = Objective(routes);
    }
    if (candidate < current - 1e-12) {
      current = candidate;
      ++stats_.accepted;
    } else {
      routes[r1] = std::move(saved1);
      if (r2 >= 0) routes[r2] = std::move(saved2);
    }
  }
  stats_.final_objective = current;
  std::vector<sim::Route> result = routes;
  std::sort(result.begin(), result.end(),
            [](const sim::Route& a, const sim::Route& b) { return a.microbatch < b.microbatch; });
  return result;
}

}  // namespace detour::planner
