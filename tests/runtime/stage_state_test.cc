// A stage's state outside the iteration (worker/runtime/stage_state.h): the
// state a donor packs is the state the joiner loads, the checksum replicas
// compare sees every byte, a step moves the parameters, and the checkpoint
// records carry what the stage file and the commit say.
#include "worker/runtime/stage_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "tests/model/model_test_util.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

struct Replica {
  std::unique_ptr<model::Stage> stage;
  std::unique_ptr<model::AdamW> optimizer;
};

Replica MakeReplica(const v1::JobSpec& spec, int stage_index) {
  Replica r;
  auto stage = model::Stage::FromJobSpec(spec, stage_index, c10::Device(c10::kCPU));
  EXPECT_TRUE(stage.ok()) << stage.status();
  r.stage = *std::move(stage);
  r.optimizer = std::make_unique<model::AdamW>(r.stage->Parameters(), spec.optimizer().adamw());
  return r;
}

// One forward and backward of a middle stage, then a step.
void TrainOnce(const v1::JobSpec& spec, Replica& r, uint64_t iteration) {
  const auto& m = spec.model();
  at::Tensor x =
      at::randn({spec.pipeline().samples_per_microbatch(), m.context_length(), m.d_model()});
  ASSERT_TRUE(r.stage->Forward(0, x).ok());
  ASSERT_TRUE(r.stage->Backward(0, at::ones_like(x)).ok());
  auto ready = StepStage(spec, iteration, 1.0, r.stage.get(), r.optimizer.get(), nullptr);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(ready->empty()) << "no K-FAC";
}

TEST(StageStateTest, WhatTheDonorPacksTheJoinerLoads) {
  const v1::JobSpec spec = model::testing::SmallSpec();
  Replica donor = MakeReplica(spec, 1);
  Replica joiner = MakeReplica(spec, 1);
  const uint64_t fresh = ParameterChecksum(joiner.stage->Parameters());
  EXPECT_EQ(ParameterChecksum(donor.stage->Parameters()), fresh) << "same seed, same start";
  TrainOnce(spec, donor, 0);
  const uint64_t trained = ParameterChecksum(donor.stage->Parameters());
  EXPECT_NE(trained, fresh) << "a step changes the parameters and the checksum sees it";

  auto frame = PackStageState(*donor.stage, *donor.optimizer, nullptr, "job-1", 1, "donor", 3);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->header.direction(), v1::DIRECTION_STATE);
  EXPECT_EQ(frame->header.dtype(), v1::DTYPE_BYTES);
  EXPECT_EQ(frame->header.epoch(), 3u);
  EXPECT_EQ(frame->header.sender(), "donor");
  ASSERT_EQ(frame->header.shape_size(), 1);
  EXPECT_EQ(static_cast<uint64_t>(frame->header.shape(0)), frame->bytes);
  ASSERT_TRUE(UnpackStageState("donor", frame->view.data, frame->view.bytes, joiner.stage.get(),
                               joiner.optimizer.get(), nullptr)
                  .ok());
  EXPECT_EQ(ParameterChecksum(joiner.stage->Parameters()), trained);
  // The optimiser's moments came along: the same step on both keeps them
  // equal, while the same parameters with a fresh AdamW step elsewhere.
  Replica fresh_moments = MakeReplica(spec, 1);
  ASSERT_TRUE(UnpackStageState("donor", frame->view.data, frame->view.bytes,
                               fresh_moments.stage.get(), fresh_moments.optimizer.get(), nullptr)
                  .ok());
  fresh_moments.optimizer =
      std::make_unique<model::AdamW>(fresh_moments.stage->Parameters(), spec.optimizer().adamw());
  for (Replica* r : {&donor, &joiner, &fresh_moments}) {
    at::manual_seed(5);
    TrainOnce(spec, *r, 1);
  }
  EXPECT_EQ(ParameterChecksum(joiner.stage->Parameters()),
            ParameterChecksum(donor.stage->Parameters()));
  EXPECT_NE(ParameterChecksum(fresh_moments.stage->Parameters()),
            ParameterChecksum(donor.stage->Parameters()));
}

TEST(StageStateTest, BytesThatAreNotAStateAreRefusedNamingTheSender) {
  const v1::JobSpec spec = model::testing::SmallSpec();
  Replica joiner = MakeReplica(spec, 1);
  const std::string junk = "not a stage file";
  absl::Status s = UnpackStageState("mallory", junk.data(), junk.size(), joiner.stage.get(),
                                    joiner.optimizer.get(), nullptr);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("the stage state from mallory"));
  // Another stage's state does not fit this one.
  Replica other = MakeReplica(spec, 0);
  auto frame = PackStageState(*other.stage, *other.optimizer, nullptr, "job-1", 0, "w0", 0);
  ASSERT_TRUE(frame.ok());
  EXPECT_FALSE(UnpackStageState("w0", frame->view.data, frame->view.bytes, joiner.stage.get(),
                                joiner.optimizer.get(), nullptr)
                   .ok());
}

TEST(StageStateTest, TheChecksumSeesOneChangedValue) {
  const v1::JobSpec spec = model::testing::SmallSpec();
  Replica r = MakeReplica(spec, 2);
  const uint64_t before = ParameterChecksum(r.stage->Parameters());
  {
    c10::NoGradGuard no_grad;
    std::vector<model::NamedTensor> params = r.stage->Parameters();
    params.back().second.view({-1})[0].add_(1e-6);
  }
  EXPECT_NE(ParameterChecksum(r.stage->Parameters()), before);
}

TEST(StageStateTest, CheckpointRecordsCarryTheFileAndTheCommit) {
  model::StageFileEntry e;
  e.stage = 2;
  e.file = "stage-2.bin";
  e.layers = {2, 3};
  e.bytes = 1234;
  e.checksum = "fnv1a64:0123456789abcdef";
  const v1::CheckpointFile f = CheckpointFileOf(e);
  EXPECT_EQ(f.stage(), 2u);
  EXPECT_EQ(f.file(), "stage-2.bin");
  EXPECT_EQ(f.layer_begin(), 2u);
  EXPECT_EQ(f.layer_end(), 3u);
  EXPECT_EQ(f.bytes(), 1234u);
  EXPECT_EQ(f.checksum(), e.checksum);
  v1::CommitCheckpoint commit;
  commit.set_iteration(8);
  *commit.add_files() = f;
  const v1::JobSpec spec = model::testing::SmallSpec(11);
  auto config = model::ModelConfigFromShape(spec.model());
  ASSERT_TRUE(config.ok());
  const model::CheckpointManifest m = ManifestOf(commit, *config, spec);
  EXPECT_EQ(m.iteration, 8u);
  EXPECT_EQ(m.num_stages, 4);
  EXPECT_EQ(m.seed, 11u);
  ASSERT_EQ(m.stages.size(), 1u);
  EXPECT_EQ(m.stages[0].file, "stage-2.bin");
  EXPECT_EQ(m.stages[0].layers, (model::LayerRange{2, 3}));
  EXPECT_EQ(m.model.d_model, 32);
}

}  // namespace
}  // namespace detour
