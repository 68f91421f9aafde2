#include "worker/model/hf_import.h"

#include <cstring>
#include <filesystem>
#include <memory>
#include <set>
#include <system_error>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/json.h"
#include "common/status.h"
#include "worker/model/hf_llama.h"
#include "worker/model/safetensors.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMaxConfigBytes = 1 << 20;
constexpr uint64_t kMaxIndexBytes = 64 << 20;
constexpr size_t kMaxShards = 4096;

absl::StatusOr<std::string> ReadBounded(const fs::path& path, uint64_t limit) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec)
    return absl::NotFoundError(absl::StrCat("cannot open ", path.string(), ": ", ec.message()));
  if (size > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), " is ", size, " bytes, more than the limit of ", limit));
  }
  return ReadFileToString(path.string());
}

// The safetensors files of `dir`: model.safetensors, or the shards named
// by model.safetensors.index.json.
absl::StatusOr<std::vector<std::unique_ptr<SafetensorsFile>>> OpenWeights(const fs::path& dir) {
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::error_code ec;
  if (fs::exists(dir / "model.safetensors", ec)) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open((dir / "model.safetensors").string()));
    files.push_back(std::move(f));
    return files;
  }
  const fs::path index = dir / "model.safetensors.index.json";
  if (!fs::exists(index, ec)) {
    return absl::NotFoundError(absl::StrCat(dir.string(),
                                            " has neither model.safetensors nor "
                                            "model.safetensors.index.json"));
  }
  ASSIGN_OR_RETURN(std::string text, ReadBounded(index, kMaxIndexBytes));
  JsonLimits limits;
  limits.max_bytes = kMaxIndexBytes;
  limits.max_depth = 8;
  auto root = ParseJson(text, limits);
  if (!root.ok()) return Annotate(root.status(), index.string());
  const JsonValue* map = root->Find("weight_map");
  if (map == nullptr || !map->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(index.string(), ": no weight_map object"));
  }
  std::set<std::string> shards;
  for (size_t i = 0; i < map->items().size(); ++i) {
    const JsonValue& file = map->items()[i];
    const std::string& name = file.string_value();
    if (!file.is_string() || name.empty() || name.size() > 255 || name == "." ||
        name.find('/') != std::string::npos || name.find("..") != std::string::npos ||
        name.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(index.string(), ": weight_map \"",
                                                     absl::CEscape(map->keys()[i].substr(0, 200)),
                                                     "\" does not name a file in the directory"));
    }
    shards.insert(name);
    if (shards.size() > kMaxShards) {
      return absl::InvalidArgumentError(
          absl::StrCat(index.string(), ": more than ", kMaxShards, " shards"));
    }
  }
  for (const std::string& s : shards) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open((dir / s).string()));
    files.push_back(std::move(f));
  }
  return files;
}

at::ScalarType TorchType(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kF32: return at::kFloat;
    case SafetensorsDType::kBF16: return at::kBFloat16;
    case SafetensorsDType::kF16: return at::kHalf;
    default: return at::kDouble;  // kF64; others are refused before
  }
}

}  // namespace

absl::StatusOr<std::map<std::string, at::Tensor>> ReadHfParameters(
    const std::string& dir_name, const ModelConfig& config, const std::vector<std::string>& names) {
  const fs::path dir(dir_name);
  const std::string config_path = (dir / "config.json").string();
  ASSIGN_OR_RETURN(std::string text, ReadBounded(dir / "config.json", kMaxConfigBytes));
  ASSIGN_OR_RETURN(HfLlamaConfig hf, ParseHfLlamaConfig(text, config_path));
  RETURN_IF_ERROR(CheckHfConfigMatches(hf, config, config_path));
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<SafetensorsFile>> files, OpenWeights(dir));

  // Every tensor must be one a LLaMA of this shape has.
  std::map<std::string, HfParameter> expected;
  for (HfParameter& p : HfLlamaParameters(config)) expected.emplace(p.hf, std::move(p));
  std::map<std::string, const SafetensorsTensor*> found;
  for (const auto& f : files) {
    for (const SafetensorsTensor& t : f->contents().tensors) {
      if (IsIgnoredHfTensor(t.name)) continue;
      if (!expected.count(t.name)) {
        return absl::InvalidArgumentError(
            absl::StrCat(f->path(), ": tensor ", absl::CEscape(t.name),
                         " is not a parameter of a LLaMA model of this job's shape {",
                         config.DebugString(), "} (biases, more layers or another architecture?)"));
      }
      if (!found.emplace(t.name, &t).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(f->path(), ": tensor ", t.name, " is also in another shard"));
      }
    }
  }

  std::map<std::string, const SafetensorsTensor*> sources;
  for (const std::string& ours : names) {
    const std::string hf_name = HfNameOf(ours);
    auto want = expected.find(hf_name);
    if (want == expected.end()) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", ours, " has no HF name"));
    }
    auto it = found.find(hf_name);
    std::string source = hf_name;
    if (it == found.end() && hf_name == "lm_head.weight" && hf.tie_word_embeddings) {
      source = "model.embed_tokens.weight";
      it = found.find(source);
    }
    if (it == found.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir_name, ": no tensor ", source, " (for our ", ours, ")"));
    }
    const SafetensorsTensor& t = *it->second;
    if (t.dtype != SafetensorsDType::kF32 && t.dtype != SafetensorsDType::kBF16 &&
        t.dtype != SafetensorsDType::kF16 && t.dtype != SafetensorsDType::kF64) {
      return absl::InvalidArgumentError(absl::StrCat(dir_name, ": tensor ", source, " is ",
                                                     SafetensorsDTypeName(t.dtype),
                                                     "; only F32, BF16, F16 and F64 are imported"));
    }
    if (t.shape != want->second.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir_name, ": tensor ", source, " is [", absl::StrJoin(t.shape, ", "),
                       "] but the job's model needs [", absl::StrJoin(want->second.shape, ", "),
                       "] for ", ours));
    }
    sources[ours] = &t;
  }
  return GuardTorch(
      absl::StrCat("importing ", dir_name),
      [&]() -> absl::StatusOr<std::map<std::string, at::Tensor>> {
        std::map<std::string, at::Tensor> out;
        for (const auto& [ours, t] : sources) {
          // A copy: the mapping's bytes need not be aligned for the dtype.
          at::Tensor raw = at::empty(t->shape, at::TensorOptions().dtype(TorchType(t->dtype)));
          if (!t->data.empty()) std::memcpy(raw.data_ptr(), t->data.data(), t->data.size());
          out.emplace(ours, raw.scalar_type() == at::kFloat ? raw : raw.to(at::kFloat));
        }
        return out;
      });
}

absl::Status InitStageFromHf(const std::string& dir, Stage* stage) {
  const std::string ctx = absl::StrCat("stage ", stage->index(), ": checkpoint.init_from ", dir);
  const std::vector<NamedTensor> params = stage->Parameters();
  std::vector<std::string> names;
  for (const auto& [name, p] : params) names.push_back(name);
  auto table = ReadHfParameters(dir, stage->config(), names);
  if (!table.ok()) return Annotate(table.status(), ctx);
  return GuardTorch(ctx, [&]() -> absl::Status {
    c10::NoGradGuard no_grad;
    for (const auto& [name, p] : params) {
      at::Tensor dst = p;
      dst.copy_(table->at(name));
    }
    return absl::OkStatus();
  });
}

}  // namespace detour::model
