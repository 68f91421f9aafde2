// End-to-end Hugging Face interop: a model trained in process (30 steps,
// loss ~3.5 against a fresh model's ~5.5) is exported with detour-export
// (the real binary), and a distributed job (real coordinator and workers)
// starts from it with checkpoint.init_from. Its losses must be those of the
// in-process engine started from the same import (not from its own seed);
// an imported job resumes from its own checkpoint; a checkpoint of another
// shape fails the job naming the mismatching field; the command line's
// errors and exit codes.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"
#include "worker/model/checkpoint.h"
#include "worker/model/engine.h"
#include "worker/model/hf_import.h"
#include "worker/model/text_data.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using HfInteropTest = E2eTest;

inline const std::string kExport = "tools/detour_export/detour-export";

// The losses of `iterations` steps of `engine` (from iteration 0) with
// full routes.
std::vector<double> Train(model::PipelineEngine& engine, const v1::JobSpec& spec,
                          uint64_t iterations) {
  auto data = model::LoadDataset(spec.data());
  EXPECT_TRUE(data.ok());
  const int mbs = static_cast<int>(spec.pipeline().microbatches_per_data_node());
  std::vector<v1::Route> routes(mbs);
  for (int mb = 0; mb < mbs; ++mb) {
    routes[mb].set_microbatch(mb);
    for (int s = 0; s < engine.num_stages(); ++s) routes[mb].add_stages(s);
  }
  std::vector<double> losses;
  for (uint64_t it = 0; it < iterations; ++it) {
    auto batch = model::IterationMicrobatches(spec, data->train, it, c10::Device(c10::kCPU));
    EXPECT_TRUE(batch.ok());
    auto stats = engine.RunIteration(it, routes, *batch);
    EXPECT_TRUE(stats.ok()) << stats.status();
    losses.push_back(stats.ok() ? stats->loss : 0);
  }
  return losses;
}

// Saves a checkpoint of a `spec` model (seed `seed`), trained for `trained`
// iterations at a high learning rate so its loss is far from a fresh
// model's, and exports it with the detour-export binary; returns the HF
// directory.
std::string ExportModel(const std::string& dir, v1::JobSpec spec, uint64_t seed,
                        const std::string& name, uint64_t trained = 0) {
  spec.set_seed(seed);
  spec.mutable_optimizer()->mutable_adamw()->set_lr(3e-2);
  auto engine = model::PipelineEngine::Create(spec, c10::Device(c10::kCPU));
  EXPECT_TRUE(engine.ok()) << engine.status();
  Train(**engine, spec, trained);
  const std::string ckpt = absl::StrCat(dir, "/", name, "-ckpt");
  EXPECT_TRUE(model::SaveCheckpoint(ckpt, **engine, trained, "").ok());
  const std::string out = absl::StrCat(dir, "/", name);
  const std::string cmd = absl::StrCat(Bin(kExport), " --quiet ", ckpt, " ", out);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return out;
}

// The in-process losses of `spec` with full routes, every stage imported
// from `hf` (or seeded when `hf` is empty).
std::vector<double> EngineLosses(const v1::JobSpec& spec, const std::string& hf) {
  auto engine = model::PipelineEngine::Create(spec, c10::Device(c10::kCPU));
  EXPECT_TRUE(engine.ok());
  for (int s = 0; s < (*engine)->num_stages() && !hf.empty(); ++s) {
    absl::Status st = model::InitStageFromHf(hf, &(*engine)->stage(s));
    EXPECT_TRUE(st.ok()) << st;
  }
  return Train(**engine, spec, spec.iterations());
}

TEST_F(HfInteropTest, DistributedJobStartsFromAnExportedModel) {
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 3);
  // The exported model comes from seed 5, trained 30 steps; the job's own
  // seed is 11.
  const std::string hf = ExportModel(dir_, spec, 5, "hf", 30);
  spec.mutable_checkpoint()->set_init_from(hf);
  ASSERT_TRUE(NormalizeJobSpec(spec).ok());

  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  const std::vector<double> distributed =
      WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(120));
  ASSERT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message() << "\n"
                                                        << c.process->Log();
  ASSERT_EQ(distributed.size(), 3u);

  const std::vector<double> imported = EngineLosses(spec, hf);
  const std::vector<double> seeded = EngineLosses(spec, "");
  for (size_t it = 0; it < distributed.size(); ++it) {
    EXPECT_NEAR(distributed[it], imported[it], 1e-4 * std::max(1.0, imported[it]))
        << "iteration " << it;
  }
  std::cout << "first loss: distributed " << distributed[0] << ", in-process import " << imported[0]
            << ", the job's own seed " << seeded[0] << "\n";
  // The job's own seed would have given another first loss.
  EXPECT_LT(distributed[0], seeded[0] - 0.5) << distributed[0] << " vs seeded " << seeded[0];
}

// A job started from an import and cancelled resumes from its own
// checkpoint: `detourctl resume` drops init_from (the two are exclusive).
TEST_F(HfInteropTest, AnImportedJobResumesFromItsOwnCheckpoint) {
  v1::JobSpec spec = MicroJob(2, 1, 1, 0.0, 40);
  const std::string hf = ExportModel(dir_, spec, 5, "hf");
  spec.mutable_checkpoint()->set_init_from(hf);
  spec.mutable_checkpoint()->set_every_iterations(2);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 2, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  ASSERT_TRUE(
      Eventually([&] { return !GetJob(c.grpc_port, submitted.id()).last_checkpoint().empty(); },
                 absl::Seconds(60)));
  const std::string at = absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port);
  std::string out;
  ASSERT_EQ(Run({Bin(kCtl), at, "cancel", submitted.id()}, &out), 0) << out;
  ASSERT_TRUE(Eventually(
      [&] { return GetJob(c.grpc_port, submitted.id()).state() == v1::JOB_STATE_CANCELLED; },
      absl::Seconds(30)));
  ASSERT_EQ(Run({Bin(kCtl), at, "resume", submitted.id()}, &out), 0) << out;
  v1::Job final_job;
  WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(120));
  EXPECT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message();
  EXPECT_EQ(final_job.resumes(), 1u);
  EXPECT_TRUE(final_job.spec().checkpoint().init_from().empty());
  EXPECT_FALSE(final_job.spec().checkpoint().resume_from().empty());
}

TEST_F(HfInteropTest, AModelOfAnotherShapeFailsTheJobNamingTheField) {
  v1::JobSpec spec = MicroJob(2, 1, 1, 0.0, 2);
  v1::JobSpec wider = spec;
  wider.mutable_model()->set_d_model(64);
  wider.mutable_model()->set_ffn_dim(64);
  const std::string hf = ExportModel(dir_, *NormalizeJobSpec(wider), 5, "hf64");
  spec.mutable_checkpoint()->set_init_from(hf);

  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 2, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(60));
  EXPECT_EQ(final_job.state(), v1::JOB_STATE_FAILED);
  std::cout << "job message: " << final_job.message() << "\n";
  EXPECT_THAT(final_job.message(), HasSubstr("checkpoint.init_from"));
  EXPECT_THAT(final_job.message(), HasSubstr("hidden_size 64 vs the job's model.d_model 32"));
}

// The command line: usage errors exit 2, a bad checkpoint 1 with the file
// named, and existing output is kept unless --overwrite.
TEST_F(HfInteropTest, ExportCommandLine) {
  const std::string hf = ExportModel(dir_, MicroJob(2, 1, 1, 0.0, 1), 5, "hf");
  const std::string ckpt = hf + "-ckpt";
  std::string out;
  EXPECT_EQ(Run({Bin(kExport)}, &out), 2);
  EXPECT_THAT(out, HasSubstr("expected CHECKPOINT_DIR and OUT_DIR"));
  EXPECT_EQ(Run({Bin(kExport), "--dtype=f8", ckpt, hf}, &out), 2);
  EXPECT_THAT(out, HasSubstr("--dtype: \"f8\" is not f32 or bf16"));
  EXPECT_EQ(Run({Bin(kExport), "--help"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("CHECKPOINT_DIR"));
  EXPECT_EQ(Run({Bin(kExport), dir_ + "/nothing", dir_ + "/out"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("nothing/manifest.json"));
  EXPECT_EQ(Run({Bin(kExport), ckpt, hf}, &out), 1);
  EXPECT_THAT(out, HasSubstr("exists; refusing to overwrite it"));
  EXPECT_EQ(Run({Bin(kExport), "--overwrite", "--dtype=bf16", ckpt, hf}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("writing model.safetensors"));
  EXPECT_THAT(out, HasSubstr("BF16"));
}

}  // namespace
}  // namespace detour::testing
