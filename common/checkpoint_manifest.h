// The manifest of a checkpoint (manifest.json): iteration, model shape and
// each stage file's layer range, size and checksum. Writing, reading and
// validation need no LibTorch (checkpoint.h reads and writes the stage files),
// so the parser is fuzzed in every build. Thread-safe (no shared state).
#ifndef DETOUR_COMMON_CHECKPOINT_MANIFEST_H_
#define DETOUR_COMMON_CHECKPOINT_MANIFEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/hash.h"
#include "common/model_config.h"

namespace detour::model {

struct StageFileEntry {
  int stage = 0;
  std::string file;   // relative to the checkpoint directory
  LayerRange layers;  // global layers held (stage 0 also holds embedding/head)
  uint64_t bytes = 0;
  std::string checksum;  // "fnv1a64:<16 hex digits>"
};

// Where a checkpoint's training data came from, so evaluation can use the
// same text, split and tokenizer (all empty for checkpoints that predate it).
struct DataProvenance {
  std::string source;              // "embedded", "text" or "shards"
  std::string path;                // data.path as the workers saw it
  std::string tokenizer;           // data.tokenizer ("" = the dataset's or bytes)
  std::string tokenizer_checksum;  // "byte" or "fnv1a64:<hex>"; "" when unknown
  double validation_fraction = 0;  // 0 = the default / the dataset's split
  bool known() const { return !source.empty(); }
};

struct CheckpointManifest {
  std::string format = "detour-checkpoint-v2";
  uint64_t iteration = 0;  // iterations completed (the next step's index)
  ModelConfig model;
  int num_stages = 0;
  int replicas_per_stage = 1;  // informational; loading does not depend on it
  uint64_t seed = 0;
  // Opaque state of the caller's route/data RNG (e.g. a counter), restored
  // on resume.
  std::string rng_state;
  std::vector<StageFileEntry> stages;
  DataProvenance data;
};

// Bounds a manifest must respect (a stored file is input like any other).
struct ManifestLimits {
  static constexpr uint64_t kMaxManifestBytes = 1 << 20;
  static constexpr size_t kMaxRngStateBytes = 4096;
  static constexpr size_t kMaxFileNameBytes = 255;
  // A stage file holds one stage's parameters and optimiser state.
  static constexpr uint64_t kMaxStageFileBytes = uint64_t{1} << 40;
  static constexpr uint64_t kMaxIteration = uint64_t{1} << 53;
};

// "fnv1a64:<16 hex digits>" of `bytes`.
std::string Checksum(absl::string_view bytes);

// The same checksum over data fed in pieces (files too large to hold):
// Fnv1a64 f; f.Add(a); f.Add(b); f.Hex() == Checksum(a + b) (common/hash.h).

// The JSON text of a manifest.
std::string ManifestJson(const CheckpointManifest& manifest);

// Parses and validates manifest JSON; `path` names it in errors. DATA_LOSS
// naming the field for malformed or out-of-range content (non-integral or
// out-of-range numbers, an invalid model shape, stage entries outside
// [0, num_stages) or with layer ranges outside the model, file names that
// leave the directory, checksums not in the format above),
// FAILED_PRECONDITION for another format (v1 checkpoints held LibTorch
// archives, which are no longer read).
absl::StatusOr<CheckpointManifest> ParseManifest(absl::string_view json, const std::string& path);

// The same rules for a detour-checkpoint-v1 manifest (the converter's
// input, checkpoint_convert.h); FAILED_PRECONDITION for any other format.
absl::StatusOr<CheckpointManifest> ParseV1Manifest(absl::string_view json, const std::string& path);

// Writes `dir`/manifest.json atomically and durably (common/files.h).
absl::Status WriteManifest(const std::string& dir, const CheckpointManifest& manifest);
// Reads `dir`/manifest.json (at most ManifestLimits::kMaxManifestBytes).
absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir);
// Reads `dir`/manifest.json of a v1 checkpoint (ParseV1Manifest).
absl::StatusOr<CheckpointManifest> ReadV1Manifest(const std::string& dir);

// Reads the bytes of the stage file `entry` names in `dir`, checking its
// size (before reading: the manifest bounds what is allocated) and checksum.
// NOT_FOUND for a missing file, DATA_LOSS for a corrupt one.
absl::StatusOr<std::string> ReadStageFileBytes(const std::string& dir, const StageFileEntry& entry);

}  // namespace detour::model

#endif  // DETOUR_COMMON_CHECKPOINT_MANIFEST_H_
