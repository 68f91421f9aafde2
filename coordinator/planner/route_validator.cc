#include "coordinator/planner/route_validator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace detour::planner {
namespace {

class Collector {
 public:
  void Add(int microbatch, std::string message) {
    out_.push_back({microbatch, std::move(message)});
  }
  std::vector<Violation> Take() { return std::move(out_); }
  size_t size() const { return out_.size(); }

 private:
  std::vector<Violation> out_;
};

}  // namespace

std::vector<Violation> FindViolations(const sim::CostModel& cost, const sim::Plan& plan,
                                      const RouteRules& rules) {
  Collector v;
  const int n = cost.num_nodes();
  const auto& stage_nodes = plan.assignment.stage_nodes;
  if (plan.assignment.num_stages() != rules.num_stages) {
    v.Add(-1, absl::StrFormat("assignment has %d stages, the pipeline %d",
                              plan.assignment.num_stages(), rules.num_stages));
    return v.Take();
  }
  std::vector<int> node_stage(n, -1);
  for (int s = 0; s < rules.num_stages; ++s) {
    if (stage_nodes[s].empty()) v.Add(-1, absl::StrFormat("stage %d has no node", s));
    for (int node : stage_nodes[s]) {
      if (node < 0 || node >= n) {
        v.Add(-1, absl::StrFormat("stage %d lists node index %d, the cluster has %d nodes", s, node,
                                  n));
        continue;
      }
      if (node_stage[node] >= 0) {
        v.Add(-1, absl::StrFormat("node %s holds stage %d and stage %d", cost.node_id(node),
                                  node_stage[node], s));
      }
      node_stage[node] = s;
    }
  }
  if (v.size() > 0) return v.Take();

  // The microbatch set: ids 0..T-1 once each, M per data node.
  const int total = rules.total_microbatches();
  if (static_cast<int>(plan.routes.size()) != total) {
    v.Add(-1,
          absl::StrFormat("%d routes for %d microbatches (%d data nodes × %d)", plan.routes.size(),
                          total, rules.data_nodes, rules.microbatches_per_data_node));
  }
  std::vector<int> seen(std::max(total, 0), 0);
  std::vector<int> per_data_node(n, 0);
  std::vector<int> visits(rules.num_stages, 0);
  std::vector<int> node_visits(n, 0);

  for (const sim::Route& r : plan.routes) {
    const int mb = r.microbatch;
    if (mb < 0 || mb >= total) {
      v.Add(mb, absl::StrFormat("microbatch id %d outside [0, %d)", mb, total));
    } else if (++seen[mb] == 2) {
      v.Add(mb, absl::StrFormat("microbatch %d has more than one route", mb));
    }
    if (r.nodes.size() != r.stages.size()) {
      v.Add(mb, absl::StrFormat("microbatch %d: %d nodes but %d stages", mb, r.nodes.size(),
                                r.stages.size()));
      continue;
    }
    if (r.nodes.empty()) {
      v.Add(mb, absl::StrFormat("microbatch %d: empty route", mb));
      continue;
    }
    bool usable = true;
    for (size_t i = 0; i < r.nodes.size(); ++i) {
      const int node = r.nodes[i];
      if (node < 0 || node >= n) {
        v.Add(mb, absl::StrFormat("microbatch %d: node index %d is not in the cluster", mb, node));
        usable = false;
        continue;
      }
      if (node_stage[node] < 0) {
        v.Add(mb, absl::StrFormat("microbatch %d: node %s holds no stage", mb, cost.node_id(node)));
        usable = false;
      } else if (node_stage[node] != r.stages[i]) {
        v.Add(mb, absl::StrFormat("microbatch %d: node %s holds stage %d, the route says %d", mb,
                                  cost.node_id(node), node_stage[node], r.stages[i]));
        usable = false;
      }
    }
    if (!usable) continue;
    if (r.stages[0] != 0) {
      v.Add(mb, absl::StrFormat("microbatch %d: starts on %s (stage %d), not on a data node", mb,
                                cost.node_id(r.nodes[0]), r.stages[0]));
      continue;
    }
    ++per_data_node[r.nodes[0]];
    if (static_cast<int>(r.stages.size()) != rules.visited_stages) {
      v.Add(mb, absl::StrFormat("microbatch %d: visits %d stages, the skip ratio asks for %d", mb,
                                r.stages.size(), rules.visited_stages));
    }
    std::vector<int> count(rules.num_stages, 0);
    for (size_t i = 1; i < r.stages.size(); ++i) {
      const int s = r.stages[i];
      if (s == 0) {
        v.Add(mb, absl::StrFormat("microbatch %d: visits data node %s besides its own", mb,
                                  cost.node_id(r.nodes[i])));
        continue;
      }
      if (++count[s] == 2) {
        v.Add(mb, absl::StrFormat("microbatch %d: visits stage %d twice", mb, s));
      }
    }
    for (int s = 1; s < rules.num_stages; ++s) visits[s] += std::min(count[s], 1);
    for (size_t i = 1; i < r.nodes.size(); ++i) {
      if (r.stages[i] != 0) ++node_visits[r.nodes[i]];
    }
    const std::string order = CheckStageOrder(rules, r.stages);
    if (!order.empty()) v.Add(mb, absl::StrFormat("microbatch %d: %s", mb, order));
  }

  for (int d : stage_nodes[0]) {
    if (per_data_node[d] != rules.microbatches_per_data_node) {
      v.Add(-1, absl::StrFormat("data node %s starts %d microbatches, not %d", cost.node_id(d),
                                per_data_node[d], rules.microbatches_per_data_node));
    }
  }
  if (rules.num_stages > 1 && rules.visited_stages > 1) {
    auto [lo, hi] = std::minmax_element(visits.begin() + 1, visits.end());
    if (*hi - *lo > 1) {
      std::vector<std::string> parts;
      for (int s = 1; s < rules.num_stages; ++s) parts.push_back(absl::StrCat(s, ":", visits[s]));
      v.Add(-1, absl::StrCat("stage visits differ by more than one (stage:visits ",
                             absl::StrJoin(parts, " "), ")"));
    }
  }

  if (v.size() == 0) {
    absl::StatusOr<std::vector<int>> caps = NodeVisitCaps(rules, cost, plan.assignment, visits);
    if (!caps.ok()) {
      v.Add(-1, std::string(caps.status().message()));
    } else {
      for (int node = 0; node < n; ++node) {
        if (node_visits[node] > (*caps)[node]) {
          v.Add(-1, absl::StrFormat("node %s (stage %d) gets %d visits, more than its cap %d "
                                    "(memory slots × rounds, pipeline.max_visits_per_node)",
                                    cost.node_id(node), node_stage[node], node_visits[node],
                                    (*caps)[node]));
        }
      }
    }
  }
  return v.Take();
}

absl::Status ValidateRoutes(const sim::CostModel& cost, const sim::Plan& plan,
                            const RouteRules& rules) {
  std::vector<Violation> found = FindViolations(cost, plan, rules);
  if (found.empty()) return absl::OkStatus();
  std::vector<std::string> lines;
  for (size_t i = 0; i < found.size() && i < 10; ++i) lines.push_back(found[i].message);
  if (found.size() > 10) lines.push_back(absl::StrFormat("... and %d more", found.size() - 10));
  return absl::InvalidArgumentError(absl::StrCat(found.size(), " route violation",
                                                 found.size() == 1 ? "" : "s", ": ",
                                                 absl::StrJoin(lines, "; ")));
}

}  // namespace detour::planner
