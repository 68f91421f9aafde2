#include "common/spec.h"

#include "absl/strings/str_cat.h"

#include <string>

#include "common/spec_json_error.h"
#include "gmock/gmock.h"
#include "google/protobuf/unknown_field_set.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

using ::detour::testing::SourceDir;

// A minimal valid job; tests break one field at a time.
constexpr char kGoodJob[] = R"({
  "name": "t",
  "model": {"preset": "tiny"},
  "pipeline": {"num_stages": 4, "data_nodes": 2, "replicas_per_stage": 2,
               "microbatches_per_data_node": 4, "skip_ratio": 0.25},
  "iterations": 10
})";

absl::Status JobStatus(const std::string& json) {
  auto parsed = ParseJobSpecJson(json);
  if (!parsed.ok()) return parsed.status();
  return NormalizeJobSpec(*parsed).status();
}

std::string Replace(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.replace(at, from.size(), to);
}

TEST(JobSpec, ShippedExamplesLoad) {
  for (const char* name : {"/examples/jobs/tiny_local.json", "/examples/jobs/tiny_kfac.json",
                           "/examples/jobs/geo20_1.5b.json"}) {
    auto spec = LoadJobSpec(SourceDir() + name);
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
  }
}

TEST(JobSpec, PresetExpandsAndDefaultsApply) {
  auto spec = NormalizeJobSpec(*ParseJobSpecJson(kGoodJob));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().num_layers(), 8u);
  EXPECT_EQ(spec->model().d_model(), 128u);
  EXPECT_EQ(spec->model().num_kv_heads(), 4u);
  EXPECT_EQ(spec->pipeline().memory_slots(), 3u);
  EXPECT_EQ(spec->pipeline().scheduler(), v1::SCHEDULER_SKIPPIPE);
  EXPECT_EQ(spec->optimizer().kind(), v1::OPTIMIZER_ADAMW);
  EXPECT_DOUBLE_EQ(spec->optimizer().adamw().lr(), 3e-4);
  EXPECT_EQ(spec->device(), "cpu");
  EXPECT_EQ(VisitedStages(spec->pipeline()), 3);
  // Idempotent.
  auto again = NormalizeJobSpec(*spec);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->SerializeAsString(), spec->SerializeAsString());
}

TEST(JobSpec, ExplicitFieldsOverridePreset) {
  auto spec = NormalizeJobSpec(*ParseJobSpecJson(
      Replace(kGoodJob, R"("preset": "tiny")", R"("preset": "tiny", "num_layers": 12)")));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model().num_layers(), 12u);
  EXPECT_EQ(spec->model().d_model(), 128u);
}

TEST(JobSpec, UnknownFieldIsNamed) {
  absl::Status s =
      JobStatus(Replace(kGoodJob, R"("iterations": 10)", R"("iterations": 10, "iteratons": 5)"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("iteratons"));
}

// JSON mistakes say where they are: the line and column of a syntax
// error, the valid names of an enum, the field meant.
TEST(JobSpec, JsonErrorsSayWhereAndWhatIsValid) {
  absl::Status s = JobStatus(Replace(kGoodJob, R"("iterations": 10)", R"("iterations" 10)"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("line 6, column 16: "));
  s = JobStatus(Replace(kGoodJob, R"("name": "t",)", R"("name": "t" "x",)"));
  EXPECT_THAT(s.message(), HasSubstr("line 2, column 15: "));
  s = JobStatus(Replace(kGoodJob, R"("skip_ratio": 0.25)",
                        R"("skip_ratio": 0.25, "scheduler": "SCHEDULER_FAST")"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("pipeline.scheduler: \"SCHEDULER_FAST\" is not one of "
                                     "SCHEDULER_"));
  EXPECT_THAT(s.message(), HasSubstr("SCHEDULER_FULL"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("UNSPECIFIED")));
  s = JobStatus(Replace(kGoodJob, R"("iterations": 10)", R"("iterations": 10, "iteratons": 5)"));
  EXPECT_THAT(s.message(), HasSubstr("unknown field \"iteratons\" (did you mean iterations?)"));
  s = JobStatus(Replace(kGoodJob, R"("num_stages": 4)", R"("num_stagse": 4)"));
  EXPECT_THAT(s.message(),
              HasSubstr("pipeline: unknown field \"num_stagse\" (did you mean num_stages?)"));
  EXPECT_EQ(LineAndColumn("ab\ncd", 4), "line 2, column 2");
  EXPECT_EQ(LineAndColumn("ab", 0), "line 1, column 1");
  EXPECT_EQ(LineAndColumn("ab", 99), "line 1, column 3");
}

TEST(JobSpec, WrongTypeIsNamed) {
  absl::Status s = JobStatus(Replace(kGoodJob, R"("num_stages": 4)", R"("num_stages": "four")"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("num_stages"));
}

TEST(JobSpec, NegativeCountIsNamed) {
  absl::Status s = JobStatus(Replace(kGoodJob, R"("data_nodes": 2)", R"("data_nodes": -2)"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("data_nodes"));
}

TEST(JobSpec, SkipRatioOutsideRange) {
  for (const char* bad : {"1.0", "1.2", "-0.1"}) {
    absl::Status s = JobStatus(
        Replace(kGoodJob, R"("skip_ratio": 0.25)", std::string(R"("skip_ratio": )") + bad));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.message(), HasSubstr("pipeline.skip_ratio")) << bad;
    EXPECT_THAT(s.message(), HasSubstr("outside [0, 1)")) << bad;
  }
}

TEST(JobSpec, MoreStagesThanLayers) {
  absl::Status s = JobStatus(Replace(kGoodJob, R"("num_stages": 4)", R"("num_stages": 9)"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("pipeline.num_stages: 9 stages exceed model.num_layers 8"));
}

TEST(JobSpec, OtherFieldChecks) {
  struct Case {
    std::string from, to, field;
  };
  const Case cases[] = {
      {R"("name": "t")", R"("name": "bad name!")", "name"},
      {R"("name": "t")", R"("name": "")", "name"},
      {R"("preset": "tiny")", R"("preset": "huge")", "model.preset"},
      {R"("iterations": 10)", R"("iterations": 0)", "iterations"},
      {R"("preset": "tiny")", R"("preset": "tiny", "num_heads": 3)", "model.num_heads"},
      {R"("iterations": 10)", R"("iterations": 10, "device": "tpu")", "device"},
      {R"("iterations": 10)", R"("iterations": 10, "data": {"source": "DATA_SOURCE_TEXT"})",
       "data.path"},
      {R"("skip_ratio": 0.25)", R"("skip_ratio": 0.25, "wire_dtype": "int8")",
       "pipeline.wire_dtype"},
      {R"("skip_ratio": 0.25)", R"("skip_ratio": 0.5, "max_jump": 1)", "pipeline.max_jump"},
      {R"("skip_ratio": 0.25)", R"("skip_ratio": 0.25, "precision": 7)", "pipeline.precision"},
      {R"("skip_ratio": 0.25)", R"("skip_ratio": 0.25, "precision": "PRECISION_FP16")",
       "precision"},
  };
  for (const Case& c : cases) {
    absl::Status s = JobStatus(Replace(kGoodJob, c.from, c.to));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.to;
    EXPECT_THAT(s.message(), HasSubstr(c.field)) << c.to << " -> " << s;
  }
}

TEST(JobSpec, PrecisionDefaultsToFp32AndTakesBf16) {
  auto plain = ParseJobSpecJson(kGoodJob);
  ASSERT_TRUE(plain.ok());
  auto normal = NormalizeJobSpec(*plain);
  ASSERT_TRUE(normal.ok()) << normal.status();
  EXPECT_EQ(normal->pipeline().precision(), v1::PRECISION_FP32);
  auto bf16 = ParseJobSpecJson(Replace(kGoodJob, R"("skip_ratio": 0.25)",
                                       R"("skip_ratio": 0.25, "precision": "PRECISION_BF16")"));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  normal = NormalizeJobSpec(*bf16);
  ASSERT_TRUE(normal.ok()) << normal.status();
  EXPECT_EQ(normal->pipeline().precision(), v1::PRECISION_BF16);
}

TEST(JobSpec, InitFromIsBoundedAndExclusiveWithResume) {
  const std::string with = Replace(kGoodJob, R"("iterations": 10)",
                                   R"("iterations": 10, "checkpoint": {"init_from": "/m/hf"})");
  EXPECT_TRUE(JobStatus(with).ok()) << JobStatus(with);
  absl::Status both = JobStatus(
      Replace(with, R"("init_from": "/m/hf")", R"("init_from": "/m/hf", "resume_from": "/c/1")"));
  EXPECT_EQ(both.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(both.message(), HasSubstr("checkpoint.init_from: is exclusive with "
                                        "checkpoint.resume_from"));
  absl::Status long_path = JobStatus(Replace(with, "/m/hf", std::string(5000, 'x')));
  EXPECT_THAT(long_path.message(), HasSubstr("checkpoint.init_from: 5000 bytes"));
  absl::Status nul = JobStatus(Replace(with, "/m/hf", "/m\\u0000x"));
  EXPECT_THAT(nul.message(), HasSubstr("checkpoint.init_from"));
}

// Every count, size and float a client sends is bounded before it is used
// or stored (a Submit with data_nodes 2^32-1 took the coordinator
// down and, stored, crash-looped it; NaN hyperparameters were trained on).
TEST(JobSpec, CountsSizesAndFloatsAreBounded) {
  struct Case {
    std::string from, to, message;
  };
  const std::string long_path(SpecLimits::kMaxPathBytes + 1, 'x');
  const Case cases[] = {
      {R"("data_nodes": 2)", R"("data_nodes": 4294967295)",
       "pipeline.data_nodes: 4294967295 exceeds the limit 4096"},
      {R"("num_stages": 4)", R"("num_stages": 2147483648)",
       "pipeline.num_stages: 2147483648 exceeds the limit 1024"},
      {R"("microbatches_per_data_node": 4)", R"("microbatches_per_data_node": 4294967295)",
       "pipeline.microbatches_per_data_node: 4294967295 exceeds the limit 4096"},
      {R"("num_stages": 4, "data_nodes": 2, "replicas_per_stage": 2)",
       R"("num_stages": 24, "data_nodes": 2, "replicas_per_stage": 4096)", "needs 94210 workers"},
      {R"("preset": "tiny")", R"("preset": "tiny", "num_layers": 100000)",
       "model.num_layers: 100000 exceeds the limit 1024"},
      {R"("preset": "tiny")",
       R"("preset": "tiny", "d_model": 65536, "num_heads": 256, "context_length": 1048576)",
       "pipeline.samples_per_microbatch: a microbatch's activation"},
      {R"("iterations": 10)", R"("iterations": 10, "optimizer": {"adamw": {"eps": "NaN"}})",
       "optimizer.adamw.eps: nan is outside (0, 1]"},
      {R"("iterations": 10)",
       R"("iterations": 10, "optimizer": {"adamw": {"weight_decay": "Infinity"}})",
       "optimizer.adamw.weight_decay: inf is outside [0, 100]"},
      {R"("iterations": 10)", R"("iterations": 10, "optimizer": {"grad_clip_norm": "NaN"})",
       "optimizer.grad_clip_norm: nan must be a finite number"},
      {R"("iterations": 10)", R"("iterations": 10, "optimizer": {"adamw": {"lr": 1e9}})",
       "optimizer.adamw.lr"},
      {R"("iterations": 10)", R"("iterations": 10, "optimizer": {"kfac": {"damping": "Infinity"}})",
       "optimizer.kfac.damping"},
      {R"("iterations": 10)",
       "\"iterations\": 10, \"data\": {\"source\": \"DATA_SOURCE_TEXT\", \"path\": \"" + long_path +
           "\"}",
       "data.path: 4097 bytes, more than the limit 4096"},
      {R"("iterations": 10)", R"("iterations": 10000000000)",
       "iterations: 10000000000 exceeds the limit 1000000000"},
  };
  for (const Case& c : cases) {
    absl::Status s = JobStatus(Replace(kGoodJob, c.from, c.to));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.to.substr(0, 200);
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.to.substr(0, 200);
  }
  // Each count within its limit, their product not.
  absl::Status many = JobStatus(
      Replace(Replace(kGoodJob, R"("data_nodes": 2)", R"("data_nodes": 100)"),
              R"("microbatches_per_data_node": 4)", R"("microbatches_per_data_node": 1000)"));
  EXPECT_THAT(std::string(many.message()),
              HasSubstr("100 data nodes x 1000 = 100000 microbatches per iteration"));
}

// Regression: fields each within their limits, or fields this
// version does not know (kept by protobuf when a Submit carries them), made
// specs of many MB that were stored and then sent in every List.
TEST(JobSpec, TotalSerializedSizeIsBounded) {
  auto base = ParseJobSpecJson(kGoodJob);
  ASSERT_TRUE(base.ok()) << base.status();
  // A pinned assignment of 4096 data nodes with 255-byte ids: every id and
  // count is within its limit, the spec is over 1 MiB.
  v1::JobSpec pinned = *base;
  pinned.mutable_pipeline()->set_num_stages(1);
  pinned.mutable_pipeline()->set_data_nodes(SpecLimits::kMaxDataNodes);
  pinned.mutable_pipeline()->set_microbatches_per_data_node(1);
  pinned.mutable_pipeline()->set_skip_ratio(0);
  v1::StageNodes* group = pinned.mutable_pipeline()->add_assignment();
  for (uint32_t i = 0; i < SpecLimits::kMaxDataNodes; ++i) {
    std::string id = std::to_string(i);
    id.resize(255, 'n');
    group->add_nodes(id);
  }
  absl::Status s = NormalizeJobSpec(pinned).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // (the size counted is the defaulted spec's, a little above pinned's)
  EXPECT_THAT(std::string(s.message()), HasSubstr("spec: is 10"));
  EXPECT_THAT(std::string(s.message()), HasSubstr(" bytes serialized"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("more than the limit of 1048576 (1 MiB)"));
  // Shorter ids: the same assignment fits.
  for (std::string& id : *group->mutable_nodes()) id.resize(8);
  EXPECT_TRUE(NormalizeJobSpec(pinned).ok()) << NormalizeJobSpec(pinned).status();

  // 2 MiB of a field this version does not know.
  v1::JobSpec unknown = *base;
  unknown.GetReflection()->MutableUnknownFields(&unknown)->AddLengthDelimited(
      999, std::string(2 << 20, 'u'));
  s = NormalizeJobSpec(unknown).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("more than the limit of 1048576"));
}

TEST(JobSpec, KfacDefaultsAndSync) {
  const std::string kfac = Replace(kGoodJob, "\"iterations\": 10",
                                   "\"iterations\": 10, \"optimizer\": {\"kind\": "
                                   "\"OPTIMIZER_KFAC\"}");
  auto spec = NormalizeJobSpec(*ParseJobSpecJson(kfac));
  ASSERT_TRUE(spec.ok()) << spec.status();
  const v1::KfacSpec& k = spec->optimizer().kfac();
  EXPECT_DOUBLE_EQ(k.damping(), 1e-3);
  EXPECT_DOUBLE_EQ(k.kl_clip(), 1e-3);
  EXPECT_EQ(k.placement(), v1::KFAC_PLACEMENT_BUBBLES);
  EXPECT_EQ(k.update(), v1::KFAC_UPDATE_GRAFT_ADAMW);
  // Replicated stages must step identically: by default the coordinator
  // chooses the scheme from the cost model (AUTO).
  EXPECT_EQ(k.replica_sync(), v1::KFAC_REPLICA_SYNC_AUTO);
  EXPECT_FALSE(k.sync_factors());
  // Normalising again changes nothing.
  auto again = NormalizeJobSpec(*spec);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->optimizer().kfac().replica_sync(), v1::KFAC_REPLICA_SYNC_AUTO);
  // A scheme given by name is kept.
  auto preconditioned = NormalizeJobSpec(*ParseJobSpecJson(Replace(
      kfac, "\"OPTIMIZER_KFAC\"",
      "\"OPTIMIZER_KFAC\", \"kfac\": {\"replica_sync\": \"KFAC_REPLICA_SYNC_PRECONDITIONED\"}")));
  ASSERT_TRUE(preconditioned.ok()) << preconditioned.status();
  EXPECT_EQ(preconditioned->optimizer().kfac().replica_sync(),
            v1::KFAC_REPLICA_SYNC_PRECONDITIONED);
  // The exact scheme on request: sync_factors (older specs, stored jobs) or
  // replica_sync FACTORS; the momentum rule needs it.
  auto factors = NormalizeJobSpec(*ParseJobSpecJson(Replace(
      kfac, "\"OPTIMIZER_KFAC\"", "\"OPTIMIZER_KFAC\", \"kfac\": {\"sync_factors\": true}")));
  ASSERT_TRUE(factors.ok()) << factors.status();
  EXPECT_EQ(factors->optimizer().kfac().replica_sync(), v1::KFAC_REPLICA_SYNC_FACTORS);
  auto by_name = NormalizeJobSpec(*ParseJobSpecJson(
      Replace(kfac, "\"OPTIMIZER_KFAC\"",
              "\"OPTIMIZER_KFAC\", \"kfac\": {\"replica_sync\": \"KFAC_REPLICA_SYNC_FACTORS\"}")));
  ASSERT_TRUE(by_name.ok()) << by_name.status();
  EXPECT_TRUE(by_name->optimizer().kfac().sync_factors());
  auto momentum = NormalizeJobSpec(*ParseJobSpecJson(
      Replace(kfac, "\"OPTIMIZER_KFAC\"",
              "\"OPTIMIZER_KFAC\", \"kfac\": {\"update\": \"KFAC_UPDATE_MOMENTUM\"}")));
  ASSERT_TRUE(momentum.ok()) << momentum.status();
  EXPECT_EQ(momentum->optimizer().kfac().replica_sync(), v1::KFAC_REPLICA_SYNC_FACTORS);
  // AUTO with the momentum rule leaves nothing to choose: FACTORS.
  auto auto_momentum = NormalizeJobSpec(*ParseJobSpecJson(
      Replace(kfac, "\"OPTIMIZER_KFAC\"",
              "\"OPTIMIZER_KFAC\", \"kfac\": {\"update\": \"KFAC_UPDATE_MOMENTUM\", "
              "\"replica_sync\": \"KFAC_REPLICA_SYNC_AUTO\"}")));
  ASSERT_TRUE(auto_momentum.ok()) << auto_momentum.status();
  EXPECT_EQ(auto_momentum->optimizer().kfac().replica_sync(), v1::KFAC_REPLICA_SYNC_FACTORS);
  // Contradictions are refused by name.
  for (const char* bad :
       {"{\"replica_sync\": \"KFAC_REPLICA_SYNC_PRECONDITIONED\", \"sync_factors\": true}",
        "{\"replica_sync\": \"KFAC_REPLICA_SYNC_AUTO\", \"sync_factors\": true}",
        "{\"replica_sync\": \"KFAC_REPLICA_SYNC_PRECONDITIONED\", "
        "\"update\": \"KFAC_UPDATE_MOMENTUM\"}"}) {
    auto r = NormalizeJobSpec(*ParseJobSpecJson(
        Replace(kfac, "\"OPTIMIZER_KFAC\"", absl::StrCat("\"OPTIMIZER_KFAC\", \"kfac\": ", bad))));
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("optimizer.kfac.replica_sync"), std::string::npos)
        << r.status();
  }

  // One replica everywhere: nothing to sync; AdamW jobs are left alone.
  std::string single = Replace(kfac, "\"data_nodes\": 2", "\"data_nodes\": 1");
  single = Replace(single, "\"replicas_per_stage\": 2", "\"replicas_per_stage\": 1");
  auto one = NormalizeJobSpec(*ParseJobSpecJson(single));
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_FALSE(one->optimizer().kfac().sync_factors());
  EXPECT_EQ(one->optimizer().kfac().replica_sync(), v1::KFAC_REPLICA_SYNC_UNSPECIFIED);
  // ... also when AUTO is asked for.
  auto one_auto = NormalizeJobSpec(*ParseJobSpecJson(
      Replace(single, "\"OPTIMIZER_KFAC\"",
              "\"OPTIMIZER_KFAC\", \"kfac\": {\"replica_sync\": \"KFAC_REPLICA_SYNC_AUTO\"}")));
  ASSERT_TRUE(one_auto.ok()) << one_auto.status();
  EXPECT_EQ(one_auto->optimizer().kfac().replica_sync(), v1::KFAC_REPLICA_SYNC_UNSPECIFIED);
  auto adamw = NormalizeJobSpec(*ParseJobSpecJson(kGoodJob));
  ASSERT_TRUE(adamw.ok());
  EXPECT_FALSE(adamw->optimizer().kfac().sync_factors());
}

TEST(JobSpec, ElasticDefaultsAndBounds) {
  auto spec = NormalizeJobSpec(*ParseJobSpecJson(kGoodJob));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(spec->elastic().disabled());
  EXPECT_EQ(spec->elastic().reconnect_grace_ms(), 2000u);
  EXPECT_EQ(spec->elastic().pause_timeout_s(), 600u);
  EXPECT_EQ(spec->elastic().reassign_horizon_iterations(), 20u);
  EXPECT_FALSE(spec->elastic().reassign_disabled());
  auto with = [](const std::string& elastic) {
    return NormalizeJobSpec(*ParseJobSpecJson(
        Replace(kGoodJob, "\"iterations\": 10",
                absl::StrCat("\"iterations\": 10, \"elastic\": {", elastic, "}"))));
  };
  EXPECT_THAT(with("\"pause_timeout_s\": 4000000000").status().message(),
              HasSubstr("elastic.pause_timeout_s: 4000000000 exceeds the limit"));
  EXPECT_THAT(with("\"reconnect_grace_ms\": 4000000000").status().message(),
              HasSubstr("elastic.reconnect_grace_ms"));
  EXPECT_THAT(with("\"reassign_horizon_iterations\": 100001").status().message(),
              HasSubstr("elastic.reassign_horizon_iterations: 100001 exceeds the limit"));
  auto horizon = with("\"reassign_horizon_iterations\": 100000, \"reassign_disabled\": true");
  ASSERT_TRUE(horizon.ok()) << horizon.status();
  EXPECT_EQ(horizon->elastic().reassign_horizon_iterations(), 100000u);
  EXPECT_TRUE(horizon->elastic().reassign_disabled());
  EXPECT_TRUE(with("\"disabled\": true, \"never_join\": true").ok());
  // What a stage's loss does: ROLLBACK unless the spec says otherwise; a
  // number outside the enum (a binary spec) is refused, naming the values.
  EXPECT_EQ(spec->elastic().on_stage_loss(), v1::STAGE_LOSS_ROLLBACK);
  auto pause = with("\"on_stage_loss\": \"STAGE_LOSS_PAUSE\"");
  ASSERT_TRUE(pause.ok()) << pause.status();
  EXPECT_EQ(pause->elastic().on_stage_loss(), v1::STAGE_LOSS_PAUSE);
  v1::JobSpec bad = *spec;
  bad.mutable_elastic()->set_on_stage_loss(static_cast<v1::StageLossAction>(9));
  auto refused = NormalizeJobSpec(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("elastic.on_stage_loss: 9 is not one of STAGE_LOSS_ROLLBACK"));
}

TEST(JobSpec, KfacBadValuesAreNamed) {
  auto with = [](const std::string& kfac) {
    return Replace(kGoodJob, "\"iterations\": 10",
                   "\"iterations\": 10, \"optimizer\": {\"kind\": \"OPTIMIZER_KFAC\", "
                   "\"kfac\": " +
                       kfac + "}");
  };
  EXPECT_THAT(JobStatus(with(R"({"damping": -1})")).message(), HasSubstr("optimizer.kfac.damping"));
  EXPECT_THAT(JobStatus(with(R"({"momentum": 1.5})")).message(),
              HasSubstr("optimizer.kfac.momentum"));
  EXPECT_THAT(JobStatus(with(R"({"lr": -0.1})")).message(), HasSubstr("optimizer.kfac.lr"));
  EXPECT_THAT(JobStatus(with(R"({"factor_decay": 2})")).message(),
              HasSubstr("optimizer.kfac.factor_decay"));
  EXPECT_THAT(JobStatus(with(R"({"curvature_microbatches": 9})")).message(),
              HasSubstr("optimizer.kfac.curvature_microbatches"));
  EXPECT_THAT(JobStatus(with(R"({"slack": 1})")).message(), HasSubstr("optimizer.kfac.slack"));
  EXPECT_TRUE(JobStatus(with(R"({"kl_clip": -1, "refresh_interval": 4})")).ok());
  // The granule cap: default 5 ms, bounded.
  auto defaulted = NormalizeJobSpec(*ParseJobSpecJson(with("{}")));
  ASSERT_TRUE(defaulted.ok()) << defaulted.status();
  EXPECT_EQ(defaulted->optimizer().kfac().max_granule_ms(), 5);
  for (const char* bad : {R"({"max_granule_ms": 0.001})", R"({"max_granule_ms": -3})",
                          R"({"max_granule_ms": 60001})"}) {
    EXPECT_THAT(JobStatus(with(bad)).message(), HasSubstr("optimizer.kfac.max_granule_ms: "))
        << bad;
  }
  EXPECT_TRUE(JobStatus(with(R"({"max_granule_ms": 0.01})")).ok());
  EXPECT_TRUE(JobStatus(with(R"({"max_granule_ms": 60000})")).ok());
}

TEST(JobSpec, MissingFileIsNotFound) {
  auto spec = LoadJobSpec("/nonexistent/job.json");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(spec.status().message(), HasSubstr("/nonexistent/job.json"));
}

TEST(JobSpec, MalformedJsonNamesTheFile) {
  auto spec = ParseJobSpecJson("{\"name\": ", "broken.json");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(spec.status().message(), HasSubstr("broken.json"));
}

constexpr char kGoodCluster[] = R"({
  "nodes": [{"id": "a", "region": "Oregon"}, {"id": "b", "region": "Tokyo"},
            {"id": "c", "region": "Tokyo", "speed": 2}],
  "links": [{"region_a": "Oregon", "region_b": "Tokyo", "latency_ms": 96,
             "bandwidth_gbytes_per_s": 0.5}]
})";

absl::Status ClusterStatus(const std::string& json) {
  auto parsed = ParseClusterSpecJson(json);
  if (!parsed.ok()) return parsed.status();
  return NormalizeClusterSpec(*parsed).status();
}

TEST(ClusterSpec, ShippedExampleLoads) {
  auto spec = LoadClusterSpec(SourceDir() + "/examples/clusters/geo20.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->nodes_size(), 20);
}

TEST(ClusterSpec, DefaultsApply) {
  auto spec = NormalizeClusterSpec(*ParseClusterSpecJson(kGoodCluster));
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_DOUBLE_EQ(spec->nodes(0).speed(), 1.0);
  EXPECT_DOUBLE_EQ(spec->nodes(2).speed(), 2.0);
  EXPECT_DOUBLE_EQ(spec->intra_region_latency_ms(), 1.0);
  EXPECT_DOUBLE_EQ(spec->compute().backward_factor(), 2.0);
}

TEST(ClusterSpec, MissingRegionPairIsNamed) {
  absl::Status s = ClusterStatus(
      Replace(kGoodCluster, R"("region": "Tokyo", "speed": 2)", R"("region": "Seoul")"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("missing region pair"));
  EXPECT_THAT(s.message(), HasSubstr("Seoul"));
}

TEST(ClusterSpec, BadValuesAreNamed) {
  struct Case {
    std::string from, to, expect;
  };
  const Case cases[] = {
      {R"("bandwidth_gbytes_per_s": 0.5)", R"("bandwidth_gbytes_per_s": 0)",
       "links[0].bandwidth_gbytes_per_s"},
      {R"("latency_ms": 96)", R"("latency_ms": -1)", "links[0].latency_ms"},
      {R"({"id": "b")", R"({"id": "a")", "nodes[1].id"},
      {R"("speed": 2)", R"("speed": -2)", "nodes[2].speed"},
      {R"("id": "a", "region": "Oregon")", R"("id": "a")", "nodes[0].region"},
      {R"("latency_ms": 96)", R"("latency_ms": 96, "jitter": 3)", "jitter"},
  };
  for (const Case& c : cases) {
    absl::Status s = ClusterStatus(Replace(kGoodCluster, c.from, c.to));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.to;
    EXPECT_THAT(s.message(), HasSubstr(c.expect)) << c.to << " -> " << s;
  }
}

TEST(ToJson, RoundTrips) {
  auto spec = NormalizeJobSpec(*ParseJobSpecJson(kGoodJob));
  ASSERT_TRUE(spec.ok());
  auto back = ParseJobSpecJson(ToJson(*spec));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), spec->SerializeAsString());
}

TEST(ModelShapeDefaultsTest, OneHomeForPresetsAndDefaults) {
  v1::ModelShape s;
  s.set_preset("tiny");
  s.set_d_model(256);  // explicit fields win over the preset's
  auto r = ResolveModelShape(s);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->d_model(), 256u);
  EXPECT_EQ(r->num_layers(), 8u);
  EXPECT_EQ(r->ffn_dim(), 384u);  // the preset's, not the default for 256
  v1::ModelShape bare;
  bare.set_d_model(100);
  bare.set_num_heads(4);
  r = ResolveModelShape(bare);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->ffn_dim(), static_cast<uint32_t>(DefaultFfnDim(100)));
  EXPECT_EQ(DefaultFfnDim(100), 320);  // 8/3·100 = 267, up to a multiple of 64
  EXPECT_EQ(r->num_kv_heads(), 4u);
  EXPECT_EQ(r->vocab_size(), 256u);
  EXPECT_EQ(r->context_length(), 128u);
  EXPECT_EQ(r->rope_theta(), 10000.0);
  EXPECT_EQ(r->norm_eps(), 1e-5);
  s.set_preset("huge");
  EXPECT_EQ(ResolveModelShape(s).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace detour
