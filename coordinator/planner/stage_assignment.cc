#include "coordinator/planner/stage_assignment.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"

namespace detour::planner {
namespace {

// Permutation of all nodes cut into groups: data nodes, stage 1, ..., stage
// S-1, unused.
sim::StageAssignment Cut(const std::vector<int>& perm, const RouteRules& rules, int replicas) {
  sim::StageAssignment a;
  a.stage_nodes.resize(rules.num_stages);
  int pos = 0;
  for (int s = 0; s < rules.num_stages; ++s) {
    const int count = s == 0 ? rules.data_nodes : replicas;
    a.stage_nodes[s].assign(perm.begin() + pos, perm.begin() + pos + count);
    pos += count;
  }
  return a;
}

int GroupOf(int pos, const RouteRules& rules, int replicas) {
  if (pos < rules.data_nodes) return 0;
  const int g = 1 + (pos - rules.data_nodes) / replicas;
  return std::min(g, rules.num_stages);  // num_stages = unused
}

}  // namespace

double AssignmentScore(const sim::CostModel& cost, const RouteRules& rules,
                       const sim::StageAssignment& a) {
  const int num_stages = rules.num_stages;
  const double m = rules.microbatches_per_data_node;
  const double total = rules.total_microbatches();
  // (1) Compute load of the busiest stage.
  // A quarter of the mean load is added so that slow nodes are avoided even
  // where they do not set the maximum.
  double compute = 0;
  double load_sum = 0;
  for (int d : a.stage_nodes[0]) {
    const double load = m * (cost.ForwardTime(d, 0) + cost.LossTime(d) + cost.BackwardTime(d, 0));
    compute = std::max(compute, load);
    load_sum += load / a.stage_nodes[0].size();
  }
  if (num_stages > 1) {
    const double visits = total * (rules.visited_stages - 1) / (num_stages - 1);
    for (int s = 1; s < num_stages; ++s) {
      double capacity = 0;
      for (int n : a.stage_nodes[s]) {
        capacity += 1.0 / std::max(1e-12, cost.ForwardTime(n, s) + cost.BackwardTime(n, s));
      }
      const double load = visits / std::max(capacity, 1e-12);
      compute = std::max(compute, load);
      load_sum += load;
    }
  }
  compute += 0.25 * load_sum / num_stages;
  // (2) Slowest all-reduce.
  double allreduce = 0;
  for (int s = 0; s < num_stages; ++s) {
    allreduce = std::max(allreduce, cost.AllReduceTime(a.stage_nodes[s], s));
  }
  // (3) Network: mean cost of a hop to the nearest replica of another stage,
  // times the hops of a round trip, times the waves a data node runs.
  double hop_sum = 0;
  long hop_count = 0;
  for (int s = 0; s < num_stages; ++s) {
    for (int n : a.stage_nodes[s]) {
      for (int t = 0; t < num_stages; ++t) {
        if (t == s) continue;
        double best = std::numeric_limits<double>::infinity();
        for (int other : a.stage_nodes[t]) best = std::min(best, cost.TransferTime(n, other));
        hop_sum += best;
        ++hop_count;
      }
    }
  }
  const double hop = hop_count > 0 ? hop_sum / hop_count : 0;
  int slots = 1;
  if (!a.stage_nodes[0].empty()) slots = std::max(1, cost.memory_slots(a.stage_nodes[0][0]));
  const double waves = std::ceil(m / slots);
  const double network = num_stages > 1 ? waves * 2.0 * rules.visited_stages * hop : 0;
  return compute + allreduce + network;
}

absl::StatusOr<sim::StageAssignment> AssignStages(const sim::CostModel& cost,
                                                  const RouteRules& rules, int replicas,
                                                  const AssignmentOptions& options) {
  const int n = cost.num_nodes();
  const int needed = rules.data_nodes + (rules.num_stages - 1) * replicas;
  if (rules.data_nodes < 1 || (rules.num_stages > 1 && replicas < 1)) {
    return absl::InvalidArgumentError("pipeline needs at least one data node and one replica");
  }
  if (needed > n) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "cluster has %d nodes; the pipeline needs data_nodes + (num_stages-1) × "
        "replicas_per_stage = %d + %d × %d = %d",
        n, rules.data_nodes, rules.num_stages - 1, replicas, needed));
  }
  if (cost.num_stages() != rules.num_stages) {
    return absl::InvalidArgumentError("cost model and pipeline disagree on the stage count");
  }
  // Work per score evaluation grows with the square of the assigned nodes.
  const double work = static_cast<double>(needed) * needed + 1;
  const int restarts = options.restarts > 0 ? options.restarts : (needed <= 64 ? 6 : 2);
  const int trials = options.trials_per_restart > 0
                         ? options.trials_per_restart
                         : static_cast<int>(std::clamp(1.5e8 / work / restarts, 40.0, 3000.0));

  // Starting points: nodes grouped by region (replicas close together),
  // regions dealt round-robin (every stage everywhere), then random ones.
  std::vector<int> by_region(n);
  std::iota(by_region.begin(), by_region.end(), 0);
  // Order by the latency to node 0, a cheap 1-D embedding of geography.
  std::stable_sort(by_region.begin(), by_region.end(), [&](int a, int b) {
    const double la = a == 0 ? 0 : cost.Latency(0, a);
    const double lb = b == 0 ? 0 : cost.Latency(0, b);
    return la < lb;
  });
  Rng rng(options.seed);
  sim::StageAssignment best;
  double best_score = std::numeric_limits<double>::infinity();
  for (int r = 0; r < restarts; ++r) {
    std::vector<int> perm;
    if (r == 0) {
      perm = by_region;
    } else if (r == 1) {
      // Deal the region-sorted nodes to groups in turn.
      const int groups = rules.num_stages;
      std::vector<std::vector<int>> dealt(groups);
      for (int i = 0; i < n; ++i) dealt[i % groups].push_back(by_region[i]);
      for (auto& g : dealt) perm.insert(perm.end(), g.begin(), g.end());
    } else {
      perm.resize(n);
      std::iota(perm.begin(), perm.end(), 0);
      for (int i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng.Uniform(i + 1)]);
    }
    double score = AssignmentScore(cost, rules, Cut(perm, rules, replicas));
    for (int t = 0; t < trials; ++t) {
      const int i = rng.Uniform(needed);
      const int j = rng.Uniform(n);
      if (GroupOf(i, rules, replicas) == GroupOf(j, rules, replicas)) continue;
      std::swap(perm[i], perm[j]);
      const double candidate = AssignmentScore(cost, rules, Cut(perm, rules, replicas));
      if (candidate < score) {
        score = candidate;
      } else {
        std::swap(perm[i], perm[j]);
      }
    }
    if (score < best_score) {
      best_score = score;
      best = Cut(perm, rules, replicas);
    }
  }
  // Keep each group in node order: stable output, readable reports.
  for (auto& nodes : best.stage_nodes) std::sort(nodes.begin(), nodes.end());
  return best;
}

}  // namespace detour::planner
