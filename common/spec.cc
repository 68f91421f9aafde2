#include "common/spec.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/spec_json_error.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace detour {
namespace {

using v1::ClusterSpec;
using v1::JobSpec;

absl::Status Invalid(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", problem));
}

// Sets a scalar proto field to `value` when it holds its zero value.
#define DETOUR_DEFAULT(msg, field, value)               \
  do {                                                  \
    if ((msg)->field() == 0) (msg)->set_##field(value); \
  } while (0)

template <typename M>
absl::StatusOr<M> ParseJson(absl::string_view json, absl::string_view what) {
  M message;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  auto status = google::protobuf::util::JsonStringToMessage(std::string(json), &message, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", ExplainSpecJsonError(json, *M::descriptor(), std::string(status.message()))));
  }
  return message;
}

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(c) && c != '-' && c != '_' && c != '.') return false;
  }
  return true;
}

std::string Num(double v) { return absl::StrFormat("%g", v); }

}  // namespace

absl::StatusOr<v1::ModelShape> ModelPreset(absl::string_view name) {
  v1::ModelShape s;
  s.set_preset(std::string(name));
  auto set = [&s](uint32_t layers, uint32_t d, uint32_t heads, uint32_t kv, uint32_t ffn,
                  uint32_t ctx, uint32_t vocab) {
    s.set_num_layers(layers);
    s.set_d_model(d);
    s.set_num_heads(heads);
    s.set_num_kv_heads(kv);
    s.set_ffn_dim(ffn);
    s.set_context_length(ctx);
    s.set_vocab_size(vocab);
  };
  if (name == "tiny") {
    set(8, 128, 4, 4, 384, 128, 256);
  } else if (name == "small") {
    set(12, 384, 6, 6, 1024, 256, 256);
  } else if (name == "500m") {
    set(24, 1024, 16, 16, 4096, 1024, 32000);
  } else if (name == "1.5b") {
    set(24, 2048, 16, 16, 8192, 4096, 32000);
  } else if (name == "8b") {
    set(32, 4096, 32, 8, 14336, 8192, 128256);
    s.set_rope_theta(500000);
  } else {
    return absl::NotFoundError(
        absl::StrCat("unknown model preset \"", name, "\" (known: tiny, small, 500m, 1.5b, 8b)"));
  }
  return s;
}

int VisitedStages(const v1::PipelineSpec& pipeline) {
  const double s = pipeline.num_stages();
  const int p = static_cast<int>(std::lround(s * (1.0 - pipeline.skip_ratio())));
  return p < 1 ? 1 : p;
}

int64_t DefaultFfnDim(int64_t d_model) {
  const int64_t raw = (8 * d_model + 2) / 3;
  return (raw + 63) / 64 * 64;
}

void FillModelShapeDefaults(v1::ModelShape* m) {
  DETOUR_DEFAULT(m, num_kv_heads, m->num_heads());
  if (m->ffn_dim() == 0 && m->d_model() > 0) {
    // Past uint32 the width stays 0, which validation refuses.
    const int64_t ffn = DefaultFfnDim(m->d_model());
    if (ffn <= UINT32_MAX) m->set_ffn_dim(static_cast<uint32_t>(ffn));
  }
  DETOUR_DEFAULT(m, vocab_size, 256u);
  DETOUR_DEFAULT(m, context_length, 128u);
  DETOUR_DEFAULT(m, rope_theta, 10000.0);
  DETOUR_DEFAULT(m, norm_eps, 1e-5);
}

absl::StatusOr<v1::ModelShape> ResolveModelShape(const v1::ModelShape& shape) {
  v1::ModelShape m = shape;
  if (!m.preset().empty()) {
    auto preset = ModelPreset(m.preset());
    if (!preset.ok()) return preset.status();
    // Explicit (non-zero) fields win over the preset's.
    v1::ModelShape merged = *preset;
    merged.MergeFrom(m);
    m = merged;
  }
  FillModelShapeDefaults(&m);
  return m;
}

void ApplyJobDefaults(JobSpec* spec) {
  v1::ModelShape* m = spec->mutable_model();
  // An unknown preset is left for ValidateJobSpec to name; the other
  // defaults are filled all the same.
  auto resolved = ResolveModelShape(*m);
  if (resolved.ok()) {
    *m = *resolved;
  } else {
    FillModelShapeDefaults(m);
  }

  v1::PipelineSpec* p = spec->mutable_pipeline();
  DETOUR_DEFAULT(p, num_stages, 4u);
  DETOUR_DEFAULT(p, data_nodes, 1u);
  DETOUR_DEFAULT(p, replicas_per_stage, 1u);
  DETOUR_DEFAULT(p, microbatches_per_data_node, 4u);
  DETOUR_DEFAULT(p, samples_per_microbatch, 1u);
  DETOUR_DEFAULT(p, max_jump, 3u);
  DETOUR_DEFAULT(p, max_swap_distance, 1u);
  DETOUR_DEFAULT(p, max_total_swap_distance, 2u);
  DETOUR_DEFAULT(p, memory_slots, 3u);
  if (p->scheduler() == v1::SCHEDULER_UNSPECIFIED) p->set_scheduler(v1::SCHEDULER_SKIPPIPE);
  if (p->grad_normalization() == v1::GRAD_NORM_UNSPECIFIED) {
    p->set_grad_normalization(v1::GRAD_NORM_VISITS);
  }
  if (p->wire_dtype().empty()) p->set_wire_dtype("fp32");
  if (p->queue_policy() == v1::QUEUE_POLICY_UNSPECIFIED) {
    p->set_queue_policy(v1::QUEUE_POLICY_ARRIVAL);
  }
  if (p->plan_objective() == v1::PLAN_OBJECTIVE_UNSPECIFIED) {
    p->set_plan_objective(v1::PLAN_OBJECTIVE_ITERATION);
  }
  if (p->precision() == v1::PRECISION_UNSPECIFIED) p->set_precision(v1::PRECISION_FP32);

  v1::OptimizerSpec* o = spec->mutable_optimizer();
  if (o->kind() == v1::OPTIMIZER_UNSPECIFIED) o->set_kind(v1::OPTIMIZER_ADAMW);
  v1::AdamWSpec* a = o->mutable_adamw();
  DETOUR_DEFAULT(a, lr, 3e-4);
  DETOUR_DEFAULT(a, beta1, 0.9);
  DETOUR_DEFAULT(a, beta2, 0.95);
  DETOUR_DEFAULT(a, eps, 1e-8);
  DETOUR_DEFAULT(a, weight_decay, 0.1);
  DETOUR_DEFAULT(o, min_lr_ratio, 0.1);
  DETOUR_DEFAULT(o, grad_clip_norm, 1.0);
  v1::KfacSpec* k = o->mutable_kfac();
  DETOUR_DEFAULT(k, damping, 1e-3);
  DETOUR_DEFAULT(k, factor_decay, 1.0);
  DETOUR_DEFAULT(k, curvature_microbatches, 1u);
  DETOUR_DEFAULT(k, lr, a->lr());
  DETOUR_DEFAULT(k, momentum, 0.9);
  DETOUR_DEFAULT(k, slack, 0.05);
  DETOUR_DEFAULT(k, kl_clip, 1e-3);
  DETOUR_DEFAULT(k, max_granule_ms, 5.0);
  if (k->placement() == v1::KFAC_PLACEMENT_UNSPECIFIED) {
    k->set_placement(v1::KFAC_PLACEMENT_BUBBLES);
  }
  if (k->update() == v1::KFAC_UPDATE_UNSPECIFIED) {
    k->set_update(v1::KFAC_UPDATE_GRAFT_ADAMW);
  }
  // Replicas must step identically. Without a choice the coordinator picks
  // the scheme from the cost model when it assigns the stages (AUTO;
  // docs/KFAC.md, "Replicas"); an explicit sync_factors keeps the exact
  // factor all-reduce (and stored jobs normalised before replica_sync), and
  // the momentum rule's KL clipping needs the raw gradient: factors too.
  if (o->kind() == v1::OPTIMIZER_KFAC) {
    const bool replicated =
        spec->pipeline().data_nodes() > 1 || spec->pipeline().replicas_per_stage() > 1;
    const bool momentum = k->update() == v1::KFAC_UPDATE_MOMENTUM;
    if (k->replica_sync() == v1::KFAC_REPLICA_SYNC_UNSPECIFIED && replicated) {
      k->set_replica_sync(k->sync_factors() || momentum ? v1::KFAC_REPLICA_SYNC_FACTORS
                                                        : v1::KFAC_REPLICA_SYNC_AUTO);
    } else if (k->replica_sync() == v1::KFAC_REPLICA_SYNC_AUTO) {
      // Nothing to choose between: one replica per stage, or the momentum
      // rule (FACTORS is its only scheme).
      if (!replicated)
        k->set_replica_sync(v1::KFAC_REPLICA_SYNC_UNSPECIFIED);
      else if (momentum)
        k->set_replica_sync(v1::KFAC_REPLICA_SYNC_FACTORS);
    }
  }
  if (k->replica_sync() == v1::KFAC_REPLICA_SYNC_FACTORS) k->set_sync_factors(true);

  v1::DataSpec* d = spec->mutable_data();
  if (d->source() == v1::DATA_SOURCE_UNSPECIFIED) d->set_source(v1::DATA_SOURCE_EMBEDDED);
  DETOUR_DEFAULT(d, validation_fraction, 0.05);

  DETOUR_DEFAULT(spec->mutable_checkpoint(), keep_last, 2u);
  // Often enough that a rollback after a stage loss (elastic.on_stage_loss)
  // redoes at most this many iterations.
  DETOUR_DEFAULT(spec->mutable_checkpoint(), every_iterations, 100u);
  if (spec->device().empty()) spec->set_device("cpu");

  v1::ElasticSpec* e = spec->mutable_elastic();
  DETOUR_DEFAULT(e, pause_timeout_s, 600u);
  DETOUR_DEFAULT(e, reconnect_grace_ms, 2000u);
  DETOUR_DEFAULT(e, reassign_horizon_iterations, 20u);
  if (e->on_stage_loss() == v1::STAGE_LOSS_UNSPECIFIED)
    e->set_on_stage_loss(v1::STAGE_LOSS_ROLLBACK);
}

namespace {

// ValidateJobSpec's sections. Each checks its fields in a fixed order: a spec
// with several errors always reports the same first one.

absl::Status ValidateModelShape(const v1::ModelShape& m) {
  if (!m.preset().empty()) {
    auto preset = ModelPreset(m.preset());
    if (!preset.ok()) return Invalid("model.preset", preset.status().message());
  }
  if (m.num_layers() == 0) return Invalid("model.num_layers", "must be > 0 (or name a preset)");
  if (m.d_model() == 0) return Invalid("model.d_model", "must be > 0 (or name a preset)");
  if (m.num_heads() == 0) return Invalid("model.num_heads", "must be > 0 (or name a preset)");
  if (m.d_model() % m.num_heads() != 0) {
    return Invalid("model.num_heads",
                   absl::StrCat(m.num_heads(), " does not divide d_model ", m.d_model()));
  }
  if ((m.d_model() / m.num_heads()) % 2 != 0) {
    return Invalid("model.num_heads", absl::StrCat("head size ", m.d_model() / m.num_heads(),
                                                   " must be even for rotary embeddings"));
  }
  if (m.num_kv_heads() == 0 || m.num_heads() % m.num_kv_heads() != 0) {
    return Invalid("model.num_kv_heads",
                   absl::StrCat(m.num_kv_heads(), " must divide num_heads ", m.num_heads()));
  }
  if (m.vocab_size() < 2) return Invalid("model.vocab_size", absl::StrCat(m.vocab_size(), " < 2"));
  using L = SpecLimits;
  for (auto [field, value, limit] :
       {std::tuple<const char*, uint64_t, uint64_t>{"model.num_layers", m.num_layers(),
                                                    L::kMaxLayers},
        {"model.d_model", m.d_model(), L::kMaxDModel},
        {"model.num_heads", m.num_heads(), L::kMaxHeads},
        {"model.ffn_dim", m.ffn_dim(), L::kMaxFfnDim},
        {"model.vocab_size", m.vocab_size(), L::kMaxVocab},
        {"model.context_length", m.context_length(), L::kMaxContext}}) {
    if (value > limit) return Invalid(field, absl::StrCat(value, " exceeds the limit ", limit));
  }
  if (!(m.rope_theta() <= 1e12)) {
    return Invalid("model.rope_theta", Num(m.rope_theta()) + " is above 1e12");
  }
  if (!(m.norm_eps() < 1)) return Invalid("model.norm_eps", Num(m.norm_eps()) + " is not < 1");
  if (!(m.rope_theta() > 0))
    return Invalid("model.rope_theta", Num(m.rope_theta()) + " must be > 0");
  if (!(m.norm_eps() > 0)) return Invalid("model.norm_eps", Num(m.norm_eps()) + " must be > 0");
  return absl::OkStatus();
}

// Per-field limits, then the sizes they multiply into (workers, microbatches,
// one activation), then at least one layer per stage.
absl::Status ValidatePipelineSizes(const v1::PipelineSpec& p, const v1::ModelShape& m) {
  using L = SpecLimits;
  for (auto [field, value, limit] :
       {std::tuple<const char*, uint64_t, uint64_t>{"pipeline.data_nodes", p.data_nodes(),
                                                    L::kMaxDataNodes},
        {"pipeline.replicas_per_stage", p.replicas_per_stage(), L::kMaxReplicas},
        {"pipeline.microbatches_per_data_node", p.microbatches_per_data_node(),
         L::kMaxMicrobatchesPerDataNode},
        {"pipeline.samples_per_microbatch", p.samples_per_microbatch(),
         L::kMaxSamplesPerMicrobatch},
        {"pipeline.memory_slots", p.memory_slots(), L::kMaxMemorySlots},
        {"pipeline.num_stages", p.num_stages(), L::kMaxLayers},
        {"pipeline.max_jump", p.max_jump(), L::kMaxLayers},
        {"pipeline.max_swaps", p.max_swaps(), L::kMaxLayers},
        {"pipeline.max_swap_distance", p.max_swap_distance(), L::kMaxLayers},
        {"pipeline.max_total_swap_distance", p.max_total_swap_distance(),
         uint64_t{L::kMaxLayers} * L::kMaxLayers},
        {"pipeline.full_model_every", p.full_model_every(), L::kMaxIterations},
        {"pipeline.max_visits_per_node", p.max_visits_per_node(), L::kMaxMicrobatches}}) {
    if (value > limit) return Invalid(field, absl::StrCat(value, " exceeds the limit ", limit));
  }
  // Products of bounded counts fit in 64 bits.
  const uint64_t workers = uint64_t{p.data_nodes()} +
                           (uint64_t{std::max(1u, p.num_stages())} - 1) * p.replicas_per_stage();
  if (workers > L::kMaxWorkers) {
    return Invalid("pipeline", absl::StrCat("needs ", workers,
                                            " workers (data_nodes + (num_stages-1) x "
                                            "replicas_per_stage), more than the limit ",
                                            L::kMaxWorkers));
  }
  const uint64_t microbatches = uint64_t{p.data_nodes()} * p.microbatches_per_data_node();
  if (microbatches > L::kMaxMicrobatches) {
    return Invalid("pipeline.microbatches_per_data_node",
                   absl::StrCat(p.data_nodes(), " data nodes x ", p.microbatches_per_data_node(),
                                " = ", microbatches,
                                " microbatches per iteration, more than the "
                                "limit ",
                                L::kMaxMicrobatches));
  }
  const uint64_t elements = uint64_t{p.samples_per_microbatch()} * m.context_length() * m.d_model();
  if (elements > L::kMaxActivationElements) {
    return Invalid("pipeline.samples_per_microbatch",
                   absl::StrCat("a microbatch's activation of ", p.samples_per_microbatch(), " x ",
                                m.context_length(), " x ", m.d_model(), " = ", elements,
                                " elements exceeds the limit ", L::kMaxActivationElements));
  }
  if (p.num_stages() > m.num_layers()) {
    return Invalid("pipeline.num_stages",
                   absl::StrCat(p.num_stages(), " stages exceed model.num_layers ", m.num_layers(),
                                " (each stage needs at least one layer)"));
  }
  return absl::OkStatus();
}

// An explicit assignment (if any): one node group per stage of the right
// size, each node id valid and used once.
absl::Status ValidatePipelineAssignment(const v1::PipelineSpec& p) {
  if (p.assignment_size() == 0) return absl::OkStatus();
  using L = SpecLimits;
  if (p.assignment_size() != static_cast<int>(p.num_stages())) {
    return Invalid("pipeline.assignment", absl::StrCat(p.assignment_size(), " stage groups for ",
                                                       p.num_stages(), " stages"));
  }
  std::set<std::string> seen;
  for (int st = 0; st < p.assignment_size(); ++st) {
    const auto& ids = p.assignment(st).nodes();
    const uint32_t want = st == 0 ? p.data_nodes() : p.replicas_per_stage();
    const std::string field = absl::StrCat("pipeline.assignment[", st, "]");
    if (static_cast<uint32_t>(ids.size()) != want) {
      return Invalid(field, absl::StrCat(ids.size(), " nodes, stage ", st, " needs ", want,
                                         st == 0 ? " (data_nodes)" : " (replicas_per_stage)"));
    }
    for (const std::string& id : ids) {
      if (id.empty()) return Invalid(field, "has an empty node id");
      if (id.size() > L::kMaxIdBytes) {
        return Invalid(
            field, absl::StrCat("a node id of ", id.size(), " bytes (limit ", L::kMaxIdBytes, ")"));
      }
      if (!seen.insert(id).second) {
        return Invalid(field, absl::StrCat("node \"", id, "\" is assigned twice"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePipeline(const v1::PipelineSpec& p, const v1::ModelShape& m) {
  RETURN_IF_ERROR(ValidatePipelineSizes(p, m));
  if (!(p.skip_ratio() >= 0.0 && p.skip_ratio() < 1.0)) {
    return Invalid("pipeline.skip_ratio", Num(p.skip_ratio()) + " is outside [0, 1)");
  }
  const int visited = VisitedStages(p);
  if (p.num_stages() > 1 && p.skip_ratio() > 0 && visited > static_cast<int>(p.num_stages())) {
    return Invalid("pipeline.skip_ratio", "visits more stages than exist");
  }
  if (p.max_jump() == 0) return Invalid("pipeline.max_jump", "must be >= 1");
  // With P-1 hops of at most max_jump stages each, routes reach stage
  // max_jump·(P-1) at most; every stage must be reachable.
  if (visited > 1 &&
      uint64_t{p.max_jump()} * static_cast<uint64_t>(visited - 1) < p.num_stages() - 1) {
    return Invalid("pipeline.max_jump",
                   absl::StrCat(p.max_jump(), " is too small: ", visited - 1, " hops of at most ",
                                p.max_jump(), " stages cannot reach stage ", p.num_stages() - 1));
  }
  if (p.max_swaps() > 0 && p.max_swap_distance() == 0) {
    return Invalid("pipeline.max_swap_distance", "must be >= 1 when max_swaps > 0");
  }
  if (p.memory_slots() == 0) return Invalid("pipeline.memory_slots", "must be >= 1");
  if (!v1::QueuePolicy_IsValid(p.queue_policy())) {
    return Invalid("pipeline.queue_policy", absl::StrCat(p.queue_policy(), " is not a policy"));
  }
  if (!v1::PlanObjective_IsValid(p.plan_objective())) {
    return Invalid("pipeline.plan_objective",
                   absl::StrCat(p.plan_objective(), " is not an objective"));
  }
  if (!v1::Precision_IsValid(p.precision())) {
    return Invalid("pipeline.precision", absl::StrCat(p.precision(),
                                                      " is not a precision (PRECISION_FP32 or "
                                                      "PRECISION_BF16)"));
  }
  RETURN_IF_ERROR(ValidatePipelineAssignment(p));
  const std::set<std::string> dtypes = {"fp32", "fp16", "bf16"};
  if (!dtypes.count(p.wire_dtype())) {
    return Invalid("pipeline.wire_dtype",
                   absl::StrCat("\"", p.wire_dtype(), "\" is not one of fp32, fp16, bf16"));
  }
  // A stage that no microbatch could ever reach would never train.
  if (visited > 1 && p.num_stages() > 1) {
    const uint64_t visits = uint64_t{p.data_nodes()} * p.microbatches_per_data_node() *
                            static_cast<uint64_t>(visited - 1);
    if (visits < p.num_stages() - 1) {
      return Invalid(
          "pipeline.microbatches_per_data_node",
          absl::StrCat(p.microbatches_per_data_node(),
                       " microbatches per data node cannot visit all ", p.num_stages() - 1,
                       " non-zero stages at skip ratio ", Num(p.skip_ratio())));
    }
  }
  return absl::OkStatus();
}

// AdamW, clipping and the lr schedule (K-FAC's settings are ValidateKfac's).
absl::Status ValidateOptimizer(const v1::OptimizerSpec& o) {
  using L = SpecLimits;
  if (!(o.adamw().lr() > 0) || !std::isfinite(o.adamw().lr())) {
    return Invalid("optimizer.adamw.lr", Num(o.adamw().lr()) + " must be > 0");
  }
  for (auto [name, v] :
       {std::pair<const char*, double>{"beta1", o.adamw().beta1()}, {"beta2", o.adamw().beta2()}}) {
    if (!(v >= 0 && v < 1)) {
      return Invalid(absl::StrCat("optimizer.adamw.", name), Num(v) + " is outside [0, 1)");
    }
  }
  if (!(o.adamw().lr() <= 10)) {
    return Invalid("optimizer.adamw.lr", Num(o.adamw().lr()) + " is above 10");
  }
  if (!(o.adamw().eps() > 0 && o.adamw().eps() <= 1)) {
    return Invalid("optimizer.adamw.eps", Num(o.adamw().eps()) + " is outside (0, 1]");
  }
  if (!(o.adamw().weight_decay() >= 0 && o.adamw().weight_decay() <= 100)) {
    return Invalid("optimizer.adamw.weight_decay",
                   Num(o.adamw().weight_decay()) + " is outside [0, 100]");
  }
  if (!(o.grad_clip_norm() >= 0) || !std::isfinite(o.grad_clip_norm())) {
    return Invalid("optimizer.grad_clip_norm",
                   Num(o.grad_clip_norm()) + " must be a finite number >= 0 (0 = no clipping)");
  }
  if (o.warmup_iterations() > L::kMaxIterations) {
    return Invalid("optimizer.warmup_iterations",
                   absl::StrCat(o.warmup_iterations(), " exceeds the limit ", L::kMaxIterations));
  }
  if (!(o.min_lr_ratio() >= 0 && o.min_lr_ratio() <= 1)) {
    return Invalid("optimizer.min_lr_ratio", Num(o.min_lr_ratio()) + " is outside [0, 1]");
  }
  return absl::OkStatus();
}

// `p` bounds the curvature microbatches.
absl::Status ValidateKfac(const v1::KfacSpec& k, const v1::PipelineSpec& p) {
  using L = SpecLimits;
  if (!(k.damping() > 0 && k.damping() <= 1e6)) {
    return Invalid("optimizer.kfac.damping", Num(k.damping()) + " is outside (0, 1e6]");
  }
  if (k.refresh_interval() > L::kMaxIterations) {
    return Invalid("optimizer.kfac.refresh_interval",
                   absl::StrCat(k.refresh_interval(), " exceeds the limit ", L::kMaxIterations));
  }
  if (!(k.factor_decay() > 0 && k.factor_decay() <= 1)) {
    return Invalid("optimizer.kfac.factor_decay", Num(k.factor_decay()) + " is outside (0, 1]");
  }
  if (k.curvature_microbatches() > p.microbatches_per_data_node()) {
    return Invalid("optimizer.kfac.curvature_microbatches",
                   absl::StrCat(k.curvature_microbatches(), " exceeds microbatches_per_data_node ",
                                p.microbatches_per_data_node()));
  }
  if (!(k.slack() >= 0 && k.slack() < 1)) {
    return Invalid("optimizer.kfac.slack", Num(k.slack()) + " is outside [0, 1)");
  }
  if (!(k.max_granule_ms() >= 0.01 && k.max_granule_ms() <= 60000)) {
    return Invalid("optimizer.kfac.max_granule_ms",
                   Num(k.max_granule_ms()) + " is outside [0.01, 60000]");
  }
  if (!(k.lr() > 0 && k.lr() <= 10)) {
    return Invalid("optimizer.kfac.lr", Num(k.lr()) + " is outside (0, 10]");
  }
  if (!(k.momentum() >= 0 && k.momentum() < 1)) {
    return Invalid("optimizer.kfac.momentum", Num(k.momentum()) + " is outside [0, 1)");
  }
  if (!std::isfinite(k.kl_clip())) {
    return Invalid("optimizer.kfac.kl_clip", Num(k.kl_clip()) + " is not finite");
  }
  if (!v1::KfacUpdate_IsValid(k.update())) {
    return Invalid("optimizer.kfac.update", absl::StrCat(k.update(), " is not a KfacUpdate"));
  }
  if (!v1::KfacReplicaSync_IsValid(k.replica_sync())) {
    return Invalid("optimizer.kfac.replica_sync",
                   absl::StrCat(k.replica_sync(), " is not a KfacReplicaSync"));
  }
  if (k.replica_sync() == v1::KFAC_REPLICA_SYNC_PRECONDITIONED && k.sync_factors()) {
    return Invalid("optimizer.kfac.replica_sync",
                   "KFAC_REPLICA_SYNC_PRECONDITIONED contradicts sync_factors = true");
  }
  if (k.replica_sync() == v1::KFAC_REPLICA_SYNC_AUTO && k.sync_factors()) {
    return Invalid("optimizer.kfac.replica_sync",
                   "KFAC_REPLICA_SYNC_AUTO contradicts sync_factors = true (which asks for "
                   "KFAC_REPLICA_SYNC_FACTORS)");
  }
  if (k.replica_sync() == v1::KFAC_REPLICA_SYNC_PRECONDITIONED &&
      k.update() == v1::KFAC_UPDATE_MOMENTUM) {
    return Invalid("optimizer.kfac.replica_sync",
                   "KFAC_REPLICA_SYNC_PRECONDITIONED needs update KFAC_UPDATE_GRAFT_ADAMW "
                   "(the momentum rule's KL clipping needs the raw gradient)");
  }
  return absl::OkStatus();
}

// The paths a job reads from (data.tokenizer is ValidateData's): their
// lengths, and which checkpoint the job starts from.
absl::Status ValidateInputPaths(const JobSpec& spec) {
  using L = SpecLimits;
  const v1::DataSpec& d = spec.data();
  if (d.path().size() > L::kMaxPathBytes) {
    return Invalid("data.path",
                   absl::StrCat(d.path().size(), " bytes, more than the limit ", L::kMaxPathBytes));
  }
  if (spec.checkpoint().resume_from().size() > L::kMaxPathBytes) {
    return Invalid("checkpoint.resume_from",
                   absl::StrCat(spec.checkpoint().resume_from().size(),
                                " bytes, more than the limit ", L::kMaxPathBytes));
  }
  const std::string& init_from = spec.checkpoint().init_from();
  if (init_from.size() > L::kMaxPathBytes) {
    return Invalid(
        "checkpoint.init_from",
        absl::StrCat(init_from.size(), " bytes, more than the limit ", L::kMaxPathBytes));
  }
  if (init_from.find('\0') != std::string::npos) {
    return Invalid("checkpoint.init_from", "contains a NUL byte");
  }
  if (!init_from.empty() && !spec.checkpoint().resume_from().empty()) {
    return Invalid("checkpoint.init_from",
                   "is exclusive with checkpoint.resume_from (a resumed job continues from its "
                   "own checkpoint)");
  }
  return absl::OkStatus();
}

absl::Status ValidateCheckpointSchedule(const v1::CheckpointPolicy& c) {
  using L = SpecLimits;
  if (c.keep_last() > L::kMaxKeepLast) {
    return Invalid("checkpoint.keep_last",
                   absl::StrCat(c.keep_last(), " exceeds the limit ", L::kMaxKeepLast));
  }
  if (c.every_iterations() > L::kMaxIterations) {
    return Invalid("checkpoint.every_iterations",
                   absl::StrCat(c.every_iterations(), " exceeds the limit ", L::kMaxIterations));
  }
  return absl::OkStatus();
}

absl::Status ValidateElastic(const v1::ElasticSpec& e) {
  using L = SpecLimits;
  if (e.pause_timeout_s() > L::kMaxPauseSeconds) {
    return Invalid("elastic.pause_timeout_s",
                   absl::StrCat(e.pause_timeout_s(), " exceeds the limit ", L::kMaxPauseSeconds));
  }
  if (e.reconnect_grace_ms() > L::kMaxReconnectGraceMs) {
    return Invalid(
        "elastic.reconnect_grace_ms",
        absl::StrCat(e.reconnect_grace_ms(), " exceeds the limit ", L::kMaxReconnectGraceMs));
  }
  if (e.reassign_horizon_iterations() > L::kMaxReassignHorizon) {
    return Invalid("elastic.reassign_horizon_iterations",
                   absl::StrCat(e.reassign_horizon_iterations(), " exceeds the limit ",
                                L::kMaxReassignHorizon));
  }
  if (!v1::StageLossAction_IsValid(e.on_stage_loss())) {
    return Invalid("elastic.on_stage_loss",
                   absl::StrCat(e.on_stage_loss(),
                                " is not one of STAGE_LOSS_ROLLBACK, STAGE_LOSS_PAUSE, "
                                "STAGE_LOSS_REINITIALIZE"));
  }
  return absl::OkStatus();
}

// The data source and its settings (data.path's length is ValidateInputPaths's).
absl::Status ValidateData(const v1::DataSpec& d) {
  using L = SpecLimits;
  if (d.source() == v1::DATA_SOURCE_TEXT && d.path().empty()) {
    return Invalid("data.path", "required when data.source is DATA_SOURCE_TEXT");
  }
  if (d.source() == v1::DATA_SOURCE_SHARDS && d.path().empty()) {
    return Invalid("data.path",
                   "required when data.source is DATA_SOURCE_SHARDS (a `detour-data prepare` "
                   "output directory)");
  }
  if (!v1::DataSourceKind_IsValid(d.source())) {
    return Invalid("data.source", absl::StrCat(d.source(), " is not a DataSourceKind"));
  }
  if (d.tokenizer().size() > L::kMaxPathBytes) {
    return Invalid(
        "data.tokenizer",
        absl::StrCat(d.tokenizer().size(), " bytes, more than the limit ", L::kMaxPathBytes));
  }
  if (!(d.validation_fraction() >= 0 && d.validation_fraction() <= 0.5)) {
    return Invalid("data.validation_fraction",
                   Num(d.validation_fraction()) + " is outside [0, 0.5]");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateJobSpec(const JobSpec& spec) {
  // First, and counting unknown fields: each field may be within its limit
  // while the whole is not (or be all unknown fields).
  if (const size_t bytes = spec.ByteSizeLong(); bytes > SpecLimits::kMaxJobSpecBytes) {
    return Invalid("spec", absl::StrCat("is ", bytes, " bytes serialized, more than the limit of ",
                                        SpecLimits::kMaxJobSpecBytes, " (1 MiB)"));
  }
  if (!ValidName(spec.name())) {
    return Invalid("name", absl::StrCat("\"", spec.name(),
                                        "\" must be 1-64 letters, digits, '-', '_' or '.'"));
  }
  // The sections in a fixed order, with the top-level fields where they have
  // always been checked, so that the first error a spec reports stays put.
  RETURN_IF_ERROR(ValidateModelShape(spec.model()));
  RETURN_IF_ERROR(ValidatePipeline(spec.pipeline(), spec.model()));
  RETURN_IF_ERROR(ValidateOptimizer(spec.optimizer()));
  RETURN_IF_ERROR(ValidateKfac(spec.optimizer().kfac(), spec.pipeline()));
  RETURN_IF_ERROR(ValidateInputPaths(spec));
  RETURN_IF_ERROR(ValidateCheckpointSchedule(spec.checkpoint()));
  RETURN_IF_ERROR(ValidateElastic(spec.elastic()));
  if (spec.iterations() > SpecLimits::kMaxIterations) {
    return Invalid("iterations", absl::StrCat(spec.iterations(), " exceeds the limit ",
                                              SpecLimits::kMaxIterations));
  }
  RETURN_IF_ERROR(ValidateData(spec.data()));
  if (spec.iterations() == 0) return Invalid("iterations", "must be > 0");
  if (spec.device() != "cpu" && spec.device() != "cuda") {
    return Invalid("device", absl::StrCat("\"", spec.device(), "\" is not cpu or cuda"));
  }
  return absl::OkStatus();
}

void ApplyClusterDefaults(ClusterSpec* spec) {
  for (v1::NodeSpec& n : *spec->mutable_nodes()) DETOUR_DEFAULT(&n, speed, 1.0);
  DETOUR_DEFAULT(spec, intra_region_latency_ms, 1.0);
  DETOUR_DEFAULT(spec, intra_region_bandwidth_gbytes_per_s, 5.0);
  v1::ComputeModel* c = spec->mutable_compute();
  DETOUR_DEFAULT(c, tflops, 100.0);
  DETOUR_DEFAULT(c, backward_factor, 2.0);
  DETOUR_DEFAULT(c, loss_factor, 0.25);
  DETOUR_DEFAULT(c, activation_bytes, 2u);
  DETOUR_DEFAULT(c, gradient_bytes, 2u);
}

absl::Status ValidateClusterSpec(const ClusterSpec& spec) {
  using L = SpecLimits;
  if (spec.nodes().empty()) return Invalid("nodes", "the cluster has no nodes");
  if (spec.nodes_size() > L::kMaxClusterNodes) {
    return Invalid("nodes", absl::StrCat(spec.nodes_size(), " nodes, more than the limit ",
                                         L::kMaxClusterNodes));
  }
  if (spec.links_size() > L::kMaxLinks) {
    return Invalid("links",
                   absl::StrCat(spec.links_size(), " links, more than the limit ", L::kMaxLinks));
  }
  if (spec.name().size() > L::kMaxIdBytes) {
    return Invalid("name", absl::StrCat(spec.name().size(), " bytes (limit ", L::kMaxIdBytes, ")"));
  }
  std::set<std::string> ids;
  std::set<std::string> regions;
  for (int i = 0; i < spec.nodes_size(); ++i) {
    const v1::NodeSpec& n = spec.nodes(i);
    const std::string field = absl::StrCat("nodes[", i, "]");
    if (n.id().empty()) return Invalid(field + ".id", "is empty");
    if (n.id().size() > L::kMaxIdBytes || n.region().size() > L::kMaxIdBytes ||
        n.address().size() > L::kMaxIdBytes) {
      return Invalid(
          field, absl::StrCat("id, region and address are limited to ", L::kMaxIdBytes, " bytes"));
    }
    if (n.memory_slots() > L::kMaxMemorySlots) {
      return Invalid(field + ".memory_slots",
                     absl::StrCat(n.memory_slots(), " exceeds the limit ", L::kMaxMemorySlots));
    }
    if (!ids.insert(n.id()).second) {
      return Invalid(field + ".id", absl::StrCat("\"", n.id(), "\" is used twice"));
    }
    if (n.region().empty())
      return Invalid(field + ".region", absl::StrCat("node ", n.id(), " has no region"));
    if (!(n.speed() > 0 && n.speed() <= 1e6)) {
      return Invalid(field + ".speed", Num(n.speed()) + " is outside (0, 1e6]");
    }
    regions.insert(n.region());
  }
  std::set<std::pair<std::string, std::string>> pairs;
  for (int i = 0; i < spec.links_size(); ++i) {
    const v1::RegionLink& l = spec.links(i);
    const std::string field = absl::StrCat("links[", i, "]");
    if (l.region_a().empty() || l.region_b().empty()) {
      return Invalid(field, "region_a and region_b are required");
    }
    if (l.region_a() == l.region_b()) {
      return Invalid(field, absl::StrCat("links region ", l.region_a(),
                                         " to itself; use intra_region_* instead"));
    }
    if (!(l.latency_ms() >= 0 && l.latency_ms() <= 1e6)) {
      return Invalid(field + ".latency_ms", Num(l.latency_ms()) + " is outside [0, 1e6]");
    }
    if (!(l.bandwidth_gbytes_per_s() > 0 && l.bandwidth_gbytes_per_s() <= 1e6)) {
      return Invalid(field + ".bandwidth_gbytes_per_s",
                     absl::StrCat(Num(l.bandwidth_gbytes_per_s()), " must be > 0 (", l.region_a(),
                                  "-", l.region_b(), ")"));
    }
    auto key = std::minmax(l.region_a(), l.region_b());
    if (!pairs.insert({key.first, key.second}).second) {
      return Invalid(
          field, absl::StrCat("region pair ", l.region_a(), "-", l.region_b(), " is given twice"));
    }
  }
  for (auto a = regions.begin(); a != regions.end(); ++a) {
    for (auto b = std::next(a); b != regions.end(); ++b) {
      if (!pairs.count({*a, *b})) {
        return Invalid("links", absl::StrCat("missing region pair ", *a, "-", *b,
                                             " (both regions have nodes)"));
      }
    }
  }
  if (!(spec.intra_region_latency_ms() >= 0 && spec.intra_region_latency_ms() <= 1e6)) {
    return Invalid("intra_region_latency_ms",
                   Num(spec.intra_region_latency_ms()) + " is outside [0, 1e6]");
  }
  if (!(spec.intra_region_bandwidth_gbytes_per_s() > 0 &&
        spec.intra_region_bandwidth_gbytes_per_s() <= 1e6)) {
    return Invalid("intra_region_bandwidth_gbytes_per_s",
                   Num(spec.intra_region_bandwidth_gbytes_per_s()) + " must be > 0");
  }
  if (!(spec.transfer_overhead_ms() >= 0 && spec.transfer_overhead_ms() <= 60000)) {
    return Invalid("transfer_overhead_ms",
                   Num(spec.transfer_overhead_ms()) + " must be in [0, 60000]");
  }
  const v1::ComputeModel& c = spec.compute();
  if (!(c.tflops() > 0 && c.tflops() <= 1e9)) {
    return Invalid("compute.tflops", Num(c.tflops()) + " is outside (0, 1e9]");
  }
  if (!(c.backward_factor() > 0 && c.backward_factor() <= 100)) {
    return Invalid("compute.backward_factor", Num(c.backward_factor()) + " is outside (0, 100]");
  }
  if (!(c.loss_factor() >= 0 && c.loss_factor() <= 100)) {
    return Invalid("compute.loss_factor", Num(c.loss_factor()) + " is outside [0, 100]");
  }
  if (c.activation_bytes() > 16 || c.gradient_bytes() > 16) {
    return Invalid(
        c.activation_bytes() > 16 ? "compute.activation_bytes" : "compute.gradient_bytes",
        "is more than 16 bytes per element");
  }
  return absl::OkStatus();
}

absl::StatusOr<JobSpec> ParseJobSpecJson(absl::string_view json, absl::string_view what) {
  return ParseJson<JobSpec>(json, what);
}

absl::StatusOr<ClusterSpec> ParseClusterSpecJson(absl::string_view json, absl::string_view what) {
  return ParseJson<ClusterSpec>(json, what);
}

absl::StatusOr<JobSpec> NormalizeJobSpec(JobSpec spec) {
  ApplyJobDefaults(&spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

absl::StatusOr<ClusterSpec> NormalizeClusterSpec(ClusterSpec spec) {
  ApplyClusterDefaults(&spec);
  RETURN_IF_ERROR(ValidateClusterSpec(spec));
  return spec;
}

absl::StatusOr<JobSpec> LoadJobSpec(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(JobSpec spec, ParseJobSpecJson(text, path));
  auto normalized = NormalizeJobSpec(std::move(spec));
  if (!normalized.ok()) return Annotate(normalized.status(), path);
  return normalized;
}

absl::StatusOr<ClusterSpec> LoadClusterSpec(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(ClusterSpec spec, ParseClusterSpecJson(text, path));
  auto normalized = NormalizeClusterSpec(std::move(spec));
  if (!normalized.ok()) return Annotate(normalized.status(), path);
  return normalized;
}

std::string ToJson(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

std::string ToJsonLine(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = false;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

}  // namespace detour
