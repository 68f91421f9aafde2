#include "worker/model/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <system_error>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <c10/core/GradMode.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/status.h"
#include "worker/model/engine.h"
#include "worker/model/kfac.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace fs = std::filesystem;
namespace {

constexpr char kManifest[] = "manifest.json";
constexpr char kTensorsKey[] = "tensors";

std::string Checksum(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return absl::StrFormat("fnv1a64:%016x", h);
}

std::string TempName(const std::string& path) {
  return absl::StrCat(path, ".tmp.", ::getpid());
}

// Writes `bytes` to `path` durably (common/files.h): `path` is either the old
// file or the complete new one, also after a crash.
absl::Status WriteAtomically(const std::string& path, const std::string& bytes) {
  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<std::string> ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", static_cast<int>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string ManifestJson(const CheckpointManifest& m) {
  std::vector<std::string> stages;
  for (const auto& s : m.stages) {
    stages.push_back(absl::StrFormat(
        "    {\"stage\": %d, \"file\": %s, \"layer_begin\": %d, \"layer_end\": "
        "%d, \"bytes\": %d, \"checksum\": %s}",
        s.stage, Quote(s.file), s.layers.begin, s.layers.end, s.bytes,
        Quote(s.checksum)));
  }
  const ModelConfig& c = m.model;
  return absl::StrCat(
      "{\n  \"format\": ", Quote(m.format), ",\n  \"iteration\": ", m.iteration,
      ",\n  \"num_stages\": ", m.num_stages,
      ",\n  \"replicas_per_stage\": ", m.replicas_per_stage,
      ",\n  \"seed\": ", Quote(absl::StrCat(m.seed)),
      ",\n  \"rng_state\": ", Quote(m.rng_state),
      ",\n  \"model\": {\"num_layers\": ", c.num_layers, ", \"d_model\": ",
      c.d_model, ", \"num_heads\": ", c.num_heads, ", \"num_kv_heads\": ",
      c.num_kv_heads, ", \"ffn_dim\": ", c.ffn_dim, ", \"vocab_size\": ",
      c.vocab_size, ", \"context_length\": ", c.context_length,
      ", \"rope_theta\": ", absl::StrFormat("%.17g", c.rope_theta),
      ", \"norm_eps\": ", absl::StrFormat("%.17g", c.norm_eps),
      "},\n  \"stages\": [\n", absl::StrJoin(stages, ",\n"), "\n  ]\n}\n");
}

bool SameShape(const ModelConfig& a, const ModelConfig& b) {
  return a.num_layers == b.num_layers && a.d_model == b.d_model &&
         a.num_heads == b.num_heads && a.num_kv_heads == b.num_kv_heads &&
         a.ffn_dim == b.ffn_dim && a.vocab_size == b.vocab_size &&
         a.context_length == b.context_length && a.rope_theta == b.rope_theta &&
         a.norm_eps == b.norm_eps;
}

// Reads one stage file after checking its size and checksum.
absl::StatusOr<std::map<std::string, at::Tensor>> ReadStageFile(
    const std::string& dir, const StageFileEntry& entry) {
  const std::string path = (fs::path(dir) / entry.file).string();
  ASSIGN_OR_RETURN(std::string bytes, ReadBytes(path));
  if (bytes.size() != entry.bytes || Checksum(bytes) != entry.checksum) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint file ", path, " is corrupt: ", bytes.size(), " bytes, ",
        Checksum(bytes), " vs manifest ", entry.bytes, " bytes, ",
        entry.checksum));
  }
  return ParseStageState(bytes, path);
}

}  // namespace

absl::StatusOr<std::string> SerializeStageState(const Stage& stage, const AdamW& optimizer,
                                                const Kfac* kfac) {
  return GuardTorch(absl::StrCat("stage ", stage.index(), " state"),
                    [&]() -> absl::StatusOr<std::string> {
                      c10::Dict<std::string, at::Tensor> table;
                      for (const auto& [name, p] : stage.Parameters()) {
                        table.insert(name, p.detach().to(at::kCPU).clone());
                      }
                      for (const auto& [name, t] : optimizer.State()) {
                        table.insert(name, t.detach().to(at::kCPU).clone());
                      }
                      if (kfac != nullptr) {
                        for (auto& [name, t] : kfac->State()) table.insert(name, t);
                      }
                      torch::serialize::OutputArchive archive;
                      archive.write(kTensorsKey, c10::IValue(table));
                      std::ostringstream out;
                      archive.save_to(out);
                      return out.str();
                    });
}

absl::StatusOr<std::map<std::string, at::Tensor>> ParseStageState(const std::string& bytes,
                                                                  const std::string& what) {
  return GuardTorch(absl::StrCat("reading ", what),
                    [&]() -> absl::StatusOr<std::map<std::string, at::Tensor>> {
                      torch::serialize::InputArchive archive;
                      archive.load_from(bytes.data(), bytes.size(), at::Device(at::kCPU));
                      c10::IValue value;
                      if (!archive.try_read(kTensorsKey, value) || !value.isGenericDict()) {
                        return absl::DataLossError(absl::StrCat(what, " holds no tensor table"));
                      }
                      std::map<std::string, at::Tensor> out;
                      for (const auto& item : value.toGenericDict()) {
                        if (!item.key().isString() || !item.value().isTensor()) {
                          return absl::DataLossError(
                              absl::StrCat(what, ": the tensor table holds a non-tensor entry"));
                        }
                        out.emplace(item.key().toStringRef(), item.value().toTensor());
                      }
                      return out;
                    });
}

absl::StatusOr<StageFileEntry> WriteStageFile(const std::string& dir, const Stage& stage,
                                              const AdamW& optimizer, const Kfac* kfac) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  StageFileEntry entry;
  entry.stage = stage.index();
  entry.file = absl::StrCat("stage-", stage.index(), ".pt");
  entry.layers = stage.layers();
  ASSIGN_OR_RETURN(std::string bytes, SerializeStageState(stage, optimizer, kfac));
  entry.bytes = bytes.size();
  entry.checksum = Checksum(bytes);
  RETURN_IF_ERROR(WriteAtomically((fs::path(dir) / entry.file).string(), bytes));
  return entry;
}

absl::Status WriteManifest(const std::string& dir,
                           const CheckpointManifest& manifest) {
  return WriteAtomically((fs::path(dir) / kManifest).string(),
                         ManifestJson(manifest));
}

absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifest).string();
  ASSIGN_OR_RETURN(std::string text, ReadBytes(path));
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(text, &root).ok()) {
    return absl::DataLossError(absl::StrCat(path, " is not valid JSON"));
  }
  const auto& f = root.fields();
  auto num = [&](const google::protobuf::Map<std::string, google::protobuf::Value>& m,
                 const char* key, double* out) -> bool {
    auto it = m.find(key);
    if (it == m.end() || !it->second.has_number_value()) return false;
    *out = it->second.number_value();
    return true;
  };
  auto str = [&](const char* key, std::string* out) -> bool {
    auto it = f.find(key);
    if (it == f.end() || it->second.kind_case() != google::protobuf::Value::kStringValue) {
      return false;
    }
    *out = it->second.string_value();
    return true;
  };
  auto missing = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(path, ": missing or malformed ", what));
  };
  CheckpointManifest m;
  double v = 0;
  if (!str("format", &m.format)) return missing("format");
  if (m.format != "detour-checkpoint-v1") {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": unsupported format ", m.format));
  }
  if (!num(f, "iteration", &v)) return missing("iteration");
  m.iteration = static_cast<uint64_t>(v);
  if (!num(f, "num_stages", &v)) return missing("num_stages");
  m.num_stages = static_cast<int>(v);
  if (num(f, "replicas_per_stage", &v)) m.replicas_per_stage = static_cast<int>(v);
  std::string seed;
  if (!str("seed", &seed) || !absl::SimpleAtoi(seed, &m.seed)) return missing("seed");
  str("rng_state", &m.rng_state);
  auto model = f.find("model");
  if (model == f.end() || !model->second.has_struct_value()) return missing("model");
  const auto& mf = model->second.struct_value().fields();
  ModelConfig& c = m.model;
  double x[9];
  const char* keys[9] = {"num_layers", "d_model", "num_heads", "num_kv_heads",
                         "ffn_dim", "vocab_size", "context_length",
                         "rope_theta", "norm_eps"};
  for (int i = 0; i < 9; ++i) {
    if (!num(mf, keys[i], &x[i])) return missing(absl::StrCat("model.", keys[i]));
  }
  c.num_layers = static_cast<int>(x[0]);
  c.d_model = static_cast<int>(x[1]);
  c.num_heads = static_cast<int>(x[2]);
  c.num_kv_heads = static_cast<int>(x[3]);
  c.ffn_dim = static_cast<int>(x[4]);
  c.vocab_size = static_cast<int>(x[5]);
  c.context_length = static_cast<int>(x[6]);
  c.rope_theta = x[7];
  c.norm_eps = x[8];
  auto stages = f.find("stages");
  if (stages == f.end() || !stages->second.has_list_value()) return missing("stages");
  for (const auto& sv : stages->second.list_value().values()) {
    if (!sv.has_struct_value()) return missing("stages[]");
    const auto& sf = sv.struct_value().fields();
    StageFileEntry e;
    double a = 0, b = 0, st = 0, bytes = 0;
    if (!num(sf, "stage", &st) || !num(sf, "layer_begin", &a) ||
        !num(sf, "layer_end", &b) || !num(sf, "bytes", &bytes) ||
        sf.find("file") == sf.end() || sf.find("checksum") == sf.end()) {
      return missing("stages[] entry");
    }
    e.stage = static_cast<int>(st);
    e.layers = {static_cast<int>(a), static_cast<int>(b)};
    e.bytes = static_cast<uint64_t>(bytes);
    e.file = sf.at("file").string_value();
    e.checksum = sf.at("checksum").string_value();
    if (e.file.find('/') != std::string::npos || e.file.find("..") != std::string::npos) {
      return absl::DataLossError(absl::StrCat(path, ": bad file name ", e.file));
    }
    m.stages.push_back(std::move(e));
  }
  return m;
}

absl::Status ApplyStageState(const std::map<std::string, at::Tensor>& table,
                             const std::string& ctx, Stage* stage, AdamW* optimizer, Kfac* kfac) {
  // Check everything before touching anything.
  const auto params = stage->Parameters();
  for (const auto& [name, p] : params) {
    auto it = table.find(name);
    if (it == table.end()) {
      return absl::InvalidArgumentError(absl::StrCat(ctx, ": lacks parameter ", name));
    }
    if (!it->second.sizes().equals(p.sizes()) ||
        it->second.scalar_type() != p.scalar_type()) {
      return absl::InvalidArgumentError(absl::StrCat(
          ctx, ": parameter ", name, " has shape ", ShapeString(it->second.sizes()),
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
  const bool has_kfac = std::any_of(table.begin(), table.end(), [](const auto& e) {
    return e.first.rfind("kfac.", 0) == 0;
  });
  return GuardTorch(ctx, [&]() -> absl::Status {
    // K-FAC first: it checks every entry before changing anything, so a
    // mismatch leaves parameters and optimiser untouched too. A checkpoint
    // of an AdamW job (or from before K-FAC state was saved) starts K-FAC's
    // statistics afresh.
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

absl::Status LoadStage(const std::string& dir, const CheckpointManifest& manifest,
                       Stage* stage, AdamW* optimizer, Kfac* kfac) {
  const std::string ctx = absl::StrCat("loading stage ", stage->index(),
                                       " from checkpoint ", dir);
  if (!SameShape(manifest.model, stage->config())) {
    return absl::FailedPreconditionError(absl::StrCat(
        ctx, ": model shape {", manifest.model.DebugString(),
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

absl::Status SaveCheckpoint(const std::string& dir, PipelineEngine& engine,
                            uint64_t iteration, const std::string& rng_state) {
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
  manifest.replicas_per_stage =
      static_cast<int>(engine.spec().pipeline().replicas_per_stage());
  manifest.seed = engine.spec().seed();
  manifest.rng_state = rng_state;
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
      s = absl::InternalError(
          absl::StrCat("cannot rename ", tmp, " to ", dir, ": ", ec.message()));
    } else {
      s = SyncDirectory(fs::path(dir).has_parent_path() ? fs::path(dir).parent_path().string()
                                                        : std::string("."));
    }
  }
  if (!s.ok()) fs::remove_all(tmp, ec);
  return s;
}

absl::StatusOr<CheckpointManifest> LoadCheckpoint(const std::string& dir,
                                                  PipelineEngine& engine) {
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
