#include "coordinator/stragglers.h"

#include <algorithm>
#include <cmath>

namespace detour {
namespace {

bool Usable(const ForwardSample& s) {
  return s.measured_s > 0 && std::isfinite(s.measured_s) && s.predicted_s > 0 &&
         std::isfinite(s.predicted_s);
}

}  // namespace

std::vector<Slowdown> FindSlowdowns(const std::vector<ForwardSample>& samples, double threshold) {
  std::vector<const ForwardSample*> usable;
  std::vector<double> slowness;
  for (const ForwardSample& s : samples) {
    if (!Usable(s)) continue;
    usable.push_back(&s);
    slowness.push_back(s.measured_s / s.predicted_s);
  }
  double median = 0;
  if (slowness.size() >= 3) {
    std::vector<double> sorted = slowness;
    std::sort(sorted.begin(), sorted.end());
    median = sorted[(sorted.size() - 1) / 2];
  }
  std::vector<Slowdown> out;
  for (size_t i = 0; i < usable.size(); ++i) {
    double reference = 0;
    std::string replica;
    for (size_t j = 0; j < usable.size(); ++j) {
      if (j == i || usable[j]->stage != usable[i]->stage) continue;
      if (replica.empty() || slowness[j] < reference) {
        reference = slowness[j];
        replica = usable[j]->worker;
      }
    }
    if (replica.empty()) reference = median;
    if (!(reference > 0)) continue;
    const double factor = slowness[i] / reference;
    if (factor >= threshold) out.push_back({usable[i]->worker, usable[i]->stage, factor, replica});
  }
  std::sort(out.begin(), out.end(), [](const Slowdown& a, const Slowdown& b) {
    return a.factor != b.factor ? a.factor > b.factor : a.worker < b.worker;
  });
  return out;
}

}  // namespace detour
