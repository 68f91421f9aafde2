#include "common/checkpoint_manifest.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/json.h"
#include "common/spec.h"
#include "common/status.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;
using Fields = google::protobuf::Map<std::string, google::protobuf::Value>;

constexpr char kManifest[] = "manifest.json";
constexpr char kFormat[] = "detour-checkpoint-v2";
constexpr char kFormatV1[] = "detour-checkpoint-v1";
constexpr char kChecksumPrefix[] = "fnv1a64:";

std::string Quote(const std::string& s) { return JsonQuote(s); }

// Reads the manifest's fields with the path and field named in every error.
class FieldReader {
 public:
  explicit FieldReader(const std::string& path) : path_(path) {}

  absl::Status Missing(absl::string_view what) const {
    return absl::DataLossError(absl::StrCat(path_, ": missing or malformed ", what));
  }
  absl::Status Bad(absl::string_view what, absl::string_view why) const {
    return absl::DataLossError(absl::StrCat(path_, ": ", what, " ", why));
  }

  // An integral JSON number in [lo, hi] (exact up to 2^53).
  absl::Status Integer(const Fields& f, const char* key, absl::string_view what, double lo,
                       double hi, double* out) const {
    auto it = f.find(key);
    if (it == f.end() || !it->second.has_number_value()) return Missing(what);
    const double v = it->second.number_value();
    if (!std::isfinite(v) || v != std::floor(v) || v < lo || v > hi) {
      return Bad(what, absl::StrCat(v, " is not an integer in [", lo, ", ", hi, "]"));
    }
    *out = v;
    return absl::OkStatus();
  }

  // A finite JSON number in (lo, hi].
  absl::Status Real(const Fields& f, const char* key, absl::string_view what, double lo, double hi,
                    double* out) const {
    auto it = f.find(key);
    if (it == f.end() || !it->second.has_number_value()) return Missing(what);
    const double v = it->second.number_value();
    if (!(v > lo && v <= hi)) {
      return Bad(what, absl::StrCat(v, " is outside (", lo, ", ", hi, "]"));
    }
    *out = v;
    return absl::OkStatus();
  }

  absl::Status String(const Fields& f, const char* key, absl::string_view what, size_t max_bytes,
                      std::string* out) const {
    auto it = f.find(key);
    if (it == f.end() || it->second.kind_case() != google::protobuf::Value::kStringValue) {
      return Missing(what);
    }
    if (it->second.string_value().size() > max_bytes) {
      return Bad(what, absl::StrCat("is ", it->second.string_value().size(), " bytes, more than ",
                                    max_bytes));
    }
    *out = it->second.string_value();
    return absl::OkStatus();
  }

 private:
  const std::string& path_;
};

absl::Status ParseModel(const FieldReader& r, const Fields& mf, ModelConfig* c) {
  using L = SpecLimits;
  double x = 0;
  struct IntField {
    const char* key;
    double max;
    int* out;
  };
  const IntField ints[] = {{"num_layers", L::kMaxLayers, &c->num_layers},
                           {"d_model", L::kMaxDModel, &c->d_model},
                           {"num_heads", L::kMaxHeads, &c->num_heads},
                           {"num_kv_heads", L::kMaxHeads, &c->num_kv_heads},
                           {"ffn_dim", L::kMaxFfnDim, &c->ffn_dim},
                           {"vocab_size", L::kMaxVocab, &c->vocab_size},
                           {"context_length", L::kMaxContext, &c->context_length}};
  for (const IntField& f : ints) {
    RETURN_IF_ERROR(r.Integer(mf, f.key, absl::StrCat("model.", f.key), 1, f.max, &x));
    *f.out = static_cast<int>(x);
  }
  RETURN_IF_ERROR(r.Real(mf, "rope_theta", "model.rope_theta", 0, 1e12, &c->rope_theta));
  RETURN_IF_ERROR(r.Real(mf, "norm_eps", "model.norm_eps", 0, 1, &c->norm_eps));
  if (c->norm_eps >= 1) return r.Bad("model.norm_eps", "must be < 1");
  // The structural rules (heads divide d_model, even head size, ...) are
  // ModelConfigFromShape's.
  auto checked = ModelConfigFromShape(ShapeFromConfig(*c));
  if (!checked.ok()) return r.Bad("model", checked.status().message());
  return absl::OkStatus();
}

absl::Status ParseStage(const FieldReader& r, const google::protobuf::Value& sv, int index,
                        const CheckpointManifest& m, StageFileEntry* e) {
  const std::string what = absl::StrCat("stages[", index, "]");
  if (!sv.has_struct_value()) return r.Missing(what);
  const Fields& sf = sv.struct_value().fields();
  double st = 0, a = 0, b = 0, bytes = 0;
  RETURN_IF_ERROR(r.Integer(sf, "stage", what + ".stage", 0, m.num_stages - 1, &st));
  RETURN_IF_ERROR(r.Integer(sf, "layer_begin", what + ".layer_begin", 0, m.model.num_layers, &a));
  RETURN_IF_ERROR(r.Integer(sf, "layer_end", what + ".layer_end", a, m.model.num_layers, &b));
  RETURN_IF_ERROR(r.Integer(sf, "bytes", what + ".bytes", 0,
                            static_cast<double>(ManifestLimits::kMaxStageFileBytes), &bytes));
  RETURN_IF_ERROR(
      r.String(sf, "file", what + ".file", ManifestLimits::kMaxFileNameBytes, &e->file));
  RETURN_IF_ERROR(r.String(sf, "checksum", what + ".checksum", 64, &e->checksum));
  e->stage = static_cast<int>(st);
  e->layers = {static_cast<int>(a), static_cast<int>(b)};
  e->bytes = static_cast<uint64_t>(bytes);
  if (e->file.empty() || e->file == "." || e->file.find('/') != std::string::npos ||
      e->file.find("..") != std::string::npos || e->file.find('\0') != std::string::npos) {
    return r.Bad(what + ".file", absl::StrCat("\"", absl::CEscape(e->file),
                                              "\" is not a file name inside the checkpoint"));
  }
  const absl::string_view hex =
      absl::string_view(e->checksum)
          .substr(std::min(e->checksum.size(), sizeof(kChecksumPrefix) - 1));
  if (!absl::StartsWith(e->checksum, kChecksumPrefix) || hex.size() != 16 ||
      !std::all_of(hex.begin(), hex.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return r.Bad(what + ".checksum",
                 absl::StrCat("\"", absl::CEscape(e->checksum), "\" is not fnv1a64:<16 hex>"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string Checksum(absl::string_view bytes) {
  Fnv1a64 f;
  f.Add(bytes);
  return f.Hex();
}

std::string ManifestJson(const CheckpointManifest& m) {
  std::vector<std::string> stages;
  for (const auto& s : m.stages) {
    stages.push_back(absl::StrFormat(
        "    {\"stage\": %d, \"file\": %s, \"layer_begin\": %d, \"layer_end\": "
        "%d, \"bytes\": %d, \"checksum\": %s}",
        s.stage, Quote(s.file), s.layers.begin, s.layers.end, s.bytes, Quote(s.checksum)));
  }
  const ModelConfig& c = m.model;
  return absl::StrCat(
      "{\n  \"format\": ", Quote(m.format), ",\n  \"iteration\": ", m.iteration,
      ",\n  \"num_stages\": ", m.num_stages, ",\n  \"replicas_per_stage\": ", m.replicas_per_stage,
      ",\n  \"seed\": ", Quote(absl::StrCat(m.seed)), ",\n  \"rng_state\": ", Quote(m.rng_state),
      ",\n  \"model\": {\"num_layers\": ", c.num_layers, ", \"d_model\": ", c.d_model,
      ", \"num_heads\": ", c.num_heads, ", \"num_kv_heads\": ", c.num_kv_heads,
      ", \"ffn_dim\": ", c.ffn_dim, ", \"vocab_size\": ", c.vocab_size,
      ", \"context_length\": ", c.context_length,
      ", \"rope_theta\": ", absl::StrFormat("%.17g", c.rope_theta),
      ", \"norm_eps\": ", absl::StrFormat("%.17g", c.norm_eps), "},\n",
      m.data.known() ? absl::StrCat("  \"data\": {\"source\": ", Quote(m.data.source),
                                    ", \"path\": ", Quote(m.data.path),
                                    ", \"tokenizer\": ", Quote(m.data.tokenizer),
                                    ", \"tokenizer_checksum\": ", Quote(m.data.tokenizer_checksum),
                                    ", \"validation_fraction\": ",
                                    absl::StrFormat("%.17g", m.data.validation_fraction), "},\n")
                     : std::string(),
      "  \"stages\": [\n", absl::StrJoin(stages, ",\n"), "\n  ]\n}\n");
}

namespace {

// Parses a manifest of `format`: v1 and v2 have the same fields and rules;
// only the stage files' contents differ.
absl::StatusOr<CheckpointManifest> ParseManifestOf(absl::string_view json, const std::string& path,
                                                   absl::string_view format) {
  const FieldReader r(path);
  if (json.size() > ManifestLimits::kMaxManifestBytes) {
    return r.Bad("", absl::StrCat("is ", json.size(), " bytes, more than the limit of ",
                                  ManifestLimits::kMaxManifestBytes));
  }
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &root).ok()) {
    return absl::DataLossError(absl::StrCat(path, " is not valid JSON"));
  }
  const Fields& f = root.fields();
  CheckpointManifest m;
  double v = 0;
  RETURN_IF_ERROR(r.String(f, "format", "format", 64, &m.format));
  if (m.format == kFormatV1 && format != kFormatV1) {
    return absl::FailedPreconditionError(absl::StrCat(
        path,
        ": a detour-checkpoint-v1 checkpoint (LibTorch archive stage files), which this "
        "version no longer reads: LibTorch's archive reader crashes on corrupt files; convert "
        "it with `detour-checkpoint convert OLD NEW`"));
  }
  if (m.format == kFormat && format != kFormat) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": already a ", kFormat, " checkpoint, not ", format));
  }
  if (m.format != format) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": unsupported format ", absl::CEscape(m.format)));
  }
  RETURN_IF_ERROR(r.Integer(f, "iteration", "iteration", 0,
                            static_cast<double>(ManifestLimits::kMaxIteration), &v));
  m.iteration = static_cast<uint64_t>(v);
  auto model = f.find("model");
  if (model == f.end() || !model->second.has_struct_value()) return r.Missing("model");
  RETURN_IF_ERROR(ParseModel(r, model->second.struct_value().fields(), &m.model));
  RETURN_IF_ERROR(r.Integer(f, "num_stages", "num_stages", 1, m.model.num_layers, &v));
  m.num_stages = static_cast<int>(v);
  if (f.count("replicas_per_stage")) {
    RETURN_IF_ERROR(
        r.Integer(f, "replicas_per_stage", "replicas_per_stage", 1, SpecLimits::kMaxReplicas, &v));
    m.replicas_per_stage = static_cast<int>(v);
  }
  std::string seed;
  RETURN_IF_ERROR(r.String(f, "seed", "seed", 20, &seed));
  if (!absl::SimpleAtoi(seed, &m.seed)) return r.Missing("seed");
  if (f.count("rng_state")) {
    RETURN_IF_ERROR(
        r.String(f, "rng_state", "rng_state", ManifestLimits::kMaxRngStateBytes, &m.rng_state));
  }
  if (auto data = f.find("data"); data != f.end()) {
    if (!data->second.has_struct_value()) return r.Missing("data");
    const Fields& df = data->second.struct_value().fields();
    DataProvenance& d = m.data;
    RETURN_IF_ERROR(r.String(df, "source", "data.source", 16, &d.source));
    if (d.source != "embedded" && d.source != "text" && d.source != "shards") {
      return r.Bad("data.source", absl::StrCat("\"", absl::CEscape(d.source),
                                               "\" is not embedded, text or shards"));
    }
    RETURN_IF_ERROR(r.String(df, "path", "data.path", SpecLimits::kMaxPathBytes, &d.path));
    RETURN_IF_ERROR(
        r.String(df, "tokenizer", "data.tokenizer", SpecLimits::kMaxPathBytes, &d.tokenizer));
    RETURN_IF_ERROR(
        r.String(df, "tokenizer_checksum", "data.tokenizer_checksum", 64, &d.tokenizer_checksum));
    double fraction = 0;
    auto vf = df.find("validation_fraction");
    if (vf == df.end() || !vf->second.has_number_value()) {
      return r.Missing("data.validation_fraction");
    }
    fraction = vf->second.number_value();
    if (!(fraction >= 0 && fraction <= 0.5)) {
      return r.Bad("data.validation_fraction", absl::StrCat(fraction, " is outside [0, 0.5]"));
    }
    d.validation_fraction = fraction;
  }
  auto stages = f.find("stages");
  if (stages == f.end() || !stages->second.has_list_value()) return r.Missing("stages");
  const auto& list = stages->second.list_value().values();
  // One file per stage at most (replicas of a stage write the same entries).
  if (list.size() > m.num_stages) {
    return r.Bad("stages",
                 absl::StrCat("has ", list.size(), " entries for ", m.num_stages, " stages"));
  }
  for (int i = 0; i < list.size(); ++i) {
    StageFileEntry e;
    RETURN_IF_ERROR(ParseStage(r, list.Get(i), i, m, &e));
    m.stages.push_back(std::move(e));
  }
  return m;
}

}  // namespace

absl::StatusOr<CheckpointManifest> ParseManifest(absl::string_view json, const std::string& path) {
  return ParseManifestOf(json, path, kFormat);
}

absl::StatusOr<CheckpointManifest> ParseV1Manifest(absl::string_view json,
                                                   const std::string& path) {
  return ParseManifestOf(json, path, kFormatV1);
}

absl::Status WriteManifest(const std::string& dir, const CheckpointManifest& manifest) {
  return WriteFileAtomically((fs::path(dir) / kManifest).string(), ManifestJson(manifest));
}

namespace {

absl::StatusOr<std::string> ReadManifestText(const std::string& path) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", ec.message()));
  if (size > ManifestLimits::kMaxManifestBytes) {
    return absl::DataLossError(absl::StrCat(path, " is ", size, " bytes, more than the limit of ",
                                            ManifestLimits::kMaxManifestBytes));
  }
  return ReadFileToString(path);
}

}  // namespace

absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifest).string();
  ASSIGN_OR_RETURN(std::string text, ReadManifestText(path));
  return ParseManifest(text, path);
}

absl::StatusOr<CheckpointManifest> ReadV1Manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifest).string();
  ASSIGN_OR_RETURN(std::string text, ReadManifestText(path));
  return ParseV1Manifest(text, path);
}

absl::StatusOr<std::string> ReadStageFileBytes(const std::string& dir,
                                               const StageFileEntry& entry) {
  const std::string path = (fs::path(dir) / entry.file).string();
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  if (!fs::is_regular_file(st)) {
    return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is not a regular file"));
  }
  const uintmax_t size = fs::file_size(path, ec);
  if (ec || size != entry.bytes) {
    return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is corrupt: ", size,
                                            " bytes vs manifest ", entry.bytes, " bytes"));
  }
  ASSIGN_OR_RETURN(std::string bytes, ReadFileToString(path));
  if (bytes.size() != entry.bytes || Checksum(bytes) != entry.checksum) {
    return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is corrupt: ", bytes.size(),
                                            " bytes, ", Checksum(bytes), " vs manifest ",
                                            entry.bytes, " bytes, ", entry.checksum));
  }
  return bytes;
}

}  // namespace detour::model
