#include "worker/model/hf_export.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/json.h"
#include "common/status.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/hf_llama.h"
#include "worker/model/stage_file.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMaxTokenizerBytes = uint64_t{256} << 20;

// A bounded walk over protobuf wire format.
class WireReader {
 public:
  explicit WireReader(absl::string_view bytes) : s_(bytes) {}
  bool done() const { return pos_ >= s_.size(); }
  bool Varint(uint64_t* out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= s_.size()) return false;
      const auto b = static_cast<unsigned char>(s_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) {
        *out = v;
        return true;
      }
    }
    return false;
  }
  // Next field: number, wire type, and for length-delimited fields the
  // payload; varints in *value.
  bool Field(uint32_t* number, absl::string_view* payload, uint64_t* value) {
    uint64_t key = 0;
    if (!Varint(&key) || (key >> 3) == 0 || (key >> 3) > 0x1FFFFFFF) return false;
    *number = static_cast<uint32_t>(key >> 3);
    switch (key & 7) {
      case 0: return Varint(value);
      case 1: return Skip(8);
      case 5: return Skip(4);
      case 2: {
        uint64_t n = 0;
        if (!Varint(&n) || n > s_.size() - pos_) return false;
        *payload = s_.substr(pos_, n);
        pos_ += n;
        return true;
      }
      default: return false;  // groups are not used by ModelProto
    }
  }

 private:
  bool Skip(size_t n) {
    if (n > s_.size() - pos_) return false;
    pos_ += n;
    return true;
  }
  absl::string_view s_;
  size_t pos_ = 0;
};

void Progress(const HfExportOptions& o, absl::string_view line) {
  if (o.progress) o.progress(line);
}

// Our parameters (F32 records of the stage files), by global name.
struct LoadedCheckpoint {
  CheckpointManifest manifest;
  std::vector<std::string> files;  // the stage files' bytes; records point into them
  std::map<std::string, StageTensorRecord> params;
};

absl::Status LoadParameters(const std::string& dir, const HfExportOptions& o,
                            LoadedCheckpoint* out) {
  ASSIGN_OR_RETURN(out->manifest, ReadManifest(dir));
  out->files.reserve(out->manifest.stages.size());
  for (const StageFileEntry& e : out->manifest.stages) {
    Progress(o, absl::StrFormat("reading %s (%.1f MB)", e.file, e.bytes / 1e6));
    ASSIGN_OR_RETURN(std::string bytes, ReadStageFileBytes(dir, e));
    out->files.push_back(std::move(bytes));
    const std::string what = (fs::path(dir) / e.file).string();
    ASSIGN_OR_RETURN(std::vector<StageTensorRecord> records,
                     DecodeStageFile(out->files.back(), what));
    for (StageTensorRecord& r : records) {
      // Parameters only: optimiser and K-FAC entries have no HF name.
      if (HfNameOf(r.name).empty()) continue;
      out->params[r.name] = std::move(r);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenizer(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("--tokenizer ", path, ": ", ec.message()));
  if (size > kMaxTokenizerBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tokenizer ", path, " is ", size, " bytes, more than the limit of ", kMaxTokenizerBytes));
  }
  return ReadFileToString(path);
}

std::string TokenizerConfigJson(int context_length) {
  return absl::StrCat(
      "{\n"
      "  \"tokenizer_class\": \"LlamaTokenizer\",\n"
      "  \"model_max_length\": ",
      context_length,
      ",\n"
      "  \"add_bos_token\": true,\n"
      "  \"add_eos_token\": false\n"
      "}\n");
}

}  // namespace

absl::StatusOr<SentencePieceInfo> InspectSentencePieceModel(absl::string_view bytes,
                                                            const std::string& what) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a SentencePiece model: ", why));
  };
  SentencePieceInfo info;
  WireReader r(bytes);
  bool trainer = false;
  while (!r.done()) {
    uint32_t number = 0;
    absl::string_view payload;
    uint64_t value = 0;
    if (!r.Field(&number, &payload, &value)) return bad("malformed protobuf");
    if (number == 1) ++info.pieces;
    if (number != 2) continue;
    trainer = true;
    WireReader t(payload);
    while (!t.done()) {
      uint32_t n = 0;
      absl::string_view p;
      uint64_t v = 0;
      if (!t.Field(&n, &p, &v)) return bad("malformed trainer_spec");
      // int32 fields; negative ids (-1 = none) arrive sign-extended.
      if (n == 41) info.bos_id = static_cast<int32_t>(v);
      if (n == 42) info.eos_id = static_cast<int32_t>(v);
    }
  }
  if (info.pieces == 0) return bad("no pieces");
  if (!trainer) return bad("no trainer_spec");
  return info;
}

uint16_t Float32ToBFloat16(float f) {
  uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0) {
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

absl::Status ExportHfCheckpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                                const HfExportOptions& o) {
  if (o.dtype != SafetensorsDType::kF32 && o.dtype != SafetensorsDType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat("export dtype ", SafetensorsDTypeName(o.dtype),
                                                   " is not supported (F32 or BF16)"));
  }
  const fs::path out(out_dir);
  if (!o.overwrite) {
    for (const char* name : {"model.safetensors", "config.json"}) {
      std::error_code ec;
      if (fs::exists(out / name, ec)) {
        return absl::AlreadyExistsError(absl::StrCat(
            (out / name).string(), " exists; refusing to overwrite it (--overwrite replaces it)"));
      }
    }
  }
  // The tokenizer first: a bad file fails before the long part.
  std::string tokenizer;
  SentencePieceInfo sp;
  std::string tokenizer_path = o.tokenizer_model;
  // The tokenizer the checkpoint records it was trained with, if any:
  // data.tokenizer, or a prepared dataset's own tokenizer.model, and its
  // checksum ("byte", a SentencePiece model's, or "" when unknown). A model
  // shipped with another tokenizer than its own would read other ids, so a
  // recorded tokenizer that is missing or differs is an error, not a default.
  std::string recorded_path, recorded_checksum;
  if (auto m = ReadManifest(checkpoint_dir); m.ok() && m->data.known()) {
    recorded_checksum = m->data.tokenizer_checksum;
    if (!m->data.tokenizer.empty()) {
      recorded_path = m->data.tokenizer;
    } else if (m->data.source == "shards" && recorded_checksum != "byte") {
      recorded_path = (fs::path(m->data.path) / "tokenizer.model").string();
    }
  }
  if (tokenizer_path.empty() && !recorded_path.empty()) {
    std::error_code ec;
    if (!fs::exists(recorded_path, ec)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the checkpoint was trained with the tokenizer ", recorded_path, " (",
                       recorded_checksum.empty() ? "checksum unknown" : recorded_checksum,
                       "), which is not there; pass --tokenizer with that SentencePiece model"));
    }
    tokenizer_path = recorded_path;
  }
  if (!tokenizer_path.empty()) {
    ASSIGN_OR_RETURN(tokenizer, ReadTokenizer(tokenizer_path));
    ASSIGN_OR_RETURN(sp, InspectSentencePieceModel(tokenizer, tokenizer_path));
    if (recorded_checksum == "byte") {
      return absl::FailedPreconditionError(
          absl::StrCat("--tokenizer ", tokenizer_path,
                       ": the checkpoint was trained with the byte tokenizer, not a "
                       "SentencePiece model; export it without --tokenizer"));
    }
    if (!recorded_checksum.empty() && Checksum(tokenizer) != recorded_checksum) {
      return absl::FailedPreconditionError(
          absl::StrCat("tokenizer ", tokenizer_path, " (", Checksum(tokenizer),
                       ") is not the one the checkpoint was trained with (", recorded_checksum,
                       (recorded_path.empty() ? "" : absl::StrCat(", ", recorded_path)), ")"));
    }
  }

  LoadedCheckpoint ckpt;
  RETURN_IF_ERROR(LoadParameters(checkpoint_dir, o, &ckpt));
  const ModelConfig& config = ckpt.manifest.model;
  if (!tokenizer.empty() && sp.pieces > config.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokenizer ", tokenizer_path, " has ", sp.pieces,
                     " pieces, more than the model's vocab_size ", config.vocab_size));
  }

  const std::vector<HfParameter> params = HfLlamaParameters(config);
  std::vector<SafetensorsTensor> tensors;
  std::vector<std::vector<uint16_t>> converted;
  converted.reserve(params.size());
  uint64_t elements = 0;
  for (const HfParameter& p : params) {
    auto it = ckpt.params.find(p.ours);
    if (it == ckpt.params.end()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint ", checkpoint_dir,
                                                     " lacks parameter ", p.ours, " (", p.hf, ")"));
    }
    const StageTensorRecord& r = it->second;
    if (r.shape != p.shape || r.dtype != StageDType::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat("checkpoint ", checkpoint_dir, ": parameter ", p.ours, " is [",
                       absl::StrJoin(r.shape, ", "), "] of dtype code ", static_cast<int>(r.dtype),
                       "; expected float32 [", absl::StrJoin(p.shape, ", "), "]"));
    }
    SafetensorsTensor t;
    t.name = p.hf;
    t.shape = p.shape;
    t.dtype = o.dtype;
    const size_t n = r.data.size() / sizeof(float);
    elements += n;
    if (o.dtype == SafetensorsDType::kF32) {
      t.data = r.data;
    } else {
      std::vector<uint16_t>& half = converted.emplace_back(n);
      for (size_t i = 0; i < n; ++i) {
        float f = 0;
        std::memcpy(&f, r.data.data() + i * sizeof(float), sizeof(float));
        half[i] = Float32ToBFloat16(f);  // little-endian hosts only (like the stage files)
      }
      t.data = absl::string_view(reinterpret_cast<const char*>(half.data()), n * sizeof(uint16_t));
    }
    tensors.push_back(std::move(t));
  }

  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec)
    return absl::UnavailableError(absl::StrCat("cannot create ", out_dir, ": ", ec.message()));
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},  // transformers refuses safetensors files without it
      {"detour_iteration", absl::StrCat(ckpt.manifest.iteration)}};
  Progress(o, absl::StrFormat("writing model.safetensors: %d tensors, %.2f M parameters, %s",
                              tensors.size(), elements / 1e6, SafetensorsDTypeName(o.dtype)));
  RETURN_IF_ERROR(WriteSafetensorsFile((out / "model.safetensors").string(), tensors, metadata));

  HfConfigExtras extras;
  extras.torch_dtype = o.dtype == SafetensorsDType::kF32 ? "float32" : "bfloat16";
  extras.iteration = ckpt.manifest.iteration;
  if (!tokenizer.empty()) {
    extras.tokenizer = "sentencepiece";
    extras.bos_token_id = sp.bos_id;
    extras.eos_token_id = sp.eos_id;
    Progress(o, absl::StrCat("writing tokenizer.model (", sp.pieces, " pieces)"));
    RETURN_IF_ERROR(WriteFileAtomically((out / "tokenizer.model").string(), tokenizer));
    RETURN_IF_ERROR(WriteFileAtomically((out / "tokenizer_config.json").string(),
                                        TokenizerConfigJson(config.context_length)));
  }
  Progress(o, "writing config.json");
  return WriteFileAtomically((out / "config.json").string(), HfLlamaConfigJson(config, extras));
}

}  // namespace detour::model
