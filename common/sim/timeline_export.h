// Exports a simulated iteration as a Chrome trace (chrome://tracing,
// ui.perfetto.dev) or as a self-contained SVG timeline a person can read:
// one row per assigned node (grouped by stage), forward / backward / loss /
// transfer / all-reduce / idle in distinct colours, a time axis and a legend.
// Functions are thread-safe (pure).
#ifndef DETOUR_COMMON_SIM_TIMELINE_EXPORT_H_
#define DETOUR_COMMON_SIM_TIMELINE_EXPORT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/plan.h"

namespace detour::sim {

// Trace-event JSON: one process, one thread per node ("w3 · stage 2"),
// complete ("X") events in microseconds; transfers on a second thread per
// node ("w3 · uplink"). `result` must come from a run with record_timeline.
std::string ChromeTraceJson(const CostModel& cost, const Plan& plan, const SimResult& result,
                            absl::string_view title);

// A bar drawn over a node's compute row in addition to the simulated
// activities, e.g. K-FAC work placed in the bubbles (docs/KFAC.md).
struct SvgOverlay {
  int node = 0;
  double start_s = 0;
  double end_s = 0;
  std::string colour;  // "#rrggbb"
  std::string label;   // tooltip
};

struct SvgOptions {
  std::string title;
  // Right end of the time axis in seconds; 0 = the iteration time. Give two
  // timelines the same value to compare them at one scale.
  double max_time_s = 0;
  int width_px = 1400;
  // Extra bars and their legend entries (colour, text). Empty: the SVG is
  // exactly what it is without them.
  std::vector<SvgOverlay> overlays;
  std::vector<std::pair<std::string, std::string>> overlay_legend;
};

// SVG document. `result` must come from a run with record_timeline.
std::string TimelineSvg(const CostModel& cost, const Plan& plan, const SimResult& result,
                        const SvgOptions& options);

}  // namespace detour::sim

#endif  // DETOUR_COMMON_SIM_TIMELINE_EXPORT_H_
