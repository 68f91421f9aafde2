// Checkpoints: one file per stage (parameters, optimiser and K-FAC state)
// plus a JSON manifest with the iteration, the model shape, and each file's
// layer range, size and checksum.
//
// Layout of a checkpoint directory:
//   manifest.json          written last; its presence marks a complete
//                          checkpoint
//   stage-<k>.bin          tensors under global names ("layers.3.wq",
//                          "layers.3.wq.adam_m", ...) in our own container
//                          (stage_file.h), never LibTorch's archive format,
//                          whose reader crashes on corrupt input
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
#include <ATen/core/Tensor.h>
#include "common/checkpoint_manifest.h"
#include "common/model_config.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"

namespace detour::model {

class PipelineEngine;
class Kfac;

// The whole state of a stage — parameters, AdamW moments and steps, and
// K-FAC's state when `kfac` is given (Kfac::State) — as the bytes of one
// stage file (stage_file.h). What checkpoints hold and what a live replica
// streams to a joining one; ParseStageFile reads it back.
absl::StatusOr<std::string> SerializeStageState(const Stage& stage, const AdamW& optimizer,
                                                const Kfac* kfac);
// The bytes of a stage file holding `tensors` (dense CPU tensors of the
// container's dtypes, unique names): INVALID_ARGUMENT naming a tensor that
// cannot be stored. What SerializeStageState and the v1 converter write.
absl::StatusOr<std::string> EncodeStageTensors(
    const std::vector<std::pair<std::string, at::Tensor>>& tensors);
// Puts a table's entries into `stage`, `optimizer` (may be null) and `kfac`
// (may be null; without "kfac.*" entries K-FAC keeps its state). Checks
// every entry's presence and shape first (INVALID_ARGUMENT naming it, `ctx`
// first): nothing changes unless everything checks out.
absl::Status ApplyStageState(const std::map<std::string, at::Tensor>& table, const std::string& ctx,
                             Stage* stage, AdamW* optimizer, Kfac* kfac);

// Worker side: writes `dir`/stage-<k>.bin atomically (temp file + rename;
// creates `dir` if needed) and returns its manifest entry.
absl::StatusOr<StageFileEntry> WriteStageFile(const std::string& dir, const Stage& stage,
                                              const AdamW& optimizer, const Kfac* kfac = nullptr);

// The manifest (WriteManifest, ReadManifest: the coordinator side) is
// checkpoint_manifest.h's.

// Decodes the bytes of a stage file into its tensor table (global names).
// DATA_LOSS naming `what` and the tensor for anything truncated or corrupt
// (stage_file.h), never a crash.
absl::StatusOr<std::map<std::string, at::Tensor>> ParseStageFile(const std::string& bytes,
                                                                 const std::string& what);

// Loads the entries `stage` and `optimizer` need from the checkpoint in
// `dir`. Checks the model shape against the manifest and the checksum of
// every file it reads. Nothing changes unless everything checks out.
absl::Status LoadStage(const std::string& dir, const CheckpointManifest& manifest, Stage* stage,
                       AdamW* optimizer, Kfac* kfac = nullptr);

// In-process convenience: every stage of `engine` plus the manifest, as one
// atomically created directory. ALREADY_EXISTS if `dir` exists.
absl::Status SaveCheckpoint(const std::string& dir, PipelineEngine& engine, uint64_t iteration,
                            const std::string& rng_state);
// Loads every stage of `engine`; returns the manifest (iteration, RNG state).
absl::StatusOr<CheckpointManifest> LoadCheckpoint(const std::string& dir, PipelineEngine& engine);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_CHECKPOINT_H_
