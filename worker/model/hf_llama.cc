#include "worker/model/hf_llama.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "common/spec.h"
#include "common/status.h"

namespace detour::model {
namespace {

// Our per-block names and transformers' (after "model.layers.<i>.").
struct BlockName {
  const char* ours;
  const char* hf;
};
constexpr BlockName kBlock[] = {
    {"attn_norm", "input_layernorm.weight"}, {"wq", "self_attn.q_proj.weight"},
    {"wk", "self_attn.k_proj.weight"},       {"wv", "self_attn.v_proj.weight"},
    {"wo", "self_attn.o_proj.weight"},       {"mlp_norm", "post_attention_layernorm.weight"},
    {"w_gate", "mlp.gate_proj.weight"},      {"w_up", "mlp.up_proj.weight"},
    {"w_down", "mlp.down_proj.weight"},
};

// The shortest text that reads back as exactly `v` (1e-05, not
// 1.0000000000000001e-05).
std::string Num(double v) {
  for (int digits = 6; digits < 17; ++digits) {
    std::string s = absl::StrFormat("%.*g", digits, v);
    double back = 0;
    if (absl::SimpleAtod(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.17g", v);
}

// Reads the fields of config.json with the field named in every error.
class ConfigReader {
 public:
  ConfigReader(const JsonValue& root, const std::string& what) : root_(root), what_(what) {}

  absl::Status Bad(absl::string_view field, absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(what_, ": ", field, " ", why));
  }
  // A positive integer <= max; `fallback` when absent (or null) unless < 0.
  absl::Status Int(const char* field, int64_t max, int64_t fallback, int64_t* out) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->is_null()) {
      if (fallback < 0) return Bad(field, "is missing");
      *out = fallback;
      return absl::OkStatus();
    }
    int64_t x = 0;
    if (!v->AsInt64(&x) || x <= 0 || x > max) {
      return Bad(field,
                 absl::StrCat(v->is_number() ? v->string_value() : JsonValue::KindName(v->kind()),
                              " is not an integer in [1, ", max, "]"));
    }
    *out = x;
    return absl::OkStatus();
  }
  absl::Status Real(const char* field, double lo, double hi, double fallback, double* out) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->is_null()) {
      *out = fallback;
      return absl::OkStatus();
    }
    if (!v->is_number() || !(v->number() > lo && v->number() <= hi)) {
      return Bad(field, absl::StrCat("is not a number in (", lo, ", ", hi, "]"));
    }
    *out = v->number();
    return absl::OkStatus();
  }
  absl::Status Bool(const char* field, bool fallback, bool* out) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->is_null()) {
      *out = fallback;
      return absl::OkStatus();
    }
    if (!v->is_bool()) return Bad(field, "is not true or false");
    *out = v->bool_value();
    return absl::OkStatus();
  }
  // A string field that must be absent or equal `expected`.
  absl::Status Expect(const char* field, const char* expected, bool required) const {
    const JsonValue* v = root_.Find(field);
    if (v == nullptr || v->is_null()) {
      return required ? Bad(field, absl::StrCat("is missing (expected \"", expected, "\")"))
                      : absl::OkStatus();
    }
    if (!v->is_string() || v->string_value() != expected) {
      return Bad(field, absl::StrCat("is ",
                                     v->is_string()
                                         ? absl::StrCat("\"", v->string_value().substr(0, 64), "\"")
                                         : JsonValue::KindName(v->kind()),
                                     ", but only \"", expected, "\" is supported"));
    }
    return absl::OkStatus();
  }

 private:
  const JsonValue& root_;
  const std::string& what_;
};

bool Close(double a, double b) {
  return std::abs(a - b) <= 1e-12 * std::max(std::abs(a), std::abs(b));
}

}  // namespace

std::vector<HfParameter> HfLlamaParameters(const ModelConfig& c) {
  const int64_t d = c.d_model;
  const int64_t kv = static_cast<int64_t>(c.num_kv_heads) * c.head_dim();
  const int64_t f = c.ffn_dim;
  const int64_t v = c.vocab_size;
  std::vector<HfParameter> out;
  out.push_back({"embed.weight", "model.embed_tokens.weight", {v, d}});
  for (int i = 0; i < c.num_layers; ++i) {
    const std::vector<std::vector<int64_t>> shapes = {{d}, {d, d}, {kv, d}, {kv, d}, {d, d},
                                                      {d}, {f, d}, {f, d},  {d, f}};
    for (size_t k = 0; k < std::size(kBlock); ++k) {
      out.push_back({absl::StrCat("layers.", i, ".", kBlock[k].ours),
                     absl::StrCat("model.layers.", i, ".", kBlock[k].hf), shapes[k]});
    }
  }
  out.push_back({"norm.weight", "model.norm.weight", {d}});
  out.push_back({"head.weight", "lm_head.weight", {v, d}});
  return out;
}

std::string HfNameOf(absl::string_view ours) {
  if (ours == "embed.weight") return "model.embed_tokens.weight";
  if (ours == "norm.weight") return "model.norm.weight";
  if (ours == "head.weight") return "lm_head.weight";
  std::vector<absl::string_view> parts = absl::StrSplit(ours, '.');
  int layer = 0;
  if (parts.size() != 3 || parts[0] != "layers" || !absl::SimpleAtoi(parts[1], &layer) ||
      layer < 0) {
    return "";
  }
  for (const BlockName& b : kBlock) {
    if (parts[2] == b.ours) return absl::StrCat("model.layers.", layer, ".", b.hf);
  }
  return "";
}

bool IsIgnoredHfTensor(absl::string_view hf_name) {
  return absl::EndsWith(hf_name, ".rotary_emb.inv_freq");
}

std::string HfLlamaConfigJson(const ModelConfig& c, const HfConfigExtras& e) {
  std::string ids;
  if (e.bos_token_id >= 0) absl::StrAppend(&ids, "  \"bos_token_id\": ", e.bos_token_id, ",\n");
  if (e.eos_token_id >= 0) absl::StrAppend(&ids, "  \"eos_token_id\": ", e.eos_token_id, ",\n");
  return absl::StrCat(
      "{\n"
      "  \"architectures\": [\"LlamaForCausalLM\"],\n"
      "  \"model_type\": \"llama\",\n"
      "  \"hidden_size\": ",
      c.d_model,
      ",\n"
      "  \"intermediate_size\": ",
      c.ffn_dim,
      ",\n"
      "  \"num_hidden_layers\": ",
      c.num_layers,
      ",\n"
      "  \"num_attention_heads\": ",
      c.num_heads,
      ",\n"
      "  \"num_key_value_heads\": ",
      c.num_kv_heads,
      ",\n"
      "  \"head_dim\": ",
      c.head_dim(),
      ",\n"
      "  \"vocab_size\": ",
      c.vocab_size,
      ",\n"
      "  \"max_position_embeddings\": ",
      c.context_length,
      ",\n"
      "  \"rms_norm_eps\": ",
      Num(c.norm_eps),
      ",\n"
      "  \"rope_theta\": ",
      Num(c.rope_theta),
      ",\n"
      "  \"rope_scaling\": null,\n"
      "  \"hidden_act\": \"silu\",\n"
      "  \"attention_bias\": false,\n"
      "  \"mlp_bias\": false,\n"
      "  \"tie_word_embeddings\": false,\n",
      ids, "  \"torch_dtype\": ", JsonQuote(e.torch_dtype),
      ",\n"
      "  \"detour\": {\"format\": \"detour-hf-v1\", \"tokenizer\": ",
      JsonQuote(e.tokenizer), ", \"iteration\": ", e.iteration,
      "}\n"
      "}\n");
}

absl::StatusOr<HfLlamaConfig> ParseHfLlamaConfig(absl::string_view json, const std::string& what) {
  JsonLimits limits;
  limits.max_bytes = size_t{1} << 20;
  limits.max_depth = 16;
  limits.max_values = 1 << 16;
  auto root = ParseJson(json, limits);
  if (!root.ok()) return Annotate(root.status(), what);
  if (!root->is_object())
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a JSON object"));
  const ConfigReader r(*root, what);
  using L = SpecLimits;
  RETURN_IF_ERROR(r.Expect("model_type", "llama", /*required=*/true));
  RETURN_IF_ERROR(r.Expect("hidden_act", "silu", /*required=*/false));
  if (const JsonValue* s = root->Find("rope_scaling"); s != nullptr && !s->is_null()) {
    return r.Bad("rope_scaling", "is set; only unscaled rotary embeddings are supported");
  }
  bool bias = false;
  RETURN_IF_ERROR(r.Bool("attention_bias", false, &bias));
  if (bias) return r.Bad("attention_bias", "is true; our attention has no biases");
  RETURN_IF_ERROR(r.Bool("mlp_bias", false, &bias));
  if (bias) return r.Bad("mlp_bias", "is true; our MLP has no biases");

  HfLlamaConfig out;
  ModelConfig& c = out.model;
  int64_t x = 0;
  RETURN_IF_ERROR(r.Int("num_hidden_layers", L::kMaxLayers, -1, &x));
  c.num_layers = static_cast<int>(x);
  RETURN_IF_ERROR(r.Int("hidden_size", L::kMaxDModel, -1, &x));
  c.d_model = static_cast<int>(x);
  RETURN_IF_ERROR(r.Int("num_attention_heads", L::kMaxHeads, -1, &x));
  c.num_heads = static_cast<int>(x);
  RETURN_IF_ERROR(r.Int("num_key_value_heads", L::kMaxHeads, c.num_heads, &x));
  c.num_kv_heads = static_cast<int>(x);
  RETURN_IF_ERROR(r.Int("intermediate_size", L::kMaxFfnDim, -1, &x));
  c.ffn_dim = static_cast<int>(x);
  RETURN_IF_ERROR(r.Int("vocab_size", L::kMaxVocab, -1, &x));
  c.vocab_size = static_cast<int>(x);
  // transformers' LlamaConfig defaults.
  RETURN_IF_ERROR(r.Int("max_position_embeddings", int64_t{1} << 40, 2048, &x));
  c.context_length = static_cast<int>(std::min<int64_t>(x, L::kMaxContext));
  RETURN_IF_ERROR(r.Real("rms_norm_eps", 0, 0.5, 1e-6, &c.norm_eps));
  RETURN_IF_ERROR(r.Real("rope_theta", 0, 1e12, 10000.0, &c.rope_theta));
  RETURN_IF_ERROR(r.Bool("tie_word_embeddings", false, &out.tie_word_embeddings));
  if (c.d_model % c.num_heads != 0) {
    return r.Bad("num_attention_heads",
                 absl::StrCat(c.num_heads, " does not divide hidden_size ", c.d_model));
  }
  if (const JsonValue* hd = root->Find("head_dim"); hd != nullptr && !hd->is_null()) {
    int64_t h = 0;
    if (!hd->AsInt64(&h) || h != c.head_dim()) {
      return r.Bad("head_dim", absl::StrCat("is not hidden_size / num_attention_heads = ",
                                            c.head_dim(), "; other head sizes are not supported"));
    }
  }
  auto checked = ModelConfigFromShape(ShapeFromConfig(c));
  if (!checked.ok()) return Annotate(checked.status(), what);
  return out;
}

absl::Status CheckHfConfigMatches(const HfLlamaConfig& hf, const ModelConfig& job,
                                  const std::string& what) {
  const ModelConfig& c = hf.model;
  struct Pair {
    const char* hf_field;
    const char* job_field;
    double hf_value, job_value;
  };
  const Pair ints[] = {
      {"num_hidden_layers", "num_layers", double(c.num_layers), double(job.num_layers)},
      {"hidden_size", "d_model", double(c.d_model), double(job.d_model)},
      {"num_attention_heads", "num_heads", double(c.num_heads), double(job.num_heads)},
      {"num_key_value_heads", "num_kv_heads", double(c.num_kv_heads), double(job.num_kv_heads)},
      {"intermediate_size", "ffn_dim", double(c.ffn_dim), double(job.ffn_dim)},
      {"vocab_size", "vocab_size", double(c.vocab_size), double(job.vocab_size)},
      {"rms_norm_eps", "norm_eps", c.norm_eps, job.norm_eps},
      {"rope_theta", "rope_theta", c.rope_theta, job.rope_theta},
  };
  for (const Pair& p : ints) {
    if (!Close(p.hf_value, p.job_value)) {
      return absl::FailedPreconditionError(absl::StrCat(what, ": ", p.hf_field, " ",
                                                        Num(p.hf_value), " vs the job's model.",
                                                        p.job_field, " ", Num(p.job_value)));
    }
  }
  if (job.context_length > c.context_length) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": max_position_embeddings ", c.context_length,
                     " is shorter than the job's model.context_length ", job.context_length));
  }
  return absl::OkStatus();
}

}  // namespace detour::model
