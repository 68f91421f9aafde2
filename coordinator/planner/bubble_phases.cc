#include "coordinator/planner/bubble_phases.h"

#include <algorithm>
#include <map>
#include <string>
#include <tuple>

namespace detour::planner {

std::vector<Gap> Gaps(const NodeTimeline& node, double end) {
  std::vector<BusyInterval> busy = node.busy;
  std::sort(busy.begin(), busy.end(),
            [](const BusyInterval& a, const BusyInterval& b) { return a.start_s < b.start_s; });
  std::vector<Gap> gaps;
  double t = 0;
  for (const BusyInterval& b : busy) {
    const double s = std::min(b.start_s, end);
    if (s > t + kBubbleEps) gaps.push_back({t, s});
    t = std::max(t, b.end_s);
  }
  if (end > t + kBubbleEps) gaps.push_back({t, end});
  return gaps;
}

bool FitsInOrder(const std::vector<Gap>& gaps, double ready, const std::vector<double>& needs) {
  double cursor = ready;
  for (double need : needs) {
    bool found = false;
    for (const auto& [s, e] : gaps) {
      const double start = std::max(s, cursor);
      if (start + need <= e + kBubbleEps) {
        cursor = start + need;
        found = true;
        break;
      }
    }
    if (!found) return false;
  }
  return true;
}

bool FitsSomeGap(const std::vector<Gap>& gaps, double ready, double need) {
  for (const auto& [s, e] : gaps) {
    if (std::max(s, ready) + need <= e + kBubbleEps) return true;
  }
  return false;
}

double PipelineBusy(const NodeTimeline& node, double end) {
  double busy = 0;
  for (const BusyInterval& b : node.busy) {
    if (b.kind == BusyInterval::Kind::kOther) continue;
    busy += std::max(0.0, std::min(b.end_s, end) - std::max(b.start_s, 0.0));
  }
  return busy;
}

WindowDecision DecideWindow(bool has_work, std::optional<uint64_t> window_start, uint64_t iteration,
                            bool close_window, uint32_t fixed_interval, bool use_bubbles,
                            size_t refreshes_in_flight) {
  WindowDecision d;
  if (!has_work) return d;
  const uint64_t start = window_start.value_or(iteration);
  d.age = iteration - start + 1;
  d.final_iteration = close_window || (fixed_interval > 0 ? d.age >= fixed_interval : !use_bubbles);
  // At least the front is in flight once there is work (it starts now if
  // none was).
  const size_t flying = std::max<size_t>(1, refreshes_in_flight);
  d.next_joins =
      use_bubbles && !close_window && flying == 1 && (fixed_interval == 0 || d.final_iteration);
  d.place = use_bubbles || d.final_iteration;
  return d;
}

void OrderTasks(const std::vector<std::string>& node_order, std::vector<v1::BubbleTask>* tasks) {
  std::map<std::string, int> node_index;
  for (size_t n = 0; n < node_order.size(); ++n) {
    node_index.emplace(node_order[n], static_cast<int>(n));
  }
  std::stable_sort(tasks->begin(), tasks->end(),
                   [&](const v1::BubbleTask& a, const v1::BubbleTask& b) {
                     return std::make_tuple(node_index[a.node()], a.serial(), a.planned_start_s(),
                                            a.refresh(), static_cast<int>(a.kind())) <
                            std::make_tuple(node_index[b.node()], b.serial(), b.planned_start_s(),
                                            b.refresh(), static_cast<int>(b.kind()));
                   });
}

}  // namespace detour::planner
