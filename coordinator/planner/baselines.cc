#include "coordinator/planner/baselines.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <tuple>

#include "absl/strings/str_format.h"
#include "common/sim/event_simulator.h"
#include "common/status.h"

namespace detour::planner {
namespace {

absl::Status CheckShape(const sim::StageAssignment& assignment, const RouteRules& rules) {
  if (assignment.num_stages() != rules.num_stages) {
    return absl::InvalidArgumentError(absl::StrFormat("assignment has %d stages, the pipeline %d",
                                                      assignment.num_stages(), rules.num_stages));
  }
  for (int s = 0; s < rules.num_stages; ++s) {
    if (assignment.stage_nodes[s].empty()) {
      return absl::InvalidArgumentError(absl::StrFormat("stage %d has no node", s));
    }
  }
  if (static_cast<int>(assignment.stage_nodes[0].size()) != rules.data_nodes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("assignment has %d data nodes, the pipeline %d",
                        assignment.stage_nodes[0].size(), rules.data_nodes));
  }
  if (rules.visited_stages < 1 || rules.visited_stages > rules.num_stages) {
    return absl::InvalidArgumentError(absl::StrFormat("visited stages %d outside [1, %d]",
                                                      rules.visited_stages, rules.num_stages));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RebalanceVisits(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                             const RouteRules& rules, std::vector<int>& quota,
                             std::vector<sim::Route>& routes) {
  std::vector<int> visits(cost.num_nodes(), 0);
  for (const auto& r : routes) {
    for (int n : r.nodes) ++visits[n];
  }
  for (int u = 1; u < rules.num_stages; ++u) {
    while (quota[u] < 0) {
      bool moved = false;
      for (int v = 1; v < rules.num_stages && !moved; ++v) {
        if (quota[v] <= 0) continue;
        for (sim::Route& r : routes) {
          const auto pos = std::find(r.stages.begin() + 1, r.stages.end(), u);
          if (pos == r.stages.end()) continue;
          if (std::find(r.stages.begin(), r.stages.end(), v) != r.stages.end()) continue;
          sim::Route changed = r;
          const size_t p = pos - r.stages.begin();
          changed.stages[p] = v;
          int node = assignment.stage_nodes[v][0];
          for (int n : assignment.stage_nodes[v]) {
            if (visits[n] < visits[node]) node = n;
          }
          changed.nodes[p] = node;
          std::vector<std::pair<int, int>> order;
          for (size_t i = 1; i < changed.stages.size(); ++i) {
            order.push_back({changed.stages[i], changed.nodes[i]});
          }
          std::sort(order.begin(), order.end());
          for (size_t i = 0; i < order.size(); ++i) {
            changed.stages[i + 1] = order[i].first;
            changed.nodes[i + 1] = order[i].second;
          }
          if (!CheckStageOrder(rules, changed.stages).empty()) continue;
          --visits[r.nodes[p]];
          ++visits[node];
          r = std::move(changed);
          ++quota[u];
          --quota[v];
          moved = true;
          break;
        }
      }
      if (!moved) {
        return absl::FailedPreconditionError(
            absl::StrFormat("cannot give every stage an equal share of visits under max_jump %d "
                            "(%d of %d stages per route); lower the skip ratio or raise max_jump",
                            rules.max_jump, rules.visited_stages, rules.num_stages));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<double> StageCapacities(const sim::CostModel& cost,
                                    const sim::StageAssignment& assignment) {
  std::vector<double> cap(assignment.num_stages(), 0);
  for (int s = 0; s < assignment.num_stages(); ++s) {
    for (int n : assignment.stage_nodes[s]) {
      cap[s] += 1.0 / std::max(1e-12, cost.ForwardTime(n, s) + cost.BackwardTime(n, s));
    }
  }
  return cap;
}

absl::StatusOr<std::vector<sim::Route>> BuildRouteSet(const sim::CostModel& cost,
                                                      const sim::StageAssignment& assignment,
                                                      const RouteRules& rules,
                                                      RouteBuilder::Mode mode, uint64_t seed,
                                                      bool wave_memory_cap, int max_candidates) {
  if (absl::Status s = CheckShape(assignment, rules); !s.ok()) return s;
  const int num_stages = rules.num_stages;
  const int total = rules.total_microbatches();
  const int m = rules.microbatches_per_data_node;
  const auto& data = assignment.stage_nodes[0];
  std::vector<int> quota = StageQuotas(rules, StageCapacities(cost, assignment));
  ASSIGN_OR_RETURN(const std::vector<int> caps, NodeVisitCaps(rules, cost, assignment, quota));
  std::vector<int> node_load(cost.num_nodes(), 0);
  RouteBuilder builder(cost, assignment, rules, mode, seed, max_candidates);

  std::vector<std::vector<int>> wave_load(m, std::vector<int>(cost.num_nodes(), 0));
  std::vector<sim::Route> routes(total);
  std::vector<double> end(total, 0);
  // (release, k, data index), smallest first.
  using Item = std::tuple<double, int, int>;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> queue;
  std::vector<int> slots(rules.data_nodes);
  for (int i = 0; i < rules.data_nodes; ++i) {
    slots[i] = std::max(1, cost.memory_slots(data[i]));
    for (int k = 0; k < std::min(m, slots[i]); ++k) queue.push({0.0, k, i});
  }
  RouteRequest req;
  QuotaPacer pacer(cost, assignment, rules, quota, total);
  while (!queue.empty()) {
    auto [release, k, i] = queue.top();
    queue.pop();
    const int wave = k / slots[i];
    req.data_node = data[i];
    req.release_s = mode == RouteBuilder::Mode::kTimed ? release : 0;
    pacer.Prepare(req);
    std::optional<BuiltRoute> built;
    // Node visit caps always hold; the per-wave memory cap only if asked.
    std::vector<char> under_cap(cost.num_nodes(), 0);
    for (int n = 0; n < cost.num_nodes(); ++n) under_cap[n] = node_load[n] < caps[n];
    if (wave_memory_cap) {
      req.node_allowed.assign(cost.num_nodes(), 0);
      for (int n = 0; n < cost.num_nodes(); ++n) {
        req.node_allowed[n] = under_cap[n] && wave_load[wave][n] < cost.memory_slots(n);
      }
      built = builder.Build(req);
    }
    req.node_allowed = under_cap;
    if (!built) built = builder.Build(req);
    if (!built) {
      // The quotas left admit no route under the jump limit: take any valid
      // route now and rebalance the visit counts afterwards.
      std::fill(req.allowed.begin() + 1, req.allowed.end(), 1);
      std::fill(req.required.begin(), req.required.end(), 0);
      built = builder.Build(req);
    }
    const int id = MicrobatchId(rules, i, k);
    if (!built) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "no route for microbatch %d satisfies the rules (%d of %d stages per route, "
          "max_jump %d, equal stage visits); lower the skip ratio or raise max_jump",
          id, rules.visited_stages, num_stages, rules.max_jump));
    }
    builder.Commit(*built);
    pacer.Take(built->stages);
    for (size_t p = 1; p < built->stages.size(); ++p) ++node_load[built->nodes[p]];
    for (int n : built->nodes) ++wave_load[wave][n];
    routes[id].microbatch = id;
    routes[id].nodes = built->nodes;
    routes[id].stages = built->stages;
    end[id] = built->score;
    if (k + slots[i] < m) {
      queue.push({mode == RouteBuilder::Mode::kTimed ? end[id] : 0.0, k + slots[i], i});
    }
  }
  RETURN_IF_ERROR(RebalanceVisits(cost, assignment, rules, pacer.quota(), routes));
  return routes;
}

absl::StatusOr<std::vector<sim::Route>> FullPipelineRoutes(const sim::CostModel& cost,
                                                           const sim::StageAssignment& assignment,
                                                           const RouteRules& rules) {
  if (absl::Status s = CheckShape(assignment, rules); !s.ok()) return s;
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

double StaticRouteCost(const sim::CostModel& cost, const sim::Route& route) {
  double total = cost.LossTime(route.nodes[0]);
  const int len = static_cast<int>(route.nodes.size());
  for (int i = 0; i < len; ++i) {
    const int a = route.nodes[i];
    const int b = route.nodes[(i + 1) % len];
    total += cost.ForwardTime(a, route.stages[i]) + cost.BackwardTime(a, route.stages[i]);
    if (a != b) total += cost.TransferTime(a, b) + cost.TransferTime(b, a);
  }
  return total;
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
