// Reading the stage files of detour-checkpoint-v1 checkpoints: LibTorch
// archives (torch::serialize::OutputArchive) holding one dict "tensors" of
// global name → tensor, the same table v2 keeps in our own container
// (stage_file.h). Only the converter uses this (checkpoint_convert.h).
//
// LibTorch's archive reader runs the TorchScript unpickler, which crashes the
// process on some corrupt inputs (found by fuzzing): call this only
// in a process that may die. detour-checkpoint runs it in a child process per
// stage file and reports which file crashed it. Thread-compatible.
#ifndef DETOUR_WORKER_MODEL_CHECKPOINT_V1_H_
#define DETOUR_WORKER_MODEL_CHECKPOINT_V1_H_

#include <string>

#include "absl/status/statusor.h"

namespace detour::model {

// The bytes of a v1 stage file → the bytes of the v2 stage file holding the
// same tensors (names, dtypes, shapes, values). DATA_LOSS naming `what` when
// the archive is not readable or holds no "tensors" dict of string → dense
// tensor; INVALID_ARGUMENT for a tensor v2 cannot store (its dtype).
absl::StatusOr<std::string> ConvertV1StageFile(const std::string& v1_bytes,
                                               const std::string& what);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_CHECKPOINT_V1_H_
