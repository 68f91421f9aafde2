// The plan of one iteration in index form: which nodes hold which stage and
// the route of every microbatch. Plain value types, no invariants enforced
// here (coordinator/planner/route_validator.h checks the skippipe rules; the
// simulator checks only what it needs to run).
#ifndef DETOUR_COMMON_SIM_PLAN_H_
#define DETOUR_COMMON_SIM_PLAN_H_

#include <vector>

namespace detour::sim {

// Node-to-stage assignment. stage_nodes[s] lists the node indices (positions
// in ClusterSpec.nodes) holding stage s; stage 0 holds the data nodes. A node
// appears in at most one stage; nodes in none are unused.
struct StageAssignment {
  std::vector<std::vector<int>> stage_nodes;

  int num_stages() const { return static_cast<int>(stage_nodes.size()); }
  // Stage of every node, -1 for unused nodes.
  std::vector<int> NodeStages(int num_nodes) const {
    std::vector<int> stage(num_nodes, -1);
    for (int s = 0; s < num_stages(); ++s) {
      for (int n : stage_nodes[s]) {
        if (n >= 0 && n < num_nodes) stage[n] = s;
      }
    }
    return stage;
  }
};

// One microbatch's way through the pipeline: the forward visiting order
// starting at its data node (nodes[0], stage 0), without the return. The loss
// runs on nodes[0]; the backward walks the route in reverse.
struct Route {
  int microbatch = 0;
  std::vector<int> nodes;
  std::vector<int> stages;  // Same length as nodes; stages[0] == 0.
};

struct Plan {
  StageAssignment assignment;
  std::vector<Route> routes;
};

}  // namespace detour::sim

#endif  // DETOUR_COMMON_SIM_PLAN_H_
