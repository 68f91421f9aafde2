// The K-FAC workload of one transformer block, described once: which
// projections K-FAC covers, the inputs they share, their factor sizes, the
// FLOPs of every work item and the bytes a replica synchronisation moves.
// The coordinator's bubble planner, `detour-sim kfac` and the worker's K-FAC
// (worker/model/kfac.cc) all take the projection list and the sizes from
// here, so what the planner prices is what the runtime computes and sends.
// No LibTorch. Plain value types; thread-compatible.
#ifndef DETOUR_COMMON_KFAC_WORKLOAD_H_
#define DETOUR_COMMON_KFAC_WORKLOAD_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "detour/v1/spec.pb.h"

namespace detour::kfac {

// The projections of a block, in task and state order.
constexpr int kNumProjections = 7;
// Distinct projection inputs (A factors): q/k/v share the normalised block
// input, gate/up the normalised attention output; o and down have their own.
constexpr int kNumInputs = 4;
enum Input { kAttnIn = 0, kAttnOut = 1, kMlpIn = 2, kMlpHidden = 3 };

struct ProjectionInfo {
  const char* module;        // "q", ..., "down" (BubbleTask.module, metrics)
  const char* param_suffix;  // parameter "layers.<i>.<suffix>"
  Input input;
};
const std::array<ProjectionInfo, kNumProjections>& Projections();
// The module names in Projections() order: q k v o gate up down.
const std::vector<std::string>& ModuleNames();
// Index of a module name, or -1.
int ModuleIndex(const std::string& module);

// One block's dimensions (from a defaulted ModelShape).
struct BlockShape {
  int64_t d_model = 0;
  int64_t kv_dim = 0;  // d_model · kv_heads / heads
  int64_t ffn_dim = 0;
};
// Uses the same defaults as the model (kv heads = heads, ffn = 8d/3 rounded
// up to 64) for fields left 0.
BlockShape BlockShapeOf(const v1::ModelShape& shape);

// Sizes and FLOPs of one block's K-FAC work (docs/KFAC.md, "Workload").
class BlockWorkload {
 public:
  explicit BlockWorkload(const BlockShape& shape);
  explicit BlockWorkload(const v1::ModelShape& shape) : BlockWorkload(BlockShapeOf(shape)) {}

  int64_t f_in(int projection) const { return f_in_[projection]; }
  int64_t f_out(int projection) const { return f_out_[projection]; }
  int64_t input_dim(int input) const { return input_dim_[input]; }

  // Curvature of one microbatch of `tokens` tokens: A = aᵀa per distinct
  // input, B = gᵀg per projection (2 FLOPs per multiply-add).
  double CurvatureAFlops(double tokens) const;
  double CurvatureBFlops(double tokens) const;
  // One n×n inversion: Cholesky (n³/3) and the inverse from it (≈ 2n³/3).
  double InvertAFlops(int projection) const;
  double InvertBFlops(int projection) const;
  // B⁻¹·X·A⁻¹ for every projection (run at every step).
  double PreconditionFlops() const;

  // Elements of what a factor synchronisation of this block sends: the
  // pending A sums (one per input), B sums (one per projection) and the two
  // token counts (Kfac::PendingFactorTensors, in this order).
  int64_t FactorSyncElements() const;
  // Elements of the block's projection weights (their gradients ride on the
  // gradient all-reduce in every scheme).
  int64_t ProjectionElements() const;

 private:
  std::array<int64_t, kNumProjections> f_in_{}, f_out_{};
  std::array<int64_t, kNumInputs> input_dim_{};
};

// Bytes per element of the synchronisation payload (fp32 on the wire).
constexpr double kSyncBytesPerElement = 4;

// How replicas of a stage stay identical under K-FAC (KfacSpec.replica_sync
// after NormalizeJobSpec; docs/KFAC.md, "Replicas").
enum class ReplicaSync {
  kNone,            // one replica per stage: nothing to synchronise
  kFactors,         // the pending factors ride on the gradient all-reduce
  kPreconditioned,  // each replica preconditions with its own factors;
                    // only the (already exchanged) gradients are reduced
};
ReplicaSync ReplicaSyncOf(const v1::KfacSpec& kfac);

// Extra seconds one block's synchronisation adds to the stage's all-reduce
// with `replicas` members, whose payload goes directly to every other
// member (the runtime's exchange, worker/runtime/job_runtime.cc) over links
// of at least `min_bandwidth_bytes_per_s`: the latency is already paid by
// the gradients, the factors add their bytes. 0 for kNone/kPreconditioned
// and fewer than two replicas.
double SyncSeconds(const BlockWorkload& block, ReplicaSync sync, int replicas,
                   double min_bandwidth_bytes_per_s);

}  // namespace detour::kfac

#endif  // DETOUR_COMMON_KFAC_WORKLOAD_H_
