#include "worker/runtime/stage_state.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/hash.h"
#include "worker/model/checkpoint.h"
#include "worker/model/token_shards.h"

namespace detour {

uint64_t ParameterChecksum(const std::vector<model::NamedTensor>& params) {
  FastHash64 h;
  for (const auto& [name, t] : params) {
    at::Tensor c = t.detach();
    if (!c.device().is_cpu() || !c.is_contiguous()) c = c.to(at::kCPU).contiguous();
    h.Add(c.data_ptr(), c.nbytes());
  }
  return h.value();
}

absl::StatusOr<StateFrame> PackStageState(const model::Stage& stage, const model::AdamW& optimizer,
                                          const model::Kfac* kfac, const std::string& job_id,
                                          uint64_t iteration, const std::string& sender,
                                          uint64_t epoch) {
  auto bytes = model::SerializeStageState(stage, optimizer, kfac);
  if (!bytes.ok()) return bytes.status();
  auto holder = std::make_shared<std::string>(*std::move(bytes));
  StateFrame f;
  f.header.set_job_id(job_id);
  f.header.set_iteration(iteration);
  f.header.set_direction(v1::DIRECTION_STATE);
  f.header.set_sender(sender);
  f.header.set_epoch(epoch);
  f.header.add_shape(static_cast<int64_t>(holder->size()));
  f.header.set_dtype(v1::DTYPE_BYTES);
  f.view.data = holder->data();
  f.view.bytes = holder->size();
  f.bytes = holder->size();
  f.view.keepalive = holder;
  return f;
}

absl::Status UnpackStageState(const std::string& sender, const void* data, size_t size,
                              model::Stage* stage, model::AdamW* optimizer, model::Kfac* kfac) {
  const std::string bytes(static_cast<const char*>(data), size);
  const std::string ctx = absl::StrCat("the stage state from ", sender);
  auto table = model::ParseStageFile(bytes, ctx);
  if (!table.ok()) return table.status();
  return model::ApplyStageState(*table, ctx, stage, optimizer, kfac);
}

absl::StatusOr<std::vector<int>> StepStage(const v1::JobSpec& spec, uint64_t iteration,
                                           double squared_norm, model::Stage* stage,
                                           model::AdamW* optimizer, model::Kfac* kfac) {
  const double lr = model::ScheduledLearningRate(spec.optimizer(), iteration, spec.iterations());
  const double clip = model::GlobalClipScale(squared_norm, spec.optimizer().grad_clip_norm());
  if (absl::Status s = optimizer->Step(lr, clip); !s.ok()) return s;
  std::vector<int> ready;
  if (kfac != nullptr) ready = kfac->CommitAgreement();
  stage->ZeroGrad();
  if (kfac != nullptr) kfac->DropAllCaptures();
  return ready;
}

v1::CheckpointFile CheckpointFileOf(const model::StageFileEntry& entry) {
  v1::CheckpointFile f;
  f.set_stage(entry.stage);
  f.set_file(entry.file);
  f.set_layer_begin(entry.layers.begin);
  f.set_layer_end(entry.layers.end);
  f.set_bytes(entry.bytes);
  f.set_checksum(entry.checksum);
  return f;
}

model::CheckpointManifest ManifestOf(const v1::CommitCheckpoint& commit,
                                     const model::ModelConfig& config, const v1::JobSpec& spec) {
  model::CheckpointManifest manifest;
  manifest.iteration = commit.iteration();
  manifest.model = config;
  manifest.num_stages = static_cast<int>(spec.pipeline().num_stages());
  manifest.replicas_per_stage = static_cast<int>(spec.pipeline().replicas_per_stage());
  manifest.seed = spec.seed();
  manifest.data = model::ProvenanceOf(spec.data());
  for (const v1::CheckpointFile& f : commit.files()) {
    model::StageFileEntry e;
    e.stage = static_cast<int>(f.stage());
    e.file = f.file();
    e.layers.begin = static_cast<int>(f.layer_begin());
    e.layers.end = static_cast<int>(f.layer_end());
    e.bytes = f.bytes();
    e.checksum = f.checksum();
    manifest.stages.push_back(e);
  }
  return manifest;
}

}  // namespace detour
