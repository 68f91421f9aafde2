#include "coordinator/planner/route_rules.h"

#include <algorithm>
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
  return r;
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
      return absl::StrFormat("swap from frontier %d back to stage %d goes %d back (> max_swap_distance %d)",
                             frontier, v, dist, rules.max_swap_distance);
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
