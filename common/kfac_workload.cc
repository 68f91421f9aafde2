#include "common/kfac_workload.h"

#include <algorithm>
#include <cmath>

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
  b.ffn_dim = shape.ffn_dim();
  if (b.ffn_dim <= 0) b.ffn_dim = ((8 * b.d_model + 2) / 3 + 63) / 64 * 64;
  return b;
}

BlockWorkload::BlockWorkload(const BlockShape& s) {
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

double BlockWorkload::InvertAFlops(int projection) const {
  const double n = static_cast<double>(f_in_[projection]);
  return n * n * n;
}

double BlockWorkload::InvertBFlops(int projection) const {
  const double n = static_cast<double>(f_out_[projection]);
  return n * n * n;
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

ReplicaSync ReplicaSyncOf(const v1::KfacSpec& kfac) {
  switch (kfac.replica_sync()) {
    case v1::KFAC_REPLICA_SYNC_FACTORS:
      return ReplicaSync::kFactors;
    case v1::KFAC_REPLICA_SYNC_PRECONDITIONED:
      return ReplicaSync::kPreconditioned;
    default:
      return kfac.sync_factors() ? ReplicaSync::kFactors : ReplicaSync::kNone;
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
