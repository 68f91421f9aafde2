#include "worker/model/engine.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "common/status.h"
#include "worker/model/routes.h"
#include "worker/model/torch_status.h"

namespace detour::model {

absl::StatusOr<std::vector<Microbatch>> IterationMicrobatches(const v1::JobSpec& spec,
                                                              const TokenSequence& tokens,
                                                              uint64_t iteration,
                                                              const c10::Device& device) {
  v1::JobSpec s = spec;
  ApplyJobDefaults(&s);
  const int ctx = static_cast<int>(s.model().context_length());
  const int nodes = static_cast<int>(s.pipeline().data_nodes());
  const int per_node = static_cast<int>(s.pipeline().microbatches_per_data_node());
  const int spm = static_cast<int>(s.pipeline().samples_per_microbatch());
  const int64_t num_samples = NumSamples(static_cast<int64_t>(tokens.size()), ctx);
  if (num_samples <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "training text of ", tokens.size(), " tokens holds no sample of ", ctx + 1, " tokens"));
  }
  SampleSharder sharder(num_samples, nodes, s.seed());
  return GuardTorch("building microbatches", [&]() -> absl::StatusOr<std::vector<Microbatch>> {
    std::vector<Microbatch> out;
    const uint64_t base = SampleSharder::IterationOffset(iteration, per_node * spm);
    for (int node = 0; node < nodes; ++node) {
      for (int j = 0; j < per_node; ++j) {
        at::Tensor batch = at::empty({spm, ctx + 1}, at::TensorOptions().dtype(at::kLong));
        auto acc = batch.accessor<int64_t, 2>();
        for (int k = 0; k < spm; ++k) {
          const int64_t sample = sharder.SampleAt(node, base + j * spm + k);
          CopySample(tokens, sample, ctx, &acc[k][0]);
        }
        Microbatch mb;
        mb.tokens = batch.narrow(1, 0, ctx).contiguous().to(device);
        mb.targets = batch.narrow(1, 1, ctx).contiguous().to(device);
        out.push_back(std::move(mb));
      }
    }
    return out;
  });
}

absl::StatusOr<std::unique_ptr<PipelineEngine>> PipelineEngine::Create(const v1::JobSpec& spec,
                                                                       c10::Device device) {
  std::unique_ptr<PipelineEngine> engine(new PipelineEngine());
  engine->spec_ = spec;
  ApplyJobDefaults(&engine->spec_);
  const int s_count = static_cast<int>(engine->spec_.pipeline().num_stages());
  for (int i = 0; i < s_count; ++i) {
    ASSIGN_OR_RETURN(auto stage, Stage::FromJobSpec(engine->spec_, i, device));
    engine->optimizers_.push_back(
        std::make_unique<AdamW>(stage->Parameters(), engine->spec_.optimizer().adamw()));
    engine->stages_.push_back(std::move(stage));
  }
  if (engine->spec_.optimizer().kind() == v1::OPTIMIZER_KFAC) {
    for (int i = 0; i < s_count; ++i) {
      ASSIGN_OR_RETURN(auto kfac,
                       Kfac::Create(engine->stages_[i].get(), engine->spec_.optimizer()));
      engine->optimizers_[i]->set_precondition_hook(kfac.get());
      engine->kfacs_.push_back(std::move(kfac));
    }
  }
  return engine;
}

uint32_t PipelineEngine::kfac_refresh_interval() const {
  if (kfacs_.empty()) return 0;
  const uint32_t k = spec_.optimizer().kfac().refresh_interval();
  return k == 0 ? 10 : k;
}

void PipelineEngine::CaptureForIteration(uint64_t iteration, int num_microbatches) {
  if (kfacs_.empty() || iteration % kfac_refresh_interval() != 0) return;
  const uint32_t per_node = std::max<uint32_t>(1, spec_.pipeline().microbatches_per_data_node());
  const uint32_t curvature = spec_.optimizer().kfac().curvature_microbatches();
  for (int m = 0; m < num_microbatches; ++m) {
    if (static_cast<uint32_t>(m) % per_node >= curvature) continue;
    for (auto& k : kfacs_) k->Capture(static_cast<uint32_t>(m));
    kfac_captured_ = true;
  }
}

std::vector<Stage*> PipelineEngine::stages() {
  std::vector<Stage*> out;
  for (auto& s : stages_) out.push_back(s.get());
  return out;
}

absl::StatusOr<double> PipelineEngine::Accumulate(const std::vector<v1::Route>& routes,
                                                  const std::vector<Microbatch>& microbatches) {
  if (normalized_) {
    return absl::FailedPreconditionError(
        "gradients are already normalised for a step; call Step first");
  }
  double loss_sum = 0;
  for (const v1::Route& route : routes) {
    RETURN_IF_ERROR(CheckRoute(route, num_stages()));
    const uint32_t mb = route.microbatch();
    if (mb >= microbatches.size()) {
      return absl::InvalidArgumentError(absl::StrCat("route names microbatch ", mb, " but only ",
                                                     microbatches.size(), " were given"));
    }
    auto fail = [&](const absl::Status& s) {
      for (auto& st : stages_) st->Drop(mb);
      return s;
    };
    at::Tensor x = microbatches[mb].tokens;
    for (int hop = 0; hop < route.stages_size(); ++hop) {
      auto out = stages_[route.stages(hop)]->Forward(mb, x);
      if (!out.ok()) return fail(out.status());
      x = *out;
    }
    auto loss = stages_[0]->LossAndBackward(mb, x, microbatches[mb].targets);
    if (!loss.ok()) return fail(loss.status());
    loss_sum += loss->loss;
    at::Tensor g = loss->grad_hidden;
    for (int hop = route.stages_size() - 1; hop >= 0; --hop) {
      auto grad = stages_[route.stages(hop)]->Backward(mb, g);
      if (!grad.ok()) return fail(grad.status());
      g = *grad;
    }
  }
  return routes.empty() ? 0.0 : loss_sum / static_cast<double>(routes.size());
}

absl::Status PipelineEngine::NormalizeGradients(int total_microbatches) {
  if (normalized_) return absl::OkStatus();
  normalized_ = true;
  for (auto& stage : stages_) {
    const double scale = GradNormalizationScale(spec_.pipeline().grad_normalization(),
                                                stage->visits(), total_microbatches);
    if (scale != 1.0 && scale != 0.0) RETURN_IF_ERROR(stage->ScaleGradients(scale));
  }
  return absl::OkStatus();
}

absl::StatusOr<IterationStats> PipelineEngine::Step(uint64_t iteration, int total_microbatches) {
  IterationStats stats;
  for (auto& stage : stages_) stats.visits.push_back(stage->visits());
  if (kfac_captured_) {
    kfac_captured_ = false;
    for (auto& k : kfacs_) {
      absl::Status refreshed = k->RefreshSerially();
      k->DropAllCaptures();
      RETURN_IF_ERROR(refreshed);
    }
  }
  RETURN_IF_ERROR(NormalizeGradients(total_microbatches));
  double squared = 0;
  for (size_t i = 0; i < stages_.size(); ++i) {
    // KFAC_REPLICA_SYNC_PRECONDITIONED: as a lone replica would (clipping
    // over the raw gradients only).
    std::set<std::string> preconditioned;
    if (i < kfacs_.size() && kfacs_[i]->replicas_precondition()) {
      preconditioned = kfacs_[i]->PreconditionedParameters();
    }
    ASSIGN_OR_RETURN(double sq, stages_[i]->SquaredGradNorm(&preconditioned));
    squared += sq;
    if (i < kfacs_.size() && kfacs_[i]->replicas_precondition()) {
      RETURN_IF_ERROR(kfacs_[i]->PreconditionInPlace());
    }
  }
  stats.grad_norm = std::sqrt(squared);
  const double clip = GlobalClipScale(squared, spec_.optimizer().grad_clip_norm());
  stats.learning_rate = ScheduledLearningRate(spec_.optimizer(), iteration, spec_.iterations());
  for (int i = 0; i < num_stages(); ++i) {
    RETURN_IF_ERROR(optimizers_[i]->Step(stats.learning_rate, clip));
    if (i < static_cast<int>(kfacs_.size())) (void)kfacs_[i]->CommitAgreement();
    stages_[i]->ZeroGrad();
  }
  normalized_ = false;
  return stats;
}

absl::StatusOr<IterationStats> PipelineEngine::RunIteration(
    uint64_t iteration, const std::vector<v1::Route>& routes,
    const std::vector<Microbatch>& microbatches) {
  CaptureForIteration(iteration, static_cast<int>(microbatches.size()));
  ASSIGN_OR_RETURN(double loss, Accumulate(routes, microbatches));
  ASSIGN_OR_RETURN(IterationStats stats, Step(iteration, static_cast<int>(routes.size())));
  stats.loss = loss;
  return stats;
}

}  // namespace detour::model
