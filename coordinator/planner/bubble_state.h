// The bubble planner's state between iterations and the pass that plans one
// iteration with it (bubble_iteration.cc). Internal to the planner: included
// by bubble_planner.cc, bubble_iteration.cc and their tests only.
#ifndef DETOUR_COORDINATOR_PLANNER_BUBBLE_STATE_H_
#define DETOUR_COORDINATOR_PLANNER_BUBBLE_STATE_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/kfac_workload.h"
#include "coordinator/planner/bubble_phases.h"
#include "coordinator/planner/bubble_planner.h"

namespace detour::planner {

using BubbleKind = v1::BubbleTask::Kind;

struct BubblePlanner::State {
  KfacWorkload workload;
  v1::KfacSpec kfac;
  BubblePlannerOptions options;

  // Per node and layer position, for one refresh in flight.
  struct NodeState {
    std::vector<int> owed_a, owed_b;    // curvature microbatches still owed
    std::vector<int> miss_a, miss_b;    // iterations without any fitting gap
    std::vector<bool> synced;           // factors all-reduced (or no sync needed)
    std::vector<double> curvature_end;  // when the layer's last curvature ended
                                        // this iteration (0 when done earlier)
    std::vector<bool> inverted;         // an inversion of the layer was placed
                                        // in an earlier iteration
    // Inversion parts still to run: (kind, layer position, module, part),
    // priority order, an item's parts consecutive and in order. `share`:
    // the part's fraction of the item's time (fixed when the refresh
    // starts, so new costs re-time it without re-splitting).
    struct Inversion {
      BubbleKind kind;
      int layer = 0;
      int module = 0;
      int misses = 0;
      int part = 0;
      int num_parts = 1;
      double share = 1;
    };
    std::vector<Inversion> inversions;
  };
  struct Refresh {
    uint64_t number = 0;
    std::vector<NodeState> nodes;
  };
  // Refreshes in flight, oldest first: at most two. flight[0] may curvature,
  // sync, invert and be activated; flight[1] only collects curvature (and
  // syncs it) until flight[0] is activated.
  std::vector<Refresh> flight;
  uint64_t next_refresh = 0;
  std::optional<uint64_t> last_activated;
  // First planned iteration after the last activation (the refresh window).
  std::optional<uint64_t> window_start;
  std::optional<uint64_t> last_iteration;
  std::vector<int> intervals;

  bool HasWork() const {
    for (const KfacNodeWork& n : workload.nodes) {
      if (!n.layers.empty()) return true;
    }
    return false;
  }
  // Per node and layer position: the shares of each item's parts under the
  // cap (PartShares), from the current costs.
  struct LayerParts {
    std::vector<double> curvature_a, curvature_b;
    std::array<std::vector<double>, kfac::kNumProjections> invert_a, invert_b;
  };
  std::vector<std::vector<LayerParts>> parts;

  bool NeedsSync(int node) const;
  Refresh NewRefresh();
  void ComputeParts();
};

// The gap time (with slack) of the parts of the item whose first part is
// list[i], in order.
template <typename Item>
std::vector<double> PartNeeds(const std::vector<Item>& list, size_t i, double slack) {
  std::vector<double> needs;
  for (size_t k = i; k < list.size() && (k == i || list[k].part > 0); ++k) {
    needs.push_back(list[k].duration * slack);
  }
  return needs;
}

// One iteration's planning over the state, in named phases (PlanIteration
// calls them in this order):
//   OpenRefreshWindow  the window's decision (DecideWindow): refreshes in
//                      flight, whether work is placed and must finish;
//   CollectCurvature   each node's gaps and the curvature microbatches this
//                      iteration's routes offer each refresh in flight;
//   PlaceInGaps        greedy first-fit of curvature and inversion parts into
//                      the gaps, per node, in priority order;
//   BookCurvature      what was placed is booked; curvature that cannot fit
//                      in time spills over into the serial tail;
//   SyncFactors        the factor all-reduce of layers complete on every
//                      replica (serial, replicas together);
//   BookInversions     inversions booked, misses counted, spill-over;
//   ActivateFront      the oldest refresh completes and is activated;
//   Finish             totals, utilisation and the tasks' order.
struct BubblePlanner::IterationPass {
  // Part of a curvature item of this iteration; a microbatch's parts are
  // consecutive and in order, and placed in that order.
  struct Curv {
    BubbleKind kind;
    int layer = 0;
    int mb = 0;
    int part = 0;
    int num_parts = 1;
    double ready = 0;
    double duration = 0;
    bool placed = false;
    double end = 0;  // with slack, when placed in a gap
    bool last() const { return part == num_parts - 1; }
  };

  IterationPass(State& state, uint64_t iteration, const sim::Plan& plan,
                const IterationTimeline& timeline, bool close_window);

  void OpenRefreshWindow();
  void CollectCurvature();
  void PlaceInGaps();
  void BookCurvature();
  void SyncFactors();
  void BookInversions();
  void ActivateFront();
  IterationBubbles Finish();

  using Inversion = State::NodeState::Inversion;
  // The seconds of one inversion part.
  static double InversionSeconds(const KfacLayerCost& c, const Inversion& inv) {
    const double whole = inv.kind == v1::BubbleTask::KIND_INVERT_A ? c.invert_a_s[inv.module]
                                                                   : c.invert_b_s[inv.module];
    return whole * inv.share;
  }
  // `b` is the part right after `a` of the same inversion.
  static bool NextPart(const Inversion& a, const Inversion& b) {
    return a.kind == b.kind && a.layer == b.layer && a.module == b.module && a.part + 1 == b.part;
  }

  // Helpers of the phases.
  void PlaceOnNode(int n);
  void MakeTask(int f, int node, BubbleKind kind, int layer_pos, int module, int microbatch,
                double start, double duration, bool serial, int part = 0, int num_parts = 1);
  void AddSerial(int f, int node, BubbleKind kind, int layer_pos, int module, int microbatch,
                 double duration, int part = 0, int num_parts = 1);
  // Remaining curvature of a layer after this iteration's placements so far.
  int OwedAfter(int f, int n, int l, bool is_a) const;
  // The next refresh's curvature of a layer may start only after the
  // front's first inversion of it (or the front inverted it earlier).
  double CurvatureGate(int n, int l) const;

  State& st;
  const uint64_t iteration;
  const sim::Plan& plan;
  const IterationTimeline& timeline;
  const bool close_window;
  const int num_nodes;
  const double end;
  const double slack;
  const bool use_bubbles;
  const uint32_t fixed;

  WindowDecision window;
  int num_refreshes = 0;  // refreshes placing work this iteration
  IterationBubbles out;
  // Serial time cursor per node, relative to end, and serial work seconds.
  std::vector<double> serial_cursor;
  std::vector<double> serial_work;
  std::vector<v1::BubbleTask> tasks;
  // curv[f][n]: refresh flight[f]'s candidates on node n.
  std::vector<std::vector<std::vector<Curv>>> curv;
  std::vector<std::vector<Gap>> gaps;
  // Microbatches whose forward (backward) ran on the node this iteration.
  std::vector<int> forwards, backwards;
  // The front's first inversion of each layer this iteration: its end (with
  // slack), infinity while none is placed.
  std::vector<std::vector<double>> first_inversion_end;
  // inv_placed[f][n][i]: inversion part i of flight[f] placed in a gap;
  // inv_end: its end with slack.
  std::array<std::vector<std::vector<bool>>, 2> inv_placed;
  std::array<std::vector<std::vector<double>>, 2> inv_end;
  // Rule 2': the next refresh inverts a layer once the front's inversions
  // of it on the node are placed. Not with a fixed interval.
  bool next_inverts = false;
  // Layers synced in this iteration, per refresh in flight.
  std::array<std::vector<std::vector<bool>>, 2> synced_now;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_BUBBLE_STATE_H_
