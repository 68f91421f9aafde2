#include "coordinator/stage_reassignment.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace detour {
namespace {

double Rate(double seconds) { return seconds > 0 && std::isfinite(seconds) ? 1.0 / seconds : 0; }

}  // namespace

std::vector<StageMove> CandidateMoves(const std::vector<std::vector<std::string>>& stages,
                                      const StageSeconds& seconds, int limit) {
  const int num_stages = static_cast<int>(stages.size());
  std::vector<double> capacity(num_stages, 0);
  for (int s = 1; s < num_stages; ++s) {
    for (const std::string& w : stages[s]) capacity[s] += Rate(seconds(w, s));
  }
  std::vector<StageMove> out;
  for (int from = 1; from < num_stages; ++from) {
    if (stages[from].size() < 2) continue;
    for (const std::string& w : stages[from]) {
      const double left = capacity[from] - Rate(seconds(w, from));
      for (int to = 1; to < num_stages; ++to) {
        if (to == from) continue;
        const double before = std::min(capacity[from], capacity[to]);
        const double after = std::min(left, capacity[to] + Rate(seconds(w, to)));
        // Relative tolerance: equal capacities computed two ways are no raise.
        if (!(after > before * (1 + 1e-9))) continue;
        StageMove m;
        m.worker = w;
        m.from = from;
        m.to = to;
        m.fills_empty_stage = stages[to].empty();
        m.capacity_gain = after - before;
        out.push_back(std::move(m));
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const StageMove& a, const StageMove& b) {
    return std::make_tuple(-a.capacity_gain, a.worker, a.to) <
           std::make_tuple(-b.capacity_gain, b.worker, b.to);
  });
  if (limit >= 0 && static_cast<int>(out.size()) > limit) out.resize(static_cast<size_t>(limit));
  return out;
}

double StageStateBytes(double parameters, double kfac_values) {
  return 4.0 * (3.0 * std::max(0.0, parameters) + std::max(0.0, kfac_values));
}

double MoveCostSeconds(double state_bytes, double latency_s, double bandwidth_bytes_per_s,
                       double pause_s) {
  double cost = std::max(0.0, pause_s);
  if (bandwidth_bytes_per_s > 0) {
    cost += std::max(0.0, latency_s) + std::max(0.0, state_bytes) / bandwidth_bytes_per_s;
  }
  return cost;
}

std::optional<StageMove> ChooseMove(double current_iteration_s,
                                    const std::vector<StageMove>& judged, uint64_t horizon) {
  if (horizon == 0) return std::nullopt;
  std::optional<StageMove> fill;
  for (const StageMove& m : judged) {
    if (!m.fills_empty_stage) continue;
    if (!fill || m.predicted_iteration_s < fill->predicted_iteration_s) fill = m;
  }
  if (fill) return fill;
  std::optional<StageMove> best;
  double best_net = 0;
  for (const StageMove& m : judged) {
    if (!std::isfinite(m.predicted_iteration_s)) continue;
    double net;
    if (!std::isfinite(current_iteration_s)) {
      net = std::numeric_limits<double>::infinity();
    } else {
      const double gain = current_iteration_s - m.predicted_iteration_s;
      if (!(gain >= kMinMoveGain * current_iteration_s) || !(gain > 0)) continue;
      net = gain * static_cast<double>(horizon) - m.cost_s;
    }
    if (!(net > 0)) continue;
    // Among moves that all pay infinitely, the shortest predicted iteration.
    if (!best || net > best_net ||
        (net == best_net && m.predicted_iteration_s < best->predicted_iteration_s)) {
      best = m;
      best_net = net;
    }
  }
  return best;
}

bool MoveMustSettle(const StageMove& m, const std::map<std::string, MadeMove>& made,
                    uint64_t iteration, uint64_t epoch) {
  if (m.fills_empty_stage) return false;
  auto it = made.find(m.worker);
  if (it == made.end()) return false;
  const MadeMove& last = it->second;
  return last.epoch == epoch && iteration >= last.iteration &&
         iteration - last.iteration < last.horizon;
}

}  // namespace detour
