#include "coordinator/planner/plan_proto.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace detour::planner {

v1::Route ToProtoRoute(const sim::CostModel& cost, const sim::Route& route) {
  v1::Route out;
  out.set_microbatch(route.microbatch);
  if (!route.nodes.empty()) out.set_data_node(cost.node_id(route.nodes[0]));
  for (int n : route.nodes) out.add_nodes(cost.node_id(n));
  for (int s : route.stages) out.add_stages(s);
  return out;
}

absl::StatusOr<sim::Route> FromProtoRoute(const sim::CostModel& cost, const v1::Route& route) {
  sim::Route out;
  out.microbatch = static_cast<int>(route.microbatch());
  if (route.nodes_size() != route.stages_size()) {
    return absl::InvalidArgumentError(absl::StrFormat("microbatch %d: %d nodes but %d stages",
                                                      out.microbatch, route.nodes_size(),
                                                      route.stages_size()));
  }
  if (route.nodes_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("microbatch %d: empty route", out.microbatch));
  }
  if (!route.data_node().empty() && route.data_node() != route.nodes(0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("microbatch %d: data_node %s is not the first node %s", out.microbatch,
                        route.data_node(), route.nodes(0)));
  }
  for (int i = 0; i < route.nodes_size(); ++i) {
    const int n = cost.NodeIndex(route.nodes(i));
    if (n < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("microbatch %d: unknown node \"%s\" (not in the cluster)", out.microbatch,
                          route.nodes(i)));
    }
    out.nodes.push_back(n);
    out.stages.push_back(static_cast<int>(route.stages(i)));
  }
  return out;
}

absl::StatusOr<sim::StageAssignment> AssignmentFromRoutes(const sim::CostModel& cost,
                                                          const std::vector<sim::Route>& routes) {
  std::vector<int> stage(cost.num_nodes(), -1);
  for (const sim::Route& r : routes) {
    for (size_t i = 0; i < r.nodes.size(); ++i) {
      const int s = r.stages[i];
      if (s < 0 || s >= cost.num_stages()) {
        return absl::InvalidArgumentError(absl::StrFormat("microbatch %d: stage %d outside [0, %d)",
                                                          r.microbatch, s, cost.num_stages()));
      }
      int& known = stage[r.nodes[i]];
      if (known >= 0 && known != s) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "node %s is routed as stage %d and as stage %d", cost.node_id(r.nodes[i]), known, s));
      }
      known = s;
    }
  }
  sim::StageAssignment a;
  a.stage_nodes.resize(cost.num_stages());
  for (int n = 0; n < cost.num_nodes(); ++n) {
    if (stage[n] >= 0) a.stage_nodes[stage[n]].push_back(n);
  }
  return a;
}

}  // namespace detour::planner
