#include "coordinator/planner/route_rules.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>

#include "absl/strings/str_format.h"
#include "common/spec.h"

namespace detour::planner {

RouteRules RulesFromPipeline(const v1::PipelineSpec& p, bool full) {
  RouteRules r;
  r.num_stages = static_cast<int>(p.num_stages());
  r.visited_stages = full ? r.num_stages : VisitedStages(p);
  r.data_nodes = static_cast<int>(p.data_nodes());
  r.microbatches_per_data_node = static_cast<int>(p.microbatches_per_data_node());
  r.max_jump = full ? 1 : static_cast<int>(p.max_jump());
  r.max_swaps = full ? 0 : static_cast<int>(p.max_swaps());
  r.max_swap_distance = static_cast<int>(p.max_swap_distance());
  r.max_total_swap_distance = static_cast<int>(p.max_total_swap_distance());
  r.memory_slots = static_cast<int>(std::max(1u, p.memory_slots()));
  r.max_visits_per_node = full ? -1 : static_cast<int>(p.max_visits_per_node());
  return r;
}

absl::StatusOr<std::vector<int>> NodeVisitCaps(const RouteRules& rules, const sim::CostModel& cost,
                                               const sim::StageAssignment& assignment,
                                               const std::vector<int>& stage_visits) {
  constexpr int kNone = std::numeric_limits<int32_t>::max();
  std::vector<int> caps(cost.num_nodes(), kNone);
  if (rules.max_visits_per_node < 0) return caps;
  for (int s = 1; s < assignment.num_stages(); ++s) {
    const auto& nodes = assignment.stage_nodes[s];
    if (nodes.empty()) continue;
    const int visits = s < static_cast<int>(stage_visits.size()) ? stage_visits[s] : 0;
    const int share = static_cast<int>((visits + nodes.size() - 1) / nodes.size());
    if (rules.max_visits_per_node > 0 &&
        static_cast<long>(rules.max_visits_per_node) * static_cast<long>(nodes.size()) < visits) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "pipeline.max_visits_per_node: %d visits per node × %d replicas of stage %d cannot "
          "take its %d visits; raise it to at least %d or set 0 (derived)",
          rules.max_visits_per_node, nodes.size(), s, visits, share));
    }
    for (int n : nodes) {
      if (n < 0 || n >= cost.num_nodes()) continue;
      const int base = rules.max_visits_per_node > 0
                           ? rules.max_visits_per_node
                           : std::max(1, cost.memory_slots(n)) * rules.rounds();
      caps[n] = std::max(base, share);
    }
  }
  return caps;
}

std::string CheckStageOrder(const RouteRules& rules, const std::vector<int>& stages) {
  int frontier = 0;
  int swaps = 0;
  int total = 0;
  for (size_t i = 1; i < stages.size(); ++i) {
    const int v = stages[i];
    if (v > frontier) {
      if (v - frontier > rules.max_jump) {
        return absl::StrFormat("jumps from frontier stage %d to stage %d (%d > max_jump %d)",
                               frontier, v, v - frontier, rules.max_jump);
      }
      frontier = v;
      continue;
    }
    const int dist = frontier - v;
    ++swaps;
    total += dist;
    if (swaps > rules.max_swaps) {
      return absl::StrFormat("swap back to stage %d is swap %d (> max_swaps %d)", v, swaps,
                             rules.max_swaps);
    }
    if (dist > rules.max_swap_distance) {
      return absl::StrFormat(
          "swap from frontier %d back to stage %d goes %d back (> max_swap_distance %d)", frontier,
          v, dist, rules.max_swap_distance);
    }
    if (total > rules.max_total_swap_distance) {
      return absl::StrFormat("total swap distance %d > max_total_swap_distance %d", total,
                             rules.max_total_swap_distance);
    }
  }
  return "";
}

std::vector<int> StageQuotas(const RouteRules& rules, const std::vector<double>& capacity) {
  const int s = rules.num_stages;
  std::vector<int> quota(s, 0);
  if (s <= 1) return quota;
  const long visits = static_cast<long>(rules.total_microbatches()) * (rules.visited_stages - 1);
  const int base = static_cast<int>(visits / (s - 1));
  int rest = static_cast<int>(visits % (s - 1));
  for (int i = 1; i < s; ++i) quota[i] = base;
  std::vector<int> order(s - 1);
  std::iota(order.begin(), order.end(), 1);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const double ca = a < static_cast<int>(capacity.size()) ? capacity[a] : 0;
    const double cb = b < static_cast<int>(capacity.size()) ? capacity[b] : 0;
    return ca > cb;
  });
  for (int i = 0; i < rest; ++i) ++quota[order[i]];
  return quota;
}

}  // namespace detour::planner
