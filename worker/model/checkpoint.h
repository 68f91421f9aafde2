// Checkpoints: one file per stage (parameters, optimiser state, RNG state)
// plus a JSON manifest with the iteration, the model shape, and each file's
// layer range, size and checksum.
//
// Layout of a checkpoint directory:
//   manifest.json          written last; its presence marks a complete
//                          checkpoint
//   stage-<k>.pt           LibTorch archive, tensors under global names
//                          ("layers.3.wq", "layers.3.wq.adam_m", ...)
// Tensors are keyed by global names, so a stage loads whatever files cover
// its layers: loading into a different replica count (any replica of stage k
// reads the same entries) or even a different stage split works.
//
// Safety: every file is written to a temporary name and renamed into place;
// SaveCheckpoint builds the whole directory under a temporary name and
// renames it, refusing (ALREADY_EXISTS) to replace an existing checkpoint.
// Loading verifies sizes and checksums (FNV-1a 64 over the file bytes) and
// every tensor's presence and shape before changing any parameter: a corrupt
// or mismatched checkpoint is refused with DATA_LOSS / FAILED_PRECONDITION /
// INVALID_ARGUMENT and leaves the stage and optimiser untouched.
// Thread-compatible (functions touch only their arguments and the files).
#ifndef DETOUR_WORKER_MODEL_CHECKPOINT_H_
#define DETOUR_WORKER_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/model/model_config.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"

namespace detour::model {

class PipelineEngine;
class Kfac;

struct StageFileEntry {
  int stage = 0;
  std::string file;       // relative to the checkpoint directory
  LayerRange layers;      // global layers held (stage 0 also holds embedding/head)
  uint64_t bytes = 0;
  std::string checksum;   // "fnv1a64:<16 hex digits>"
};

struct CheckpointManifest {
  std::string format = "detour-checkpoint-v1";
  uint64_t iteration = 0;  // iterations completed (the next step's index)
  ModelConfig model;
  int num_stages = 0;
  int replicas_per_stage = 1;  // informational; loading does not depend on it
  uint64_t seed = 0;
  // Opaque state of the caller's route/data RNG (e.g. a counter), restored
  // on resume.
  std::string rng_state;
  std::vector<StageFileEntry> stages;
};

// The whole state of a stage — parameters, AdamW moments and steps, and
// K-FAC's state when `kfac` is given (Kfac::State) — as the bytes of one
// LibTorch archive holding a name -> tensor table. What stage files hold and
// what a live replica streams to a joining one.
absl::StatusOr<std::string> SerializeStageState(const Stage& stage, const AdamW& optimizer,
                                                const Kfac* kfac);
// The table of such bytes; DATA_LOSS (naming `what`) for anything else.
absl::StatusOr<std::map<std::string, at::Tensor>> ParseStageState(const std::string& bytes,
                                                                  const std::string& what);
// Puts a table's entries into `stage`, `optimizer` (may be null) and `kfac`
// (may be null; entries "kfac.*" absent = K-FAC keeps its state). Checks
// every entry's presence and shape first (INVALID_ARGUMENT naming it, `ctx`
// first): nothing changes unless everything checks out.
absl::Status ApplyStageState(const std::map<std::string, at::Tensor>& table,
                             const std::string& ctx, Stage* stage, AdamW* optimizer,
                             Kfac* kfac);

// Worker side: writes `dir`/stage-<k>.pt atomically (temp file + rename;
// creates `dir` if needed) and returns its manifest entry.
absl::StatusOr<StageFileEntry> WriteStageFile(const std::string& dir,
                                              const Stage& stage,
                                              const AdamW& optimizer,
                                              const Kfac* kfac = nullptr);

// Coordinator side: writes `dir`/manifest.json atomically.
absl::Status WriteManifest(const std::string& dir,
                           const CheckpointManifest& manifest);
absl::StatusOr<CheckpointManifest> ReadManifest(const std::string& dir);

// Loads the entries `stage` and `optimizer` need from the checkpoint in
// `dir`. Checks the model shape against the manifest and the checksum of
// every file it reads. Nothing changes unless everything checks out.
absl::Status LoadStage(const std::string& dir, const CheckpointManifest& manifest,
                       Stage* stage, AdamW* optimizer, Kfac* kfac = nullptr);

// In-process convenience: every stage of `engine` plus the manifest, as one
// atomically created directory. ALREADY_EXISTS if `dir` exists.
absl::Status SaveCheckpoint(const std::string& dir, PipelineEngine& engine,
                            uint64_t iteration, const std::string& rng_state);
// Loads every stage of `engine`; returns the manifest (iteration, RNG state).
absl::StatusOr<CheckpointManifest> LoadCheckpoint(const std::string& dir,
                                                  PipelineEngine& engine);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_CHECKPOINT_H_
