// detour-eval: perplexity of a checkpoint on validation text, through all
// stages or a chosen subset/order of them (inference with skipped stages).
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/version.h"
#include "worker/model/checkpoint.h"
#include "worker/model/engine.h"
#include "worker/model/evaluate.h"
#include "worker/model/token_shards.h"

namespace detour::eval_tool {
namespace {

constexpr char kUsage[] = R"(detour-eval: perplexity with all stages or a subset of them.

Usage:
  detour-eval [--checkpoint DIR | --preset NAME] [--split S] [--stages LIST | --half]
              [--data PATH [--tokenizer FILE]] [--validation-fraction F] [--max-samples N]
              [--batch N] [--seed N] [--threads N] [--device D] [--json]
  detour-eval --version

  --checkpoint DIR   a checkpoint written by detour (its manifest.json); the
                     model shape comes from the manifest
  --preset NAME      no checkpoint: a freshly initialised model (smoke tests)
  --split S          evaluate with S stages (default: the checkpoint's stage
                     count; weights are keyed by layer, so any S <= layers
                     works); --split = layers gives one layer per stage
  --stages LIST      visiting order, e.g. 0,2,4 (stage 0 first; default all)
  --half             stage 0 plus every other stage: half of the stages
  --data PATH        a dataset from `detour-data prepare`, or a UTF-8 file or
                     directory (default: the data the checkpoint records it was
                     trained on; the embedded corpus for --preset)
  --tokenizer FILE   SentencePiece model for text --data (default: bytes); a
                     tokenizer other than the checkpoint's is refused
  --validation-fraction F   held-out tail of text data used for evaluation
                     (default: the checkpoint's, else 0.05; a prepared
                     dataset's validation split is fixed)
  --max-samples N    evaluate at most N samples, spread evenly (default all)
Flags take `--name value` or `--name=value`.
Exit status: 0 on success, 1 on an error, 2 on bad usage.
)";

struct Args {
  std::string checkpoint, preset, stages, data, tokenizer, device = "cpu";
  int64_t split = 0, max_samples = 0, batch = 8, threads = 1;
  double fraction = 0;  // 0 = the checkpoint's or the default
  uint64_t seed = 0;
  bool half = false, json = false;
};

bool Parse(int argc, char** argv, Args* a, std::string* error) {
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    // `--name=value` as well as `--name value`.
    std::optional<std::string> inline_value;
    if (const size_t eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      inline_value = flag.substr(eq + 1);
      flag.resize(eq);
    }
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--version") {
      std::cout << "detour-eval " << kVersion << " (" << kGitRevision << ")\n";
      std::exit(0);
    }
    if (inline_value.has_value() && (flag == "--half" || flag == "--json")) {
      *error = absl::StrCat(flag, " takes no value");
      return false;
    }
    if (flag == "--half") {
      a->half = true;
      continue;
    }
    if (flag == "--json") {
      a->json = true;
      continue;
    }
    if (!inline_value.has_value() && i + 1 >= argc) {
      *error = absl::StrCat(flag, " needs a value");
      return false;
    }
    const std::string v = inline_value.has_value() ? *inline_value : argv[++i];
    bool ok = true;
    if (flag == "--checkpoint")
      a->checkpoint = v;
    else if (flag == "--preset")
      a->preset = v;
    else if (flag == "--stages")
      a->stages = v;
    else if (flag == "--data")
      a->data = v;
    else if (flag == "--tokenizer")
      a->tokenizer = v;
    else if (flag == "--device")
      a->device = v;
    else if (flag == "--split")
      ok = absl::SimpleAtoi(v, &a->split) && a->split > 0;
    else if (flag == "--max-samples")
      ok = absl::SimpleAtoi(v, &a->max_samples) && a->max_samples >= 0;
    else if (flag == "--batch")
      ok = absl::SimpleAtoi(v, &a->batch) && a->batch > 0;
    else if (flag == "--threads")
      ok = absl::SimpleAtoi(v, &a->threads) && a->threads > 0;
    else if (flag == "--seed")
      ok = absl::SimpleAtoi(v, &a->seed);
    else if (flag == "--validation-fraction")
      ok = absl::SimpleAtod(v, &a->fraction) && a->fraction > 0 && a->fraction <= 0.5;
    else {
      *error = absl::StrCat("unknown flag ", flag);
      return false;
    }
    if (!ok) {
      *error = absl::StrCat(flag, ": bad value \"", v, "\"");
      return false;
    }
  }
  if (a->checkpoint.empty() == a->preset.empty()) {
    *error = "give exactly one of --checkpoint and --preset";
    return false;
  }
  if (a->half && !a->stages.empty()) {
    *error = "--half and --stages exclude each other";
    return false;
  }
  return true;
}

absl::Status Main(const Args& args) {
  at::set_num_threads(static_cast<int>(args.threads));
  if (args.device != "cpu" && !(args.device.rfind("cuda", 0) == 0 && at::hasCUDA())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device ", args.device, ": this LibTorch build has no such device"));
  }
  v1::JobSpec spec;
  spec.set_name("detour-eval");
  spec.set_iterations(1);
  spec.set_seed(args.seed);
  model::CheckpointManifest manifest;
  if (!args.checkpoint.empty()) {
    ASSIGN_OR_RETURN(manifest, model::ReadManifest(args.checkpoint));
    *spec.mutable_model() = model::ShapeFromConfig(manifest.model);
    spec.mutable_pipeline()->set_num_stages(manifest.num_stages);
    spec.set_seed(manifest.seed);
  } else {
    spec.mutable_model()->set_preset(args.preset);
  }
  if (args.split > 0) spec.mutable_pipeline()->set_num_stages(args.split);
  if (!args.data.empty()) {
    const bool dataset = model::ReadDatasetManifest(args.data).ok();
    spec.mutable_data()->set_source(dataset ? v1::DATA_SOURCE_SHARDS : v1::DATA_SOURCE_TEXT);
    spec.mutable_data()->set_path(args.data);
    spec.mutable_data()->set_tokenizer(args.tokenizer);
  } else if (manifest.data.known()) {
    *spec.mutable_data() = model::DataSpecOf(manifest.data);
    std::fprintf(stderr, "detour-eval: the checkpoint's data: %s%s%s%s\n",
                 manifest.data.source.c_str(), manifest.data.path.empty() ? "" : " ",
                 manifest.data.path.c_str(),
                 manifest.data.tokenizer.empty()
                     ? ""
                     : absl::StrCat(", tokenizer ", manifest.data.tokenizer).c_str());
  } else if (!args.checkpoint.empty()) {
    std::fprintf(stderr,
                 "detour-eval: the checkpoint records no data source (written by an "
                 "older detour); evaluating on the embedded corpus — give --data\n");
  }
  if (!args.tokenizer.empty() && args.data.empty()) {
    return absl::InvalidArgumentError("--tokenizer applies to --data only");
  }
  if (args.fraction > 0) {
    if (spec.data().source() == v1::DATA_SOURCE_SHARDS) {
      return absl::InvalidArgumentError(
          "--validation-fraction: a prepared dataset's validation split is fixed");
    }
    spec.mutable_data()->set_validation_fraction(args.fraction);
  }
  ApplyJobDefaults(&spec);
  ASSIGN_OR_RETURN(auto engine, model::PipelineEngine::Create(spec, c10::Device(args.device)));
  if (!args.checkpoint.empty()) {
    RETURN_IF_ERROR(model::LoadCheckpoint(args.checkpoint, *engine).status());
  }
  ASSIGN_OR_RETURN(model::TextDataset data, model::LoadDataset(spec.data()));
  if (!manifest.data.tokenizer_checksum.empty() &&
      manifest.data.tokenizer_checksum != data.tokenizer_checksum) {
    return absl::FailedPreconditionError(
        absl::StrCat("the checkpoint was trained on ids of tokenizer ",
                     manifest.data.tokenizer_checksum, " but the data is tokenised with ",
                     data.tokenizer_checksum, " (give the checkpoint's tokenizer, or its data)"));
  }
  RETURN_IF_ERROR(model::CheckVocabulary(data, static_cast<int>(spec.model().vocab_size())));
  model::EvalOptions options;
  options.batch_size = static_cast<int>(args.batch);
  options.max_samples = args.max_samples;
  if (args.half) {
    options.route = model::SpreadRoute(engine->num_stages(), 0.5);
  } else if (!args.stages.empty()) {
    for (absl::string_view s : absl::StrSplit(args.stages, ',')) {
      int v = 0;
      if (!absl::SimpleAtoi(s, &v)) {
        return absl::InvalidArgumentError(absl::StrCat("--stages: bad stage \"", s, "\""));
      }
      options.route.push_back(v);
    }
  }
  ASSIGN_OR_RETURN(auto result, model::Perplexity(engine->stages(), data.validation, options));
  std::vector<int> route = options.route;
  if (route.empty()) {
    for (int s = 0; s < engine->num_stages(); ++s) route.push_back(s);
  }
  if (args.json) {
    std::printf(
        "{\"perplexity\": %.6f, \"mean_nll\": %.6f, \"tokens\": %lld, "
        "\"samples\": %lld, \"stages\": [%s], \"num_stages\": %d}\n",
        result.perplexity, result.mean_nll, static_cast<long long>(result.tokens),
        static_cast<long long>(result.samples), absl::StrJoin(route, ", ").c_str(),
        engine->num_stages());
  } else {
    std::printf("perplexity %.4f (%.4f nats/token) over %lld tokens, stages {%s} of %d\n",
                result.perplexity, result.mean_nll, static_cast<long long>(result.tokens),
                absl::StrJoin(route, ",").c_str(), engine->num_stages());
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace detour::eval_tool

int main(int argc, char** argv) {
  detour::eval_tool::Args args;
  std::string error;
  if (!detour::eval_tool::Parse(argc, argv, &args, &error)) {
    std::fprintf(stderr, "detour-eval: %s\n\n%s", error.c_str(), detour::eval_tool::kUsage);
    return 2;
  }
  absl::Status s = detour::eval_tool::Main(args);
  if (!s.ok()) {
    std::fprintf(stderr, "detour-eval: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
