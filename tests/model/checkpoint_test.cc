#include "worker/model/checkpoint.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include "absl/strings/str_replace.h"

#include "model_test_util.h"
#include "worker/model/corpus.h"
#include "worker/model/engine.h"
#include "worker/model/routes.h"
#include "worker/model/stage_file.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;
using testing::SmallSpec;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    // One directory per process: ctest runs tests of this binary in parallel.
    root_ =
        fs::path(::testing::TempDir()) / ("detour_checkpoint_test." + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
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

  std::map<std::string, at::Tensor> Snapshot(PipelineEngine& engine) {
    std::map<std::string, at::Tensor> out;
    for (int s = 0; s < engine.num_stages(); ++s) {
      for (const auto& [n, p] : engine.stage(s).Parameters()) out[n] = p.detach().clone();
    }
    return out;
  }

  fs::path root_;
  TokenSequence tokens_;
  v1::JobSpec spec_;
};

TEST_F(CheckpointTest, RoundTripReproducesTheNextStepBitForBit) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  Train(**a, 0, 3);
  const std::string dir = (root_ / "ckpt-3").string();
  ASSERT_TRUE(SaveCheckpoint(dir, **a, 3, "route-counter=3").ok());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "manifest.json"));
  Train(**a, 3, 5);
  auto expected = Snapshot(**a);

  // A replica-count change and a diverged state: the load must overwrite
  // every parameter and moment. (The seed stays: it also orders the data.)
  v1::JobSpec other = spec_;
  other.mutable_pipeline()->set_replicas_per_stage(3);
  auto b = PipelineEngine::Create(other, at::Device(at::kCPU));
  ASSERT_TRUE(b.ok());
  Train(**b, 7, 9);
  auto manifest = LoadCheckpoint(dir, **b);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->iteration, 3u);
  EXPECT_EQ(manifest->rng_state, "route-counter=3");
  EXPECT_EQ(manifest->stages.size(), 4u);
  Train(**b, 3, 5);
  auto got = Snapshot(**b);
  ASSERT_EQ(got.size(), expected.size());
  for (const auto& [name, t] : expected) {
    EXPECT_TRUE(at::equal(got[name], t)) << name;
  }
}

TEST_F(CheckpointTest, LoadsIntoADifferentStageSplit) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  Train(**a, 0, 2);
  const std::string dir = (root_ / "ckpt").string();
  ASSERT_TRUE(SaveCheckpoint(dir, **a, 2, "").ok());
  v1::JobSpec two = spec_;
  two.mutable_pipeline()->set_num_stages(2);
  two.mutable_pipeline()->set_skip_ratio(0);
  auto b = PipelineEngine::Create(two, at::Device(at::kCPU));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(LoadCheckpoint(dir, **b).ok());
  auto want = Snapshot(**a);
  for (const auto& [name, t] : Snapshot(**b)) {
    EXPECT_TRUE(at::equal(want[name], t)) << name;
  }
}

TEST_F(CheckpointTest, CorruptOrMismatchedIsRefusedAndNothingChanges) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  Train(**a, 0, 1);
  const std::string dir = (root_ / "ckpt").string();
  ASSERT_TRUE(SaveCheckpoint(dir, **a, 1, "").ok());

  // Saving over an existing checkpoint is refused; the old one stays valid.
  EXPECT_EQ(SaveCheckpoint(dir, **a, 1, "").code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(ReadManifest(dir).ok());

  auto b = PipelineEngine::Create(SmallSpec(5), at::Device(at::kCPU));
  ASSERT_TRUE(b.ok());
  const auto before = Snapshot(**b);
  auto unchanged = [&] {
    for (const auto& [name, t] : Snapshot(**b)) {
      if (!at::equal(before.at(name), t)) return false;
    }
    return true;
  };

  // One flipped byte in stage 2's file (after stages 0 and 1 would load).
  const fs::path file = fs::path(dir) / "stage-2.bin";
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::string corrupt = bytes;
  corrupt[corrupt.size() / 2] ^= 0x40;
  std::ofstream(file, std::ios::binary | std::ios::trunc) << corrupt;
  auto s = LoadCheckpoint(dir, **b);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
  EXPECT_NE(s.status().message().find("stage-2.bin"), std::string::npos);
  EXPECT_TRUE(unchanged());

  // Truncated file.
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes.substr(0, 100);
  EXPECT_EQ(LoadCheckpoint(dir, **b).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(unchanged());
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  EXPECT_TRUE(LoadCheckpoint(dir, **b).ok());

  // Another model shape.
  v1::JobSpec wide = SmallSpec();
  wide.mutable_model()->set_d_model(48);
  wide.mutable_model()->set_num_heads(6);
  wide.mutable_model()->set_num_kv_heads(3);
  auto c = PipelineEngine::Create(wide, at::Device(at::kCPU));
  ASSERT_TRUE(c.ok());
  auto shape = LoadCheckpoint(dir, **c);
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(shape.status().message().find("d_model=32"), std::string::npos);

  // Broken manifest.
  std::ofstream(fs::path(dir) / "manifest.json", std::ios::trunc) << "{\"format\": 3";
  EXPECT_EQ(LoadCheckpoint(dir, **c).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(LoadCheckpoint((root_ / "missing").string(), **c).status().code(),
            absl::StatusCode::kNotFound);
}

// Regression (found by fuzzing): a stage file that passes the
// manifest's size and checksum (rewritten with it, as a faulty writer or a
// hand edit would) but is truncated or corrupt inside reached LibTorch's
// archive importer, which segfaulted in its TorchScript unpickler. Stage
// files are now our own bounded container: every such file is DATA_LOSS
// naming the file, and nothing changes.
TEST_F(CheckpointTest, CorruptStageFileBehindAMatchingManifestIsAnError) {
  auto a = PipelineEngine::Create(spec_, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  const std::string dir = (root_ / "ckpt").string();
  ASSERT_TRUE(SaveCheckpoint(dir, **a, 1, "").ok());
  auto manifest = ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  const fs::path file = fs::path(dir) / manifest->stages[1].file;
  std::string bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_GT(bytes.size(), 1000u);
  auto b = PipelineEngine::Create(SmallSpec(5), at::Device(at::kCPU));
  ASSERT_TRUE(b.ok());
  const auto before = Snapshot(**b);
  std::vector<std::string> variants = {bytes.substr(0, bytes.size() / 2),
                                       bytes.substr(0, bytes.size() - 1), bytes.substr(0, 12),
                                       bytes + "x", ""};
  for (size_t at : {size_t{8}, size_t{12}, size_t{16}, size_t{40}}) {
    std::string flipped = bytes;
    for (size_t i = at; i < at + 8; ++i) flipped[i] = '\xff';
    variants.push_back(flipped);
  }
  for (size_t v = 0; v < variants.size(); ++v) {
    SCOPED_TRACE(v);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << variants[v];
    CheckpointManifest m = *manifest;
    m.stages[1].bytes = variants[v].size();
    m.stages[1].checksum = Checksum(variants[v]);
    ASSERT_TRUE(WriteManifest(dir, m).ok());
    auto s = LoadCheckpoint(dir, **b);
    ASSERT_FALSE(s.ok());
    if (v < 5) {  // truncated or extended: the container says so
      EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
      EXPECT_NE(s.status().message().find(manifest->stages[1].file), std::string::npos)
          << s.status();
    }  // flipped bytes may also leave a well-formed file naming other tensors
  }
  // Well-formed, but a negative optimiser step count.
  {
    auto records = DecodeStageFile(bytes, "stage");
    ASSERT_TRUE(records.ok()) << records.status();
    std::string negative;
    const int64_t minus_five = -5;
    negative.assign(reinterpret_cast<const char*>(&minus_five), sizeof(minus_five));
    bool found = false;
    for (auto& r : *records) {
      if (r.name.size() > 10 && r.name.substr(r.name.size() - 10) == ".adam_step") {
        ASSERT_EQ(r.data.size(), 8u);
        r.data = negative;
        found = true;
        break;
      }
    }
    ASSERT_TRUE(found);
    const std::string edited = EncodeStageFile(*records);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << edited;
    CheckpointManifest m = *manifest;
    m.stages[1].bytes = edited.size();
    m.stages[1].checksum = Checksum(edited);
    ASSERT_TRUE(WriteManifest(dir, m).ok());
    auto s = LoadCheckpoint(dir, **b);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("is not a step count"), std::string::npos) << s.status();
  }
  for (const auto& [name, t] : Snapshot(**b)) EXPECT_TRUE(at::equal(before.at(name), t)) << name;
  // A v1 checkpoint (LibTorch archives) is refused by name, not read.
  std::ofstream(fs::path(dir) / "manifest.json", std::ios::trunc) << absl::StrReplaceAll(
      ManifestJson(*manifest), {{"detour-checkpoint-v2", "detour-checkpoint-v1"}});
  auto old = LoadCheckpoint(dir, **b);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(old.status().message().find("detour-checkpoint-v1"), std::string::npos);
}

}  // namespace
}  // namespace detour::model
