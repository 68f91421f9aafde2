// K-FAC's curvature: capturing microbatches, accumulating and finalising the
// factors, inverting and activating them, and the state that holds it all.
// kfac_precondition.cc puts the active inverses to use.
#include "worker/model/kfac.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/kfac_workload.h"
#include "common/status.h"
#include "worker/model/kfac_inverse.h"
#include "worker/model/torch_status.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

// Projections, their parameter names and shared inputs: common/kfac_workload.h
// (the planner prices exactly this list).
constexpr int kNumModules = kfac::kNumProjections;
constexpr int kNumInputs = kfac::kNumInputs;
static_assert(static_cast<int>(LayerCapture::kAttnIn) == kfac::kAttnIn &&
                  static_cast<int>(LayerCapture::kAttnOut) == kfac::kAttnOut &&
                  static_cast<int>(LayerCapture::kMlpIn) == kfac::kMlpIn &&
                  static_cast<int>(LayerCapture::kMlpHidden) == kfac::kMlpHidden,
              "LayerCapture's inputs are the workload's");

// Input group (LayerCapture::Input) of a module.
int InputOf(int m) { return kfac::Projections()[m].input; }

int ModuleIndex(const std::string& module) { return kfac::ModuleIndex(module); }

}  // namespace

const std::vector<std::string>& KfacModules() { return kfac::ModuleNames(); }

kfac::BlockShape KfacBlockShape(const ModelConfig& c) {
  kfac::BlockShape shape;
  shape.d_model = c.d_model;
  shape.kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim();
  shape.ffn_dim = c.ffn_dim;
  return shape;
}

absl::StatusOr<KfacFactors> KfacFactorsForLinear(const at::Tensor& input,
                                                 const at::Tensor& grad_out) {
  if (!input.defined() || !grad_out.defined() || input.dim() != 2 || grad_out.dim() != 2 ||
      input.size(0) != grad_out.size(0) || input.size(0) == 0) {
    return absl::InvalidArgumentError(
        "K-FAC factors: need input [N, f_in] and grad_out [N, f_out], N > 0");
  }
  return GuardTorch("K-FAC factors", [&]() -> absl::StatusOr<KfacFactors> {
    c10::NoGradGuard no_grad;
    const double n = static_cast<double>(input.size(0));
    KfacFactors f;
    f.a = at::matmul(input.t(), input) / n;
    f.b = at::matmul(grad_out.t(), grad_out) / n;
    return f;
  });
}

KfacDamping PiDamping(double trace_a, int64_t dim_a, double trace_b, int64_t dim_b,
                      double damping) {
  KfacDamping d;
  const double root = std::sqrt(damping);
  double pi = 0;
  if (dim_a > 0 && dim_b > 0) {
    pi = std::sqrt((trace_a / static_cast<double>(dim_a)) / (trace_b / static_cast<double>(dim_b)));
  }
  if (!std::isfinite(pi) || pi <= 0) {
    d.pi = 1;
    d.damping_a = d.damping_b = std::max(root, kMinKfacDamping);
    return d;
  }
  d.pi = pi;
  d.damping_a = std::max(root * pi, kMinKfacDamping);
  d.damping_b = std::max(root / pi, kMinKfacDamping);
  return d;
}

absl::StatusOr<at::Tensor> DampedInverse(const at::Tensor& factor, double damping,
                                         double* used_damping) {
  return BlockedDampedInverse(factor, damping, used_damping);
}

Kfac::Kfac(Stage* stage, const v1::OptimizerSpec& spec)
    : stage_(stage),
      begin_(stage->layers().begin),
      damping_(spec.kfac().damping()),
      factor_decay_(spec.kfac().factor_decay()),
      kfac_lr_(spec.kfac().lr()),
      momentum_(spec.kfac().momentum()),
      kl_clip_(spec.kfac().kl_clip()),
      adamw_lr_(spec.adamw().lr()),
      weight_decay_(spec.adamw().weight_decay()),
      update_(spec.kfac().update() == v1::KFAC_UPDATE_UNSPECIFIED ? v1::KFAC_UPDATE_GRAFT_ADAMW
                                                                  : spec.kfac().update()),
      beta1_(spec.adamw().beta1() > 0 ? spec.adamw().beta1() : 0.9),
      beta2_(spec.adamw().beta2() > 0 ? spec.adamw().beta2() : 0.95),
      eps_(spec.adamw().eps() > 0 ? spec.adamw().eps() : 1e-8),
      replicas_precondition_(spec.kfac().replica_sync() == v1::KFAC_REPLICA_SYNC_PRECONDITIONED) {}

Kfac::~Kfac() { DropAllCaptures(); }

absl::StatusOr<std::unique_ptr<Kfac>> Kfac::Create(Stage* stage, const v1::OptimizerSpec& spec) {
  if (stage == nullptr) return absl::InvalidArgumentError("K-FAC: null stage");
  const v1::KfacSpec& k = spec.kfac();
  if (!(k.damping() > 0) || !std::isfinite(k.damping())) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.kfac.damping: ", k.damping(), " must be > 0"));
  }
  if (!(k.factor_decay() > 0 && k.factor_decay() <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.kfac.factor_decay: ", k.factor_decay(), " is outside (0, 1]"));
  }
  if (!(k.lr() > 0) || !(spec.adamw().lr() > 0)) {
    return absl::InvalidArgumentError(
        "optimizer.kfac.lr and optimizer.adamw.lr must be > 0 (apply defaults)");
  }
  if (!(k.momentum() >= 0 && k.momentum() < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer.kfac.momentum: ", k.momentum(), " is outside [0, 1)"));
  }
  if (k.replica_sync() == v1::KFAC_REPLICA_SYNC_AUTO) {
    return absl::InvalidArgumentError(
        "optimizer.kfac.replica_sync: KFAC_REPLICA_SYNC_AUTO is left unresolved; the "
        "coordinator chooses FACTORS or PRECONDITIONED before it assigns the stages");
  }
  if (k.replica_sync() == v1::KFAC_REPLICA_SYNC_PRECONDITIONED &&
      k.update() == v1::KFAC_UPDATE_MOMENTUM) {
    return absl::InvalidArgumentError(
        "optimizer.kfac.replica_sync: KFAC_REPLICA_SYNC_PRECONDITIONED needs update "
        "KFAC_UPDATE_GRAFT_ADAMW (the momentum rule's KL clipping needs the raw gradient)");
  }
  if (!(spec.adamw().beta1() >= 0 && spec.adamw().beta1() < 1 && spec.adamw().beta2() >= 0 &&
        spec.adamw().beta2() < 1)) {
    return absl::InvalidArgumentError(
        "optimizer.adamw.beta1/beta2 must be in [0, 1) (K-FAC grafting)");
  }
  std::unique_ptr<Kfac> kfac(new Kfac(stage, spec));
  const kfac::BlockWorkload block(KfacBlockShape(stage->config()));
  kfac->curvature_a_items_ = block.CurvatureItemWeights(true);
  kfac->curvature_b_items_ = block.CurvatureItemWeights(false);
  RETURN_IF_ERROR(GuardTorch("K-FAC allocation", [&]() -> absl::Status {
    const auto opts = at::TensorOptions().dtype(at::kFloat).device(stage->device());
    for (int l = stage->layers().begin; l < stage->layers().end; ++l) {
      LayerState& st = kfac->layers_[l];
      for (int i = 0; i < kNumInputs; ++i) {
        st.a_sum[i] = at::zeros({block.input_dim(i), block.input_dim(i)}, opts);
      }
      for (int m = 0; m < kNumModules; ++m) {
        st.b_sum[m] = at::zeros({block.f_out(m), block.f_out(m)}, opts);
      }
      st.a_count = at::zeros({1}, opts);
      st.b_count = at::zeros({1}, opts);
    }
    return absl::OkStatus();
  }));
  return kfac;
}

void Kfac::Capture(uint32_t mb) {
  std::vector<std::shared_ptr<LayerCapture>> records;
  for (size_t i = 0; i < layers_.size(); ++i) {
    records.push_back(std::make_shared<LayerCapture>());
  }
  // Sizes match by construction.
  stage_->SetCapture(mb, records).IgnoreError();
  captures_[mb] = std::move(records);
}

bool Kfac::captured(uint32_t mb) const { return captures_.count(mb) != 0; }

void Kfac::DropCapture(uint32_t mb) {
  captures_.erase(mb);
  stage_->ClearCapture(mb);
}

void Kfac::DropAllCaptures() {
  for (const auto& [mb, records] : captures_) stage_->ClearCapture(mb);
  captures_.clear();
}

absl::StatusOr<Kfac::LayerState*> Kfac::Layer(int layer, const std::string& what) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("K-FAC ", what, ": layer ", layer, " is not held by stage ", stage_->index(),
                     " (layers [", stage_->layers().begin, ", ", stage_->layers().end, "))"));
  }
  return &it->second;
}

absl::StatusOr<LayerCapture*> Kfac::Record(int layer, uint32_t mb, const std::string& what) {
  RETURN_IF_ERROR(Layer(layer, what).status());
  auto it = captures_.find(mb);
  if (it == captures_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("K-FAC ", what, " layer ", layer, " mb ", mb,
                     ": microbatch was not captured (call Capture before its forward)"));
  }
  return it->second[layer - begin_].get();
}

absl::Status Kfac::CurvatureA(int layer, uint32_t mb, int part, int num_parts) {
  return Curvature(layer, mb, /*is_a=*/true, part, num_parts);
}

absl::Status Kfac::CurvatureB(int layer, uint32_t mb, int part, int num_parts) {
  return Curvature(layer, mb, /*is_a=*/false, part, num_parts);
}

absl::Status Kfac::Curvature(int layer, uint32_t mb, bool is_a, int part, int num_parts) {
  const char* what = is_a ? "curvature A" : "curvature B";
  ASSIGN_OR_RETURN(LayerCapture * rec, Record(layer, mb, what));
  const std::string ctx =
      absl::StrCat("K-FAC ", what, " layer ", layer, " mb ", mb,
                   num_parts > 1 ? absl::StrCat(" part ", part + 1, "/", num_parts) : "");
  const std::vector<int64_t>& items = is_a ? curvature_a_items_ : curvature_b_items_;
  if (num_parts < 1 || num_parts > static_cast<int>(items.size()) || part < 0 ||
      part >= num_parts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "K-FAC ", what, " layer ", layer, " mb ", mb, ": part ", part, " of ", num_parts,
        " (at most ", items.size(), " parts, one per ", is_a ? "input" : "projection", ")"));
  }
  if (is_a ? rec->a_consumed : rec->b_consumed) {
    return absl::FailedPreconditionError(absl::StrCat(ctx, ": already consumed"));
  }
  if (is_a ? !rec->forward_done : !rec->backward_done()) {
    return absl::FailedPreconditionError(absl::StrCat(
        ctx, ": the microbatch's ", !is_a && rec->forward_done ? "backward" : "forward",
        " has not run on this stage"));
  }
  const std::vector<int> bounds = kfac::SplitIntoParts(items, num_parts);
  const int first = bounds[part], last = bounds[part + 1];
  bool counted = false;
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    const bool taken = is_a ? rec->a_taken[i] : rec->b_taken[i];
    counted = counted || taken;
    if (taken && i >= first && i < last) {
      return absl::FailedPreconditionError(absl::StrCat(ctx, ": already consumed"));
    }
  }
  LayerState* st = &layers_.at(layer);
  RETURN_IF_ERROR(GuardTorch(ctx, [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    int64_t n = 0;
    for (int i = first; i < last; ++i) {
      const at::Tensor& raw = is_a ? rec->inputs[i] : rec->output_grads[i];
      at::Tensor& sum = is_a ? st->a_sum[i] : st->b_sum[i];
      at::Tensor x = raw.reshape({-1, raw.size(-1)}).to(sum.device(), at::kFloat);
      n = x.size(0);
      if (is_a) {
        sum.addmm_(x.t(), x);
      } else {
        // The microbatch loss is a mean over its n tokens: g·n is the
        // per-token gradient. Σ (n g)(n g)ᵀ = n² Σ g gᵀ.
        sum.addmm_(x.t(), x, /*beta=*/1.0,
                   /*alpha=*/static_cast<double>(n) * static_cast<double>(n));
      }
    }
    // The microbatch's tokens count once, with its first part.
    if (!counted) (is_a ? st->a_count : st->b_count).add_(static_cast<double>(n));
    return absl::OkStatus();
  }));
  bool all = true;
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    if (i >= first && i < last) {
      (is_a ? rec->inputs[i] : rec->output_grads[i]) = at::Tensor();
      (is_a ? rec->a_taken[i] : rec->b_taken[i]) = true;
    }
    all = all && (is_a ? rec->a_taken[i] : rec->b_taken[i]);
  }
  if (all) (is_a ? rec->a_consumed : rec->b_consumed) = true;
  return absl::OkStatus();
}

std::vector<at::Tensor> Kfac::PendingFactorTensors(int layer) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return {};
  LayerState& st = it->second;
  std::vector<at::Tensor> out(st.a_sum.begin(), st.a_sum.end());
  out.insert(out.end(), st.b_sum.begin(), st.b_sum.end());
  out.push_back(st.a_count);
  out.push_back(st.b_count);
  return out;
}

absl::Status Kfac::Finalize(int layer, LayerState* st) {
  return GuardTorch(absl::StrCat("K-FAC finalise layer ", layer), [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    const double na = st->a_count.item<double>();
    const double nb = st->b_count.item<double>();
    if (na <= 0 && nb <= 0) return absl::OkStatus();  // nothing new
    auto blend = [&](at::Tensor* running, const at::Tensor& sum, double n) {
      at::Tensor fresh = sum / n;
      if (!running->defined()) {
        *running = fresh;
      } else {
        *running = running->mul(1.0 - factor_decay_).add_(fresh, factor_decay_);
      }
    };
    if (na > 0) {
      for (int i = 0; i < kNumInputs; ++i) blend(&st->a[i], st->a_sum[i], na);
    }
    if (nb > 0) {
      for (int m = 0; m < kNumModules; ++m) blend(&st->b[m], st->b_sum[m], nb);
    }
    // One snapshot of every trace before any sum is cleared.
    double tr_a[kNumInputs];
    double tr_b[kNumModules];
    for (int i = 0; i < kNumInputs; ++i) {
      tr_a[i] = st->a[i].defined() ? st->a[i].trace().item<double>() : NAN;
    }
    for (int m = 0; m < kNumModules; ++m) {
      tr_b[m] = st->b[m].defined() ? st->b[m].trace().item<double>() : NAN;
    }
    for (int m = 0; m < kNumModules; ++m) {
      const int i = InputOf(m);
      const int64_t dim_a = st->a_sum[i].size(0);
      const int64_t dim_b = st->b_sum[m].size(0);
      st->proj[m].damping = PiDamping(tr_a[i], dim_a, tr_b[m], dim_b, damping_);
    }
    for (auto& t : st->a_sum) t.zero_();
    for (auto& t : st->b_sum) t.zero_();
    st->a_count.zero_();
    st->b_count.zero_();
    return absl::OkStatus();
  });
}

absl::Status Kfac::Invert(int layer, const std::string& module, bool is_a, int part, int num_parts,
                          int64_t refresh) {
  if (refresh < 0) refresh = last_activated_ + 1;
  const std::string what = is_a ? "invert A" : "invert B";
  ASSIGN_OR_RETURN(LayerState * st, Layer(layer, what));
  const int m = ModuleIndex(module);
  if (m < 0) {
    return absl::InvalidArgumentError(absl::StrCat("K-FAC ", what, " layer ", layer,
                                                   ": unknown projection \"", module,
                                                   "\" (q, k, v, o, gate, up, down)"));
  }
  const std::string ctx =
      absl::StrCat("K-FAC ", what, " layer ", layer, " ", module,
                   num_parts > 1 ? absl::StrCat(" part ", part + 1, "/", num_parts) : "");
  const int64_t n = is_a ? st->a_sum[InputOf(m)].size(0) : st->b_sum[m].size(0);
  const std::vector<int64_t> units = kfac::InversionUnitWeights(n);
  if (num_parts < 1 || num_parts > static_cast<int>(units.size()) || part < 0 ||
      part >= num_parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("K-FAC ", what, " layer ", layer, " ", module, ": part ", part, " of ",
                     num_parts, " (a ", n, "-wide inversion has ", units.size(), " units)"));
  }
  Projection& p = st->proj[m];
  std::shared_ptr<DampedInverseWork>& work = is_a ? p.a_work : p.b_work;
  int64_t& work_refresh = is_a ? p.a_work_refresh : p.b_work_refresh;
  if (part == 0 || work == nullptr || work_refresh != refresh) {
    work.reset();
    work_refresh = refresh;
    if (st->finalized_refresh != refresh) {
      RETURN_IF_ERROR(Finalize(layer, st));
      st->finalized_refresh = refresh;
    }
    const at::Tensor& factor = is_a ? st->a[InputOf(m)] : st->b[m];
    if (!factor.defined()) {
      return absl::FailedPreconditionError(
          absl::StrCat(ctx, ": no ", is_a ? "activation" : "gradient", " curvature yet"));
    }
    auto started =
        DampedInverseWork::Start(factor, is_a ? p.damping.damping_a : p.damping.damping_b);
    if (!started.ok()) {
      return absl::Status(started.status().code(),
                          absl::StrCat(ctx, ": ", started.status().message()));
    }
    work = std::move(*started);
  }
  const std::vector<int> bounds = kfac::SplitIntoParts(units, num_parts);
  const int until = part == num_parts - 1 ? work->units() : bounds[part + 1];
  if (absl::Status s = work->RunUntil(until); !s.ok()) {
    work.reset();
    return absl::Status(s.code(), absl::StrCat(ctx, ": ", s.message()));
  }
  if (work->done()) {
    StageInverse(refresh, work->result(), is_a ? &p.a_staged : &p.b_staged,
                 is_a ? &p.a_tag : &p.b_tag);
    work.reset();
  }
  return absl::OkStatus();
}

absl::Status Kfac::InvertA(int layer, const std::string& module, int part, int num_parts,
                           int64_t refresh) {
  return Invert(layer, module, /*is_a=*/true, part, num_parts, refresh);
}

absl::Status Kfac::InvertB(int layer, const std::string& module, int part, int num_parts,
                           int64_t refresh) {
  return Invert(layer, module, /*is_a=*/false, part, num_parts, refresh);
}

namespace {

// A factor's two staging slots kept in order: an empty slot last, the
// lower refresh first (so State() writes them the same way whatever the
// history).
void CanonicalSlots(std::array<at::Tensor, 2>* staged, std::array<int64_t, 2>* tag) {
  const bool swap = (*staged)[1].defined() && (!(*staged)[0].defined() || (*tag)[1] < (*tag)[0]);
  if (swap) {
    std::swap((*staged)[0], (*staged)[1]);
    std::swap((*tag)[0], (*tag)[1]);
  }
  for (int slot = 0; slot < 2; ++slot) {
    if (!(*staged)[slot].defined()) (*tag)[slot] = -1;
  }
}

}  // namespace

void Kfac::StageInverse(int64_t refresh, const at::Tensor& inverse,
                        std::array<at::Tensor, 2>* staged, std::array<int64_t, 2>* tag) {
  // The slot of the same refresh, else an empty one, else the older one
  // (at most two refreshes are in flight, so none is lost normally).
  int slot;
  if ((*staged)[0].defined() && (*tag)[0] == refresh) {
    slot = 0;
  } else if ((*staged)[1].defined() && (*tag)[1] == refresh) {
    slot = 1;
  } else if (!(*staged)[0].defined()) {
    slot = 0;
  } else if (!(*staged)[1].defined()) {
    slot = 1;
  } else {
    slot = (*tag)[0] <= (*tag)[1] ? 0 : 1;
  }
  (*staged)[slot] = inverse;
  (*tag)[slot] = refresh;
  CanonicalSlots(staged, tag);
}

namespace {

// Activation of one factor's staged inverses (Kfac::Activate): the newest
// staged for a refresh up to `refresh` becomes active, the one for refresh
// + 1 stays, others are dropped.
void PromoteStaged(int64_t refresh, int64_t any, at::Tensor* active,
                   std::array<at::Tensor, 2>* staged, std::array<int64_t, 2>* tag) {
  const int older = (*tag)[1] < (*tag)[0] ? 1 : 0;
  for (int slot : {older, 1 - older}) {
    at::Tensor& t = (*staged)[slot];
    int64_t& r = (*tag)[slot];
    if (t.defined() && (r == any || (r >= 0 && r <= refresh))) {
      *active = t;
    } else if (t.defined() && r == refresh + 1) {
      continue;
    }
    t = at::Tensor();
    r = -1;
  }
  CanonicalSlots(staged, tag);
}

}  // namespace

void Kfac::Activate(int64_t refresh) {
  if (refresh < 0) refresh = last_activated_ + 1;
  for (auto& [layer, st] : layers_) {
    for (Projection& p : st.proj) {
      PromoteStaged(refresh, kAnyRefresh, &p.a_inv, &p.a_staged, &p.a_tag);
      PromoteStaged(refresh, kAnyRefresh, &p.b_inv, &p.b_staged, &p.b_tag);
    }
  }
  last_activated_ = refresh;
}

void Kfac::RebaseRefreshes(int64_t last_activated) {
  const int64_t delta = last_activated - last_activated_;
  if (delta == 0) return;
  auto shift = [delta](int64_t* r) {
    if (*r >= 0) *r += delta;
  };
  for (auto& [layer, st] : layers_) {
    shift(&st.finalized_refresh);
    for (Projection& p : st.proj) {
      for (int slot = 0; slot < 2; ++slot) {
        shift(&p.a_tag[slot]);
        shift(&p.b_tag[slot]);
      }
      shift(&p.a_work_refresh);
      shift(&p.b_work_refresh);
    }
  }
  last_activated_ = last_activated;
}

bool Kfac::has_inverses(int layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return false;
  for (const Projection& p : it->second.proj) {
    if (!p.a_inv.defined() || !p.b_inv.defined()) return false;
  }
  return true;
}

absl::Status Kfac::RefreshSerially() {
  for (const auto& [mb, records] : captures_) {
    for (size_t i = 0; i < records.size(); ++i) {
      const int layer = begin_ + static_cast<int>(i);
      const LayerCapture& rec = *records[i];
      if (rec.forward_done && !rec.a_consumed) RETURN_IF_ERROR(CurvatureA(layer, mb));
      if (rec.backward_done() && !rec.b_consumed) RETURN_IF_ERROR(CurvatureB(layer, mb));
    }
  }
  for (auto& [layer, st] : layers_) {
    const bool has_a = st.a[0].defined() || st.a_count.item<double>() > 0;
    const bool has_b = st.b[0].defined() || st.b_count.item<double>() > 0;
    if (!has_a || !has_b) continue;
    for (const std::string& module : KfacModules()) {
      RETURN_IF_ERROR(InvertA(layer, module));
      RETURN_IF_ERROR(InvertB(layer, module));
    }
  }
  Activate();
  return absl::OkStatus();
}

double Kfac::last_graft_scale(int layer, const std::string& module) const {
  auto it = layers_.find(layer);
  const int m = ModuleIndex(module);
  if (it == layers_.end() || m < 0) return 0;
  return it->second.proj[m].graft_scale;
}

at::Tensor Kfac::FactorA(int layer, const std::string& module) const {
  auto it = layers_.find(layer);
  const int m = ModuleIndex(module);
  if (it == layers_.end() || m < 0) return at::Tensor();
  return it->second.a[InputOf(m)];
}

at::Tensor Kfac::FactorB(int layer, const std::string& module) const {
  auto it = layers_.find(layer);
  const int m = ModuleIndex(module);
  if (it == layers_.end() || m < 0) return at::Tensor();
  return it->second.b[m];
}

at::Tensor Kfac::InverseA(int layer, const std::string& module) const {
  auto it = layers_.find(layer);
  const int m = ModuleIndex(module);
  if (it == layers_.end() || m < 0) return at::Tensor();
  return it->second.proj[m].a_inv;
}

at::Tensor Kfac::InverseB(int layer, const std::string& module) const {
  auto it = layers_.find(layer);
  const int m = ModuleIndex(module);
  if (it == layers_.end() || m < 0) return at::Tensor();
  return it->second.proj[m].b_inv;
}

absl::StatusOr<KfacDamping> Kfac::Damping(int layer, const std::string& module) const {
  auto it = layers_.find(layer);
  const int m = ModuleIndex(module);
  if (it == layers_.end() || m < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("K-FAC damping: no layer ", layer, " projection ", module));
  }
  return it->second.proj[m].damping;
}

}  // namespace detour::model

namespace detour::model {
namespace {

// The pieces of one layer's K-FAC state, with the shape each must have.
struct StatePiece {
  std::string name;
  at::Tensor* tensor = nullptr;
  std::vector<int64_t> shape;
  at::ScalarType dtype = at::kFloat;
};

// The factor pieces of a layer (pending sums, running averages, counts):
// one list serves saving and loading, so the two cannot drift apart. A
// template so the private LayerState type need not be named here.
template <typename LayerStateT>
void AddFactorPieces(int layer, LayerStateT& st, std::vector<StatePiece>& out) {
  const std::string p = absl::StrCat("kfac.", layer, ".");
  for (int i = 0; i < kNumInputs; ++i) {
    const auto dims = st.a_sum[i].sizes().vec();
    out.push_back({absl::StrCat(p, "a_sum.", i), &st.a_sum[i], dims});
    out.push_back({absl::StrCat(p, "a.", i), &st.a[i], dims});
  }
  for (int m = 0; m < kNumModules; ++m) {
    const auto dims = st.b_sum[m].sizes().vec();
    out.push_back({absl::StrCat(p, "b_sum.", m), &st.b_sum[m], dims});
    out.push_back({absl::StrCat(p, "b.", m), &st.b[m], dims});
  }
  out.push_back({p + "a_count", &st.a_count, {1}});
  out.push_back({p + "b_count", &st.b_count, {1}});
}

// The tensors of every projection: active and staged inverses, momentum,
// grafting moments (the scalars — damping, step — are handled apart).
template <typename LayerStateT>
void AddProjectionPieces(int layer, LayerStateT& st, std::vector<StatePiece>& out) {
  for (int m = 0; m < kNumModules; ++m) {
    auto& pr = st.proj[m];
    const std::string p = absl::StrCat("kfac.", layer, ".", KfacModules()[m], ".");
    const auto a = st.a_sum[InputOf(m)].sizes().vec();
    const auto b = st.b_sum[m].sizes().vec();
    const std::vector<int64_t> w = {b[0], a[0]};
    out.push_back({p + "a_inv", &pr.a_inv, a});
    out.push_back({p + "b_inv", &pr.b_inv, b});
    for (int slot = 0; slot < 2; ++slot) {
      out.push_back({absl::StrCat(p, "a_inv_staged.", slot), &pr.a_staged[slot], a});
      out.push_back({absl::StrCat(p, "b_inv_staged.", slot), &pr.b_staged[slot], b});
    }
    out.push_back({p + "momentum", &pr.momentum, w});
    out.push_back({p + "adam_m", &pr.adam_m, w});
    out.push_back({p + "adam_v", &pr.adam_v, w});
  }
}

}  // namespace

std::vector<NamedTensor> Kfac::State() const {
  std::vector<NamedTensor> out;
  for (const auto& [layer, st_const] : layers_) {
    // The piece lists point into the state; nothing is written through them.
    LayerState& st = const_cast<LayerState&>(st_const);
    std::vector<StatePiece> pieces;
    AddFactorPieces(layer, st, pieces);
    AddProjectionPieces(layer, st, pieces);
    for (const StatePiece& piece : pieces) {
      if (piece.tensor->defined()) {
        out.emplace_back(piece.name, piece.tensor->detach().to(at::kCPU).clone());
      }
    }
    for (int m = 0; m < kNumModules; ++m) {
      const Projection& pr = st.proj[m];
      const std::string p = absl::StrCat("kfac.", layer, ".", KfacModules()[m], ".");
      out.emplace_back(p + "damping",
                       at::tensor({pr.damping.pi, pr.damping.damping_a, pr.damping.damping_b},
                                  at::TensorOptions().dtype(at::kDouble)));
      out.emplace_back(p + "adam_step",
                       at::tensor({pr.adam_step}, at::TensorOptions().dtype(at::kLong)));
      out.emplace_back(p + "graft_scale",
                       at::tensor({pr.graft_scale}, at::TensorOptions().dtype(at::kDouble)));
      // Relative to the last activation (1 = the next refresh), so that the
      // state does not depend on how the coordinator numbers refreshes (a
      // resumed job numbers them from 0 again).
      auto relative = [&](const at::Tensor& staged, int64_t tag) -> int64_t {
        if (!staged.defined()) return -1;
        return tag == kAnyRefresh ? 1 : std::max<int64_t>(1, tag - last_activated_);
      };
      out.emplace_back(
          p + "staged_refresh",
          at::tensor({relative(pr.a_staged[0], pr.a_tag[0]), relative(pr.a_staged[1], pr.a_tag[1]),
                      relative(pr.b_staged[0], pr.b_tag[0]), relative(pr.b_staged[1], pr.b_tag[1])},
                     at::TensorOptions().dtype(at::kLong)));
    }
    out.emplace_back(absl::StrCat("kfac.", layer, ".replicas_ready"),
                     at::tensor({static_cast<int64_t>(st.replicas_ready)},
                                at::TensorOptions().dtype(at::kLong)));
    // Relative as well: 0 = no refresh after the last activation finalised.
    const int64_t finalized =
        st.finalized_refresh > last_activated_ ? st.finalized_refresh - last_activated_ : 0;
    out.emplace_back(absl::StrCat("kfac.", layer, ".finalized_refresh"),
                     at::tensor({finalized}, at::TensorOptions().dtype(at::kLong)));
  }
  return out;
}

absl::Status Kfac::LoadState(const std::map<std::string, at::Tensor>& table) {
  auto shape_of = [](const at::Tensor& t) {
    return absl::StrCat("[", absl::StrJoin(t.sizes(), ","), "]");
  };
  // Pass 1 checks, pass 2 assigns: nothing changes on a mismatch.
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& [layer, st] : layers_) {
      std::vector<StatePiece> pieces;
      AddFactorPieces(layer, st, pieces);
      AddProjectionPieces(layer, st, pieces);
      for (const StatePiece& piece : pieces) {
        auto it = table.find(piece.name);
        if (it == table.end()) {
          // Absent = not computed yet at the source (a running factor before
          // the first refresh); the pending sums and counts always exist.
          const bool required = piece.name.find("_sum.") != std::string::npos ||
                                piece.name.find("_count") != std::string::npos;
          if (pass == 0 && required) {
            return absl::InvalidArgumentError(absl::StrCat("K-FAC state lacks ", piece.name));
          }
          if (pass == 1) *piece.tensor = at::Tensor();
          continue;
        }
        if (pass == 0) {
          if (it->second.sizes().vec() != piece.shape || it->second.scalar_type() != piece.dtype) {
            return absl::InvalidArgumentError(
                absl::StrCat("K-FAC state ", piece.name, " has shape ", shape_of(it->second), " ",
                             c10::toString(it->second.scalar_type()), ", expected [",
                             absl::StrJoin(piece.shape, ","), "] float"));
          }
        } else {
          *piece.tensor = it->second.to(stage_->device()).clone();
        }
      }
      for (int m = 0; m < kNumModules; ++m) {
        Projection& pr = st.proj[m];
        const std::string p = absl::StrCat("kfac.", layer, ".", KfacModules()[m], ".");
        auto damping = table.find(p + "damping");
        auto step = table.find(p + "adam_step");
        auto graft = table.find(p + "graft_scale");
        if (pass == 0) {
          if (damping == table.end() || damping->second.numel() != 3 ||
              damping->second.scalar_type() != at::kDouble || step == table.end() ||
              step->second.numel() != 1 || step->second.scalar_type() != at::kLong ||
              graft == table.end() || graft->second.numel() != 1 ||
              graft->second.scalar_type() != at::kDouble) {
            return absl::InvalidArgumentError(absl::StrCat(
                "K-FAC state ", p, "{damping,adam_step,graft_scale} missing or malformed"));
          }
          auto tags = table.find(p + "staged_refresh");
          if (tags != table.end() &&
              (tags->second.numel() != 4 || tags->second.scalar_type() != at::kLong)) {
            return absl::InvalidArgumentError(
                absl::StrCat("K-FAC state ", p, "staged_refresh is malformed"));
          }
          for (const auto& [name, is_a] :
               {std::make_pair("a_inv_new", true), std::make_pair("b_inv_new", false)}) {
            auto legacy = table.find(p + name);
            const auto want = (is_a ? st.a_sum[InputOf(m)] : st.b_sum[m]).sizes().vec();
            if (legacy != table.end() && (legacy->second.sizes().vec() != want ||
                                          legacy->second.scalar_type() != at::kFloat)) {
              return absl::InvalidArgumentError(
                  absl::StrCat("K-FAC state ", p, name, " has shape ", shape_of(legacy->second),
                               ", expected [", absl::StrJoin(want, ","), "] float"));
            }
          }
          continue;
        }
        const at::Tensor d = damping->second.contiguous();
        pr.damping.pi = d.data_ptr<double>()[0];
        pr.damping.damping_a = d.data_ptr<double>()[1];
        pr.damping.damping_b = d.data_ptr<double>()[2];
        pr.adam_step = step->second.item<int64_t>();
        pr.graft_scale = graft->second.item<double>();
        // The staged inverses' refreshes; a state from before refresh tags
        // has one staged inverse per factor ("*_inv_new"), activated next.
        auto tags = table.find(p + "staged_refresh");
        const bool tagged = tags != table.end() && tags->second.numel() == 4 &&
                            tags->second.scalar_type() == at::kLong;
        const at::Tensor tag = tagged ? tags->second.contiguous() : at::Tensor();
        // Stored relative to the last activation: anchored at this one's
        // (a fresh K-FAC: none; RebaseRefreshes moves it to the plan's).
        auto absolute = [&](const at::Tensor& staged, int i) -> int64_t {
          if (!staged.defined()) return kNoRefresh;
          if (!tagged) return kAnyRefresh;
          return last_activated_ + std::max<int64_t>(1, tag.data_ptr<int64_t>()[i]);
        };
        for (int slot = 0; slot < 2; ++slot) {
          pr.a_tag[slot] = absolute(pr.a_staged[slot], slot);
          pr.b_tag[slot] = absolute(pr.b_staged[slot], 2 + slot);
        }
        for (const auto& [name, is_a] :
             {std::make_pair("a_inv_new", true), std::make_pair("b_inv_new", false)}) {
          auto legacy = table.find(p + name);
          if (legacy == table.end()) continue;
          (is_a ? pr.a_staged : pr.b_staged)[0] = legacy->second.to(stage_->device()).clone();
          (is_a ? pr.a_tag : pr.b_tag)[0] = kAnyRefresh;
        }
      }
      // Absent in states written before replica_sync (they synced factors)
      // resp. before inversions came in parts (finalised = not yet).
      auto ready = table.find(absl::StrCat("kfac.", layer, ".replicas_ready"));
      auto finalized = table.find(absl::StrCat("kfac.", layer, ".finalized_refresh"));
      if (pass == 0) {
        for (const auto& [it, piece] : {std::make_pair(ready, "replicas_ready"),
                                        std::make_pair(finalized, "finalized_refresh")}) {
          if (it != table.end() &&
              (it->second.numel() != 1 || it->second.scalar_type() != at::kLong)) {
            return absl::InvalidArgumentError(
                absl::StrCat("K-FAC state kfac.", layer, ".", piece, " is malformed"));
          }
        }
      } else {
        st.replicas_ready = ready != table.end() && ready->second.item<int64_t>() != 0;
        const int64_t rel = finalized != table.end() ? finalized->second.item<int64_t>() : 0;
        st.finalized_refresh = rel > 0 ? last_activated_ + rel : kNoRefresh;
        st.agreed = false;
        for (Projection& pr : st.proj) {
          pr.a_work.reset();
          pr.b_work.reset();
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace detour::model
