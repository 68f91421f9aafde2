// detour-export: converts a detour checkpoint directory into a Hugging Face
// LLaMA directory (model.safetensors + config.json [+ tokenizer]) that
// transformers, vLLM or llama.cpp's converter load, and that a detour job
// starts from with checkpoint.init_from.
#include <iostream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "worker/model/hf_export.h"

namespace {

constexpr char kEpilog[] = R"(Arguments:
  CHECKPOINT_DIR   a detour checkpoint: the directory holding manifest.json
                   (a job's last_checkpoint in `detourctl get JOB`, or one
                   under demo-out/coordinator/checkpoints/ after `make demo`)
  OUT_DIR          the Hugging Face directory to write (created if missing)

Writes OUT_DIR/model.safetensors (transformers' LLaMA tensor names),
OUT_DIR/config.json (LlamaForCausalLM) and, with --tokenizer (default: the
SentencePiece model the checkpoint records it was trained with, if any),
tokenizer.model
plus tokenizer_config.json. Optimiser and K-FAC state are not exported.

Examples:
  detour-export /var/lib/detour/checkpoints/JOB/ITERATION hf-tiny
  detour-export --dtype bf16 --tokenizer sp.model ckpt/ hf-model/
  python3 -c 'import transformers as t; t.AutoModelForCausalLM.from_pretrained("hf-tiny")'

Exit status: 0 on success, 1 on an error (named on stderr), 2 on bad usage.
)";

}  // namespace

int main(int argc, char** argv) {
  detour::FlagSet flags("detour-export",
                        "Exports a detour checkpoint to the Hugging Face LLaMA layout:\n"
                        "  detour-export [flags] CHECKPOINT_DIR OUT_DIR");
  std::string dtype = "f32";
  std::string tokenizer;
  bool overwrite = false;
  bool quiet = false;
  flags.String("dtype", &dtype, "tensor dtype in model.safetensors: f32 (exact) or bf16");
  flags.String("tokenizer", &tokenizer,
               "SentencePiece .model to ship as tokenizer.model (default: the one the "
               "checkpoint records it was trained with; none, and \"byte\" in config.json, "
               "for the byte tokenizer); one the checkpoint was not trained with is refused");
  flags.Bool("overwrite", &overwrite, "replace model.safetensors/config.json already in OUT_DIR");
  flags.Bool("quiet", &quiet, "no progress lines");
  flags.SetEpilog(kEpilog);
  auto args = flags.Parse(argc, argv);
  if (!args.ok()) return flags.Fail(args.status());
  if (args->size() != 2) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("expected CHECKPOINT_DIR and OUT_DIR, got ", args->size(), " arguments")));
  }
  detour::model::HfExportOptions options;
  const std::string d = absl::AsciiStrToLower(dtype);
  if (d == "f32" || d == "float32") {
    options.dtype = detour::model::SafetensorsDType::kF32;
  } else if (d == "bf16" || d == "bfloat16") {
    options.dtype = detour::model::SafetensorsDType::kBF16;
  } else {
    return flags.Fail(
        absl::InvalidArgumentError(absl::StrCat("--dtype: \"", dtype, "\" is not f32 or bf16")));
  }
  options.tokenizer_model = tokenizer;
  options.overwrite = overwrite;
  if (!quiet) {
    options.progress = [](absl::string_view line) {
      std::cerr << "detour-export: " << line << "\n";
    };
  }
  const absl::Status s = detour::model::ExportHfCheckpoint((*args)[0], (*args)[1], options);
  if (!s.ok()) {
    std::cerr << "detour-export: " << s.message() << "\n";
    return 1;
  }
  if (!quiet) std::cerr << "detour-export: wrote " << (*args)[1] << "\n";
  return 0;
}
