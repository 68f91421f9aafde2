// Loading, defaulting and validating JobSpec and ClusterSpec.
//
// Specs on disk are the proto3 JSON mapping of detour.v1.JobSpec /
// detour.v1.ClusterSpec. Every error names the offending field by its JSON
// path and the value, e.g. `pipeline.skip_ratio: 1.2 is outside [0, 1)`.
// Functions here are thread-safe (no shared state).
#ifndef DETOUR_COMMON_SPEC_H_
#define DETOUR_COMMON_SPEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "detour/v1/spec.pb.h"

namespace detour {

// Parses JSON text into a message. Unknown fields and wrong types are
// INVALID_ARGUMENT naming the field. `what` names the source in messages.
absl::StatusOr<v1::JobSpec> ParseJobSpecJson(absl::string_view json,
                                             absl::string_view what = "job spec");
absl::StatusOr<v1::ClusterSpec> ParseClusterSpecJson(absl::string_view json,
                                                     absl::string_view what = "cluster spec");

// Upper bounds on every count and size in a spec, checked by the validators
// before a spec is used, stored or allocated for (a spec arrives from any
// client). Documented in docs/OPERATIONS.md §"Limits".
struct SpecLimits {
  static constexpr uint32_t kMaxLayers = 1024;
  static constexpr uint32_t kMaxDModel = 65536;
  static constexpr uint32_t kMaxHeads = 1024;
  static constexpr uint32_t kMaxFfnDim = 1u << 20;
  static constexpr uint32_t kMaxVocab = 1u << 22;
  static constexpr uint32_t kMaxContext = 1u << 20;
  // Elements of one microbatch's activation (samples × context × d_model).
  static constexpr uint64_t kMaxActivationElements = uint64_t{1} << 31;
  static constexpr uint32_t kMaxDataNodes = 4096;
  static constexpr uint32_t kMaxReplicas = 4096;
  // Workers a coordinator registers at once (lost ones included until
  // forgotten), and so the most a job can need: data_nodes + (num_stages - 1)
  // × replicas_per_stage.
  static constexpr uint64_t kMaxWorkers = 10000;
  static constexpr uint32_t kMaxMicrobatchesPerDataNode = 4096;
  static constexpr uint64_t kMaxMicrobatches = 1u << 16;
  static constexpr uint32_t kMaxSamplesPerMicrobatch = 4096;
  static constexpr uint32_t kMaxMemorySlots = 1024;
  static constexpr uint64_t kMaxIterations = 1'000'000'000;
  static constexpr uint32_t kMaxKeepLast = 1000;
  static constexpr size_t kMaxPathBytes = 4096;
  static constexpr size_t kMaxIdBytes = 256;
  // A whole JobSpec, serialized (unknown fields included): what a job costs
  // in the store, in every Get/List answer and on disk.
  static constexpr size_t kMaxJobSpecBytes = size_t{1} << 20;
  static constexpr int kMaxClusterNodes = 65536;
  static constexpr int kMaxLinks = 1 << 20;
  static constexpr uint32_t kMaxPauseSeconds = 7 * 24 * 3600;
  static constexpr uint32_t kMaxReconnectGraceMs = 600'000;
  static constexpr uint32_t kMaxReassignHorizon = 100'000;
};

// Reads, parses, defaults and validates a spec file. NOT_FOUND when the file
// is missing.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);
absl::StatusOr<v1::ClusterSpec> LoadClusterSpec(const std::string& path);

// Expands the model preset (explicit fields win) and fills every zero field
// with the default its proto comment names. Idempotent. Does not validate.
void ApplyJobDefaults(v1::JobSpec* spec);
void ApplyClusterDefaults(v1::ClusterSpec* spec);

// Checks a defaulted spec. INVALID_ARGUMENT naming the field and value.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);
absl::Status ValidateClusterSpec(const v1::ClusterSpec& spec);

// Both of the above, for specs that arrive over gRPC.
absl::StatusOr<v1::JobSpec> NormalizeJobSpec(v1::JobSpec spec);
absl::StatusOr<v1::ClusterSpec> NormalizeClusterSpec(v1::ClusterSpec spec);

// The shape of a named preset ("tiny", "small", "500m", "1.5b", "8b").
// NOT_FOUND for an unknown name.
absl::StatusOr<v1::ModelShape> ModelPreset(absl::string_view name);

// The one home of the model shape's defaults (the job defaults, the worker's
// ModelConfig and the K-FAC workload all take them from here):
// The feed-forward width of a shape without ffn_dim: 8/3 of d_model rounded
// up to a multiple of 64.
int64_t DefaultFfnDim(int64_t d_model);
// Fills every zero field of `shape` with the default its proto comment names
// (kv heads = heads, the ffn width above, vocabulary 256, context 128, rope
// theta 10000, norm eps 1e-5). Leaves the preset alone.
void FillModelShapeDefaults(v1::ModelShape* shape);
// The preset expanded (explicit non-zero fields win), then the defaults
// filled. NOT_FOUND for an unknown preset. Does not validate.
absl::StatusOr<v1::ModelShape> ResolveModelShape(const v1::ModelShape& shape);

// Stages visited per microbatch, P = max(1, round(S·(1-k))), stage 0 included.
int VisitedStages(const v1::PipelineSpec& pipeline);

// Writes a message as indented JSON (proto3 mapping, original field names).
std::string ToJson(const google::protobuf::Message& message);
// The same on one line, without a trailing newline (for JSON Lines output).
std::string ToJsonLine(const google::protobuf::Message& message);

}  // namespace detour

#endif  // DETOUR_COMMON_SPEC_H_
