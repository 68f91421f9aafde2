// Model shape and stage layout of a LLaMA-style decoder, without LibTorch.
//
// A ModelConfig is the defaulted numeric form of detour.v1.ModelShape. The
// layer split assigns each stage a run of consecutive transformer blocks; it is
// a pure function so the coordinator, the simulator and every worker agree on
// it without talking. Everything here is thread-safe (no shared state).
#ifndef DETOUR_COMMON_MODEL_CONFIG_H_
#define DETOUR_COMMON_MODEL_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "detour/v1/spec.pb.h"

namespace detour::model {

struct ModelConfig {
  int num_layers = 0;
  int d_model = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int ffn_dim = 0;
  int vocab_size = 256;
  int context_length = 128;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;

  int head_dim() const { return d_model / num_heads; }
  // Parameters of one transformer block / of the whole model.
  int64_t LayerParameters() const;
  int64_t TotalParameters() const;
  std::string DebugString() const;
};

// Builds a config from a ModelShape: expands the preset (explicit fields win),
// fills the defaults of the proto comments and validates the numbers
// (INVALID_ARGUMENT naming the field; NOT_FOUND for an unknown preset).
absl::StatusOr<ModelConfig> ModelConfigFromShape(const v1::ModelShape& shape);

// The explicit ModelShape (no preset) of a config; inverse of the above.
v1::ModelShape ShapeFromConfig(const ModelConfig& config);

// Half-open range [begin, end) of global layer indices.
struct LayerRange {
  int begin = 0;
  int end = 0;
  int size() const { return end - begin; }
  bool operator==(const LayerRange& o) const { return begin == o.begin && end == o.end; }
};

// Layers held by `stage` of `num_stages` for a model of `num_layers` blocks.
// The split is common/stage_layers.h's (one rule for coordinator, simulator
// and workers): consecutive ranges differing by at most one block, the larger
// ranges last, since stage 0 also carries the embedding, LM head and loss.
// INVALID_ARGUMENT unless 1 <= num_stages <= num_layers and
// 0 <= stage < num_stages.
absl::StatusOr<LayerRange> StageLayerRange(int num_layers, int num_stages, int stage);

}  // namespace detour::model

#endif  // DETOUR_COMMON_MODEL_CONFIG_H_
