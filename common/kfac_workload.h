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

  const BlockShape& shape() const { return shape_; }
  int64_t f_in(int projection) const { return f_in_[projection]; }
  int64_t f_out(int projection) const { return f_out_[projection]; }
  int64_t input_dim(int input) const { return input_dim_[input]; }

  // Curvature of one microbatch of `tokens` tokens: A = aᵀa per distinct
  // input, B = gᵀg per projection (2 FLOPs per multiply-add).
  double CurvatureAFlops(double tokens) const;
  double CurvatureBFlops(double tokens) const;
  // The items a curvature granule is made of, with their weights (∝ FLOPs,
  // 2·tokens·n² each): A — the distinct inputs in Input order (n = their
  // width); B — the projections in Projections() order (n = f_out). A part
  // of a curvature task is a contiguous run of them (SplitIntoParts).
  std::vector<int64_t> CurvatureItemWeights(bool a) const;
  // One n×n inversion as the worker computes it: the sum of
  // InversionUnitWeights(n) / 3, n³ up to kUnblockedInversion (Cholesky n³/3,
  // the inverse from it 2n³/3), a little more when blocked.
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
  BlockShape shape_;
  std::array<int64_t, kNumProjections> f_in_{}, f_out_{};
  std::array<int64_t, kNumInputs> input_dim_{};
};

// ---- Granules (docs/KFAC.md "Granules") ----------------------------------
// A work item of the bubble planner may be split into parts, each its own
// bubble task (BubbleTask.part / num_parts), so that pipeline work arriving
// during a K-FAC task waits at most for one part. An item is a sequence of
// weighted units (curvature: CurvatureItemWeights; inversion:
// InversionUnitWeights) and a part is a contiguous run of units. The planner
// and the worker derive the runs from (weights, num_parts) with
// SplitIntoParts — integer arithmetic, so both get the same runs.

// Bounds of `num_parts` contiguous non-empty runs of `weights` (in order)
// whose heaviest run is as light as possible: run i is [bounds[i],
// bounds[i+1]), bounds has num_parts + 1 entries (the last is
// weights.size()). Among the optimal splits, each run takes as many units as
// it can. num_parts is clamped to [1, weights.size()]; empty weights give {0}.
std::vector<int> SplitIntoParts(const std::vector<int64_t>& weights, int num_parts);

// The fewest runs (as SplitIntoParts) whose heaviest weighs at most
// `max_weight`; weights.size() when a single unit is heavier.
int PartsForMaxWeight(const std::vector<int64_t>& weights, int64_t max_weight);

// Parts for an item of `weights` that takes `seconds` when no part may take
// more than `cap_seconds` (time ∝ weight): 1 when it fits whole or the cap
// is not positive, at most weights.size().
int PartsForCap(const std::vector<int64_t>& weights, double seconds, double cap_seconds);

// The damped inverse of an n×n factor is computed in units
// (worker/model/kfac_inverse.h). Up to kUnblockedInversion wide: two units,
// the Cholesky factorisation (n³/3) and the inverse from it (2n³/3; LAPACK's
// potrf and potri). Wider: n is cut into InversionBlocks(n) blocks of about
// kInversionBlock rows; the units are the Cholesky steps, one per block
// column (factor the diagonal block, solve the panel below it, update the
// later block columns' lower part), then the inverse's block columns (two
// triangular solves each). Blocking costs FLOPs (≈ n³·(1 + 1.5/blocks):
// +29% at 5 blocks, +9% at 16), hence only for wide factors, whose
// granules matter. The result depends on the factor, the damping and n
// only — never on how the units are grouped into parts.
constexpr int64_t kInversionBlock = 256;
constexpr int64_t kUnblockedInversion = 1024;
constexpr int kMaxInversionBlocks = 64;
int InversionBlocks(int64_t n);
// First row of block `b` (b = InversionBlocks(n) gives n).
int64_t InversionBlockStart(int64_t n, int b);
// 3 × the FLOPs of each unit, in order (integers: the Cholesky of a b×b
// block is b³/3 FLOPs). Sum / 3 = the inversion's FLOPs.
std::vector<int64_t> InversionUnitWeights(int64_t n);

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
// An unresolved KFAC_REPLICA_SYNC_AUTO (the coordinator resolves it before it
// plans: planner::ChooseReplicaSync) is priced as kPreconditioned, the
// scheme without factor traffic.
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
