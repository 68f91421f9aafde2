#include "coordinator/planner/route_sets.h"

#include <algorithm>
#include <limits>
#include <queue>
#include <tuple>

#include "absl/strings/str_format.h"
#include "common/sim/event_simulator.h"
#include "common/status.h"

namespace detour::planner {

absl::Status CheckRouteShape(const sim::StageAssignment& assignment, const RouteRules& rules) {
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
  if (absl::Status s = CheckRouteShape(assignment, rules); !s.ok()) return s;
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

}  // namespace detour::planner
