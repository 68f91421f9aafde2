// detour-checkpoint convert on real v1 checkpoints: stage files written the
// way v1 wrote them (a LibTorch archive holding the dict "tensors" of the
// stage's parameters and AdamW state), converted by the real program, whose
// child runs LibTorch's reader. The result loads into stages and trains on
// bit for bit; a reader that dies kills only the child and the file is
// named; a truncated archive is a clean error; nothing is left behind.
#include "worker/model/checkpoint_v1.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <gtest/gtest.h>
#include <torch/serialize/output-archive.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/files.h"
#include "common/subprocess.h"
#include "model_test_util.h"
#include "tests/test_paths.h"
#include "worker/model/checkpoint.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/corpus.h"
#include "worker/model/engine.h"
#include "worker/model/routes.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;
using testing::SmallSpec;

// A corrupt v1 stage file on which LibTorch's archive reader (the
// TorchScript unpickler) segfaulted under the stage_loader fuzzer
// (docs/DEVELOPMENT.md). Through the converter's reader (InputArchive, which
// parses the archive's code first) Debian's LibTorch refuses it cleanly in a
// gcc build; whether it crashes depends on the build.
constexpr char kCrashingArchive[] =
    "tests/fuzz/corpus/stage_loader/libtorch_archive_unpickler_segv_1.bin";

std::string Tool() {
  return ::detour::testing::BuildDir() + "/tools/detour_checkpoint/detour-checkpoint";
}

class CheckpointV1Test : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    root_ = fs::path(::testing::TempDir()) /
            ("detour_checkpoint_v1_test." + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    old_ = (root_ / "v1").string();
    new_ = (root_ / "v2").string();
    tokens_ = SplitText(GenerateCorpus(3, 20000), 0.0)->train;
    spec_ = SmallSpec();
    spec_.mutable_optimizer()->mutable_adamw()->set_lr(1e-2);
    spec_.mutable_pipeline()->set_skip_ratio(0.25);
  }
  void TearDown() override { fs::remove_all(root_); }

  void Train(PipelineEngine& engine, uint64_t from, uint64_t to) {
    for (uint64_t it = from; it < to; ++it) {
      auto routes = GenerateRoutes(engine.spec().pipeline(), 4, 1, it);
      auto mbs = IterationMicrobatches(engine.spec(), tokens_, it, at::Device(at::kCPU));
      ASSERT_TRUE(routes.ok() && mbs.ok());
      ASSERT_TRUE(engine.RunIteration(it, *routes, *mbs).ok());
    }
  }

  // Parameters and optimiser state of every stage, by global name.
  static std::map<std::string, at::Tensor> State(PipelineEngine& engine) {
    std::map<std::string, at::Tensor> out;
    for (int s = 0; s < engine.num_stages(); ++s) {
      for (const auto& [n, p] : engine.stage(s).Parameters()) out[n] = p.detach().clone();
      for (const auto& [n, t] : engine.optimizer(s).State()) out[n] = t.detach().clone();
    }
    return out;
  }

  // `engine` saved as a detour-checkpoint-v1 writer saved it: per stage a
  // LibTorch archive with the dict "tensors", then the manifest.
  void WriteV1(PipelineEngine& engine, uint64_t iteration) {
    CheckpointManifest m;
    m.format = "detour-checkpoint-v1";
    m.iteration = iteration;
    m.model = engine.stage(0).config();
    m.num_stages = engine.num_stages();
    m.seed = engine.spec().seed();
    m.rng_state = absl::StrCat("route-counter=", iteration);
    for (int s = 0; s < engine.num_stages(); ++s) {
      c10::Dict<std::string, at::Tensor> table;
      for (const auto& [n, p] : engine.stage(s).Parameters()) table.insert(n, p.detach().clone());
      for (const auto& [n, t] : engine.optimizer(s).State()) table.insert(n, t.detach().clone());
      torch::serialize::OutputArchive archive;
      archive.write("tensors", c10::IValue(table));
      std::ostringstream out;
      archive.save_to(out);
      StageFileEntry e;
      e.stage = s;
      e.file = absl::StrCat("stage-", s, ".pt");
      e.layers = engine.stage(s).layers();
      PutV1File(&e, out.str());
      m.stages.push_back(e);
    }
    v1_ = m;
    ASSERT_TRUE(WriteManifest(old_, m).ok());
  }

  // Replaces a v1 stage file and updates its manifest entry to match, so the
  // damage gets past the checksum to LibTorch's reader.
  void PutV1File(StageFileEntry* e, const std::string& bytes) {
    ASSERT_TRUE(WriteFileAtomically((fs::path(old_) / e->file).string(), bytes).ok());
    e->bytes = bytes.size();
    e->checksum = Checksum(bytes);
  }

  // Runs detour-checkpoint; returns its exit status, output in `output`.
  int Run(const std::vector<std::string>& args, std::string* output) {
    std::vector<std::string> argv = {Tool()};
    argv.insert(argv.end(), args.begin(), args.end());
    ChildProcess p;
    const std::string log = (root_ / absl::StrCat("run", ++runs_, ".log")).string();
    EXPECT_TRUE(p.Start(argv, log).ok());
    const std::optional<int> code = p.Wait(absl::Seconds(120));
    *output = p.Log();
    return code.value_or(-1);
  }

  bool NothingLeftBehind() const {
    if (fs::exists(new_)) return false;
    for (const auto& entry : fs::directory_iterator(root_)) {
      if (absl::StartsWith(entry.path().filename().string(), "v2")) return false;
    }
    return true;
  }

  fs::path root_;
  std::string old_, new_;
  CheckpointManifest v1_;
  TokenSequence tokens_;
  v1::JobSpec spec_;
  int runs_ = 0;
};

TEST_F(CheckpointV1Test, ConvertedCheckpointLoadsAndTrainsOnBitForBit) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  Train(**a, 0, 3);
  WriteV1(**a, 3);
  const auto saved = State(**a);
  // v2 refuses the v1 checkpoint and says how to convert it.
  auto refused = ReadManifest(old_);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "detour-checkpoint convert"));

  std::string out;
  ASSERT_EQ(Run({"convert", old_, new_}, &out), 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "stage-3.pt → stage-3.bin")) << out;
  ASSERT_EQ(Run({"verify", new_}, &out), 0) << out;
  EXPECT_TRUE(absl::StrContains(out, "detour-checkpoint-v2, iteration 3, 4 stages")) << out;

  auto m = ReadManifest(new_);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->iteration, 3u);
  EXPECT_EQ(m->rng_state, "route-counter=3");
  ASSERT_EQ(m->stages.size(), 4u);
  // Into a fresh engine with another seed's weights and another split: every
  // parameter and moment is the saved one.
  v1::JobSpec two = spec_;
  two.mutable_pipeline()->set_num_stages(2);
  two.mutable_pipeline()->set_skip_ratio(0);
  auto b = PipelineEngine::Create(two, at::Device(at::kCPU));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(LoadCheckpoint(new_, **b).ok());
  const auto loaded = State(**b);
  EXPECT_EQ(loaded.size(), saved.size());
  for (const auto& [name, t] : loaded) {
    ASSERT_TRUE(saved.count(name)) << name;
    EXPECT_TRUE(at::equal(saved.at(name), t)) << name;
  }
  // Same split: training on from the converted checkpoint equals training
  // on from the state it was saved from.
  auto c = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(c.ok());
  Train(**c, 5, 6);  // diverge first: the load must overwrite everything
  ASSERT_TRUE(LoadCheckpoint(new_, **c).ok());
  for (const auto& [name, t] : State(**c)) EXPECT_TRUE(at::equal(saved.at(name), t)) << name;
  Train(**a, 3, 5);
  Train(**c, 3, 5);
  const auto want = State(**a);
  for (const auto& [name, t] : State(**c)) EXPECT_TRUE(at::equal(want.at(name), t)) << name;

  // OLD is untouched; converting again into an existing NEW is refused.
  for (const StageFileEntry& e : v1_.stages) EXPECT_TRUE(ReadStageFileBytes(old_, e).ok());
  EXPECT_EQ(Run({"convert", old_, new_}, &out), 1) << out;
  EXPECT_TRUE(absl::StrContains(out, "exists")) << out;
}

TEST_F(CheckpointV1Test, TheFuzzersCrashingArchiveIsNamedAndNothingIsLeft) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  WriteV1(**a, 0);
  auto crashing = ReadFileToString(::detour::testing::SourceDir() + "/" + kCrashingArchive);
  ASSERT_TRUE(crashing.ok()) << crashing.status();
  PutV1File(&v1_.stages[2], *crashing);
  ASSERT_TRUE(WriteManifest(old_, v1_).ok());

  // In a sanitized build a crash of the child is reported by ASan; its report
  // goes to this test's directory (checked below), not to the run's log
  // directory that tools/checks.sh fails on. (log_path is a flag common to
  // the sanitizers: UBSAN_OPTIONS, read after ASAN_OPTIONS, would win.)
  const std::string reports = (root_ / "reader-crash").string();
  std::map<std::string, std::string> saved;
  for (const char* var : {"ASAN_OPTIONS", "UBSAN_OPTIONS"}) {
    const char* options = std::getenv(var);
    if (options == nullptr) continue;
    saved[var] = options;
    ::setenv(var, absl::StrCat(options, ":log_path=", reports).c_str(), 1);
  }
  std::string out;
  const int code = Run({"convert", old_, new_}, &out);
  for (const auto& [var, options] : saved) ::setenv(var.c_str(), options.c_str(), 1);
  // Either fate names the file and leaves nothing: LibTorch's reader crashes
  // in the child, or it refuses the bytes with an exception.
  const std::string file = (fs::path(old_) / "stage-2.pt").string();
  EXPECT_EQ(code, 1) << out;
  const bool crashed =
      absl::StrContains(out, file + ": LibTorch's archive reader crashed on this file");
  if (crashed) {
    EXPECT_TRUE(absl::StrContains(out, "the file is corrupt")) << out;
  } else {
    EXPECT_TRUE(absl::StrContains(out, "reading the LibTorch archive " + file)) << out;
  }
  EXPECT_TRUE(NothingLeftBehind());
  // Whatever a sanitizer reported is the reader's crash inside LibTorch, not
  // a finding in our code (the parent's own exit included).
  for (const auto& entry : fs::directory_iterator(root_)) {
    if (!absl::StartsWith(entry.path().filename().string(), "reader-crash")) continue;
    EXPECT_TRUE(crashed) << "a sanitizer report without a crash: " << entry.path();
    auto report = ReadFileToString(entry.path().string());
    ASSERT_TRUE(report.ok());
    const size_t frame0 = report->find("#0 ");
    ASSERT_NE(frame0, std::string::npos) << *report;
    const std::string line = report->substr(frame0, report->find('\n', frame0) - frame0);
    EXPECT_TRUE(absl::StrContains(*report, "SEGV")) << *report;
    EXPECT_TRUE(absl::StrContains(line, "libtorch") || absl::StrContains(line, "libc10"))
        << *report;
  }
}

// A reader child that dies by a signal, made deterministic: the child's
// write of the converted stage-0 file (0.3 MiB) passes RLIMIT_FSIZE and the
// kernel kills it with SIGXFSZ. The parent names the file and the signal,
// does not call the file corrupt (the signal came from a limit, not from a
// fault in the reader) and leaves nothing behind.
TEST_F(CheckpointV1Test, AReaderKilledByASignalIsNamedAndNothingIsLeft) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  WriteV1(**a, 0);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit small = saved;
  small.rlim_cur = 64 << 10;  // the logs fit, a converted stage file does not
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string out;
  const int code = Run({"convert", old_, new_}, &out);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(absl::StrContains(out, (fs::path(old_) / "stage-0.pt").string() +
                                         ": LibTorch's archive reader was stopped by signal " +
                                         std::to_string(SIGXFSZ)))
      << out;
  EXPECT_TRUE(absl::StrContains(out, "the file was not judged")) << out;
  EXPECT_FALSE(absl::StrContains(out, "corrupt")) << out;
  EXPECT_TRUE(NothingLeftBehind());
}

TEST_F(CheckpointV1Test, ATruncatedArchiveIsACleanErrorAndAChangedFileIsCaught) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  WriteV1(**a, 0);
  auto bytes = ReadFileToString((fs::path(old_) / "stage-1.pt").string());
  ASSERT_TRUE(bytes.ok());
  PutV1File(&v1_.stages[1], bytes->substr(0, bytes->size() / 2));
  ASSERT_TRUE(WriteManifest(old_, v1_).ok());
  std::string out;
  EXPECT_EQ(Run({"convert", old_, new_}, &out), 1) << out;
  EXPECT_TRUE(absl::StrContains(
      out, "reading the LibTorch archive " + (fs::path(old_) / "stage-1.pt").string()))
      << out;
  EXPECT_FALSE(absl::StrContains(out, "crashed")) << out;
  EXPECT_TRUE(NothingLeftBehind());

  // A file changed after its manifest entry was written: caught by the
  // checksum, before LibTorch reads it.
  std::string changed = *bytes;
  changed[changed.size() / 3] ^= 0x40;
  ASSERT_TRUE(WriteFileAtomically((fs::path(old_) / "stage-1.pt").string(), changed).ok());
  v1_.stages[1].bytes = bytes->size();
  v1_.stages[1].checksum = Checksum(*bytes);
  ASSERT_TRUE(WriteManifest(old_, v1_).ok());
  EXPECT_EQ(Run({"convert", old_, new_}, &out), 1) << out;
  EXPECT_TRUE(absl::StrContains(out, "stage-1.pt is corrupt")) << out;
  EXPECT_TRUE(NothingLeftBehind());

  // Usage errors.
  EXPECT_EQ(Run({"convert", old_}, &out), 2) << out;
  EXPECT_EQ(Run({"frobnicate"}, &out), 2) << out;
  EXPECT_EQ(Run({"verify", old_}, &out), 1) << out;  // v1: refused by the v2 reader
  EXPECT_TRUE(absl::StrContains(out, "detour-checkpoint convert")) << out;
}

}  // namespace
}  // namespace detour::model
