#include "common/model_config.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"

namespace detour::model {

int64_t ModelConfig::LayerParameters() const {
  const int64_t d = d_model;
  const int64_t kv = static_cast<int64_t>(num_kv_heads) * head_dim();
  // q, o: d×d; k, v: kv×d; gate, up, down: 3·d·ffn; two RMSNorm weights.
  return 2 * d * d + 2 * kv * d + 3 * d * ffn_dim + 2 * d;
}

int64_t ModelConfig::TotalParameters() const {
  // Embedding, LM head (untied), final norm.
  return num_layers * LayerParameters() + 2 * static_cast<int64_t>(vocab_size) * d_model + d_model;
}

std::string ModelConfig::DebugString() const {
  return absl::StrCat("layers=", num_layers, " d_model=", d_model, " heads=", num_heads,
                      " kv_heads=", num_kv_heads, " ffn=", ffn_dim, " vocab=", vocab_size,
                      " context=", context_length);
}

absl::StatusOr<ModelConfig> ModelConfigFromShape(const v1::ModelShape& shape) {
  auto resolved = ResolveModelShape(shape);
  if (!resolved.ok()) return resolved.status();
  const v1::ModelShape& s = *resolved;
  ModelConfig c;
  c.num_layers = static_cast<int>(s.num_layers());
  c.d_model = static_cast<int>(s.d_model());
  c.num_heads = static_cast<int>(s.num_heads());
  c.num_kv_heads = static_cast<int>(s.num_kv_heads());
  // The default width of a zero d_model is 0, refused below.
  c.ffn_dim = static_cast<int>(s.ffn_dim());
  c.vocab_size = static_cast<int>(s.vocab_size());
  c.context_length = static_cast<int>(s.context_length());
  c.rope_theta = s.rope_theta();
  c.norm_eps = s.norm_eps();

  auto bad = [](absl::string_view field, int64_t v, absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat("model.", field, ": ", v, " ", why));
  };
  if (c.num_layers <= 0) return bad("num_layers", c.num_layers, "must be > 0");
  if (c.d_model <= 0) return bad("d_model", c.d_model, "must be > 0");
  if (c.num_heads <= 0 || c.d_model % c.num_heads != 0) {
    return bad("num_heads", c.num_heads, "must be > 0 and divide d_model");
  }
  if (c.head_dim() % 2 != 0) {
    return bad("num_heads", c.num_heads,
               "gives an odd head dimension (rotary embeddings need even)");
  }
  if (c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0) {
    return bad("num_kv_heads", c.num_kv_heads, "must be > 0 and divide num_heads");
  }
  if (c.ffn_dim <= 0) return bad("ffn_dim", c.ffn_dim, "must be > 0");
  if (c.vocab_size <= 0) return bad("vocab_size", c.vocab_size, "must be > 0");
  if (c.context_length <= 0) {
    return bad("context_length", c.context_length, "must be > 0");
  }
  return c;
}

v1::ModelShape ShapeFromConfig(const ModelConfig& c) {
  v1::ModelShape s;
  s.set_num_layers(c.num_layers);
  s.set_d_model(c.d_model);
  s.set_num_heads(c.num_heads);
  s.set_num_kv_heads(c.num_kv_heads);
  s.set_ffn_dim(c.ffn_dim);
  s.set_vocab_size(c.vocab_size);
  s.set_context_length(c.context_length);
  s.set_rope_theta(c.rope_theta);
  s.set_norm_eps(c.norm_eps);
  return s;
}

absl::StatusOr<LayerRange> StageLayerRange(int num_layers, int num_stages, int stage) {
  // One rule for the whole system: the coordinator assigns with the same one.
  ASSIGN_OR_RETURN(LayerSpan span, StageLayers(num_layers, num_stages, stage));
  LayerRange r;
  r.begin = span.begin;
  r.end = span.end;
  return r;
}

}  // namespace detour::model
