#include "coordinator/planner/bubble_planner.h"

#include "coordinator/planner/bubble_state.h"

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

constexpr int kNumModules = kfac::kNumProjections;

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

// Block dimensions beyond this are refused (the unit weights are n³).
constexpr int64_t kMaxDimension = int64_t{1} << 20;

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
  IterationPass pass(st, iteration, plan, timeline, close_window);
  pass.OpenRefreshWindow();
  pass.CollectCurvature();
  pass.PlaceInGaps();
  pass.BookCurvature();
  pass.SyncFactors();
  pass.BookInversions();
  pass.ActivateFront();
  return pass.Finish();
}

}  // namespace detour::planner
