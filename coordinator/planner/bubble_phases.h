// The pure steps of the bubble planner's iteration pass (bubble_planner.h):
// the free gaps of a node's timeline, whether items fit them, the refresh
// window's decision for an iteration, and the tasks' final order. Each is a
// function of its arguments, tested on its own (bubble_phases_test.cc); the
// pass that strings them together with the planner's state lives in
// bubble_iteration.cc. Thread-safe (pure functions).
#ifndef DETOUR_COORDINATOR_PLANNER_BUBBLE_PHASES_H_
#define DETOUR_COORDINATOR_PLANNER_BUBBLE_PHASES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/planner/bubble_planner.h"
#include "detour/v1/control_service.pb.h"

namespace detour::planner {

// Times compare with a small tolerance: timelines come from sums of doubles.
inline constexpr double kBubbleEps = 1e-9;

using Gap = std::pair<double, double>;  // [start, end) in seconds

// Free time of one node: [0, end) minus its busy intervals, sorted.
std::vector<Gap> Gaps(const NodeTimeline& node, double end);

// True when items of lengths `needs` fit the gaps one after another (each
// within one gap), the first from `ready` on.
bool FitsInOrder(const std::vector<Gap>& gaps, double ready, const std::vector<double>& needs);

// True when an item of length `need` ready at `ready` fits some gap.
bool FitsSomeGap(const std::vector<Gap>& gaps, double ready, double need);

// Seconds of [0, end) the node spends on pipeline work (forward, backward,
// loss, transfers it waits for; not kOther).
double PipelineBusy(const NodeTimeline& node, double end);

// The refresh window's decision for one iteration.
struct WindowDecision {
  // Iterations of the window, this one included (0 without K-FAC work).
  uint64_t age = 0;
  // Everything the oldest refresh owes must finish in this iteration: a
  // checkpoint closes the window, a fixed interval ends, or (serial
  // placement) every iteration.
  bool final_iteration = false;
  // Work is placed this iteration: into the bubbles, or serially in the
  // window's final iteration.
  bool place = false;
  // A second refresh joins the one in flight: at once (bubbles, adaptive
  // interval) or in the window's final iteration (fixed interval); never
  // with serial placement nor in an iteration that closes the window.
  bool next_joins = false;
};
// `window_start`: the window's first iteration (unset: this one opens it);
// `refreshes_in_flight` before this iteration (after a checkpoint's cut).
// `fixed_interval` 0 = adaptive.
WindowDecision DecideWindow(bool has_work, std::optional<uint64_t> window_start, uint64_t iteration,
                            bool close_window, uint32_t fixed_interval, bool use_bubbles,
                            size_t refreshes_in_flight);

// Deterministic order of an iteration's tasks: node (in `node_order`),
// bubble before serial, start time, refresh (older first: at equal times its
// inversion precedes the next refresh's curvature), then kind.
void OrderTasks(const std::vector<std::string>& node_order, std::vector<v1::BubbleTask>* tasks);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_BUBBLE_PHASES_H_
