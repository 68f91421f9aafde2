// Converting a detour-checkpoint-v1 directory (stage files were LibTorch
// archives, checkpoint_v1.h) into a detour-checkpoint-v2 one (our own
// container, stage_file.h), so that checkpoints written before v2 are not
// lost; and checking a v2 checkpoint's files without LibTorch.
//
// The conversion of one stage file is the caller's `convert_stage`:
// LibTorch's archive reader crashes on some corrupt inputs, so
// detour-checkpoint runs it in a child process. This part needs no LibTorch:
// it validates the v1 manifest (the v2 rules) and every v1 file's size and
// checksum before any is read, builds the new checkpoint in NEW.tmp.<pid>
// beside NEW (every file fsynced), checks each file the converter wrote (size,
// container), writes the manifest last, renames the directory into place and
// fsyncs its parent; on any error it removes what it built and leaves OLD as
// it was. Thread-compatible.
#ifndef DETOUR_WORKER_MODEL_CHECKPOINT_CONVERT_H_
#define DETOUR_WORKER_MODEL_CHECKPOINT_CONVERT_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/checkpoint_manifest.h"

namespace detour::model {

struct V1ConvertOptions {
  // Turns the v1 stage file `v1_path`, whose size and checksum match
  // `entry`, into a v2 stage file written durably at `out_path`. An error
  // names what went wrong; the converter adds the file.
  std::function<absl::Status(const std::string& v1_path, const StageFileEntry& entry,
                             const std::string& out_path)>
      convert_stage;
  // Progress lines ("stage-1.pt: 12 tensors, 3.1 MiB"); may be empty.
  std::function<void(absl::string_view)> progress;
};

// Converts the v1 checkpoint in `old_dir` into a new v2 checkpoint `new_dir`
// and returns its manifest (the v1 fields, format v2, files stage-<k>.bin).
// ALREADY_EXISTS when `new_dir` exists; FAILED_PRECONDITION when `old_dir`
// is not v1 (a v2 checkpoint needs no conversion); DATA_LOSS naming the file
// for a corrupt manifest or stage file (size, checksum, or what
// `convert_stage` reports); NOT_FOUND for a missing one.
absl::StatusOr<CheckpointManifest> ConvertV1Checkpoint(const std::string& old_dir,
                                                       const std::string& new_dir,
                                                       const V1ConvertOptions& options);

// Checks the v2 checkpoint in `dir` as far as possible without LibTorch: the
// manifest, each stage file's size and checksum against it and its
// container (stage_file.h). Returns the manifest; the errors of ReadManifest,
// ReadStageFileBytes and DecodeStageFile.
absl::StatusOr<CheckpointManifest> VerifyCheckpoint(const std::string& dir);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_CHECKPOINT_CONVERT_H_
