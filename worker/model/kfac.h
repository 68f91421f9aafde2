// K-FAC (Kronecker-factored approximate curvature) for the seven projections
// of every transformer block a stage holds: q, k, v, o, gate, up, down
// (pipefisher.md §2). Embeddings, norms and the LM head stay with AdamW.
//
// For a projection y = W·a (W: [f_out, f_in], bias-free):
//   A = (1/N) Σ a aᵀ      over every token of the curvature microbatches
//   B = (1/N) Σ g gᵀ      g = N_mb · d loss_mb / d y, per token
//   ΔW = (B + λ_B I)⁻¹ · ∇W · (A + λ_A I)⁻¹
// Normalisation: a microbatch's loss is the MEAN token cross-entropy over its
// N_mb = B·T tokens (LmHead::Loss, reached through Stage::LossAndBackward), so
// the gradient reaching a projection is 1/N_mb times the per-token gradient;
// CurvatureB multiplies it back by N_mb (the rows of the captured tensor: a
// stage sees the whole microbatch). A and B are therefore per-token second
// moments (B is the empirical Fisher's output factor, with the data's
// labels), A ⊗ B approximates the per-token Fisher, and the damping λ is in
// per-token units, independent of the microbatch size. ∇W is the step's
// normalised gradient (a mean over tokens), so ΔW is a natural gradient.
//
// Damping (π-corrected Tikhonov): π = sqrt((tr A/dim A)/(tr B/dim B)),
// λ_A = sqrt(λ)·π, λ_B = sqrt(λ)/π, each floored at 1e-7; π zero or not
// finite (or a factor missing) → sqrt(λ) for both. π is computed per
// projection from one snapshot of all the layer's traces when the layer is
// finalised (see InvertA), so the order of the inversions does not matter.
// Inverses: Cholesky in fp32; on failure fp64; then the damping ×10, up to 4
// times. A non-finite factor is an error, never a NaN inverse.
//
// Thread-compatible: one thread at a time (the worker's executor). Does not
// own the Stage, which must outlive it. Factors live on the stage's device.
#ifndef DETOUR_WORKER_MODEL_KFAC_H_
#define DETOUR_WORKER_MODEL_KFAC_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kfac_workload.h"
#include "detour/v1/spec.pb.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"

namespace detour::model {

struct LayerCapture;      // transformer.h
class DampedInverseWork;  // kfac_inverse.h

// Projections of a block: "q","k","v","o","gate","up","down".
const std::vector<std::string>& KfacModules();

// The dimensions of one block of `config` (common/kfac_workload.h).
kfac::BlockShape KfacBlockShape(const ModelConfig& config);

// ---- The math, as free functions (tests, docs). -------------------------

struct KfacFactors {
  at::Tensor a;  // [f_in, f_in]  = (1/N) Σ a aᵀ
  at::Tensor b;  // [f_out, f_out] = (1/N) Σ g gᵀ
};
// Factors of one linear layer from its inputs [N, f_in] and output gradients
// [N, f_out] (taken as given: no rescaling). INVALID_ARGUMENT on bad shapes.
absl::StatusOr<KfacFactors> KfacFactorsForLinear(const at::Tensor& input,
                                                 const at::Tensor& grad_out);

struct KfacDamping {
  double pi = 1;
  double damping_a = 0;
  double damping_b = 0;
};
// π-corrected damping from the traces and dimensions of A and B (see above).
KfacDamping PiDamping(double trace_a, int64_t dim_a, double trace_b, int64_t dim_b, double damping);

// (F + damping·I)⁻¹ by Cholesky with the fallbacks above, in F's dtype:
// every unit of DampedInverseWork (kfac_inverse.h) in one go — potrf and
// potri up to kfac::kUnblockedInversion wide, blocked beyond.
// `used_damping` (optional) receives the damping that succeeded.
// FAILED_PRECONDITION for a non-finite F, INTERNAL if every retry fails.
absl::StatusOr<at::Tensor> DampedInverse(const at::Tensor& factor, double damping,
                                         double* used_damping = nullptr);

// B⁻¹ · grad · A⁻¹ for grad [f_out, f_in].
absl::StatusOr<at::Tensor> KfacPreconditionedGradient(const at::Tensor& grad,
                                                      const at::Tensor& a_inv,
                                                      const at::Tensor& b_inv);

// ---- Per-stage optimiser. -------------------------------------------------
//
// Life of one refresh: Capture(mb) before the forward of each curvature
// microbatch; CurvatureA(l, mb) after its forward, CurvatureB(l, mb) after its
// backward (each frees what it consumed); optionally all-reduce
// PendingFactorTensors(l) among replicas; InvertA/InvertB per projection;
// Activate() at the step where the new inverses take effect. Precondition
// (the AdamW hook) uses the active inverses every step in between.
//
// Layers without active inverses yet are left to AdamW entirely (their
// projections are not listed in self_updated), so training starts with
// AdamW on a layer until its first refresh completes.
class Kfac : public PreconditionHook {
 public:
  // K-FAC for every block of `stage` (not owned, must outlive). `spec` is the
  // job's OptimizerSpec with defaults applied (NormalizeJobSpec): uses
  // spec.kfac() (damping, factor_decay, lr, momentum, kl_clip) and
  // spec.adamw() (peak lr for the schedule ratio, weight_decay).
  // INVALID_ARGUMENT for a null stage or out-of-range settings.
  static absl::StatusOr<std::unique_ptr<Kfac>> Create(Stage* stage, const v1::OptimizerSpec& spec);
  ~Kfac() override;

  // Call BEFORE stage->Forward(mb, ...): keeps the block inputs of mb during
  // its forward and the projections' output gradients during its backward.
  // Replaces an earlier capture of the same id. Only captured microbatches
  // cost memory.
  void Capture(uint32_t mb);
  bool captured(uint32_t mb) const;

  // Adds microbatch mb's contribution for block `layer` (global index) to the
  // pending activation factors A (needs mb's forward done) / gradient factors
  // B (needs its backward done) and frees that block's saved tensors.
  // In parts (docs/KFAC.md "Granules"): part p of num_parts takes run p of
  // kfac::SplitIntoParts(CurvatureItemWeights) — a run of the distinct
  // inputs (A) or projections (B) — in any order; the microbatch's token
  // count is added with its first part, and the record is consumed once
  // every input (projection) is. The sums equal the unsplit call's bit for
  // bit. FAILED_PRECONDITION naming layer and mb when the data is not there
  // (not captured, forward/backward not run, already consumed);
  // INVALID_ARGUMENT for a layer this stage does not hold or a bad part.
  absl::Status CurvatureA(int layer, uint32_t mb, int part = 0, int num_parts = 1);
  absl::Status CurvatureB(int layer, uint32_t mb, int part = 0, int num_parts = 1);
  // Forgets the saved tensors of mb (no-op if none).
  void DropCapture(uint32_t mb);
  void DropAllCaptures();

  // Pending factor sums of `layer` plus their token counts, for an in-place
  // all-reduce SUM among the stage's replicas (sync_factors). Fixed order,
  // identical on every replica: A sums of the inputs of {q,k,v}, o, {gate,
  // up}, down; B sums of q, k, v, o, gate, up, down; then the A token count
  // and the B token count (shape [1]). All float32 on the stage's device
  // (counts are exact up to 2^24 tokens per refresh). Empty for a layer the
  // stage does not hold. Modifying them in place is allowed.
  std::vector<at::Tensor> PendingFactorTensors(int layer);

  // Cholesky inverse of the damped factor of one projection (module in
  // KfacModules()) for refresh `refresh` (-1: the one after the last
  // activated), staged until Activate() of that refresh. The first inversion
  // of a layer for a refresh finalises the layer: pending sums → means
  // (F_new = sum / count), running average F ← (1-ρ)F + ρF_new (ρ =
  // factor_decay; the first refresh takes F_new), π per projection from ONE
  // snapshot of all traces, then the pending sums are cleared. Curvature
  // added after that belongs to the next refresh, even when more inversions
  // of this one follow (they use the factors as finalised). The next
  // refresh may invert before this one is activated (at most two are
  // staged: refresh numbers r and r+1), once this one's inversions of the
  // layer have begun.
  // In parts (docs/KFAC.md "Granules"): part p of num_parts runs the units
  // of run p of kfac::SplitIntoParts(InversionUnitWeights(n)) of a
  // DampedInverseWork; part 0 starts it (dropping one in progress), the
  // last part finishes and stages the inverse, which equals the unsplit
  // call's bit for bit. A later part with no inversion in progress (a
  // restart lost it) runs the missing units first. FAILED_PRECONDITION if
  // the layer has no curvature of that kind yet; INVALID_ARGUMENT for an
  // unknown layer or module or a bad part.
  absl::Status InvertA(int layer, const std::string& module, int part = 0, int num_parts = 1,
                       int64_t refresh = -1);
  absl::Status InvertB(int layer, const std::string& module, int part = 0, int num_parts = 1,
                       int64_t refresh = -1);
  // The inverses staged for refreshes up to `refresh` (-1: the one after the
  // last activated) become the ones Precondition uses (per projection;
  // others keep their previous inverses); those staged for refresh + 1 stay
  // staged, any others (from an abandoned numbering) are dropped.
  void Activate(int64_t refresh = -1);
  // The coordinator's numbering: `last_activated` is the refresh activated
  // last (-1: none; IterationPlan.kfac_refresh_base - 2). Shifts every
  // refresh number held (finalised, staged, in progress) by the difference
  // to this K-FAC's own, so that what is pending keeps its place: after
  // joining with a replica's state (stored relative to its last
  // activation), or when a restarted coordinator numbers from 0 again.
  void RebaseRefreshes(int64_t last_activated);
  // All 7 projections of the block have active inverses.
  bool has_inverses(int layer) const;

  // Serial convenience (in-process engine, detour-train, SERIAL placement):
  // CurvatureA/B for every captured microbatch whose forward/backward ran,
  // then InvertA/B of every projection of every held layer that has both
  // kinds of curvature, then Activate. Captures stay (consumed) until
  // DropCapture/DropAllCaptures.
  absl::Status RefreshSerially();

  // PreconditionHook. lr_kfac = kfac.lr × (lr / adamw.lr) follows the AdamW
  // schedule (equal to AdamW's lr with the default kfac.lr). Layers without
  // inverses: no-op (AdamW's). Per kfac.update:
  //
  // KFAC_UPDATE_GRAFT_ADAMW (default; layer-wise grafting as with Shampoo):
  // Precondition, per projection of the layer with gradient g: K-FAC's own
  // Adam moments m ← β1·m + (1-β1)·g, v ← β2·v + (1-β2)·g² (adamw.beta1/2,
  // bias-corrected m̂, v̂), the AdamW update U = m̂/(√v̂ + eps), the K-FAC
  // direction D = B⁻¹·m̂·A⁻¹, and the step S = D·‖U‖/‖D‖ (Frobenius norms,
  // per projection; S = U if D is zero or not finite). g ← S (written into
  // the gradient), W ← W·(1 - lr_kfac·weight_decay) - lr_kfac·S, named in
  // self_updated. K-FAC chooses the direction, AdamW's per-layer step size
  // the length. BeginStep only fixes lr_kfac.
  //
  // KFAC_UPDATE_MOMENTUM: BeginStep computes, for every layer with active
  // inverses and every projection with a gradient, ΔW = B⁻¹·∇W·A⁻¹ and one
  // KL-clipping factor over the stage, ν = min(1, sqrt(kl_clip /
  // (lr_kfac² Σ⟨ΔW, ∇W⟩))) (kl_clip < 0: ν = 1). Precondition then, per
  // projection of the layer: ∇W ← ν·ΔW (written into the gradient),
  // momentum buffer m ← μ·m + ∇W, W ← W·(1 - lr_kfac·weight_decay) -
  // lr_kfac·m, and names it in self_updated.
  //
  // KFAC_REPLICA_SYNC_PRECONDITIONED (replicas_precondition()): the
  // gradients of the replicas-ready layers (below) arrive here already
  // preconditioned and reduced, ĝ = Σ_r B_r⁻¹·G_r·A_r⁻¹ / visits (clipped
  // like the rest). GRAFT_ADAMW then keeps its Adam moments of ĝ and steps
  // S = m̂·‖U‖/‖m̂‖ with U = m̂/(√v̂ + eps): the direction is the momentum of
  // the preconditioned gradient (B⁻¹·m̂·A⁻¹ for fixed inverses), the length
  // AdamW's on ĝ. Every input is the reduced sum, so the replicas step
  // identically. Layers not ready are left to AdamW.
  absl::Status BeginStep(double lr) override;
  absl::Status Precondition(int layer, const std::vector<NamedTensor>& params, double lr,
                            std::set<std::string>* self_updated) override;

  // --- Replicas preconditioning their own gradients -------------------------
  // (KfacSpec.replica_sync = KFAC_REPLICA_SYNC_PRECONDITIONED; docs/KFAC.md
  // "Replicas"). Each replica keeps the factors of its own curvature
  // microbatches. Per iteration the runtime (1) calls PreconditionFlat on its
  // summed local gradient before the all-reduce, appending ReadyVotes(); (2)
  // reduces; (3) AgreeReady with the summed votes; (4) steps; (5)
  // CommitAgreement. A layer is preconditioned and K-FAC-stepped only once
  // it is replicas-ready: all members of an earlier iteration's reduce held
  // inverses for it (inverses, once there, stay), so every replica makes
  // the same choice for every layer in every iteration.
  bool replicas_precondition() const { return replicas_precondition_; }
  bool replicas_ready(int layer) const;
  // One float per held layer, in layer order: 1 where this replica has
  // inverses for every projection, else 0 (on the CPU).
  at::Tensor ReadyVotes() const;
  // `votes`: the members' ReadyVotes summed. Layers with `members` votes
  // become replicas-ready at the next CommitAgreement (not before: the
  // step of this iteration still sees the choice its gradients were made
  // with). INVALID_ARGUMENT for a wrong size.
  absl::Status AgreeReady(const at::Tensor& votes, int members);
  // Returns the layers that became replicas-ready.
  std::vector<int> CommitAgreement();
  // `flat` holds `params`' gradients one after another (each numel, in
  // order; a float CPU tensor). Replaces the slices of the replicas-ready
  // layers' projections by B⁻¹·slice·A⁻¹ with this replica's active
  // inverses.
  absl::Status PreconditionFlat(const std::vector<NamedTensor>& params, at::Tensor* flat) const;
  // The same for a stage without replicas (the in-process engine): the
  // parameters' gradients are preconditioned in place, and the layer votes
  // are agreed with this replica's own (CommitAgreement after the step).
  absl::Status PreconditionInPlace();
  // Parameter names whose reduced gradient is a preconditioned one (the
  // replicas-ready layers' projections): the runtime leaves them out of the
  // clipping norm, which is over raw gradients.
  std::set<std::string> PreconditionedParameters() const;

  // Everything K-FAC keeps between steps, for checkpoints and for a replica
  // joining a running job: per held layer the pending sums and counts, the
  // running factors, and per projection the active and staged inverses, the
  // damping (π, λ_A, λ_B), the momentum buffer, the grafting moments and
  // step, and whether the layer is replicas-ready. Named
  // "kfac.<layer>.<piece>"; pieces not yet computed are absent.
  // On the CPU, cloned.
  std::vector<NamedTensor> State() const;
  // Replaces the state with the "kfac.<layer>.*" entries of `table` for the
  // layers this stage holds (other entries are ignored). Checks every shape
  // first: INVALID_ARGUMENT naming the entry, and nothing changes.
  absl::Status LoadState(const std::map<std::string, at::Tensor>& table);

  // Introspection for tests and metrics. Undefined tensors / errors when
  // absent.
  at::Tensor FactorA(int layer, const std::string& module) const;  // running
  at::Tensor FactorB(int layer, const std::string& module) const;
  at::Tensor InverseA(int layer, const std::string& module) const;  // active
  at::Tensor InverseB(int layer, const std::string& module) const;
  absl::StatusOr<KfacDamping> Damping(int layer, const std::string& module) const;
  double last_kl_scale() const { return last_kl_scale_; }  // ν of the last step
  // KFAC_UPDATE_GRAFT_ADAMW: ‖U‖/‖D‖ of the projection's last step (0: none).
  double last_graft_scale(int layer, const std::string& module) const;

 private:
  static constexpr int64_t kNoRefresh = -1;
  static constexpr int64_t kAnyRefresh = -2;
  struct Projection {
    at::Tensor a_inv, b_inv;  // active
    // Staged until Activate: two slots, tagged with their refresh (lower
    // first; kNoRefresh: empty; kAnyRefresh: activated by the next Activate).
    std::array<at::Tensor, 2> a_staged, b_staged;
    std::array<int64_t, 2> a_tag{kNoRefresh, kNoRefresh}, b_tag{kNoRefresh, kNoRefresh};
    // Inversions in progress (parts) and their refresh; not part of State().
    std::shared_ptr<DampedInverseWork> a_work, b_work;
    int64_t a_work_refresh = kNoRefresh, b_work_refresh = kNoRefresh;
    KfacDamping damping;
    at::Tensor momentum;        // KFAC_UPDATE_MOMENTUM
    at::Tensor adam_m, adam_v;  // KFAC_UPDATE_GRAFT_ADAMW
    int64_t adam_step = 0;
    double graft_scale = 0;
  };
  struct LayerState {
    std::array<at::Tensor, 4> a_sum;  // per input group
    std::array<at::Tensor, 7> b_sum;  // per projection
    at::Tensor a_count, b_count;      // [1]
    std::array<at::Tensor, 4> a;      // running averages (undefined: none yet)
    std::array<at::Tensor, 7> b;
    std::array<Projection, 7> proj;
    bool replicas_ready = false;  // replicas_precondition(): agreed
    bool agreed = false;          // ... at the coming CommitAgreement
    // The refresh the factors were last finalised for (its first inversion);
    // curvature since then belongs to a later refresh.
    int64_t finalized_refresh = kNoRefresh;
  };

  Kfac(Stage* stage, const v1::OptimizerSpec& spec);
  absl::StatusOr<LayerState*> Layer(int layer, const std::string& what);
  absl::StatusOr<LayerCapture*> Record(int layer, uint32_t mb, const std::string& what);
  absl::Status Finalize(int layer, LayerState* st);
  absl::Status Invert(int layer, const std::string& module, bool is_a, int part, int num_parts,
                      int64_t refresh);
  // Stages `inverse` for `refresh` in one of a factor's two slots.
  static void StageInverse(int64_t refresh, const at::Tensor& inverse,
                           std::array<at::Tensor, 2>* staged, std::array<int64_t, 2>* tag);
  absl::Status Curvature(int layer, uint32_t mb, bool is_a, int part, int num_parts);
  absl::Status GraftStep(int layer, const std::vector<NamedTensor>& params,
                         std::set<std::string>* self_updated);
  // Whether Precondition K-FAC-steps `layer` this step.
  bool steps_layer(int layer) const;

  Stage* stage_;
  int begin_ = 0;                                               // first global layer held
  std::vector<int64_t> curvature_a_items_, curvature_b_items_;  // kfac::BlockWorkload
  double damping_, factor_decay_, kfac_lr_, momentum_, kl_clip_;
  double adamw_lr_, weight_decay_;
  v1::KfacUpdate update_;
  double beta1_, beta2_, eps_;
  bool replicas_precondition_ = false;
  std::map<int, LayerState> layers_;
  std::map<uint32_t, std::vector<std::shared_ptr<LayerCapture>>> captures_;
  // BeginStep's clipped updates by parameter name, and the step's lr_kfac.
  std::map<std::string, at::Tensor> step_updates_;
  double step_lr_ = 0;
  double last_kl_scale_ = 1;
  int64_t last_activated_ = kNoRefresh;
};

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_KFAC_H_
