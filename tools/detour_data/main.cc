// detour-data: train a SentencePiece tokenizer, prepare pre-tokenised
// datasets for DATA_SOURCE_SHARDS, and inspect them (docs/DATA.md).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/status.h"
#include "worker/model/text_data.h"
#include "worker/model/token_shards.h"
#include "worker/model/tokenizer.h"

namespace detour::data_tool {
namespace {

constexpr char kCommands[] = R"(Commands:
  tokenizer --output FILE.model [flags] INPUT...
      Train a SentencePiece tokenizer (BPE or unigram) on text files,
      directories of them, or JSONL (.jsonl, one {"text": ...} per line).
  prepare --output DIR [--tokenizer FILE.model] [flags] INPUT...
      Tokenise the inputs once into a dataset directory (token files, document
      index, manifest) for a job's data.source DATA_SOURCE_SHARDS.
  inspect DIR [--verify] [--show N]
      Print a dataset's manifest summary and the first N tokens decoded.

Run `detour-data COMMAND --help` for a command's flags.
Exit status: 0 on success, 1 on an error, 2 on bad usage.
)";

// A one-line progress display on stderr when it is a terminal, else a line
// every 10%.
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), tty_(::isatty(2) != 0) {}
  void Show(const model::PrepareProgress& p) {
    if (quiet_) return;
    const double pct = p.bytes_total > 0 ? 100.0 * p.bytes_done / p.bytes_total : 100.0;
    const std::string line =
        absl::StrFormat("prepare: %5.1f%%  %.1f / %.1f MB read, %d documents, %d tokens", pct,
                        p.bytes_done / 1e6, p.bytes_total / 1e6, p.documents, p.tokens);
    if (tty_) {
      std::fprintf(stderr, "\r%s", line.c_str());
    } else if (pct >= next_) {
      std::fprintf(stderr, "%s\n", line.c_str());
      next_ = pct + 10;
    }
  }
  void Done() {
    if (!quiet_ && tty_) std::fprintf(stderr, "\n");
  }

 private:
  bool quiet_;
  bool tty_;
  double next_ = 0;
};

model::TextDocuments ParseDocuments(const std::string& s, absl::Status* status) {
  if (s == "paragraphs") return model::TextDocuments::kParagraphs;
  if (s == "lines") return model::TextDocuments::kLines;
  if (s == "files") return model::TextDocuments::kFiles;
  *status = absl::InvalidArgumentError(
      absl::StrCat("--documents \"", s, "\" is not paragraphs, lines or files"));
  return model::TextDocuments::kParagraphs;
}

int Tokenizer(int argc, char** argv) {
  FlagSet flags("detour-data tokenizer",
                "Trains a SentencePiece tokenizer. Usage: detour-data tokenizer "
                "--output FILE.model [flags] INPUT...");
  std::string output, type = "bpe", field = "text";
  int64_t vocab = 8000, threads = std::max(1u, std::thread::hardware_concurrency());
  int64_t max_lines = 2000000;
  double coverage = 0.9995;
  flags.String("output", &output, "the .model file to write (required)");
  flags.String("type", &type, "bpe or unigram");
  flags.Int("vocab_size", &vocab, "pieces in the vocabulary (>= 260)");
  flags.Double("character_coverage", &coverage,
               "share of characters covered by pieces; "
               "the rest are spelled as bytes");
  flags.Int("threads", &threads, "training threads");
  flags.Int("max_lines", &max_lines, "train on at most this many lines of the inputs");
  flags.String("jsonl_field", &field, "the text field of .jsonl lines");
  flags.SetEpilog("INPUT... are text files, directories (read recursively) or .jsonl files.\n");
  auto args = flags.Parse(argc, argv);
  if (!args.ok()) return flags.Fail(args.status());
  if (output.empty() || args->empty()) {
    return flags.Fail(absl::InvalidArgumentError(output.empty() ? "--output FILE.model is required"
                                                                : "no INPUT given"));
  }
  // The training lines: the inputs read as `prepare` reads them, one line
  // at a time, streamed into spm_train (nothing staged on disk).
  std::fprintf(stderr, "tokenizer: training %s, vocabulary %lld...\n", type.c_str(),
               static_cast<long long>(vocab));
  model::SentencePieceTraining t;
  t.model_type = type;
  t.vocab_size = static_cast<int>(vocab);
  t.character_coverage = coverage;
  t.num_threads = static_cast<int>(threads);
  t.max_sentences = max_lines;
  model::TokenizerCorpus corpus;
  auto model = model::TrainTokenizerOnInputs(t, *args, field,
                                             absl::StrCat(output, ".spm-", ::getpid()), &corpus);
  if (!model.ok()) {
    std::fprintf(stderr, "detour-data tokenizer: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const double bytes = static_cast<double>(corpus.bytes);
  if (absl::Status s = WriteFileAtomically(output, *model); !s.ok()) {
    std::fprintf(stderr, "detour-data tokenizer: %s\n", s.ToString().c_str());
    return 1;
  }
  auto check = model::Tokenizer::Load(output);
  if (!check.ok()) {
    std::fprintf(stderr, "detour-data tokenizer: %s\n", check.status().ToString().c_str());
    return 1;
  }
  std::printf("wrote %s: %s, %d pieces, %s (trained on %lld lines, %.1f MB of text)\n",
              output.c_str(), type.c_str(), (*check)->vocab_size(), (*check)->checksum().c_str(),
              static_cast<long long>(corpus.lines), bytes / 1e6);
  return 0;
}

int Prepare(int argc, char** argv) {
  FlagSet flags("detour-data prepare",
                "Tokenises inputs into a dataset directory. Usage: detour-data prepare "
                "--output DIR [flags] INPUT...");
  model::PrepareOptions o;
  std::string documents = "paragraphs";
  int64_t seed = 0;
  bool quiet = false;
  flags.String("output", &o.output, "the dataset directory to create (required)");
  flags.String("tokenizer", &o.tokenizer_path,
               "a SentencePiece .model (default: the byte tokenizer)");
  flags.Double("validation_fraction", &o.validation_fraction,
               "share of documents held out for validation, in [0, 0.5]");
  flags.Int("split_seed", &seed, "seed of the document split");
  flags.String("documents", &documents,
               "how text files are cut into documents: paragraphs (at blank lines), lines or "
               "files; .jsonl lines are always one document each");
  flags.String("jsonl_field", &o.jsonl_field, "the text field of .jsonl lines");
  flags.Bool("force", &o.force, "replace an existing output directory");
  flags.Bool("quiet", &quiet, "no progress output");
  flags.SetEpilog("INPUT... are text files, directories (read recursively) or .jsonl files.\n");
  auto args = flags.Parse(argc, argv);
  if (!args.ok()) return flags.Fail(args.status());
  absl::Status bad;
  o.text_documents = ParseDocuments(documents, &bad);
  if (!bad.ok()) return flags.Fail(bad);
  if (o.output.empty() || args->empty()) {
    return flags.Fail(absl::InvalidArgumentError(o.output.empty() ? "--output DIR is required"
                                                                  : "no INPUT given"));
  }
  if (seed < 0) return flags.Fail(absl::InvalidArgumentError("--split_seed must be >= 0"));
  o.split_seed = static_cast<uint64_t>(seed);
  o.inputs = *args;
  Progress progress(quiet);
  o.progress = [&](const model::PrepareProgress& p) { progress.Show(p); };
  auto m = model::PrepareDataset(o);
  progress.Done();
  if (!m.ok()) {
    std::fprintf(stderr, "detour-data prepare: %s\n", m.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "wrote %s: %llu train tokens in %llu documents, %llu validation tokens in %llu "
      "documents, %s tokenizer (vocabulary %u), %u-byte tokens\n",
      o.output.c_str(), static_cast<unsigned long long>(m->train().tokens()),
      static_cast<unsigned long long>(m->train().documents()),
      static_cast<unsigned long long>(m->validation().tokens()),
      static_cast<unsigned long long>(m->validation().documents()), m->tokenizer_kind().c_str(),
      m->vocab_size(), m->token_bytes());
  return 0;
}

int Inspect(int argc, char** argv) {
  FlagSet flags("detour-data inspect",
                "Summarises a dataset. Usage: detour-data inspect DIR [--verify] [--show N]");
  bool verify = false;
  int64_t show = 64;
  flags.Bool("verify", &verify, "check every checksum and token id (reads all files)");
  flags.Int("show", &show, "decode this many tokens from the start of the training split");
  auto args = flags.Parse(argc, argv);
  if (!args.ok()) return flags.Fail(args.status());
  if (args->size() != 1) return flags.Fail(absl::InvalidArgumentError("give one dataset DIR"));
  auto ds = model::OpenShardDataset((*args)[0], verify);
  if (!ds.ok()) {
    std::fprintf(stderr, "detour-data inspect: %s\n", ds.status().ToString().c_str());
    return 1;
  }
  const auto& m = ds->manifest;
  std::printf(
      "%s: %s\n  tokenizer %s (%s), vocabulary %u, %u-byte tokens, eos %d\n"
      "  train %llu tokens / %llu documents, validation %llu / %llu (fraction %g, "
      "seed %llu)\n  %d sources, %.1f MB of text%s\n",
      (*args)[0].c_str(), m.format().c_str(), m.tokenizer_kind().c_str(),
      m.tokenizer_checksum().c_str(), m.vocab_size(), m.token_bytes(), m.eos_id(),
      static_cast<unsigned long long>(m.train().tokens()),
      static_cast<unsigned long long>(m.train().documents()),
      static_cast<unsigned long long>(m.validation().tokens()),
      static_cast<unsigned long long>(m.validation().documents()), m.validation_fraction(),
      static_cast<unsigned long long>(m.split_seed()), m.sources_size(), m.text_bytes() / 1e6,
      verify ? "; verified" : "");
  if (show > 0) {
    auto tok = model::Tokenizer::Load(
        m.tokenizer_file().empty() ? "" : absl::StrCat((*args)[0], "/", m.tokenizer_file()));
    if (!tok.ok()) {
      std::fprintf(stderr, "detour-data inspect: %s\n", tok.status().ToString().c_str());
      return 1;
    }
    const int64_t n = std::min<int64_t>(show, ds->train.size());
    auto text = (*tok)->Decode(ds->train.Slice(0, n));
    std::printf("  first %lld tokens: %s\n", static_cast<long long>(n),
                text.ok() ? absl::StrCat("\"", absl::CEscape(*text), "\"").c_str()
                          : text.status().ToString().c_str());
  }
  return 0;
}

int Main(int argc, char** argv) {
  FlagSet flags("detour-data", "Tokenizers and prepared datasets for detour jobs.");
  flags.SetEpilog(kCommands);
  auto args = flags.Parse(argc, argv, /*stop_at_positional=*/true);
  if (!args.ok()) return flags.Fail(args.status());
  if (args->empty()) {
    std::fprintf(stderr, "detour-data: give a command\n\n%s", kCommands);
    return 2;
  }
  const std::string cmd = (*args)[0];
  // The subcommand sees argv from its own name on.
  int sub = 1;
  while (sub < argc && cmd != argv[sub]) ++sub;
  if (cmd == "tokenizer") return Tokenizer(argc - sub, argv + sub);
  if (cmd == "prepare") return Prepare(argc - sub, argv + sub);
  if (cmd == "inspect") return Inspect(argc - sub, argv + sub);
  std::fprintf(stderr, "detour-data: unknown command \"%s\"\n\n%s", cmd.c_str(), kCommands);
  return 2;
}

}  // namespace
}  // namespace detour::data_tool

int main(int argc, char** argv) { return detour::data_tool::Main(argc, argv); }
