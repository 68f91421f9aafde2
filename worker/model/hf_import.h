// Import of a Hugging Face LLaMA checkpoint as a stage's starting weights
// (JobSpec checkpoint.init_from): a directory with config.json and either
// model.safetensors or a sharded model.safetensors.index.json — our own
// exports (hf_export.h) or a compatible LLaMA-architecture model.
//
// config.json is checked against the job's shape (hf_llama.h) and every
// tensor against the shape the stage needs; F32, BF16, F16 and F64 tensors
// are converted to the stage's float32 parameters. A tied checkpoint
// (tie_word_embeddings, no lm_head.weight) initialises our untied head from
// the embedding. Tensors a LLaMA of this shape does not have (biases, extra
// layers) are refused, not ignored. Nothing changes unless everything checks
// out. Errors name the directory and the field or tensor: NOT_FOUND for
// missing files, INVALID_ARGUMENT for malformed ones, FAILED_PRECONDITION
// for a model of another shape. Thread-compatible (like Stage).
#ifndef DETOUR_WORKER_MODEL_HF_IMPORT_H_
#define DETOUR_WORKER_MODEL_HF_IMPORT_H_

#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "worker/model/stage.h"

namespace detour::model {

// The float32 CPU tensors for our global parameter names `names` of a model
// of shape `config`, read from the HF directory `dir` (checked as above).
absl::StatusOr<std::map<std::string, at::Tensor>> ReadHfParameters(
    const std::string& dir, const ModelConfig& config, const std::vector<std::string>& names);

// Sets `stage`'s parameters from `dir`. Optimiser state is untouched (a job
// starting from an import starts its optimiser afresh).
absl::Status InitStageFromHf(const std::string& dir, Stage* stage);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_HF_IMPORT_H_
