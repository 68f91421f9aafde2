#include "worker/runtime/runtime_setup.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "worker/model/checkpoint.h"
#include "worker/model/hf_import.h"
#include "worker/model/token_shards.h"

namespace detour {

void RuntimeSetup::OnAssignment(const v1::StageAssignment& a) {
  if (!job_id_.empty() && a.job_id() == job_id_ && a.epoch() == epoch_ &&
      static_cast<int>(a.stage()) == stage_index_ && a.restore_from().empty()) {
    // The coordinator repeats what it sent (a session reopened): answer
    // again, keep the stage.
    LogInfo("job ", job_id_, ": repeated assignment of stage ", stage_index_);
    for (const v1::WorkerMessage& m : replay_) Send(m, /*replay=*/false);
    return;
  }
  if (!job_id_.empty()) {
    if (a.job_id() == job_id_) {
      // The coordinator moves this worker to another stage of the job: it
      // drops its stage and builds the new one (with a replica's state).
      LogInfo("job ", job_id_, ": moving from stage ", stage_index_, " to stage ", a.stage());
    } else {
      LogWarning("assignment for job ", a.job_id(), " while holding job ", job_id_,
                 "; abandoning the old job");
    }
    core_->Abandon();
  }
  absl::Status built = Build(a);
  if (!built.ok()) {
    LogError("cannot build stage ", a.stage(), " of job ", a.job_id(), ": ", built.message());
    core_->ReportError(a.job_id(), a.start_iteration(), built);
    core_->Abandon();
    return;
  }
  metrics_.Holding(job_id_, absl::StrCat(stage_index_));
  LogInfo("job ", job_id_, ": holding stage ", stage_index_, " (layers ", a.layer_begin(), "-",
          a.layer_end(), "), replica ", reducer_.rank() + 1, " of ", group_.size(),
          a.start_iteration() > 0 ? absl::StrCat(", from iteration ", a.start_iteration()) : "",
          a.restore_from().empty() ? "" : absl::StrCat(", restored from ", a.restore_from()),
          a.state_from().empty() ? "" : absl::StrCat(", state from ", a.state_from()));
  v1::WorkerMessage ready;
  ready.mutable_stage_ready()->set_job_id(job_id_);
  ready.mutable_stage_ready()->set_stage(stage_index_);
  uint64_t params = 0;
  for (const auto& [name, t] : stage_->Parameters()) params += t.numel();
  ready.mutable_stage_ready()->set_num_parameters(params);
  Send(std::move(ready));
}

absl::Status RuntimeSetup::Build(const v1::StageAssignment& a) {
  ASSIGN_OR_RETURN(v1::JobSpec spec, NormalizeJobSpec(a.spec()));
  if (a.worker_id().empty()) return absl::InvalidArgumentError("assignment names no worker_id");
  me_ = a.worker_id();
  job_id_ = a.job_id();
  spec_ = spec;
  stage_index_ = static_cast<int>(a.stage());
  epoch_ = a.epoch();
  completed_ = a.start_iteration();
  group_.assign(a.replica_group().begin(), a.replica_group().end());
  std::string why;
  if (!reducer_.Restart(epoch_, group_, me_, &why)) return absl::InvalidArgumentError(why);
  const c10::Device device =
      options_.device == "cuda" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
  device_ = device;
  // Non-data nodes take whatever the plan routes to them: the planner
  // bounds their activation memory; refusing work here could deadlock the
  // pipeline. Data nodes bound their own starts by memory_slots.
  v1::JobSpec stage_spec = spec;
  const uint32_t total =
      spec.pipeline().data_nodes() * spec.pipeline().microbatches_per_data_node();
  stage_spec.mutable_pipeline()->set_memory_slots(std::max(spec.pipeline().memory_slots(), total));
  ASSIGN_OR_RETURN(stage_, model::Stage::FromJobSpec(stage_spec, stage_index_, device));
  // Gradient sums in microbatch order, whatever order the backwards run in
  // (RuntimePipeline folds them as the order allows).
  stage_->SetOrderedAccumulation(true);
  optimizer_ = std::make_unique<model::AdamW>(stage_->Parameters(), spec.optimizer().adamw());
  flat_numel_ = 0;
  for (const auto& [name, t] : stage_->Parameters()) flat_numel_ += t.numel();
  factor_numel_ = 0;
  const model::LayerRange layers = stage_->layers();
  if (spec.optimizer().kind() == v1::OPTIMIZER_KFAC) {
    ASSIGN_OR_RETURN(kfac_, model::Kfac::Create(stage_.get(), spec.optimizer()));
    optimizer_->set_precondition_hook(kfac_.get());
    for (int l = layers.begin; l < layers.end; ++l) {
      for (const at::Tensor& t : kfac_->PendingFactorTensors(l)) factor_numel_ += t.numel();
    }
  }
  bubbles_ = std::make_unique<BubbleSchedule>(kfac_ != nullptr, layers.begin, layers.end,
                                              model::KfacBlockShape(stage_->config()));
  if (!a.restore_from().empty()) {
    ASSIGN_OR_RETURN(model::CheckpointManifest manifest, model::ReadManifest(a.restore_from()));
    RETURN_IF_ERROR(
        model::LoadStage(a.restore_from(), manifest, stage_.get(), optimizer_.get(), kfac_.get()));
  } else if (a.state_from().empty() && !spec.checkpoint().init_from().empty()) {
    // A fresh start from imported weights; a restore or a live replica's
    // state (a joining worker) supersedes them.
    RETURN_IF_ERROR(model::InitStageFromHf(spec.checkpoint().init_from(), stage_.get()));
  }
  if (stage_index_ == 0) {
    ASSIGN_OR_RETURN(model::TextDataset data, model::LoadDataset(spec.data()));
    RETURN_IF_ERROR(model::CheckVocabulary(data, static_cast<int>(spec.model().vocab_size())));
    train_tokens_ = std::move(data.train);
  }
  wire_ = WireDType(spec.pipeline().wire_dtype());
  PeerTransportConfig config;
  config.region = options_.region;
  config.emulate_network = a.emulate_network();
  config.security = options_.security;
  config.ack_timeout = options_.peer_ack_timeout;
  config.connect_timeout = options_.peer_connect_timeout;
  transport_ =
      options_.transport ? options_.transport(config) : GrpcPeerTransport::Factory()(config);
  SetPeers(a.peers());
  state_from_ = a.state_from();
  FrameAdmission::Stage admitted;
  admitted.job_id = job_id_;
  admitted.iteration = completed_;
  admitted.epoch = epoch_;
  admitted.activation_shape = {spec.pipeline().samples_per_microbatch(),
                               spec.model().context_length(), spec.model().d_model()};
  admitted.wire = wire_;
  admitted.flat_numel = flat_numel_;
  admitted.factor_numel = factor_numel_;
  admitted.state_from = state_from_;
  admitted.microbatches = total;
  admitted.replicas = a.replica_group_size();
  admission_.Open(admitted);
  if (set_job_) set_job_(job_id_);
  return absl::OkStatus();
}

}  // namespace detour
