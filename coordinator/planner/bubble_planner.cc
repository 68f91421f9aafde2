#include "coordinator/planner/bubble_planner.h"

#include <algorithm>
#include <array>
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

// True when items of lengths `needs` fit the gaps one after another (each
// within one gap), the first from `ready` on.
bool FitsInOrder(const std::vector<std::pair<double, double>>& gaps, double ready,
                 const std::vector<double>& needs) {
  double cursor = ready;
  for (double need : needs) {
    bool found = false;
    for (const auto& [s, e] : gaps) {
      const double start = std::max(s, cursor);
      if (start + need <= e + kEps) {
        cursor = start + need;
        found = true;
        break;
      }
    }
    if (!found) return false;
  }
  return true;
}

// The gap time (with slack) of the parts of the item whose first part is
// list[i], in order.
template <typename Curv>
std::vector<double> PartNeeds(const std::vector<Curv>& list, size_t i, double slack) {
  std::vector<double> needs;
  for (size_t k = i; k < list.size() && (k == i || list[k].part > 0); ++k) {
    needs.push_back(list[k].duration * slack);
  }
  return needs;
}

// True when an item of length `need` ready at `ready` fits some gap.
bool FitsSomeGap(const std::vector<std::pair<double, double>>& gaps, double ready, double need) {
  for (const auto& [s, e] : gaps) {
    if (std::max(s, ready) + need <= e + kEps) return true;
  }
  return false;
}

// Shares of an item's time per part (in order, summing to 1): the fewest
// parts of `weights` (kfac::PartsForCap) that keep each within `cap_s`.
std::vector<double> PartShares(const std::vector<int64_t>& weights, double seconds, double cap_s) {
  const int parts = weights.empty() ? 1 : kfac::PartsForCap(weights, seconds, cap_s);
  if (parts <= 1) return {1.0};
  const std::vector<int> bounds = kfac::SplitIntoParts(weights, parts);
  double total = 0;
  for (int64_t w : weights) total += static_cast<double>(w);
  if (!(total > 0)) return {1.0};
  std::vector<double> shares;
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    double sum = 0;
    for (int i = bounds[p]; i < bounds[p + 1]; ++i) sum += static_cast<double>(weights[i]);
    shares.push_back(sum / total);
  }
  return shares;
}

// The seconds of one inversion part.
template <typename Inversion>
double InversionSeconds(const KfacLayerCost& c, const Inversion& inv) {
  const double whole = inv.kind == v1::BubbleTask::KIND_INVERT_A ? c.invert_a_s[inv.module]
                                                                 : c.invert_b_s[inv.module];
  return whole * inv.share;
}

// `b` is the part right after `a` of the same inversion.
template <typename Inversion>
bool NextPart(const Inversion& a, const Inversion& b) {
  return a.kind == b.kind && a.layer == b.layer && a.module == b.module && a.part + 1 == b.part;
}

// Block dimensions beyond this are refused (the unit weights are n³).
constexpr int64_t kMaxDimension = int64_t{1} << 20;

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

KfacLayerCost EstimateKfacLayerCost(const kfac::BlockWorkload& block, double tokens_per_microbatch,
                                    double flops_per_s) {
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
  c.shape = block.shape();
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
        case sim::ActivityKind::kForward: b.kind = BusyInterval::Kind::kForward; break;
        case sim::ActivityKind::kBackward: b.kind = BusyInterval::Kind::kBackward; break;
        case sim::ActivityKind::kLoss: b.kind = BusyInterval::Kind::kLoss; break;
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
        default: b.kind = BusyInterval::Kind::kOther; break;
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
      Kind kind;
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
    std::array<std::vector<double>, kNumModules> invert_a, invert_b;
  };
  std::vector<std::vector<LayerParts>> parts;

  bool NeedsSync(int node) const;
  Refresh NewRefresh();
  void ComputeParts();
};

void BubblePlanner::State::ComputeParts() {
  // Serial work is never split: nothing waits for it.
  const double cap_s =
      kfac.placement() == v1::KFAC_PLACEMENT_SERIAL ? 0 : kfac.max_granule_ms() * 1e-3;
  parts.assign(workload.nodes.size(), {});
  for (size_t n = 0; n < workload.nodes.size(); ++n) {
    const KfacNodeWork& w = workload.nodes[n];
    for (const KfacLayerCost& c : w.costs) {
      LayerParts lp;
      if (c.shape.d_model <= 0) {
        lp.curvature_a = lp.curvature_b = {1.0};
        for (int m = 0; m < kNumModules; ++m) lp.invert_a[m] = lp.invert_b[m] = {1.0};
      } else {
        const kfac::BlockWorkload block(c.shape);
        lp.curvature_a = PartShares(block.CurvatureItemWeights(true), c.curvature_a_s, cap_s);
        lp.curvature_b = PartShares(block.CurvatureItemWeights(false), c.curvature_b_s, cap_s);
        for (int m = 0; m < kNumModules; ++m) {
          lp.invert_a[m] =
              PartShares(kfac::InversionUnitWeights(block.f_in(m)), c.invert_a_s[m], cap_s);
          lp.invert_b[m] =
              PartShares(kfac::InversionUnitWeights(block.f_out(m)), c.invert_b_s[m], cap_s);
        }
      }
      parts[n].push_back(std::move(lp));
    }
  }
}

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
          const LayerParts& lp = parts[n][l];
          const std::vector<double>& shares =
              kind == v1::BubbleTask::KIND_INVERT_A ? lp.invert_a[m] : lp.invert_b[m];
          const int num_parts = static_cast<int>(shares.size());
          for (int p = 0; p < num_parts; ++p) {
            s.inversions.push_back({kind, static_cast<int>(l), m, 0, p, num_parts, shares[p]});
          }
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
      return absl::InvalidArgumentError(
          absl::StrFormat("bubble planner: node %d (%s) has %d layers but %d cost entries", n,
                          w.node_id, w.layers.size(), w.costs.size()));
    }
    for (size_t l = 0; l < w.costs.size(); ++l) {
      const KfacLayerCost& c = w.costs[l];
      if (c.invert_a_s.size() != kNumModules || c.invert_b_s.size() != kNumModules) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "bubble planner: node %s layer %d: invert_a_s/invert_b_s need %d entries "
            "(KfacModules), got %d/%d",
            w.node_id, w.layers[l], kNumModules, c.invert_a_s.size(), c.invert_b_s.size()));
      }
      bool bad = !(c.curvature_a_s >= 0) || !(c.curvature_b_s >= 0) || !(c.precondition_s >= 0) ||
                 !(c.sync_s >= 0) || !std::isfinite(c.curvature_a_s) ||
                 !std::isfinite(c.curvature_b_s) || !std::isfinite(c.precondition_s) ||
                 !std::isfinite(c.sync_s);
      for (int m = 0; m < kNumModules; ++m) {
        bad = bad || !(c.invert_a_s[m] >= 0) || !(c.invert_b_s[m] >= 0) ||
              !std::isfinite(c.invert_a_s[m]) || !std::isfinite(c.invert_b_s[m]);
      }
      if (bad) {
        return absl::InvalidArgumentError(
            absl::StrFormat("bubble planner: node %s layer %d: durations must be finite and >= 0",
                            w.node_id, w.layers[l]));
      }
      for (int64_t d : {c.shape.d_model, c.shape.kv_dim, c.shape.ffn_dim}) {
        if (d < 0 || d > kMaxDimension) {
          return absl::InvalidArgumentError(absl::StrFormat(
              "bubble planner: node %s layer %d: block dimension %d is outside [0, %d]", w.node_id,
              w.layers[l], d, kMaxDimension));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<BubblePlanner> BubblePlanner::Create(KfacWorkload workload, const v1::KfacSpec& kfac,
                                                    BubblePlannerOptions options) {
  if (options.serial_after < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: serial_after %d must be >= 1", options.serial_after));
  }
  if (!(kfac.slack() >= 0) || !std::isfinite(kfac.slack())) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: kfac.slack %g must be >= 0", kfac.slack()));
  }
  if (!(kfac.max_granule_ms() >= 0) || !std::isfinite(kfac.max_granule_ms())) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bubble planner: kfac.max_granule_ms %g must be >= 0", kfac.max_granule_ms()));
  }
  RETURN_IF_ERROR(ValidateWorkload(workload));
  auto state = std::make_unique<State>();
  state->workload = std::move(workload);
  state->kfac = kfac;
  state->options = options;
  state->ComputeParts();
  return BubblePlanner(std::move(state));
}

absl::Status BubblePlanner::UpdateCosts(const KfacWorkload& workload) {
  RETURN_IF_ERROR(ValidateWorkload(workload));
  const KfacWorkload& now = state_->workload;
  if (workload.nodes.size() != now.nodes.size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: new costs for %d nodes, the job has %d",
                        workload.nodes.size(), now.nodes.size()));
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
  state_->ComputeParts();
  return absl::OkStatus();
}

absl::Status BubblePlanner::SetWorkload(KfacWorkload workload) {
  RETURN_IF_ERROR(ValidateWorkload(workload));
  state_->workload = std::move(workload);
  // The granules follow the nodes (their number, layers and speeds).
  state_->ComputeParts();
  state_->flight.clear();
  state_->window_start.reset();
  return absl::OkStatus();
}

uint64_t BubblePlanner::completed_refreshes() const { return state_->intervals.size(); }

std::optional<uint64_t> BubblePlanner::last_activated_refresh() const {
  return state_->last_activated;
}

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
    return absl::InvalidArgumentError(
        absl::StrFormat("bubble planner: timeline has %d nodes, the workload %d",
                        timeline.nodes.size(), num_nodes));
  }
  if (st.last_iteration && iteration <= *st.last_iteration) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "bubble planner: iteration %d planned after iteration %d", iteration, *st.last_iteration));
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
  const bool final_iteration = work && (close_window || (fixed > 0 ? age >= fixed : !use_bubbles));
  // A checkpoint closes the window: nothing younger than the front survives it.
  // The next refresh takes the abandoned one's number: the workers may hold
  // layers it finalised and inverses it staged (rule 2'), which the next
  // refresh takes over — as in a job resumed from the checkpoint, whose
  // state holds them as the next refresh's.
  if (close_window && st.flight.size() > 1) {
    st.next_refresh = st.flight[1].number;
    st.flight.resize(1);
  }
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
                       double start, double duration, bool serial, int part = 0,
                       int num_parts = 1) {
    v1::BubbleTask t;
    t.set_kind(kind);
    t.set_node(st.workload.nodes[node].node_id);
    t.set_layer(static_cast<uint32_t>(st.workload.nodes[node].layers[layer_pos]));
    t.set_module(module >= 0 ? KfacModules()[module] : "");
    t.set_microbatch(static_cast<uint32_t>(std::max(0, microbatch)));
    t.set_refresh(st.flight[f].number);
    t.set_planned_start_s(start);
    t.set_planned_duration_s(duration);
    t.set_part(static_cast<uint32_t>(part));
    t.set_num_parts(static_cast<uint32_t>(num_parts));
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
                        double duration, int part = 0, int num_parts = 1) {
    make_task(f, node, kind, layer_pos, module, microbatch, end + serial_cursor[node], duration,
              true, part, num_parts);
    serial_cursor[node] += duration;
  };

  // Microbatches visiting each node, by id.
  std::vector<std::vector<int>> visiting(num_nodes);
  for (const sim::Route& r : plan.routes) {
    for (int n : r.nodes) {
      if (n >= 0 && n < num_nodes) visiting[n].push_back(r.microbatch);
    }
  }

  // One part of a curvature item of this iteration; a microbatch's parts
  // are consecutive and in order, and placed in that order.
  struct Curv {
    Kind kind;
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
  // curv[f][n]: refresh flight[f]'s candidates on node n.
  std::vector<std::vector<std::vector<Curv>>> curv(num_refreshes,
                                                   std::vector<std::vector<Curv>>(num_nodes));
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
        const std::vector<double>& shares =
            is_a ? st.parts[n][l].curvature_a : st.parts[n][l].curvature_b;
        const int num_parts = static_cast<int>(shares.size());
        size_t next = 0;
        for (int f = 0; f < num_refreshes; ++f) {
          const State::NodeState& ns = st.flight[f].nodes[n];
          const int owed = is_a ? ns.owed_a[l] : ns.owed_b[l];
          for (int i = 0; i < owed && next < cand.size(); ++i, ++next) {
            for (int p = 0; p < num_parts; ++p) {
              Curv c;
              c.kind = kind;
              c.layer = static_cast<int>(l);
              c.mb = cand[next].first;
              c.part = p;
              c.num_parts = num_parts;
              c.ready = cand[next].second;
              c.duration = d * shares[p];
              curv[f][n].push_back(c);
            }
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
      if (c.placed && c.last() && c.layer == l &&
          (c.kind == v1::BubbleTask::KIND_CURVATURE_A) == is_a) {
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
  // Priority: what was begun (a microbatch's or an inversion's next part),
  // then curvature — the front's A, B, the next refresh's A, B: a
  // microbatch's curvature can run only in its own iteration, inversions
  // in any — then the front's inversions A, B and (adaptive interval) the
  // next refresh's. With a fixed interval the next refresh's curvature
  // comes after the front's inversions (they must end in the window).
  // inv_placed[f][n][i]: inversion part i of flight[f] placed in a gap;
  // inv_end: its end with slack.
  std::array<std::vector<std::vector<bool>>, 2> inv_placed;
  std::array<std::vector<std::vector<double>>, 2> inv_end;
  for (int f = 0; f < 2; ++f) {
    inv_placed[f].resize(num_nodes);
    inv_end[f].resize(num_nodes);
  }
  // Rule 2': the next refresh inverts a layer once the front's inversions of
  // it on the node are placed (the worker stages its inverses apart until
  // its own activation). Not with a fixed interval: its window comes later.
  const bool next_inverts = num_refreshes > 1 && fixed == 0;
  for (int n = 0; n < num_nodes && place; ++n) {
    const KfacNodeWork& w = st.workload.nodes[n];
    if (w.layers.empty()) continue;
    for (int f = 0; f < num_refreshes; ++f) {
      const size_t count = st.flight[f].nodes[n].inversions.size();
      inv_placed[f][n].assign(count, false);
      inv_end[f][n].assign(count, 0);
    }
    const size_t layers = w.layers.size();
    first_inversion_end[n].assign(layers, kInf);
    if (!use_bubbles) continue;
    // Curvature still owed per refresh and layer (A + B microbatches) and
    // when its last placed part ends.
    std::array<std::vector<int>, 2> left;
    std::array<std::vector<double>, 2> done_at;
    for (int f = 0; f < num_refreshes; ++f) {
      const State::NodeState& ns = st.flight[f].nodes[n];
      left[f].assign(layers, 0);
      done_at[f].assign(layers, 0);
      for (size_t l = 0; l < layers; ++l) left[f][l] = ns.owed_a[l] + ns.owed_b[l];
    }
    // When inversion part i of flight[f] may start: after the layer's
    // curvature (and sync), after the item's previous part (still listed =
    // not placed before this iteration), and for the next refresh after
    // every inversion part of the layer the front still owes.
    auto inv_ready = [&](int f, size_t i) -> double {
      const State::NodeState& ns = st.flight[f].nodes[n];
      const State::NodeState::Inversion& inv = ns.inversions[i];
      if (left[f][inv.layer] > 0 || !ns.synced[inv.layer]) return kInf;
      // With sync the factors were all-reduced at a previous step: ready at 0.
      double ready = done_at[f][inv.layer];
      if (i > 0 && NextPart(ns.inversions[i - 1], inv)) {
        if (!inv_placed[f][n][i - 1]) return kInf;
        ready = std::max(ready, inv_end[f][n][i - 1]);
      }
      if (f == 1) {
        const auto& front = st.flight[0].nodes[n].inversions;
        for (size_t k = 0; k < front.size(); ++k) {
          if (front[k].layer != inv.layer) continue;
          if (!inv_placed[0][n][k]) return kInf;
          ready = std::max(ready, inv_end[0][n][k]);
        }
      }
      return ready;
    };
    for (const auto& gap : gaps[n]) {
      // Plain variables, not structured bindings: lambdas below capture them.
      const double gs = gap.first;
      const double ge = gap.second;
      double t = gs;
      while (t < ge - kEps) {
        bool placed = false;
        double next_ready = kInf;
        // A curvature microbatch of the node has parts placed and parts left.
        auto curvature_open = [&]() {
          for (int f = 0; f < num_refreshes; ++f) {
            const std::vector<Curv>& list = curv[f][n];
            for (size_t i = 0; i + 1 < list.size(); ++i) {
              if (list[i].placed && !list[i].last() && !list[i + 1].placed) return true;
            }
          }
          return false;
        };
        // begun: only the next part of a microbatch (inversion) whose
        // earlier parts are placed; else any part whose turn it is.
        auto try_curvature = [&](int f, bool begun) {
          std::vector<Curv>& list = curv[f][n];
          for (size_t i = 0; i < list.size(); ++i) {
            Curv& c = list[i];
            if (c.placed) continue;
            if (c.part > 0 && !list[i - 1].placed) continue;  // the parts go in order
            if (begun && c.part == 0) continue;
            double ready = f == 0 ? c.ready : std::max(c.ready, curvature_gate(n, c.layer));
            if (c.part > 0) ready = std::max(ready, list[i - 1].end);
            if (ready > t + kEps) {
              next_ready = std::min(next_ready, ready);
              continue;
            }
            if (t + c.duration * slack > ge + kEps) continue;
            // A microbatch starts only when no other is half placed and all
            // its parts fit this iteration's gaps from here (its data does
            // not outlive the iteration).
            if (c.part == 0 && c.num_parts > 1 &&
                (curvature_open() || !FitsInOrder(gaps[n], t, PartNeeds(list, i, slack)))) {
              continue;
            }
            c.placed = true;
            make_task(f, n, c.kind, c.layer, -1, c.mb, t, c.duration, false, c.part, c.num_parts);
            t += c.duration * slack;
            c.end = t;
            if (c.last()) --left[f][c.layer];
            done_at[f][c.layer] = std::max(done_at[f][c.layer], t);
            placed = true;
            return;
          }
        };
        auto try_inversion = [&](int f, bool begun) {
          const auto& list = st.flight[f].nodes[n].inversions;
          for (size_t i = 0; i < list.size(); ++i) {
            if (inv_placed[f][n][i]) continue;
            const State::NodeState::Inversion& inv = list[i];
            if (begun && !(i > 0 && NextPart(list[i - 1], inv) && inv_placed[f][n][i - 1])) {
              continue;
            }
            const double ready = inv_ready(f, i);
            if (ready > t + kEps) {
              next_ready = std::min(next_ready, ready);
              continue;
            }
            const double d = InversionSeconds(w.costs[inv.layer], inv);
            if (t + d * slack > ge + kEps) continue;
            inv_placed[f][n][i] = true;
            make_task(f, n, inv.kind, inv.layer, inv.module, -1, t, d, false, inv.part,
                      inv.num_parts);
            t += d * slack;
            inv_end[f][n][i] = t;
            if (f == 0) {
              first_inversion_end[n][inv.layer] = std::min(first_inversion_end[n][inv.layer], t);
            }
            placed = true;
            return;
          }
        };
        // What was begun goes on first: a microbatch's parts (its data lives
        // only this iteration), then an inversion's (fewer half-done
        // inversions held by the worker). Then the priority order.
        try_curvature(0, true);
        if (!placed && num_refreshes > 1) try_curvature(1, true);
        if (!placed) try_inversion(0, true);
        if (!placed && next_inverts) try_inversion(1, true);
        if (!placed) try_curvature(0, false);
        // With a fixed interval the front must finish in its window (or run
        // serially): its inversions before the next refresh's curvature.
        if (!placed && num_refreshes > 1 && fixed == 0) try_curvature(1, false);
        if (!placed) try_inversion(0, false);
        if (!placed && num_refreshes > 1 && fixed > 0) try_curvature(1, false);
        if (!placed && next_inverts) try_inversion(1, false);
        if (placed) continue;
        if (next_ready >= ge - kEps) break;
        t = std::max(t, next_ready);
      }
    }
    for (int f = 0; f < num_refreshes; ++f) {
      for (size_t l = 0; l < layers; ++l) {
        st.flight[f].nodes[n].curvature_end[l] = done_at[f][l];
      }
    }
  }

  // --- Curvature: book what was placed, serialise what must be. -----------
  for (int f = 0; f < num_refreshes; ++f) {
    const bool last_chance = f == 0 && final_iteration;
    for (int n = 0; n < num_nodes; ++n) {
      const KfacNodeWork& w = st.workload.nodes[n];
      if (w.layers.empty()) continue;
      State::NodeState& ns = st.flight[f].nodes[n];
      // A microbatch whose first parts ran in a gap finishes now (serially
      // if need be): its saved inputs and gradients live only this iteration.
      std::vector<Curv>& list = curv[f][n];
      for (size_t i = 0; i < list.size(); ++i) {
        Curv& c = list[i];
        if (c.placed || c.part == 0 || !list[i - 1].placed) continue;
        c.placed = true;
        add_serial(f, n, c.kind, c.layer, -1, c.mb, c.duration, c.part, c.num_parts);
      }
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
          for (size_t i = 0; i < list.size(); ++i) {
            const Curv& c = list[i];
            if (c.placed || c.layer != l_int || c.kind != kind) continue;
            any_candidate = true;
            // A microbatch fits when all its parts do, in order.
            if (c.part == 0) {
              fits =
                  fits || FitsInOrder(gaps[n], std::max(c.ready, gate), PartNeeds(list, i, slack));
            }
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
              add_serial(f, n, kind, l_int, -1, c.mb, c.duration, c.part, c.num_parts);
              if (c.last()) --owed;
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
  // Layers synced in this iteration, per refresh in flight: their
  // inversions run from the next iteration on.
  std::array<std::vector<std::vector<bool>>, 2> synced_now;
  for (auto& per_node : synced_now) {
    per_node.resize(num_nodes);
    for (int n = 0; n < num_nodes; ++n) {
      per_node[n].assign(st.workload.nodes[n].layers.size(), false);
    }
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
                if (inv_placed[0][m][i] && front.inversions[i].layer == p) ready = false;
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
            synced_now[f][m][pos[i]] = true;
          }
        }
      }
    }
  }

  // --- Inversions: book, count misses, serialise (the front's first). ------
  // Per node and layer, before the front's list is booked: whether all the
  // front's inversions of the layer are placed in gaps (none left, none
  // serial now), and when the last of them ends (rule 2' for the next).
  std::vector<std::vector<bool>> front_done(num_nodes);
  std::vector<std::vector<double>> front_end(num_nodes);
  for (int n = 0; n < num_nodes && place && next_inverts; ++n) {
    front_done[n].assign(st.workload.nodes[n].layers.size(), true);
    front_end[n].assign(st.workload.nodes[n].layers.size(), 0);
    const auto& front = st.flight[0].nodes[n].inversions;
    for (size_t k = 0; k < front.size() && k < inv_placed[0][n].size(); ++k) {
      if (!inv_placed[0][n][k]) front_done[n][front[k].layer] = false;
      front_end[n][front[k].layer] = std::max(front_end[n][front[k].layer], inv_end[0][n][k]);
    }
  }
  for (int f = 0; f < num_refreshes && place; ++f) {
    if (f == 1 && !next_inverts) break;
    for (int n = 0; n < num_nodes; ++n) {
      const KfacNodeWork& w = st.workload.nodes[n];
      if (w.layers.empty()) continue;
      State::NodeState& ns = st.flight[f].nodes[n];
      std::vector<State::NodeState::Inversion> remaining;
      std::vector<bool> inverted_now(w.layers.size(), false);
      // The item's previous part went serial now: the rest follows it there.
      bool cascade = false;
      for (size_t i = 0; i < ns.inversions.size(); ++i) {
        auto inv = ns.inversions[i];
        const bool continues = i > 0 && NextPart(ns.inversions[i - 1], inv);
        if (!continues) cascade = false;
        const int l = inv.layer;
        if (inv_placed[f][n][i]) {
          inverted_now[l] = true;
          continue;
        }
        const double d = InversionSeconds(w.costs[l], inv);
        if ((f == 0 && final_iteration) || cascade) {
          add_serial(f, n, inv.kind, l, inv.module, -1, d, inv.part, inv.num_parts);
          inverted_now[l] = true;
          cascade = true;
          continue;
        }
        // Ready during this iteration's gaps? (Synced just now: from the
        // next; a later part: once its previous part ran.)
        const bool curvature_done = ns.owed_a[l] == 0 && ns.owed_b[l] == 0;
        bool was_ready =
            curvature_done && ns.synced[l] && (f == 0 || front_done[n][l]) && !synced_now[f][n][l];
        double ready_at = ns.curvature_end[l];
        if (continues) {
          if (inv_placed[f][n][i - 1]) {
            ready_at = std::max(ready_at, inv_end[f][n][i - 1]);
          } else {
            was_ready = false;
          }
        }
        if (f == 1) ready_at = std::max(ready_at, front_end[n][l]);
        if (was_ready && use_bubbles) {
          if (!FitsSomeGap(gaps[n], ready_at, d * slack)) ++inv.misses;
          if (inv.misses >= st.options.serial_after) {
            add_serial(f, n, inv.kind, l, inv.module, -1, d, inv.part, inv.num_parts);
            inverted_now[l] = true;
            cascade = true;
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
      st.last_activated = st.flight[0].number;
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
