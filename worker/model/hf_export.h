// Export of a detour checkpoint to the Hugging Face LLaMA layout (what
// `detour-export` does): a directory with
//   model.safetensors      every parameter under transformers' name
//                          (hf_llama.h), F32 or BF16
//   config.json            LlamaForCausalLM config (hf_llama.h)
//   tokenizer.model        with a SentencePiece model: a copy of it, plus
//   tokenizer_config.json  a minimal LlamaTokenizer config
// No LibTorch: the stage files are read with our own container parser
// (stage_file.h), their sizes and checksums checked against the manifest.
// Optimiser and K-FAC state are not exported. Every file is written
// crash-safely; the whole model is held in memory once (plus one BF16 copy).
// Thread-compatible (touches only its arguments and the files).
#ifndef DETOUR_WORKER_MODEL_HF_EXPORT_H_
#define DETOUR_WORKER_MODEL_HF_EXPORT_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/model/safetensors.h"

namespace detour::model {

struct HfExportOptions {
  // kF32 (exact) or kBF16 (rounded to nearest even; NaN kept NaN).
  SafetensorsDType dtype = SafetensorsDType::kF32;
  // A SentencePiece .model file to ship as tokenizer.model; "" = the model
  // uses our byte tokenizer (recorded in config.json's "detour" section).
  std::string tokenizer_model;
  // Replace model.safetensors / config.json already in the output directory
  // (otherwise ALREADY_EXISTS).
  bool overwrite = false;
  // Called with one line per step (may be empty).
  std::function<void(absl::string_view)> progress;
};

// What a SentencePiece model file says that config.json needs. Read with our
// own bounded protobuf wire-format walk (the ModelProto's pieces and
// trainer_spec ids), so export needs no SentencePiece library.
struct SentencePieceInfo {
  int64_t pieces = 0;
  int64_t bos_id = 1;  // SentencePiece's defaults
  int64_t eos_id = 2;
};
// INVALID_ARGUMENT naming `what` for bytes that are not a ModelProto.
absl::StatusOr<SentencePieceInfo> InspectSentencePieceModel(absl::string_view bytes,
                                                            const std::string& what);

// float32 → bfloat16, rounded to nearest even.
uint16_t Float32ToBFloat16(float f);

// Exports the checkpoint in `checkpoint_dir` (its manifest.json) to
// `out_dir` (created if missing). Errors name the file and tensor:
// NOT_FOUND / DATA_LOSS for a missing or corrupt checkpoint,
// INVALID_ARGUMENT for a parameter missing or of the wrong shape or a bad
// tokenizer file, ALREADY_EXISTS for existing output without `overwrite`.
absl::Status ExportHfCheckpoint(const std::string& checkpoint_dir, const std::string& out_dir,
                                const HfExportOptions& options);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_HF_EXPORT_H_
