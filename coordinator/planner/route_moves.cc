#include "coordinator/planner/route_moves.h"

#include <algorithm>

namespace detour::planner {
namespace {

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

RouteMoves::RouteMoves(const sim::CostModel& cost, const sim::StageAssignment& assignment,
                       const RouteRules& rules, std::vector<sim::Route>& routes,
                       std::vector<std::vector<int>> units, std::vector<int> caps, uint64_t seed)
    : assignment_(assignment),
      rules_(rules),
      routes_(routes),
      members_(std::move(units)),
      caps_(std::move(caps)),
      rng_(seed),
      node_visits_(cost.num_nodes(), 0),
      by_data_(cost.num_nodes()) {
  for (int u = 0; u < static_cast<int>(members_.size()); ++u) {
    paths_.push_back(routes_[members_[u][0]]);
    Tally(u, +1);
    by_data_[paths_[u].nodes[0]].push_back(u);
  }
  for (int s = 1; s < assignment_.num_stages(); ++s) {
    if (assignment_.stage_nodes[s].size() > 1) multi_replica_stages_.push_back(s);
  }
}

// Applies one random move and writes it into the routes. False when the
// drawn move does not apply or breaks a cap (nothing changed then).
bool RouteMoves::Propose() {
  saved_.clear();
  const int num_units = static_cast<int>(paths_.size());
  const int visits = rules_.visited_stages - 1;
  if (num_units == 0 || visits < 1) return false;
  const int kind = rng_.Uniform(100);
  bool ok = false;
  if (kind < 22) {
    ok = Rehome(rng_.Uniform(num_units), 1 + rng_.Uniform(visits));
  } else if (kind < 44) {
    ok = ExchangeNodes(rng_.Uniform(num_units), 1 + rng_.Uniform(visits));
  } else if (kind < 62) {
    ok = ExchangeStages(rng_.Uniform(num_units), rng_.Uniform(num_units));
  } else if (kind < 74) {
    ok = Reorder(rng_.Uniform(num_units));
  } else if (kind < 86) {
    ok = ExchangeRoutes(rng_.Uniform(num_units));
  } else {
    ok = SwapRoles(rng_.Uniform(2) == 0);
  }
  // Touched units count again; a node over its cap rejects the move.
  for (const auto& [u, path] : saved_) {
    Tally(u, +1);
    for (size_t i = 1; i < paths_[u].nodes.size(); ++i) {
      if (node_visits_[paths_[u].nodes[i]] > caps_[paths_[u].nodes[i]]) ok = false;
    }
  }
  if (!ok) {
    Undo();
    return false;
  }
  for (const auto& [u, path] : saved_) Write(u);
  return true;
}

void RouteMoves::Undo() {
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
    Tally(it->first, -1);
    paths_[it->first] = std::move(it->second);
    Tally(it->first, +1);
    Write(it->first);
  }
  saved_.clear();
}

void RouteMoves::Tally(int u, int sign) {
  const sim::Route& p = paths_[u];
  for (size_t i = 1; i < p.nodes.size(); ++i) node_visits_[p.nodes[i]] += sign * Weight(u);
}

void RouteMoves::Write(int u) {
  for (int r : members_[u]) {
    routes_[r].nodes = paths_[u].nodes;
    routes_[r].stages = paths_[u].stages;
  }
}

// Saves unit u (once per move) and takes its visits out of the tally
// until Propose counts the touched units again.
sim::Route& RouteMoves::Touch(int u) {
  for (const auto& [index, path] : saved_) {
    if (index == u) return paths_[u];
  }
  saved_.push_back({u, paths_[u]});
  Tally(u, -1);
  return paths_[u];
}

bool RouteMoves::Rehome(int u, int pos) {
  const auto& replicas = assignment_.stage_nodes[paths_[u].stages[pos]];
  if (replicas.size() < 2) return false;
  const int node = replicas[rng_.Uniform(static_cast<int>(replicas.size()))];
  if (node == paths_[u].nodes[pos] || node_visits_[node] + Weight(u) > caps_[node]) return false;
  Touch(u).nodes[pos] = node;
  return true;
}

bool RouteMoves::ExchangeNodes(int u1, int p1) {
  const int stage = paths_[u1].stages[p1];
  if (assignment_.stage_nodes[stage].size() < 2) return false;
  const int u2 = rng_.Uniform(static_cast<int>(paths_.size()));
  const int p2 = PositionOfStage(paths_[u2], stage);
  if (u2 == u1 || p2 < 0 || paths_[u2].nodes[p2] == paths_[u1].nodes[p1]) return false;
  const int a = paths_[u1].nodes[p1];
  const int b = paths_[u2].nodes[p2];
  Touch(u1).nodes[p1] = b;
  Touch(u2).nodes[p2] = a;
  return true;
}

// Exchanges a stage visit (with its node) between two units of one size.
bool RouteMoves::ExchangeStages(int u1, int u2) {
  if (u1 == u2 || Weight(u1) != Weight(u2)) return false;
  const int visits = rules_.visited_stages - 1;
  std::vector<int> only1, only2;
  for (int i = 1; i <= visits; ++i) {
    if (PositionOfStage(paths_[u2], paths_[u1].stages[i]) < 0) only1.push_back(i);
    if (PositionOfStage(paths_[u1], paths_[u2].stages[i]) < 0) only2.push_back(i);
  }
  if (only1.empty() || only2.empty()) return false;
  const int p1 = only1[rng_.Uniform(static_cast<int>(only1.size()))];
  const int p2 = only2[rng_.Uniform(static_cast<int>(only2.size()))];
  sim::Route& a = Touch(u1);
  sim::Route& b = Touch(u2);
  std::swap(a.stages[p1], b.stages[p2]);
  std::swap(a.nodes[p1], b.nodes[p2]);
  // Keep each path's existing order where it stays valid.
  for (sim::Route* x : {&a, &b}) {
    if (!CheckStageOrder(rules_, x->stages).empty()) SortVisits(*x);
  }
  return CheckStageOrder(rules_, a.stages).empty() && CheckStageOrder(rules_, b.stages).empty();
}

// Reorders two consecutive visits (creates or removes a swap).
bool RouteMoves::Reorder(int u) {
  const int visits = rules_.visited_stages - 1;
  if (rules_.max_swaps == 0 || visits < 2) return false;
  const int pos = 1 + rng_.Uniform(visits - 1);
  sim::Route& x = Touch(u);
  std::swap(x.stages[pos], x.stages[pos + 1]);
  std::swap(x.nodes[pos], x.nodes[pos + 1]);
  return CheckStageOrder(rules_, x.stages).empty();
}

// Exchanges the paths of two units of one data node (changes which of
// them runs in an earlier wave).
bool RouteMoves::ExchangeRoutes(int u1) {
  const auto& mine = by_data_[paths_[u1].nodes[0]];
  if (mine.size() < 2) return false;
  const int u2 = mine[rng_.Uniform(static_cast<int>(mine.size()))];
  if (u2 == u1 || Weight(u1) != Weight(u2) || paths_[u1].nodes == paths_[u2].nodes) {
    return false;
  }
  sim::Route& a = Touch(u1);
  sim::Route& b = Touch(u2);
  std::swap(a.nodes, b.nodes);
  std::swap(a.stages, b.stages);
  return true;
}

// Two replicas of one stage trade their visits: all of them, or only those
// of one data node's microbatches.
bool RouteMoves::SwapRoles(bool one_data_node) {
  if (multi_replica_stages_.empty()) return false;
  const int stage =
      multi_replica_stages_[rng_.Uniform(static_cast<int>(multi_replica_stages_.size()))];
  const auto& replicas = assignment_.stage_nodes[stage];
  const int a = replicas[rng_.Uniform(static_cast<int>(replicas.size()))];
  const int b = replicas[rng_.Uniform(static_cast<int>(replicas.size()))];
  if (a == b) return false;
  const int data =
      one_data_node ? paths_[rng_.Uniform(static_cast<int>(paths_.size()))].nodes[0] : -1;
  bool changed = false;
  for (int u = 0; u < static_cast<int>(paths_.size()); ++u) {
    if (data >= 0 && paths_[u].nodes[0] != data) continue;
    const int p = PositionOfStage(paths_[u], stage);
    if (p < 0 || (paths_[u].nodes[p] != a && paths_[u].nodes[p] != b)) continue;
    sim::Route& x = Touch(u);
    x.nodes[p] = x.nodes[p] == a ? b : a;
    changed = true;
  }
  return changed;
}

// Microbatches of one data node on the same path form a unit (a lane).
std::vector<std::vector<int>> LanesOf(const std::vector<sim::Route>& routes) {
  std::vector<std::vector<int>> units;
  std::vector<char> done(routes.size(), 0);
  for (size_t a = 0; a < routes.size(); ++a) {
    if (done[a]) continue;
    units.push_back({static_cast<int>(a)});
    for (size_t b = a + 1; b < routes.size(); ++b) {
      if (!done[b] && routes[b].nodes == routes[a].nodes && routes[b].stages == routes[a].stages) {
        units.back().push_back(static_cast<int>(b));
        done[b] = 1;
      }
    }
  }
  return units;
}

std::vector<std::vector<int>> Singletons(size_t n) {
  std::vector<std::vector<int>> units(n);
  for (size_t i = 0; i < n; ++i) units[i] = {static_cast<int>(i)};
  return units;
}

}  // namespace detour::planner
