#include "common/kfac_workload.h"

#include "common/spec.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace detour::kfac {

const std::array<ProjectionInfo, kNumProjections>& Projections() {
  static constexpr std::array<ProjectionInfo, kNumProjections> kProjections = {{
      {"q", "wq", kAttnIn},
      {"k", "wk", kAttnIn},
      {"v", "wv", kAttnIn},
      {"o", "wo", kAttnOut},
      {"gate", "w_gate", kMlpIn},
      {"up", "w_up", kMlpIn},
      {"down", "w_down", kMlpHidden},
  }};
  return kProjections;
}

const std::vector<std::string>& ModuleNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>;
    for (const ProjectionInfo& p : Projections()) v->push_back(p.module);
    return v;
  }();
  return *names;
}

int ModuleIndex(const std::string& module) {
  const auto& names = ModuleNames();
  auto it = std::find(names.begin(), names.end(), module);
  return it == names.end() ? -1 : static_cast<int>(it - names.begin());
}

BlockShape BlockShapeOf(const v1::ModelShape& shape) {
  BlockShape b;
  b.d_model = shape.d_model();
  const int64_t heads = std::max<int64_t>(1, shape.num_heads());
  const int64_t kv_heads = shape.num_kv_heads() > 0 ? shape.num_kv_heads() : heads;
  b.kv_dim = b.d_model * kv_heads / heads;
  b.ffn_dim = shape.ffn_dim() > 0 ? shape.ffn_dim() : DefaultFfnDim(b.d_model);
  return b;
}

BlockWorkload::BlockWorkload(const BlockShape& s) : shape_(s) {
  // q d→d, k and v d→kv, o d→d, gate and up d→ffn, down ffn→d.
  const std::array<std::pair<int64_t, int64_t>, kNumProjections> dims = {{
      {s.d_model, s.d_model},
      {s.d_model, s.kv_dim},
      {s.d_model, s.kv_dim},
      {s.d_model, s.d_model},
      {s.d_model, s.ffn_dim},
      {s.d_model, s.ffn_dim},
      {s.ffn_dim, s.d_model},
  }};
  for (int p = 0; p < kNumProjections; ++p) {
    f_in_[p] = dims[p].first;
    f_out_[p] = dims[p].second;
    input_dim_[Projections()[p].input] = dims[p].first;
  }
}

double BlockWorkload::CurvatureAFlops(double tokens) const {
  double flops = 0;
  for (int64_t n : input_dim_) flops += 2.0 * tokens * static_cast<double>(n) * n;
  return flops;
}

double BlockWorkload::CurvatureBFlops(double tokens) const {
  double flops = 0;
  for (int64_t n : f_out_) flops += 2.0 * tokens * static_cast<double>(n) * n;
  return flops;
}

std::vector<int64_t> BlockWorkload::CurvatureItemWeights(bool a) const {
  std::vector<int64_t> w;
  if (a) {
    for (int64_t n : input_dim_) w.push_back(n * n);
  } else {
    for (int64_t n : f_out_) w.push_back(n * n);
  }
  return w;
}

namespace {

double InversionFlops(int64_t n) {
  double weight = 0;
  for (int64_t w : InversionUnitWeights(n)) weight += static_cast<double>(w);
  return weight / 3;
}

// Runs of at most `max_weight` taken greedily from the left (the fewest
// such runs); INT_MAX when one unit is heavier.
int GreedyRuns(const std::vector<int64_t>& weights, int64_t max_weight) {
  int runs = 0;
  int64_t sum = 0;
  for (int64_t w : weights) {
    if (w > max_weight) return std::numeric_limits<int>::max();
    if (runs == 0 || sum + w > max_weight) {
      ++runs;
      sum = 0;
    }
    sum += w;
  }
  return runs;
}

}  // namespace

double BlockWorkload::InvertAFlops(int projection) const {
  return InversionFlops(f_in_[projection]);
}

double BlockWorkload::InvertBFlops(int projection) const {
  return InversionFlops(f_out_[projection]);
}

double BlockWorkload::PreconditionFlops() const {
  double flops = 0;
  for (int p = 0; p < kNumProjections; ++p) {
    const double fi = static_cast<double>(f_in_[p]);
    const double fo = static_cast<double>(f_out_[p]);
    // B⁻¹·X (f_out² f_in) then ·A⁻¹ (f_out f_in²).
    flops += 2.0 * (fo * fo * fi + fo * fi * fi);
  }
  return flops;
}

int64_t BlockWorkload::FactorSyncElements() const {
  int64_t n = 2;  // the A and B token counts
  for (int64_t d : input_dim_) n += d * d;
  for (int64_t d : f_out_) n += d * d;
  return n;
}

int64_t BlockWorkload::ProjectionElements() const {
  int64_t n = 0;
  for (int p = 0; p < kNumProjections; ++p) n += f_in_[p] * f_out_[p];
  return n;
}

std::vector<int> SplitIntoParts(const std::vector<int64_t>& weights, int num_parts) {
  const int n = static_cast<int>(weights.size());
  if (n == 0) return {0};
  const int parts = std::clamp(num_parts, 1, n);
  // The lightest heaviest run: binary search over the greedy run count.
  int64_t lo = 0, hi = 0;
  for (int64_t w : weights) {
    lo = std::max(lo, std::max<int64_t>(w, 0));
    hi += std::max<int64_t>(w, 0);
  }
  std::vector<int64_t> clean(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) clean[i] = std::max<int64_t>(weights[i], 0);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (GreedyRuns(clean, mid) <= parts) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  // Each run takes units while it stays within the bound and leaves one
  // unit for every run after it.
  std::vector<int> bounds = {0};
  int next = 0;
  for (int part = 0; part < parts; ++part) {
    int64_t sum = clean[next++];
    const int runs_after = parts - part - 1;
    while (next < n &&
           (part == parts - 1 || (sum + clean[next] <= lo && n - (next + 1) >= runs_after))) {
      sum += clean[next++];
    }
    bounds.push_back(next);
  }
  return bounds;
}

int PartsForMaxWeight(const std::vector<int64_t>& weights, int64_t max_weight) {
  const int runs = GreedyRuns(weights, max_weight);
  return std::min<int>(runs, static_cast<int>(weights.size()));
}

int PartsForCap(const std::vector<int64_t>& weights, double seconds, double cap_seconds) {
  if (weights.empty() || !(cap_seconds > 0) || !(seconds > cap_seconds)) return 1;
  double total = 0;
  for (int64_t w : weights) total += static_cast<double>(std::max<int64_t>(w, 0));
  const double bound = std::floor(total * cap_seconds / seconds);
  if (!(bound >= 0)) return static_cast<int>(weights.size());
  const int64_t max_weight =
      bound > 9e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bound);
  return std::max(1, PartsForMaxWeight(weights, max_weight));
}

int InversionBlocks(int64_t n) {
  if (n <= kUnblockedInversion) return 1;
  const int64_t blocks = (n + kInversionBlock - 1) / kInversionBlock;
  return static_cast<int>(std::min<int64_t>(blocks, kMaxInversionBlocks));
}

int64_t InversionBlockStart(int64_t n, int b) {
  const int blocks = InversionBlocks(n);
  const int64_t width = (n + blocks - 1) / blocks;
  return std::min<int64_t>(n, width * b);
}

std::vector<int64_t> InversionUnitWeights(int64_t n) {
  if (n <= 0) return {};
  const int blocks = InversionBlocks(n);
  if (blocks == 1) return {n * n * n, 2 * n * n * n};
  auto start = [&](int b) { return InversionBlockStart(n, b); };
  auto size = [&](int b) { return start(b + 1) - start(b); };
  std::vector<int64_t> w;
  // Cholesky step k: factor the diagonal block (s³/3), solve the panel below
  // (r·s²), update the lower triangle of every later block column j
  // (2·h_j·s·s_j, h_j = rows from its diagonal down).
  for (int k = 0; k < blocks; ++k) {
    const int64_t s = size(k);
    const int64_t r = n - start(k + 1);
    int64_t update = 0;
    for (int j = k + 1; j < blocks; ++j) update += (n - start(j)) * s * size(j);
    w.push_back(s * s * s + 3 * r * s * s + 6 * update);
  }
  // Inverse block column j: two triangular solves of h_j rows, s_j columns.
  for (int j = 0; j < blocks; ++j) {
    const int64_t h = n - start(j);
    w.push_back(6 * h * h * size(j));
  }
  return w;
}

ReplicaSync ReplicaSyncOf(const v1::KfacSpec& kfac) {
  switch (kfac.replica_sync()) {
    case v1::KFAC_REPLICA_SYNC_FACTORS: return ReplicaSync::kFactors;
    case v1::KFAC_REPLICA_SYNC_PRECONDITIONED:
    case v1::KFAC_REPLICA_SYNC_AUTO: return ReplicaSync::kPreconditioned;
    default: return kfac.sync_factors() ? ReplicaSync::kFactors : ReplicaSync::kNone;
  }
}

double SyncSeconds(const BlockWorkload& block, ReplicaSync sync, int replicas,
                   double min_bandwidth_bytes_per_s) {
  if (sync != ReplicaSync::kFactors || replicas < 2) return 0;
  if (!(min_bandwidth_bytes_per_s > 0)) return 0;
  return static_cast<double>(block.FactorSyncElements()) * kSyncBytesPerElement /
         min_bandwidth_bytes_per_s;
}

}  // namespace detour::kfac
