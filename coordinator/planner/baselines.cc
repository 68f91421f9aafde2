#include "coordinator/planner/baselines.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <tuple>

#include "absl/strings/str_format.h"
#include "common/sim/event_simulator.h"
#include "common/status.h"

namespace detour::planner {

absl::StatusOr<std::vector<sim::Route>> FullPipelineRoutes(const sim::CostModel& cost,
                                                           const sim::StageAssignment& assignment,
                                                           const RouteRules& rules) {
  if (absl::Status s = CheckRouteShape(assignment, rules); !s.ok()) return s;
  const int num_stages = rules.num_stages;
  // Columns: as many as the smallest non-zero stage has replicas.
  int columns = std::numeric_limits<int>::max();
  for (int s = 1; s < num_stages; ++s) {
    columns = std::min<int>(columns, assignment.stage_nodes[s].size());
  }
  if (num_stages == 1) columns = 1;
  // column_nodes[c][s]; stage 0 is filled per data node below.
  std::vector<std::vector<int>> column_nodes(columns, std::vector<int>(num_stages, -1));
  for (int s = 1; s < num_stages; ++s) {
    const auto& nodes = assignment.stage_nodes[s];
    std::vector<char> used(nodes.size(), 0);
    std::vector<char> done(columns, 0);
    // Greedy matching: the cheapest (column, node) link first.
    for (int round = 0; round < columns; ++round) {
      double best = std::numeric_limits<double>::infinity();
      int bc = -1, bj = -1;
      for (int c = 0; c < columns; ++c) {
        if (done[c]) continue;
        for (size_t j = 0; j < nodes.size(); ++j) {
          if (used[j]) continue;
          const double link = s == 1 ? 0 : cost.TransferTime(column_nodes[c][s - 1], nodes[j]);
          if (link < best) {
            best = link;
            bc = c;
            bj = static_cast<int>(j);
          }
        }
      }
      done[bc] = 1;
      used[bj] = 1;
      column_nodes[bc][s] = nodes[bj];
    }
  }
  // Data nodes: the least loaded column, ties to the best-connected one.
  std::vector<int> load(columns, 0);
  std::vector<sim::Route> routes;
  routes.reserve(rules.total_microbatches());
  for (int i = 0; i < rules.data_nodes; ++i) {
    const int d = assignment.stage_nodes[0][i];
    int bc = 0;
    for (int c = 1; c < columns; ++c) {
      if (load[c] < load[bc]) {
        bc = c;
      } else if (load[c] == load[bc] && num_stages > 1) {
        const double a = cost.TransferTime(d, column_nodes[c][1]) +
                         cost.TransferTime(column_nodes[c][num_stages - 1], d);
        const double b = cost.TransferTime(d, column_nodes[bc][1]) +
                         cost.TransferTime(column_nodes[bc][num_stages - 1], d);
        if (a < b) bc = c;
      }
    }
    ++load[bc];
    for (int k = 0; k < rules.microbatches_per_data_node; ++k) {
      sim::Route r;
      r.microbatch = MicrobatchId(rules, i, k);
      r.nodes.push_back(d);
      r.stages.push_back(0);
      for (int s = 1; s < num_stages; ++s) {
        r.nodes.push_back(column_nodes[bc][s]);
        r.stages.push_back(s);
      }
      routes.push_back(std::move(r));
    }
  }
  std::sort(routes.begin(), routes.end(),
            [](const sim::Route& a, const sim::Route& b) { return a.microbatch < b.microbatch; });
  return routes;
}

absl::StatusOr<std::vector<sim::Route>> RandomSkipRoutes(const sim::CostModel& cost,
                                                         const sim::StageAssignment& assignment,
                                                         const RouteRules& rules, uint64_t seed) {
  // Nodes are drawn without regard to load as well: balancing them per wave
  // would already be a (network-blind) scheduling heuristic.
  auto routes = BuildRouteSet(cost, assignment, rules, RouteBuilder::Mode::kRandom, seed,
                              /*wave_memory_cap=*/false, /*max_candidates=*/0);
  if (!routes.ok() || rules.max_swaps == 0) return routes;
  // Random reorderings within the swap limits; dropped again if they could
  // deadlock on memory slots.
  std::vector<sim::Route> swapped = *routes;
  Rng rng(seed ^ 0x5eed5eedull);
  for (sim::Route& r : swapped) {
    const int len = static_cast<int>(r.stages.size());
    if (len < 3 || rng.Uniform(2) == 0) continue;
    const int i = 1 + rng.Uniform(len - 2);
    std::swap(r.stages[i], r.stages[i + 1]);
    std::swap(r.nodes[i], r.nodes[i + 1]);
    if (!CheckStageOrder(rules, r.stages).empty()) {
      std::swap(r.stages[i], r.stages[i + 1]);
      std::swap(r.nodes[i], r.nodes[i + 1]);
    }
  }
  sim::Plan plan{assignment, swapped};
  sim::SimOptions options;
  options.record_timeline = false;
  if (sim::Simulate(cost, plan, options).ok()) return swapped;
  return routes;
}

absl::StatusOr<std::vector<sim::Route>> SkipNoCollisionRoutes(
    const sim::CostModel& cost, const sim::StageAssignment& assignment, const RouteRules& rules) {
  ASSIGN_OR_RETURN(std::vector<sim::Route> routes,
                   BuildRouteSet(cost, assignment, rules, RouteBuilder::Mode::kStatic, 0,
                                 /*wave_memory_cap=*/true));
  // The greedy favours the microbatches planned first; a local search on the
  // summed static cost (still blind to time, hence to collisions) spreads
  // the good links fairly. Moves keep quotas and per-wave memory caps.
  const int num_routes = static_cast<int>(routes.size());
  const int visits = rules.visited_stages - 1;
  if (num_routes < 1 || visits < 1) return routes;
  const int m = rules.microbatches_per_data_node;
  auto wave_of = [&](const sim::Route& r) {
    return (r.microbatch % m) / std::max(1, cost.memory_slots(r.nodes[0]));
  };
  std::vector<std::vector<int>> wave_load(m, std::vector<int>(cost.num_nodes(), 0));
  std::vector<double> route_cost(num_routes);
  std::vector<int> node_load(cost.num_nodes(), 0);
  std::vector<int> stage_visits(rules.num_stages, 0);
  for (int r = 0; r < num_routes; ++r) {
    for (int n : routes[r].nodes) ++wave_load[wave_of(routes[r])][n];
    for (size_t p = 1; p < routes[r].nodes.size(); ++p) {
      ++node_load[routes[r].nodes[p]];
      ++stage_visits[routes[r].stages[p]];
    }
    route_cost[r] = StaticRouteCost(cost, routes[r]);
  }
  ASSIGN_OR_RETURN(const std::vector<int> caps,
                   NodeVisitCaps(rules, cost, assignment, stage_visits));
  Rng rng(0x51a71c);
  const int iterations = std::min(400 * num_routes, 2000000);
  for (int it = 0; it < iterations; ++it) {
    const int r1 = rng.Uniform(num_routes);
    const int w1 = wave_of(routes[r1]);
    if (rng.Uniform(2) == 0) {
      // Re-home a visit to a replica with room in this wave.
      const int pos = 1 + rng.Uniform(visits);
      const auto& replicas = assignment.stage_nodes[routes[r1].stages[pos]];
      const int node = replicas[rng.Uniform(static_cast<int>(replicas.size()))];
      const int old = routes[r1].nodes[pos];
      if (node == old || wave_load[w1][node] >= cost.memory_slots(node) ||
          node_load[node] >= caps[node]) {
        continue;
      }
      routes[r1].nodes[pos] = node;
      const double c = StaticRouteCost(cost, routes[r1]);
      if (c < route_cost[r1] - 1e-12) {
        route_cost[r1] = c;
        --wave_load[w1][old];
        ++wave_load[w1][node];
        --node_load[old];
        ++node_load[node];
      } else {
        routes[r1].nodes[pos] = old;
      }
      continue;
    }
    // Exchange one node between two routes of the same wave visiting the
    // same stage: loads stay put.
    const int r2 = rng.Uniform(num_routes);
    if (r2 == r1 || wave_of(routes[r2]) != w1) continue;
    const int p1 = 1 + rng.Uniform(visits);
    int p2 = -1;
    for (int i = 1; i <= visits; ++i) {
      if (routes[r2].stages[i] == routes[r1].stages[p1]) p2 = i;
    }
    if (p2 < 0 || routes[r1].nodes[p1] == routes[r2].nodes[p2]) continue;
    std::swap(routes[r1].nodes[p1], routes[r2].nodes[p2]);
    const double c1 = StaticRouteCost(cost, routes[r1]);
    const double c2 = StaticRouteCost(cost, routes[r2]);
    if (c1 + c2 < route_cost[r1] + route_cost[r2] - 1e-12) {
      route_cost[r1] = c1;
      route_cost[r2] = c2;
    } else {
      std::swap(routes[r1].nodes[p1], routes[r2].nodes[p2]);
    }
  }
  return routes;
}

}  // namespace detour::planner
