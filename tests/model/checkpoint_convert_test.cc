// The v1 → v2 converter's orchestration (no LibTorch): a fake stage
// converter stands in for the child process detour-checkpoint runs, so every
// failure path is exercised — a damaged v1 file is named before any reader
// runs, a failing or lying converter leaves nothing behind, the result is a
// valid v2 checkpoint with the v1 manifest's fields. The real reader and
// tool: checkpoint_v1_test.cc.
#include "worker/model/checkpoint_convert.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/stage_file.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

class CheckpointConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ("detour_checkpoint_convert_test." + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    old_ = (root_ / "old").string();
    new_ = (root_ / "new").string();
    // A v1 checkpoint of a 4-layer model in two stages; the "archives" are
    // opaque bytes here (multiples of 4: the fake turns them into float32s).
    v1_.format = "detour-checkpoint-v1";
    v1_.iteration = 40;
    v1_.model.num_layers = 4;
    v1_.model.d_model = 64;
    v1_.model.num_heads = 4;
    v1_.model.num_kv_heads = 2;
    v1_.model.ffn_dim = 192;
    v1_.model.vocab_size = 256;
    v1_.model.context_length = 32;
    v1_.num_stages = 2;
    v1_.replicas_per_stage = 2;
    v1_.seed = 99;
    v1_.rng_state = "routes=40";
    AddV1File(0, {0, 2}, std::string(64, 'a'));
    AddV1File(1, {2, 4}, std::string(32, 'b'));
    ASSERT_TRUE(WriteManifest(old_, v1_).ok());
  }
  void TearDown() override { fs::remove_all(root_); }

  void AddV1File(int stage, LayerRange layers, const std::string& bytes) {
    StageFileEntry e{stage, absl::StrCat("stage-", stage, ".pt"), layers, bytes.size(),
                     Checksum(bytes)};
    ASSERT_TRUE(WriteFileAtomically((fs::path(old_) / e.file).string(), bytes).ok());
    v1_.stages.push_back(e);
  }

  // What the child does, without LibTorch: the v1 bytes as one float32
  // tensor named after the file.
  V1ConvertOptions Fake() {
    V1ConvertOptions o;
    o.convert_stage = [this](const std::string& v1_path, const StageFileEntry& entry,
                             const std::string& out_path) -> absl::Status {
      ++calls_;
      auto bytes = ReadFileToString(v1_path);
      if (!bytes.ok()) return bytes.status();
      StageTensorRecord r;
      r.name = absl::StrCat("blob.", entry.stage);
      r.shape = {static_cast<int64_t>(bytes->size() / 4)};
      r.data = *bytes;
      return WriteFileAtomically(out_path, EncodeStageFile({r}));
    };
    return o;
  }

  // Nothing beside NEW: no NEW.tmp.* directory after a failure.
  bool NothingLeftBehind() const {
    if (fs::exists(new_)) return false;
    for (const auto& entry : fs::directory_iterator(root_)) {
      if (absl::StartsWith(entry.path().filename().string(), "new")) return false;
    }
    return true;
  }

  fs::path root_;
  std::string old_, new_;
  CheckpointManifest v1_;
  int calls_ = 0;
};

TEST_F(CheckpointConvertTest, WritesAV2CheckpointWithTheV1Fields) {
  std::vector<std::string> progress;
  V1ConvertOptions options = Fake();
  options.progress = [&](absl::string_view line) { progress.emplace_back(line); };
  auto m = ConvertV1Checkpoint(old_, new_ + "/", options);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(calls_, 2);
  EXPECT_EQ(progress.size(), 2u);
  auto back = VerifyCheckpoint(new_);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->format, "detour-checkpoint-v2");
  EXPECT_EQ(back->iteration, 40u);
  EXPECT_EQ(back->seed, 99u);
  EXPECT_EQ(back->rng_state, "routes=40");
  EXPECT_EQ(back->replicas_per_stage, 2);
  EXPECT_EQ(back->model.DebugString(), v1_.model.DebugString());
  ASSERT_EQ(back->stages.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    const StageFileEntry& e = back->stages[s];
    EXPECT_EQ(e.stage, s);
    EXPECT_EQ(e.file, absl::StrCat("stage-", s, ".bin"));
    EXPECT_TRUE(e.layers == v1_.stages[s].layers);
    auto bytes = ReadStageFileBytes(new_, e);
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    auto records = DecodeStageFile(*bytes, e.file);
    ASSERT_TRUE(records.ok()) << records.status();
    ASSERT_EQ(records->size(), 1u);
    EXPECT_EQ((*records)[0].name, absl::StrCat("blob.", s));
    EXPECT_EQ((*records)[0].data, std::string(s == 0 ? 64 : 32, s == 0 ? 'a' : 'b'));
  }
  // OLD is still the v1 checkpoint it was; nothing else was created.
  EXPECT_TRUE(ReadV1Manifest(old_).ok());
  for (const StageFileEntry& e : v1_.stages) EXPECT_TRUE(ReadStageFileBytes(old_, e).ok());
  int entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(root_)) ++entries;
  EXPECT_EQ(entries, 2);
}

TEST_F(CheckpointConvertTest, ADamagedV1FileIsNamedBeforeAnyReaderRuns) {
  // A byte flipped in stage 1's file; the manifest still has the old checksum.
  std::string bytes(32, 'b');
  bytes[7] = 'x';
  ASSERT_TRUE(WriteFileAtomically((fs::path(old_) / "stage-1.pt").string(), bytes).ok());
  auto m = ConvertV1Checkpoint(old_, new_, Fake());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "stage-1.pt")) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "fnv1a64")) << m.status();
  EXPECT_EQ(calls_, 0);
  EXPECT_TRUE(NothingLeftBehind());
  // A missing one: NOT_FOUND.
  fs::remove(fs::path(old_) / "stage-0.pt");
  m = ConvertV1Checkpoint(old_, new_, Fake());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound) << m.status();
  EXPECT_TRUE(NothingLeftBehind());
}

TEST_F(CheckpointConvertTest, AFailingReaderLeavesNothingAndNamesTheFile) {
  V1ConvertOptions options = Fake();
  auto fake = options.convert_stage;
  options.convert_stage = [&](const std::string& v1_path, const StageFileEntry& entry,
                              const std::string& out_path) -> absl::Status {
    if (entry.stage == 1) return absl::DataLossError("the reader crashed (signal 11)");
    return fake(v1_path, entry, out_path);
  };
  auto m = ConvertV1Checkpoint(old_, new_, options);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(absl::StrContains(m.status().message(), (fs::path(old_) / "stage-1.pt").string() +
                                                          ": the reader crashed (signal 11)"))
      << m.status();
  EXPECT_TRUE(NothingLeftBehind());
}

TEST_F(CheckpointConvertTest, AConverterThatWritesGarbageIsCaught) {
  V1ConvertOptions options;
  options.convert_stage = [](const std::string&, const StageFileEntry&,
                             const std::string& out_path) {
    return WriteFileAtomically(out_path, "DTRSTG01\x05\x00\x00\x00 truncated");
  };
  auto m = ConvertV1Checkpoint(old_, new_, options);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "stage-0.pt")) << m.status();
  EXPECT_TRUE(NothingLeftBehind());
  // One that writes nothing at all.
  options.convert_stage = [](const std::string&, const StageFileEntry&, const std::string&) {
    return absl::OkStatus();
  };
  m = ConvertV1Checkpoint(old_, new_, options);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(NothingLeftBehind());
}

TEST_F(CheckpointConvertTest, RefusesAnExistingTargetAV2SourceAndDuplicateStages) {
  fs::create_directories(new_);
  auto m = ConvertV1Checkpoint(old_, new_, Fake());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kAlreadyExists) << m.status();
  EXPECT_TRUE(fs::is_empty(new_));
  fs::remove(new_);

  ASSERT_TRUE(ConvertV1Checkpoint(old_, new_, Fake()).ok());
  // A v2 checkpoint needs no conversion; v2's own reader refuses v1.
  m = ConvertV1Checkpoint(new_, (root_ / "again").string(), Fake());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "already a detour-checkpoint-v2"));
  auto v2_reader = ReadManifest(old_);
  EXPECT_EQ(v2_reader.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(v2_reader.status().message(), "detour-checkpoint convert"));
  fs::remove_all(new_);

  // Two entries for one stage: refused, not silently merged.
  CheckpointManifest dup = v1_;
  dup.stages[1].stage = 0;
  ASSERT_TRUE(WriteManifest(old_, dup).ok());
  calls_ = 0;
  m = ConvertV1Checkpoint(old_, new_, Fake());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "two entries for stage 0"));
  EXPECT_EQ(calls_, 0);
  EXPECT_TRUE(NothingLeftBehind());
}

}  // namespace
}  // namespace detour::model
