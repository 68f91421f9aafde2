#include "worker/model/token_shards.h"
#include "worker/model/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <system_error>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/status.h"
#include "worker/model/engine.h"
#include "worker/model/kfac.h"
#include "worker/model/stage_file.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace fs = std::filesystem;
namespace {

absl::StatusOr<StageDType> StageDTypeOf(at::ScalarType type, const std::string& name) {
  switch (type) {
    case at::kFloat: return StageDType::kFloat32;
    case at::kDouble: return StageDType::kFloat64;
    case at::kHalf: return StageDType::kFloat16;
    case at::kBFloat16: return StageDType::kBFloat16;
    case at::kLong: return StageDType::kInt64;
    case at::kInt: return StageDType::kInt32;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor ", name, ": dtype ", c10::toString(type), " has no stage-file code"));
  }
}

at::ScalarType ScalarTypeOf(StageDType dtype) {
  switch (dtype) {
    case StageDType::kFloat32: return at::kFloat;
    case StageDType::kFloat64: return at::kDouble;
    case StageDType::kFloat16: return at::kHalf;
    case StageDType::kBFloat16: return at::kBFloat16;
    case StageDType::kInt64: return at::kLong;
    case StageDType::kInt32: return at::kInt;
  }
  return at::kFloat;  // unreachable: DecodeStageFile admits only the codes above
}

std::string TempName(const std::string& path) { return absl::StrCat(path, ".tmp.", ::getpid()); }

// Writes `bytes` to `path` durably (common/files.h): `path` is either the old
// file or the complete new one, also after a crash.
absl::Status WriteAtomically(const std::string& path, const std::string& bytes) {
  return WriteFileAtomically(path, bytes);
}

bool SameShape(const ModelConfig& a, const ModelConfig& b) {
  return a.num_layers == b.num_layers && a.d_model == b.d_model && a.num_heads == b.num_heads &&
         a.num_kv_heads == b.num_kv_heads && a.ffn_dim == b.ffn_dim &&
         a.vocab_size == b.vocab_size && a.context_length == b.context_length &&
         a.rope_theta == b.rope_theta && a.norm_eps == b.norm_eps;
}

// Reads one stage file (size and checksum checked) into its tensor table.
absl::StatusOr<std::map<std::string, at::Tensor>> ReadStageFile(const std::string& dir,
                                                                const StageFileEntry& entry) {
  ASSIGN_OR_RETURN(std::string bytes, ReadStageFileBytes(dir, entry));
  return ParseStageFile(bytes, (fs::path(dir) / entry.file).string());
}

}  // namespace

absl::StatusOr<std::map<std::string, at::Tensor>> ParseStageFile(const std::string& bytes,
                                                                 const std::string& what) {
  // Our own bounded container (stage_file.h): LibTorch only allocates
  // tensors of shapes already checked against the bytes present.
  ASSIGN_OR_RETURN(std::vector<StageTensorRecord> records, DecodeStageFile(bytes, what));
  return GuardTorch(
      absl::StrCat("reading ", what), [&]() -> absl::StatusOr<std::map<std::string, at::Tensor>> {
        std::map<std::string, at::Tensor> out;
        for (const StageTensorRecord& r : records) {
          at::Tensor t = at::empty(r.shape, at::TensorOptions().dtype(ScalarTypeOf(r.dtype)));
          if (static_cast<size_t>(t.nbytes()) != r.data.size()) {
            return absl::DataLossError(absl::StrCat(what, ": tensor ", r.name, " has ",
                                                    r.data.size(), " bytes for ", t.nbytes()));
          }
          if (!r.data.empty()) std::memcpy(t.data_ptr(), r.data.data(), r.data.size());
          out.emplace(r.name, std::move(t));
        }
        return out;
      });
}

absl::StatusOr<std::string> SerializeStageState(const Stage& stage, const AdamW& optimizer,
                                                const Kfac* kfac) {
  return GuardTorch(absl::StrCat("stage ", stage.index(), " state"),
                    [&]() -> absl::StatusOr<std::string> {
                      // CPU, contiguous copies; the records point into them.
                      std::vector<std::pair<std::string, at::Tensor>> tensors;
                      for (const auto& [name, p] : stage.Parameters()) {
                        tensors.emplace_back(name, p.detach().to(at::kCPU).contiguous());
                      }
                      for (const auto& [name, t] : optimizer.State()) {
                        tensors.emplace_back(name, t.detach().to(at::kCPU).contiguous());
                      }
                      if (kfac != nullptr) {
                        for (auto& [name, t] : kfac->State())
                          tensors.emplace_back(name, t.contiguous());
                      }
                      return EncodeStageTensors(tensors);
                    });
}

absl::StatusOr<std::string> EncodeStageTensors(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  return GuardTorch("encoding a stage file", [&]() -> absl::StatusOr<std::string> {
    std::set<std::string> names;
    std::vector<StageTensorRecord> records;
    for (const auto& [name, t] : tensors) {
      if (!t.defined() || t.layout() != at::kStrided || !t.device().is_cpu() ||
          !t.is_contiguous()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, " is not a dense contiguous CPU tensor"));
      }
      if (name.empty() || name.size() > StageFileLimits::kMaxNameBytes) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor name \"", absl::CEscape(name.substr(0, 64)),
                         "\" is empty or longer than ", StageFileLimits::kMaxNameBytes, " bytes"));
      }
      if (t.dim() > static_cast<int64_t>(StageFileLimits::kMaxDims)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has ", t.dim(),
                                                       " dimensions, more than ",
                                                       StageFileLimits::kMaxDims));
      }
      if (!names.insert(name).second) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " appears twice"));
      }
      StageTensorRecord r;
      r.name = name;
      ASSIGN_OR_RETURN(r.dtype, StageDTypeOf(t.scalar_type(), name));
      r.shape.assign(t.sizes().begin(), t.sizes().end());
      r.data = absl::string_view(static_cast<const char*>(t.data_ptr()),
                                 static_cast<size_t>(t.nbytes()));
      records.push_back(std::move(r));
    }
    if (records.size() > StageFileLimits::kMaxTensors) {
      return absl::InvalidArgumentError(
          absl::StrCat(records.size(), " tensors, more than ", StageFileLimits::kMaxTensors));
    }
    return EncodeStageFile(records);
  });
}

absl::StatusOr<StageFileEntry> WriteStageFile(const std::string& dir, const Stage& stage,
                                              const AdamW& optimizer, const Kfac* kfac) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  StageFileEntry entry;
  entry.stage = stage.index();
  entry.file = absl::StrCat("stage-", stage.index(), ".bin");
  entry.layers = stage.layers();
  ASSIGN_OR_RETURN(std::string bytes, SerializeStageState(stage, optimizer, kfac));
  entry.bytes = bytes.size();
  entry.checksum = Checksum(bytes);
  RETURN_IF_ERROR(WriteAtomically((fs::path(dir) / entry.file).string(), bytes));
  return entry;
}

absl::Status ApplyStageState(const std::map<std::string, at::Tensor>& table, const std::string& ctx,
                             Stage* stage, AdamW* optimizer, Kfac* kfac) {
  // Check everything before touching anything.
  const auto params = stage->Parameters();
  for (const auto& [name, p] : params) {
    auto it = table.find(name);
    if (it == table.end()) {
      return absl::InvalidArgumentError(absl::StrCat(ctx, ": checkpoint lacks parameter ", name));
    }
    if (!it->second.sizes().equals(p.sizes()) || it->second.scalar_type() != p.scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat(ctx, ": parameter ", name, " has shape ",
                                                     ShapeString(it->second.sizes()),
                                                     " vs expected ", ShapeString(p.sizes())));
    }
  }
  if (optimizer != nullptr) {
    // LoadState validates before it changes anything; run it on a scratch
    // optimiser first so a failure leaves ours untouched.
    AdamW scratch(params, v1::AdamWSpec());
    absl::Status s = scratch.LoadState(table);
    if (!s.ok()) return Annotate(s, ctx);
  }
  const bool has_kfac = std::any_of(table.begin(), table.end(),
                                    [](const auto& e) { return e.first.rfind("kfac.", 0) == 0; });
  return GuardTorch(ctx, [&]() -> absl::Status {
    // K-FAC first: it checks every entry before changing anything, so a
    // mismatch leaves parameters and optimiser untouched too. A checkpoint
    // of an AdamW job starts K-FAC's statistics afresh.
    if (kfac != nullptr && has_kfac) {
      absl::Status s = kfac->LoadState(table);
      if (!s.ok()) return Annotate(s, ctx);
    }
    c10::NoGradGuard no_grad;
    for (const auto& [name, p] : params) {
      at::Tensor dst = p;
      dst.copy_(table.at(name));
    }
    if (optimizer != nullptr) return optimizer->LoadState(table);
    return absl::OkStatus();
  });
}

absl::Status LoadStage(const std::string& dir, const CheckpointManifest& manifest, Stage* stage,
                       AdamW* optimizer, Kfac* kfac) {
  const std::string ctx = absl::StrCat("loading stage ", stage->index(), " from checkpoint ", dir);
  if (!SameShape(manifest.model, stage->config())) {
    return absl::FailedPreconditionError(
        absl::StrCat(ctx, ": model shape {", manifest.model.DebugString(),
                     "} differs from this job's {", stage->config().DebugString(), "}"));
  }
  // Files holding our layers, plus stage 0's file for embedding and head.
  const LayerRange mine = stage->layers();
  std::map<std::string, at::Tensor> table;
  for (const auto& entry : manifest.stages) {
    const bool overlaps = entry.layers.begin < mine.end && mine.begin < entry.layers.end;
    const bool needed = overlaps || (stage->index() == 0 && entry.stage == 0);
    if (!needed) continue;
    auto part = ReadStageFile(dir, entry);
    if (!part.ok()) return Annotate(part.status(), ctx);
    table.insert(part->begin(), part->end());
  }
  return ApplyStageState(table, ctx, stage, optimizer, kfac);
}

absl::Status SaveCheckpoint(const std::string& dir, PipelineEngine& engine, uint64_t iteration,
                            const std::string& rng_state) {
  std::error_code ec;
  if (fs::exists(dir, ec)) {
    return absl::AlreadyExistsError(
        absl::StrCat("checkpoint ", dir, " exists; refusing to overwrite it"));
  }
  const std::string tmp = TempName(fs::path(dir).lexically_normal().string());
  fs::remove_all(tmp, ec);
  CheckpointManifest manifest;
  manifest.iteration = iteration;
  manifest.model = engine.stage(0).config();
  manifest.num_stages = engine.num_stages();
  manifest.replicas_per_stage = static_cast<int>(engine.spec().pipeline().replicas_per_stage());
  manifest.seed = engine.spec().seed();
  manifest.rng_state = rng_state;
  manifest.data = ProvenanceOf(engine.spec().data());
  for (int s = 0; s < engine.num_stages(); ++s) {
    auto entry = WriteStageFile(tmp, engine.stage(s), engine.optimizer(s));
    if (!entry.ok()) {
      fs::remove_all(tmp, ec);
      return entry.status();
    }
    manifest.stages.push_back(*entry);
  }
  absl::Status s = WriteManifest(tmp, manifest);
  if (s.ok()) {
    fs::rename(tmp, dir, ec);
    if (ec) {
      s = absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", dir, ": ", ec.message()));
    } else {
      s = SyncDirectory(fs::path(dir).has_parent_path() ? fs::path(dir).parent_path().string()
                                                        : std::string("."));
    }
  }
  if (!s.ok()) fs::remove_all(tmp, ec);
  return s;
}

absl::StatusOr<CheckpointManifest> LoadCheckpoint(const std::string& dir, PipelineEngine& engine) {
  ASSIGN_OR_RETURN(CheckpointManifest manifest, ReadManifest(dir));
  // Validate every stage against scratch copies first so a failure in stage
  // k does not leave stages < k loaded.
  for (int s = 0; s < engine.num_stages(); ++s) {
    auto scratch = Stage::Create(engine.stage(s).config(), s, engine.num_stages(),
                                 StageOptions{1, engine.stage(s).device(), 0});
    if (!scratch.ok()) return scratch.status();
    AdamW scratch_opt((*scratch)->Parameters(), v1::AdamWSpec());
    RETURN_IF_ERROR(LoadStage(dir, manifest, scratch->get(), &scratch_opt));
  }
  for (int s = 0; s < engine.num_stages(); ++s) {
    RETURN_IF_ERROR(LoadStage(dir, manifest, &engine.stage(s), &engine.optimizer(s)));
  }
  return manifest;
}

}  // namespace detour::model
