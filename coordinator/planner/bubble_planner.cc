#include "coordinator/planner/bubble_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status.h"

namespace detour::planner {
namespace {

using Kind = v1::BubbleTask::Kind;

// Times compare with a small tolerance: timelines come from sums of doubles.
constexpr double kEps = 1e-9;

constexpr int kNumModules = kfac::kNumProjections;

// Free time of one node: [0, end) minus busy, as sorted segments.
std::vector<std::pair<double, double>> Gaps(const NodeTimeline& node, double end) {
  std::vector<BusyInterval> busy = node.busy;
  std::sort(busy.begin(), busy.end(),
            [](const BusyInterval& a, const BusyInterval& b) { return a.start_s < b.start_s; });
  std::vector<std::pair<double, double>> gaps;
  double t = 0;
  for (const BusyInterval& b : busy) {
    const double s = std::min(b.start_s, end);
    if (s > t + kEps) gaps.push_back({t, s});
    t = std::max(t, b.end_s);
  }
  if (end > t + kEps) gaps.push_back({t, end});
  return gaps;
}

// True when an item of length `need` ready at `ready` fits some gap.
bool FitsSomeGap(const std::vector<std::pair<double, double>>& gaps, double ready, double need) {
  for (const auto& [s, e] : gaps) {
    if (std::max(s, ready) + need <= e + kEps) return true;
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

}  // namespace

const std::vector<std::string>& KfacModules() { return kfac::ModuleNames(); }

KfacLayerCost EstimateKfacLayerCost(const v1::ModelShape& shape, double tokens_per_microbatch,
                                    double flops_per_s) {
  return EstimateKfacLayerCost(kfac::BlockWorkload(shape), tokens_per_microbatch, flops_per_s);
}

KfacLayerCost EstimateKfacLayerCost(const kfac::BlockWorkload& block,
                                    double tokens_per_microbatch, double flops_per_s) {
  const double speed = flops_per_s > 0 ? flops_per_s : 1.0;
  KfacLayerCost c;
  c.curvature_a_s = block.CurvatureAFlops(tokens_per_microbatch) / speed;
  c.curvature_b_s = block.CurvatureBFlops(tokens_per_microbatch) / speed;
  for (int m = 0; m < kNumModules; ++m) {
    c.invert_a_s.push_back(block.InvertAFlops(m) / speed);
    c.invert_b_s.push_back(block.InvertBFlops(m) / speed);
  }
  c.precondition_s = block.PreconditionFlops() / speed;
  c.sync_s = 0;
  return c;
}

double StageSyncSeconds(const sim::CostModel& cost, const std::vector<int>& group,
                        const kfac::BlockWorkload& block, kfac::ReplicaSync sync) {
  if (group.size() < 2) return 0;
  double min_bandwidth = 0;
  bool first = true;
  for (int a : group) {
    for (int b : group) {
      if (a == b) continue;
      min_bandwidth = first ? cost.Bandwidth(a, b) : std::min(min_bandwidth, cost.Bandwidth(a, b));
      first = false;
    }
  }
  return kfac::SyncSeconds(block, sync, static_cast<int>(group.size()), min_bandwidth);
}

IterationTimeline TimelineFromSimulation(const sim::SimResult& result) {
  IterationTimeline t;
  t.end_s = result.iteration_time_s;
  t.nodes.resize(result.compute.size());
  for (size_t n = 0; n < result.compute.size(); ++n) {
    for (const sim::Activity& a : result.compute[n]) {
      BusyInterval b;
      b.start_s = a.start_s;
      b.end_s = a.end_s;
      b.microbatch = a.microbatch;
      switch (a.kind) {
        case sim::ActivityKind::kForward:
          b.kind = BusyInterval::Kind::kForward;
          break;
        case sim::ActivityKind::kBackward:
          b.kind = BusyInterval::Kind::kBackward;
          break;
        case sim::ActivityKind::kLoss:
          b.kind = BusyInterval::Kind::kLoss;
          break;
        default:
          // The all-reduce: the worker is in its collective, no bubble.
          b.kind = BusyInterval::Kind::kOther;
          b.microbatch = -1;
          break;
      }
      t.nodes[n].busy.push_back(b);
    }
    std::sort(t.nodes[n].busy.begin(), t.nodes[n].busy.end(),
              [](const BusyInterval& a, const BusyInterval& b) { return a.start_s < b.start_s; });
  }
  return t;
}

IterationTimeline TimelineFromReports(const std::vector<v1::TimingReport>& reports,
                                      const std::vector<std::string>& node_ids) {
  IterationTimeline t;
  t.nodes.resize(node_ids.size());
  std::map<std::string, int> index;
  for (size_t i = 0; i < node_ids.size(); ++i) index.emplace(node_ids[i], static_cast<int>(i));
  for (const v1::TimingReport& r : reports) {
    auto it = index.find(r.node());
    if (it == index.end()) continue;
    t.end_s = std::max(t.end_s, r.iteration_time_s());
    std::vector<BusyInterval>& busy = t.nodes[it->second].busy;
    for (const v1::TaskTiming& task : r.tasks()) {
      // Bubble tasks are what this planner places: counting them as busy
      // would evict K-FAC work from the gaps it was measured in.
      if (task.kind() == v1::TaskTiming::KIND_BUBBLE) continue;
      BusyInterval b;
      b.start_s = task.start_s();
      b.end_s = task.start_s() + std::max(0.0, task.duration_s());
      switch (task.kind()) {
        case v1::TaskTiming::KIND_FORWARD:
          b.kind = BusyInterval::Kind::kForward;
          b.microbatch = static_cast<int>(task.microbatch());
          break;
        case v1::TaskTiming::KIND_BACKWARD:
          b.kind = BusyInterval::Kind::kBackward;
          b.microbatch = static_cast<int>(task.microbatch());
          break;
        case v1::TaskTiming::KIND_LOSS:
          b.kind = BusyInterval::Kind::kLoss;
          b.microbatch = static_cast<int>(task.microbatch());
          break;
        default:
          b.kind = BusyInterval::Kind::kOther;
          break;
      }
      busy.push_back(b);
    }
  }
  // Sorted, and overlaps (clock jitter between threads) trimmed.
  for (NodeTimeline& node : t.nodes) {
    std::sort(node.busy.begin(), node.busy.end(),
              [](const BusyInterval& a, const BusyInterval& b) { return a.start_s < b.start_s; });
    std::vector<BusyInterval> clean;
    double last_end = -std::numeric_limits<double>::infinity();
    for (BusyInterval b : node.busy) {
      b.start_s = std::max(b.start_s, last_end);
      if (b.end_s <= b.start_s) continue;
      last_end = b.end_s;
      clean.push_back(b);
    }
    node.busy = std::move(clean);
  }
  return t;
}

// ---------------------------------------------------------------------------

struct BubblePlanner::State {
  KfacWorkload workload;
  v1::KfacSpec kfac;
  BubblePlannerOptions options;

  // Per node and layer position, for one refresh in flight.
  struct NodeState {
    std::vector<int> owed_a, owed_b;      // curvature microbatches still owed
    std::vector<int> miss_a, miss_b;      // iterations without any fitting gap
    std::vector<bool> synced;             // factors all-reduced (or no sync needed)
    std::vector<double> curvature_end;    // when the layer's last curvature ended
                                          // this iteration (0 when done earlier)
    std::vector<bool> inverted;           // an inversion of the layer was placed
                                          // in an earlier iteration
    // Inversions still to run: (kind, layer position, module), priority order.
    struct Inversion {
      Kind kind;
      int layer = 0;
      int module = 0;
      int misses = 0;
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
  bool NeedsSync(int node) const;
  Refresh NewRefresh();
};

bool BubblePlanner::State::NeedsSync(int node) const {
  if (!kfac.sync_factors()) return false;
  const KfacNodeWork& w = workload.nodes[node];
  if (w.layers.empty() || w.stage < 0) return false;
  for (size_t m = 0; m < workload.nodes.size(); ++m) {
    if (static_cast<int>(m) != node && workload.nodes[m].stage == w.stage &&
        !workload.nodes[m].layers.empty()) {
      return true;
    }
  }
  return false;
}

BubblePlanner::State::Refresh BubblePlanner::State::NewRefresh() {
  Refresh r;
  r.number = next_refresh++;
  const int k = static_cast<int>(std::max<uint32_t>(1, kfac.curvature_microbatches()));
  r.nodes.assign(workload.nodes.size(), NodeState());
  for (size_t n = 0; n < workload.nodes.size(); ++n) {
    const size_t layers = workload.nodes[n].layers.size();
    NodeState& s = r.nodes[n];
    s.owed_a.assign(layers, k);
    s.owed_b.assign(layers, k);
    s.miss_a.assign(layers, 0);
    s.miss_b.assign(layers, 0);
    s.synced.assign(layers, !NeedsSync(static_cast<int>(n)));
    s.curvature_end.assign(layers, 0);
    s.inverted.assign(layers, false);
    for (Kind kind : {v1::BubbleTask::KIND_INVERT_A, v1::BubbleTask::KIND_INVERT_B}) {
      for (size_t l = 0; l < layers; ++l) {
        for (int m = 0; m < kNumModules; ++m) {
          s.inversions.push_back({kind, static_cast<int>(l), m, 0});
        }
      }
    }
  }
  return r;
}

BubblePlanner::BubblePlanner(std::unique_ptr<State> state) : state_(std::move(state)) {}
BubblePlanner::BubblePlanner(BubblePlanner&&) noexcept = default;
BubblePlanner& BubblePlanner::operator=(BubblePlanner&&) noexcept = default;
BubblePlanner::~BubblePlanner() = default;

static absl::Status ValidateWorkload(const KfacWorkload& workload) {
  for (size_t n = 0; n < workload.nodes.size(); ++n) {
    const KfacNodeWork& w = workload.nodes[n];
    if (w.costs.size() != w.layers.size()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bubble planner: node %d (%s) has %d layers but %d cost entries", n, w.node_id,
          w.layers.size(), w.costs.size()));
    }
    for (size_t l = 0; l < w.costs.size(); ++l) {
      const KfacLayerCost& c = w.costs[l];
      if (c.invert_a_s.size() != kNumModules || c.invert_b_s.size() != kNumModules) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bubble planner: node %s layer %d: invert_a_s/invert_b_s need %d entries "
            "(KfacModules), got %d/%d",
            w.node_id, w.layers[l], kNumModules, c.invert_a_s.size(), c.invert_b_s.size()));
      }
      bool bad = !(c.curvature_a_s >= 0) || !(c.curvature_b_s >= 0) ||
                 !(c.precondition_s >= 0) || !(c.sync_s >= 0);
      for (int m = 0; m < kNumModules; ++m) {
        bad = bad || !(c.invert_a_s[m] >= 0) || !(c.invert_b_s[m] >= 0);
      }
      if (bad) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bubble planner: node %s layer %d: durations must be finite and >= 0", w.node_id,
            w.layers[l]));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<BubblePlanner> BubblePlanner::Create(KfacWorkload workload,
                                                    const v1::KfacSpec& kfac,
                                                    BubblePlannerOptions options) {
  if (options.serial_after < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: serial_after %d must be >= 1", options.serial_after));
  }
  if (!(kfac.slack() >= 0) || !std::isfinite(kfac.slack())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: kfac.slack %g must be >= 0", kfac.slack()));
  }
  RETURN_IF_ERROR(ValidateWorkload(workload));
  auto state = std::make_unique<State>();
  state->workload = std::move(workload);
  state->kfac = kfac;
  state->options = options;
  return BubblePlanner(std::move(state));
}

absl::Status BubblePlanner::UpdateCosts(const KfacWorkload& workload) {
  RETURN_IF_ERROR(ValidateWorkload(workload));
  const KfacWorkload& now = state_->workload;
  if (workload.nodes.size() != now.nodes.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bubble planner: new costs for %d nodes, the job has %d", workload.nodes.size(),
        now.nodes.size()));
  }
  for (size_t n = 0; n < now.nodes.size(); ++n) {
    const KfacNodeWork& a = now.nodes[n];
    const KfacNodeWork& b = workload.nodes[n];
    if (a.node_id != b.node_id || a.stage != b.stage || a.layers != b.layers) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "bubble planner: new costs for node %d (%s) change its id, stage or layers", n,
          b.node_id));
    }
  }
  for (size_t n = 0; n < now.nodes.size(); ++n) {
    state_->workload.nodes[n].costs = workload.nodes[n].costs;
  }
  return absl::OkStatus();
}

absl::Status BubblePlanner::SetWorkload(KfacWorkload workload) {
  RETURN_IF_ERROR(ValidateWorkload(workload));
  state_->workload = std::move(workload);
  state_->flight.clear();
  state_->window_start.reset();
  return absl::OkStatus();
}

uint64_t BubblePlanner::completed_refreshes() const { return state_->intervals.size(); }

const std::vector<int>& BubblePlanner::refresh_intervals() const { return state_->intervals; }

double BubblePlanner::mean_refresh_interval() const {
  const std::vector<int>& v = state_->intervals;
  if (v.empty()) return 0;
  double sum = 0;
  for (int i : v) sum += i;
  return sum / v.size();
}

absl::StatusOr<IterationBubbles> BubblePlanner::PlanIteration(uint64_t iteration,
                                                              const sim::Plan& plan,
                                                              const IterationTimeline& timeline,
                                                              bool close_window) {
  State& st = *state_;
  const int num_nodes = static_cast<int>(st.workload.nodes.size());
  if (static_cast<int>(timeline.nodes.size()) != num_nodes) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bubble planner: timeline has %d nodes, the workload %d", timeline.nodes.size(),
        num_nodes));
  }
  if (st.last_iteration && iteration <= *st.last_iteration) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bubble planner: iteration %d planned after iteration %d", iteration,
        *st.last_iteration));
  }
  if (!(timeline.end_s >= 0) || !std::isfinite(timeline.end_s)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: timeline end %g", timeline.end_s));
  }
  st.last_iteration = iteration;

  constexpr double kInf = std::numeric_limits<double>::infinity();
  const double end = timeline.end_s;
  const double slack = 1.0 + st.kfac.slack();
  const bool use_bubbles = st.kfac.placement() != v1::KFAC_PLACEMENT_SERIAL;
  const uint32_t fixed = st.kfac.refresh_interval();

  IterationBubbles out;
  out.bubble_s.assign(num_nodes, 0);
  out.serial_s.assign(num_nodes, 0);
  out.precondition_s.assign(num_nodes, 0);

  const bool work = st.HasWork();
  if (work && !st.window_start) st.window_start = iteration;
  // Iterations of the current window, this one included: the oldest refresh
  // in flight is activated at the end of a window.
  const uint64_t age = work ? iteration - *st.window_start + 1 : 0;
  // The iteration in which everything the oldest refresh still owes must finish.
  const bool final_iteration =
      work && (close_window || (fixed > 0 ? age >= fixed : !use_bubbles));
  // A checkpoint closes the window: nothing younger than the front survives it.
  if (close_window && st.flight.size() > 1) st.flight.resize(1);
  if (work && st.flight.empty()) st.flight.push_back(st.NewRefresh());
  // The next refresh joins at once (bubbles, adaptive interval) or in the last
  // iteration of the current window (fixed interval); never with serial placement
  // nor in an iteration that closes the window.
  if (work && use_bubbles && !close_window && st.flight.size() == 1 &&
      (fixed == 0 || final_iteration)) {
    st.flight.push_back(st.NewRefresh());
  }
  const bool place = work && (use_bubbles || final_iteration);
  // Refreshes placing work this iteration: flight[0] (the front) and flight[1].
  const int num_refreshes = place ? static_cast<int>(st.flight.size()) : 0;

  // Serial time cursor per node, relative to end_s, and serial work seconds.
  std::vector<double> serial_cursor(num_nodes, 0);
  std::vector<double> serial_work(num_nodes, 0);
  std::vector<v1::BubbleTask> tasks;

  auto make_task = [&](int f, int node, Kind kind, int layer_pos, int module, int microbatch,
                       double start, double duration, bool serial) {
    v1::BubbleTask t;
    t.set_kind(kind);
    t.set_node(st.workload.nodes[node].node_id);
    t.set_layer(static_cast<uint32_t>(st.workload.nodes[node].layers[layer_pos]));
    t.set_module(module >= 0 ? KfacModules()[module] : "");
    t.set_microbatch(static_cast<uint32_t>(std::max(0, microbatch)));
    t.set_refresh(st.flight[f].number);
    t.set_planned_start_s(start);
    t.set_planned_duration_s(duration);
    t.set_part(0);
    t.set_num_parts(1);
    t.set_serial(serial);
    tasks.push_back(std::move(t));
    if (kind == v1::BubbleTask::KIND_SYNC_FACTORS) {
      // Network time: on the critical path (serial_s) but not compute.
    } else if (serial) {
      serial_work[node] += duration;
    } else {
      out.bubble_s[node] += duration;
    }
  };
  auto add_serial = [&](int f, int node, Kind kind, int layer_pos, int module, int microbatch,
                        double duration) {
    make_task(f, node, kind, layer_pos, module, microbatch, end + serial_cursor[node], duration,
              true);
    serial_cursor[node] += duration;
  };

  // Microbatches visiting each node, by id.
  std::vector<std::vector<int>> visiting(num_nodes);
  for (const sim::Route& r : plan.routes) {
    for (int n : r.nodes) {
      if (n >= 0 && n < num_nodes) visiting[n].push_back(r.microbatch);
    }
  }

  // One curvature item of this iteration.
  struct Curv {
    Kind kind;
    int layer = 0;
    int mb = 0;
    double ready = 0;
    double duration = 0;
    bool placed = false;
  };
  // curv[f][n]: refresh flight[f]'s candidates on node n.
  std::vector<std::vector<std::vector<Curv>>> curv(
      num_refreshes, std::vector<std::vector<Curv>>(num_nodes));
  std::vector<std::vector<std::pair<double, double>>> gaps(num_nodes);
  // Microbatches whose forward (backward) ran on the node this iteration.
  std::vector<int> forwards(num_nodes, 0), backwards(num_nodes, 0);

  for (int n = 0; n < num_nodes && place; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    const NodeTimeline& tl = timeline.nodes[n];
    gaps[n] = use_bubbles ? Gaps(tl, end) : std::vector<std::pair<double, double>>();

    // Candidate microbatches with their forward / backward end on this node.
    std::vector<int> mbs = visiting[n];
    std::sort(mbs.begin(), mbs.end());
    mbs.erase(std::unique(mbs.begin(), mbs.end()), mbs.end());
    std::vector<std::pair<int, double>> fwd, bwd;  // (mb, end)
    for (int mb : mbs) {
      double f = -1, b = -1;
      for (const BusyInterval& bi : tl.busy) {
        if (bi.microbatch != mb) continue;
        if (bi.kind == BusyInterval::Kind::kForward) f = std::max(f, bi.end_s);
        if (bi.kind == BusyInterval::Kind::kBackward) b = std::max(b, bi.end_s);
      }
      if (f >= 0) fwd.push_back({mb, f});
      if (b >= 0) bwd.push_back({mb, b});
    }
    forwards[n] = static_cast<int>(fwd.size());
    backwards[n] = static_cast<int>(bwd.size());
    // The oldest refresh takes the lowest microbatch ids; the next one the
    // following ids: a microbatch feeds one refresh per layer and kind.
    for (Kind kind : {v1::BubbleTask::KIND_CURVATURE_A, v1::BubbleTask::KIND_CURVATURE_B}) {
      const bool is_a = kind == v1::BubbleTask::KIND_CURVATURE_A;
      const auto& cand = is_a ? fwd : bwd;
      for (size_t l = 0; l < w.layers.size(); ++l) {
        const double d = is_a ? w.costs[l].curvature_a_s : w.costs[l].curvature_b_s;
        size_t next = 0;
        for (int f = 0; f < num_refreshes; ++f) {
          const State::NodeState& ns = st.flight[f].nodes[n];
          const int owed = is_a ? ns.owed_a[l] : ns.owed_b[l];
          for (int i = 0; i < owed && next < cand.size(); ++i, ++next) {
            curv[f][n].push_back(
                {kind, static_cast<int>(l), cand[next].first, cand[next].second, d, false});
          }
        }
      }
    }
    // Layers whose curvature was complete before this iteration.
    for (int f = 0; f < num_refreshes; ++f) {
      auto& ends = st.flight[f].nodes[n].curvature_end;
      std::fill(ends.begin(), ends.end(), 0.0);
    }
  }

  // Remaining curvature of a layer after this iteration's placements so far.
  auto owed_after = [&](int f, int n, int l, bool is_a) {
    const State::NodeState& ns = st.flight[f].nodes[n];
    int owed = is_a ? ns.owed_a[l] : ns.owed_b[l];
    for (const Curv& c : curv[f][n]) {
      if (c.placed && c.layer == l && (c.kind == v1::BubbleTask::KIND_CURVATURE_A) == is_a) {
        --owed;
      }
    }
    return owed;
  };

  // The front's first inversion of each layer this iteration: its end (with
  // slack), kInf while none is placed. The next refresh's curvature of the
  // layer must start after it (or the front inverted the layer earlier).
  std::vector<std::vector<double>> first_inversion_end(num_nodes);
  auto curvature_gate = [&](int n, int l) -> double {
    if (num_refreshes < 2) return 0;
    if (st.flight[0].nodes[n].inverted[l]) return 0;
    return first_inversion_end[n][l];
  };

  // --- Greedy first-fit inside the gaps, per node. -------------------------
  // Priority: the front's curvature A, B, its inversions A, B, then the next
  // refresh's curvature A, B (it may not invert before the front is active).
  std::vector<std::vector<bool>> inv_placed(num_nodes);  // the front's
  for (int n = 0; n < num_nodes && place; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    State::NodeState& ns = st.flight[0].nodes[n];
    inv_placed[n].assign(ns.inversions.size(), false);
    const size_t layers = w.layers.size();
    first_inversion_end[n].assign(layers, kInf);
    if (!use_bubbles) continue;
    // Curvature still owed per layer (A + B) and when its last placed item ends.
    std::vector<int> left(layers, 0);
    std::vector<double> done_at(layers, 0);
    for (size_t l = 0; l < layers; ++l) left[l] = ns.owed_a[l] + ns.owed_b[l];
    auto inv_ready = [&](int l) -> double {
      if (left[l] > 0 || !ns.synced[l]) return kInf;
      // With sync the factors were all-reduced at a previous step: ready at 0.
      return done_at[l];
    };
    for (const auto& gap : gaps[n]) {
      // Plain variables, not structured bindings: lambdas below capture them.
      const double gs = gap.first;
      const double ge = gap.second;
      double t = gs;
      while (t < ge - kEps) {
        bool placed = false;
        double next_ready = kInf;
        auto try_curvature = [&](int f) {
          for (Curv& c : curv[f][n]) {
            if (c.placed) continue;
            const double ready = f == 0 ? c.ready : std::max(c.ready, curvature_gate(n, c.layer));
            if (ready > t + kEps) {
              next_ready = std::min(next_ready, ready);
              continue;
            }
            if (t + c.duration * slack > ge + kEps) continue;
            c.placed = true;
            make_task(f, n, c.kind, c.layer, -1, c.mb, t, c.duration, false);
            t += c.duration * slack;
            if (f == 0) {
              --left[c.layer];
              done_at[c.layer] = std::max(done_at[c.layer], t);
            }
            placed = true;
            return;
          }
        };
        try_curvature(0);
        if (placed) continue;
        for (size_t i = 0; i < ns.inversions.size(); ++i) {
          if (inv_placed[n][i]) continue;
          const auto& inv = ns.inversions[i];
          const double ready = inv_ready(inv.layer);
          if (ready > t + kEps) {
            next_ready = std::min(next_ready, ready);
            continue;
          }
          const KfacLayerCost& c = w.costs[inv.layer];
          const double d = inv.kind == v1::BubbleTask::KIND_INVERT_A ? c.invert_a_s[inv.module]
                                                                     : c.invert_b_s[inv.module];
          if (t + d * slack > ge + kEps) continue;
          inv_placed[n][i] = true;
          make_task(0, n, inv.kind, inv.layer, inv.module, -1, t, d, false);
          t += d * slack;
          first_inversion_end[n][inv.layer] = std::min(first_inversion_end[n][inv.layer], t);
          placed = true;
          break;
        }
        if (placed) continue;
        if (num_refreshes > 1) try_curvature(1);
        if (placed) continue;
        if (next_ready >= ge - kEps) break;
        t = std::max(t, next_ready);
      }
    }
    for (size_t l = 0; l < layers; ++l) ns.curvature_end[l] = done_at[l];
  }

  // --- Curvature: book what was placed, serialise what must be. -----------
  for (int f = 0; f < num_refreshes; ++f) {
    const bool last_chance = f == 0 && final_iteration;
    for (int n = 0; n < num_nodes; ++n) {
      const KfacNodeWork& w = st.workload.nodes[n];
      if (w.layers.empty()) continue;
      State::NodeState& ns = st.flight[f].nodes[n];
      for (Kind kind : {v1::BubbleTask::KIND_CURVATURE_A, v1::BubbleTask::KIND_CURVATURE_B}) {
        const bool is_a = kind == v1::BubbleTask::KIND_CURVATURE_A;
        for (size_t l = 0; l < w.layers.size(); ++l) {
          const int l_int = static_cast<int>(l);
          int owed = owed_after(f, n, l_int, is_a);
          if (owed <= 0) {
            (is_a ? ns.owed_a : ns.owed_b)[l] = 0;
            continue;
          }
          // The next refresh: not before the front's first inversion of the
          // layer on this node (in the bubbles this iteration or earlier). A
          // front inversion that runs serially now only lets it in next time.
          const double gate = f == 0 ? 0 : curvature_gate(n, l_int);
          if (gate == kInf) {
            (is_a ? ns.owed_a : ns.owed_b)[l] = owed;
            continue;
          }
          int& misses = is_a ? ns.miss_a[l] : ns.miss_b[l];
          bool any_candidate = false;
          bool fits = false;
          for (const Curv& c : curv[f][n]) {
            if (c.placed || c.layer != l_int || c.kind != kind) continue;
            any_candidate = true;
            fits = fits || FitsSomeGap(gaps[n], std::max(c.ready, gate), c.duration * slack);
          }
          // The older refresh taking every microbatch of the node is no miss.
          const int ran = is_a ? forwards[n] : backwards[n];
          const bool taken = f > 0 && !any_candidate && ran > 0;
          if (!fits && !taken) ++misses;
          const bool go_serial = last_chance || misses >= st.options.serial_after;
          if (go_serial) {
            for (Curv& c : curv[f][n]) {
              if (c.placed || c.layer != l_int || c.kind != kind) continue;
              c.placed = true;
              add_serial(f, n, kind, l_int, -1, c.mb, c.duration);
              --owed;
            }
            // What no microbatch of this iteration can provide (the node was
            // visited by too few, or by none for serial_after iterations) is
            // waived: the refresh goes ahead with fewer curvature microbatches.
            if (!any_candidate || last_chance) owed = 0;
            misses = 0;
          }
          (is_a ? ns.owed_a : ns.owed_b)[l] = std::max(0, owed);
        }
      }
    }
  }

  // --- Factor sync: serial, all replicas of a stage at once. ---------------
  std::vector<std::vector<bool>> synced_now(num_nodes);  // the front's
  for (int n = 0; n < num_nodes; ++n) {
    synced_now[n].assign(st.workload.nodes[n].layers.size(), false);
  }
  if (place && st.kfac.sync_factors()) {
    // Group replicas by stage, and sync layers in layer order.
    std::map<int, std::vector<int>> stage_nodes;
    for (int n = 0; n < num_nodes; ++n) {
      if (st.NeedsSync(n)) stage_nodes[st.workload.nodes[n].stage].push_back(n);
    }
    for (int f = 0; f < num_refreshes; ++f) {
      for (const auto& [stage, members] : stage_nodes) {
        const KfacNodeWork& first = st.workload.nodes[members[0]];
        for (size_t l = 0; l < first.layers.size(); ++l) {
          const int layer = first.layers[l];
          // Position of the layer on every replica; all must be done.
          bool ready = true;
          bool all_synced = true;
          std::vector<int> pos;
          for (int m : members) {
            const auto& ls = st.workload.nodes[m].layers;
            auto it = std::find(ls.begin(), ls.end(), layer);
            if (it == ls.end()) {
              ready = false;
              break;
            }
            const int p = static_cast<int>(it - ls.begin());
            pos.push_back(p);
            const State::NodeState& ns = st.flight[f].nodes[m];
            if (ns.owed_a[p] > 0 || ns.owed_b[p] > 0) ready = false;
            if (!ns.synced[p]) all_synced = false;
            if (f > 0) {
              // The next refresh's factors are all-reduced with the pending
              // sums: only once the front inverted the layer on every replica
              // in an earlier iteration (rule 1 on all replicas), and not in
              // an iteration with front inversions of the layer in the
              // bubbles (the worker holds inversions of a syncing layer until
              // the all-reduce).
              const State::NodeState& front = st.flight[0].nodes[m];
              if (!front.inverted[p]) ready = false;
              for (size_t i = 0; i < front.inversions.size(); ++i) {
                if (inv_placed[m][i] && front.inversions[i].layer == p) ready = false;
              }
            }
          }
          if (!ready || all_synced) continue;
          double start = 0, duration = 0;
          for (size_t i = 0; i < members.size(); ++i) {
            start = std::max(start, serial_cursor[members[i]]);
            duration = std::max(duration, st.workload.nodes[members[i]].costs[pos[i]].sync_s);
          }
          for (size_t i = 0; i < members.size(); ++i) {
            const int m = members[i];
            serial_cursor[m] = start;
            add_serial(f, m, v1::BubbleTask::KIND_SYNC_FACTORS, pos[i], -1, -1, duration);
            st.flight[f].nodes[m].synced[pos[i]] = true;
            if (f == 0) synced_now[m][pos[i]] = true;
          }
        }
      }
    }
  }

  // --- The front's inversions: book, count misses, serialise. -------------
  for (int n = 0; n < num_nodes && place; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    State::NodeState& ns = st.flight[0].nodes[n];
    std::vector<State::NodeState::Inversion> remaining;
    std::vector<bool> inverted_now(w.layers.size(), false);
    for (size_t i = 0; i < ns.inversions.size(); ++i) {
      auto inv = ns.inversions[i];
      const int l = inv.layer;
      if (inv_placed[n][i]) {
        inverted_now[l] = true;
        continue;
      }
      const bool curvature_done = ns.owed_a[l] == 0 && ns.owed_b[l] == 0;
      const KfacLayerCost& c = w.costs[l];
      const double d = inv.kind == v1::BubbleTask::KIND_INVERT_A ? c.invert_a_s[inv.module]
                                                                 : c.invert_b_s[inv.module];
      if (final_iteration) {
        add_serial(0, n, inv.kind, l, inv.module, -1, d);
        inverted_now[l] = true;
        continue;
      }
      // Ready during this iteration's gaps? (Synced just now: from the next.)
      const bool was_ready = curvature_done && ns.synced[l] && !synced_now[n][l];
      if (was_ready && use_bubbles) {
        if (!FitsSomeGap(gaps[n], ns.curvature_end[l], d * slack)) ++inv.misses;
        if (inv.misses >= st.options.serial_after) {
          add_serial(0, n, inv.kind, l, inv.module, -1, d);
          inverted_now[l] = true;
          continue;
        }
      }
      remaining.push_back(inv);
    }
    ns.inversions = std::move(remaining);
    for (size_t l = 0; l < w.layers.size(); ++l) {
      if (inverted_now[l]) ns.inverted[l] = true;
    }
  }

  // --- Activation of the front. --------------------------------------------
  if (num_refreshes > 0) {
    bool complete = true;
    for (int n = 0; n < num_nodes && complete; ++n) {
      const State::NodeState& ns = st.flight[0].nodes[n];
      if (!ns.inversions.empty()) complete = false;
      for (size_t l = 0; l < ns.owed_a.size() && complete; ++l) {
        if (ns.owed_a[l] > 0 || ns.owed_b[l] > 0 || !ns.synced[l]) complete = false;
      }
    }
    if (complete && (fixed == 0 || final_iteration)) {
      out.activate_refresh = st.flight[0].number;
      st.intervals.push_back(static_cast<int>(age));
      st.window_start.reset();
      st.flight.erase(st.flight.begin());
    }
  }

  // --- Totals. -------------------------------------------------------------
  double busy = 0, kfac = 0, longest_tail = 0;
  int holders = 0;
  for (int n = 0; n < num_nodes; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    ++holders;
    for (const KfacLayerCost& c : w.costs) out.precondition_s[n] += c.precondition_s;
    out.serial_s[n] = serial_cursor[n];
    busy += PipelineBusy(timeline.nodes[n], end);
    kfac += out.bubble_s[n] + serial_work[n] + out.precondition_s[n];
    longest_tail = std::max(longest_tail, out.serial_s[n] + out.precondition_s[n]);
  }
  out.iteration_time_s = end + longest_tail;
  if (holders > 0 && end > 0) out.utilization_before = busy / (holders * end);
  if (holders > 0 && out.iteration_time_s > 0) {
    out.utilization_after = (busy + kfac) / (holders * out.iteration_time_s);
  }

  // Deterministic order: node, bubble before serial, start time, refresh
  // (older first: at equal times its inversion precedes the next refresh's
  // curvature), then kind.
  std::map<std::string, int> node_index;
  for (int n = 0; n < num_nodes; ++n) node_index.emplace(st.workload.nodes[n].node_id, n);
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const v1::BubbleTask& a, const v1::BubbleTask& b) {
                     return std::make_tuple(node_index[a.node()], a.serial(), a.planned_start_s(),
                                            a.refresh(), static_cast<int>(a.kind())) <
                            std::make_tuple(node_index[b.node()], b.serial(), b.planned_start_s(),
                                            b.refresh(), static_cast<int>(b.kind()));
                   });
  out.tasks = std::move(tasks);
  return out;
}

}  // namespace detour::planner
