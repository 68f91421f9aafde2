// bf16 mixed precision (PipelineSpec.precision): what a bf16 stage computes
// against the float32 stage and the bf16 monolithic model, that parameters,
// gradients, optimiser and K-FAC state stay float32, that the cached bf16
// weight copies follow every parameter update, that a slot holds less, that
// training follows float32 within a stated tolerance, checkpoints, and the
// refusals.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "absl/strings/str_cat.h"
#include "common/spec.h"
#include "model_test_util.h"
#include "tests/heap_in_use.h"
#include "worker/model/checkpoint.h"
#include "worker/model/corpus.h"
#include "worker/model/engine.h"
#include "worker/model/kfac.h"
#include "worker/model/routes.h"
#include "worker/model/stage_file.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;
using testing::MaxAbsDiff;
using testing::SmallSpec;

// ‖a − b‖ / ‖b‖ (Frobenius).
double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bd = b.to(at::kDouble);
  return (a.to(at::kDouble) - bd).norm().item<double>() / bd.norm().item<double>();
}

class PrecisionTest : public ::testing::Test {
 protected:
  void SetUp() override { at::set_num_threads(1); }

  static v1::JobSpec Spec(v1::Precision precision) {
    v1::JobSpec spec = SmallSpec();
    spec.mutable_pipeline()->set_precision(precision);
    spec.mutable_pipeline()->set_memory_slots(4);
    spec.mutable_optimizer()->mutable_adamw()->set_lr(3e-3);
    return spec;
  }

  std::vector<Microbatch> Batches(const v1::JobSpec& spec, uint64_t iteration) {
    static const TokenSequence* tokens = [] {
      auto ds = SplitText(GenerateCorpus(3, 60000), 0.0);
      return new TokenSequence(ds->train);
    }();
    auto mbs = IterationMicrobatches(spec, *tokens, iteration, at::Device(at::kCPU));
    EXPECT_TRUE(mbs.ok()) << mbs.status();
    return *mbs;
  }

  // Losses of iterations [from, to) with the job's generated routes.
  std::vector<double> Train(PipelineEngine& engine, uint64_t from, uint64_t to) {
    std::vector<double> losses;
    const v1::JobSpec& spec = engine.spec();
    const int mbs = static_cast<int>(spec.pipeline().microbatches_per_data_node());
    for (uint64_t it = from; it < to; ++it) {
      auto routes = GenerateRoutes(spec.pipeline(), mbs, spec.seed(), it);
      EXPECT_TRUE(routes.ok()) << routes.status();
      auto stats = engine.RunIteration(it, *routes, Batches(spec, it));
      EXPECT_TRUE(stats.ok()) << stats.status();
      losses.push_back(stats.ok() ? stats->loss : NAN);
    }
    return losses;
  }
};

// A bf16 stage takes and returns float32 hidden states, its parameters and
// gradients are float32, and its results are those of the float32 stage up
// to bf16 rounding — but not equal to them: the arithmetic really is bf16.
TEST_F(PrecisionTest, Bf16StageComputesInBf16AndKeepsFloat32Gradients) {
  for (int index : {0, 2}) {
    SCOPED_TRACE(index);
    auto full = Stage::FromJobSpec(Spec(v1::PRECISION_FP32), index, at::Device(at::kCPU));
    auto half = Stage::FromJobSpec(Spec(v1::PRECISION_BF16), index, at::Device(at::kCPU));
    ASSERT_TRUE(full.ok() && half.ok()) << full.status() << half.status();
    at::manual_seed(5);
    const at::Tensor in =
        index == 0 ? at::randint(0, 256, {2, 16}, at::kLong) : at::randn({2, 16, 32});
    const at::Tensor targets = at::randint(0, 256, {2, 16}, at::kLong);
    auto a = (*full)->Forward(0, in);
    auto b = (*half)->Forward(0, in);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_EQ(b->scalar_type(), at::kFloat);
    EXPECT_LT(RelativeError(*b, *a), 2e-2);
    EXPECT_GT(MaxAbsDiff(*b, *a), 0.0) << "bf16 gave the float32 result exactly";
    at::Tensor ga, gb;
    if (index == 0) {
      auto la = (*full)->LossAndBackward(1, *a, targets);
      auto lb = (*half)->LossAndBackward(1, *b, targets);
      ASSERT_TRUE(la.ok() && lb.ok()) << la.status() << lb.status();
      EXPECT_NEAR(lb->loss, la->loss, 1e-2 * la->loss);
      EXPECT_NE(lb->loss, la->loss);
      EXPECT_EQ(lb->grad_hidden.scalar_type(), at::kFloat);
      ga = la->grad_hidden;
      gb = lb->grad_hidden;
    } else {
      ga = gb = at::randn({2, 16, 32});
    }
    auto ia = (*full)->Backward(0, ga);
    auto ib = (*half)->Backward(0, gb);
    ASSERT_TRUE(ia.ok() && ib.ok()) << ia.status() << ib.status();
    if (index != 0) {
      EXPECT_EQ(ib->scalar_type(), at::kFloat);
      EXPECT_LT(RelativeError(*ib, *ia), 3e-2);
    }
    auto pa = (*full)->Parameters();
    auto pb = (*half)->Parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      SCOPED_TRACE(pa[i].first);
      EXPECT_EQ(pb[i].second.scalar_type(), at::kFloat);
      ASSERT_TRUE(pb[i].second.grad().defined());
      EXPECT_EQ(pb[i].second.grad().scalar_type(), at::kFloat);
      // The embedding's gradient is sparse in rows; every other one is dense.
      EXPECT_LT(RelativeError(pb[i].second.grad(), pa[i].second.grad()), 5e-2);
    }
  }
}

// The pipeline in bf16 is the monolithic model in bf16: the same operations
// in the same order, so the same loss and gradients.
TEST_F(PrecisionTest, Bf16PipelineEqualsTheBf16MonolithicModel) {
  const v1::JobSpec spec = Spec(v1::PRECISION_BF16);
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto config = ModelConfigFromShape(spec.model());
  ASSERT_TRUE(config.ok());
  Transformer reference(*config, spec.seed(), at::Device(at::kCPU));
  reference->set_compute_dtype(at::kBFloat16);
  const std::vector<Microbatch> mbs = Batches(spec, 0);
  v1::Route route;
  route.set_microbatch(0);
  for (int s = 0; s < 4; ++s) route.add_stages(s);
  auto loss = (*engine)->Accumulate({route}, mbs);
  ASSERT_TRUE(loss.ok()) << loss.status();
  at::Tensor ref = reference->Loss(mbs[0].tokens, mbs[0].targets);
  torch::autograd::backward({ref});
  EXPECT_NEAR(*loss, ref.item<double>(), 1e-6);
  const auto want = testing::ToMap(reference->GlobalParameters());
  for (int s = 0; s < 4; ++s) {
    for (const auto& [name, p] : (*engine)->stage(s).Parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_LT(MaxAbsDiff(p.grad(), want.at(name).grad()), 1e-6) << name;
    }
  }
}

// The bf16 weight copies are made once per parameter version: after an
// optimiser step (in place) the next forward uses the new weights — the
// same output as a fresh bf16 stage holding them — and microbatches between
// two steps share one copy.
TEST_F(PrecisionTest, Bf16WeightCopiesFollowParameterUpdates) {
  const v1::JobSpec spec = Spec(v1::PRECISION_BF16);
  auto stage = Stage::FromJobSpec(spec, 1, at::Device(at::kCPU));
  ASSERT_TRUE(stage.ok());
  AdamW opt((*stage)->Parameters(), spec.optimizer().adamw());
  at::manual_seed(9);
  const at::Tensor x = at::randn({2, 16, 32});
  auto before = (*stage)->Forward(0, x);
  ASSERT_TRUE(before.ok());
  ASSERT_TRUE((*stage)->Backward(0, at::randn({2, 16, 32})).ok());
  ASSERT_TRUE(opt.Step(1e-2, 1.0).ok());
  (*stage)->ZeroGrad();
  auto after = (*stage)->Forward(1, x);
  ASSERT_TRUE(after.ok());
  EXPECT_GT(MaxAbsDiff(*after, *before), 0.0) << "the step did not reach the bf16 copies";

  auto fresh = Stage::FromJobSpec(spec, 1, at::Device(at::kCPU));
  ASSERT_TRUE(fresh.ok());
  {
    c10::NoGradGuard no_grad;
    auto src = (*stage)->Parameters();
    auto dst = (*fresh)->Parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].second.copy_(src[i].second);
  }
  auto expected = (*fresh)->Forward(0, x);
  ASSERT_TRUE(expected.ok());
  EXPECT_TRUE(at::equal(*after, *expected));
  // Inference (no graph) after the step sees the new weights as well.
  auto inferred = (*stage)->Infer(x);
  ASSERT_TRUE(inferred.ok());
  EXPECT_TRUE(at::equal(*inferred, *expected));
}

// What bf16 is for: a microbatch in flight holds far less heap than in
// float32 (glibc's count of bytes in use; ASan's under ASan), at a shape
// where activations dominate.
TEST_F(PrecisionTest, Bf16SlotHoldsLessMemory) {
  ModelConfig config;
  config.num_layers = 2;
  config.d_model = 64;
  config.num_heads = 4;
  config.num_kv_heads = 4;
  config.ffn_dim = 192;
  config.context_length = 128;
  auto heap = ::detour::testing::HeapBytesInUse;
  double bytes[2];
  for (int k = 0; k < 2; ++k) {
    StageOptions o;
    o.compute_dtype = k == 0 ? at::kFloat : at::kBFloat16;
    auto stage = Stage::Create(config, 1, 2, o);
    ASSERT_TRUE(stage.ok()) << stage.status();
    at::manual_seed(1);
    const at::Tensor x = at::randn({4, 128, 64});
    // Warm: the bf16 weight copies exist before the measured forward.
    ASSERT_TRUE((*stage)->Forward(0, x).ok());
    const double h0 = heap();
    ASSERT_TRUE((*stage)->Forward(1, x).ok());
    bytes[k] = heap() - h0;
    (*stage)->DropAll();
  }
  EXPECT_LT(bytes[1], 0.7 * bytes[0]) << "bf16 " << bytes[1] << " vs float32 " << bytes[0];
}

// The smoke run: the same job in float32 and in bf16 on the embedded
// corpus. The bf16 loss falls as the float32 one does, and stays within 0.05
// nats of it at every one of 40 iterations (measured: at most ~0.01).
TEST_F(PrecisionTest, MixedPrecisionTrainingFollowsFloat32) {
  v1::JobSpec fp32 = Spec(v1::PRECISION_FP32);
  fp32.set_iterations(40);
  fp32.mutable_pipeline()->set_skip_ratio(0.25);
  v1::JobSpec bf16 = fp32;
  bf16.mutable_pipeline()->set_precision(v1::PRECISION_BF16);
  auto a = PipelineEngine::Create(fp32, at::Device(at::kCPU));
  auto b = PipelineEngine::Create(bf16, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<double> la = Train(**a, 0, 40);
  const std::vector<double> lb = Train(**b, 0, 40);
  double first = 0, last = 0, worst = 0;
  for (int it = 0; it < 40; ++it) {
    if (it < 5) first += lb[it] / 5;
    if (it >= 35) last += lb[it] / 5;
    worst = std::max(worst, std::abs(lb[it] - la[it]));
    EXPECT_NEAR(lb[it], la[it], 0.05) << "iteration " << it;
  }
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
  EXPECT_GT(worst, 0.0) << "bf16 and float32 losses are identical";
  std::printf("largest |bf16 - fp32| loss difference over 40 iterations: %.4f\n", worst);
  for (int s = 0; s < 4; ++s) {
    for (const auto& [name, t] : (*b)->optimizer(s).State()) {
      if (t.is_floating_point()) {
        EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
      }
    }
  }
}

// K-FAC in bf16: factors and inverses are float32 (computed from the bf16
// projections' inputs and output gradients), and the loss falls.
TEST_F(PrecisionTest, KfacInBf16KeepsFloat32FactorsAndTrains) {
  v1::JobSpec spec = Spec(v1::PRECISION_BF16);
  spec.set_iterations(20);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  spec.mutable_optimizer()->mutable_kfac()->set_refresh_interval(2);
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok()) << engine.status();
  const std::vector<double> losses = Train(**engine, 0, 20);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front() - 0.5);
  Kfac* kfac = (*engine)->kfac(1);
  ASSERT_NE(kfac, nullptr);
  const int layer = (*engine)->stage(1).layers().begin;
  for (const char* module : {"q", "down"}) {
    SCOPED_TRACE(module);
    ASSERT_TRUE(kfac->FactorA(layer, module).defined());
    EXPECT_EQ(kfac->FactorA(layer, module).scalar_type(), at::kFloat);
    EXPECT_EQ(kfac->FactorB(layer, module).scalar_type(), at::kFloat);
    EXPECT_EQ(kfac->InverseA(layer, module).scalar_type(), at::kFloat);
    EXPECT_TRUE(at::isfinite(kfac->InverseA(layer, module)).all().item<bool>());
  }
  for (const auto& [name, t] : kfac->State()) {
    if (t.is_floating_point() && t.scalar_type() != at::kDouble) {
      EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    }
  }
}

// Checkpoints of a bf16 job hold the float32 master weights and moments;
// loading one into a new bf16 job continues bit for bit.
TEST_F(PrecisionTest, Bf16CheckpointsHoldFloat32AndResumeBitForBit) {
  const v1::JobSpec spec = Spec(v1::PRECISION_BF16);
  const fs::path root = fs::temp_directory_path() / absl::StrCat("detour_prec_", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root);
  auto a = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(a.ok());
  Train(**a, 0, 3);
  const std::string dir = (root / "ckpt").string();
  ASSERT_TRUE(SaveCheckpoint(dir, **a, 3, "").ok());
  const std::vector<double> straight = Train(**a, 3, 6);

  for (int s = 0; s < 4; ++s) {
    std::ifstream in(dir + "/stage-" + std::to_string(s) + ".bin", std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto table = ParseStageFile(bytes, "stage file");
    ASSERT_TRUE(table.ok()) << table.status();
    for (const auto& [name, t] : *table) {
      if (t.is_floating_point()) {
        EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
      }
    }
  }
  auto b = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(b.ok());
  auto manifest = LoadCheckpoint(dir, **b);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  const std::vector<double> resumed = Train(**b, 3, 6);
  EXPECT_EQ(resumed, straight);
  fs::remove_all(root);
}

TEST_F(PrecisionTest, UnsupportedPrecisionsAreRefused) {
  ModelConfig config;
  config.num_layers = 2;
  config.d_model = 32;
  config.num_heads = 2;
  config.num_kv_heads = 2;
  config.ffn_dim = 64;
  StageOptions o;
  o.compute_dtype = at::kHalf;
  auto half = Stage::Create(config, 0, 2, o);
  EXPECT_EQ(half.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(half.status().message().find("only float32 and bfloat16"), std::string::npos)
      << half.status();
  v1::JobSpec spec = Spec(v1::PRECISION_BF16);
  spec.mutable_pipeline()->set_precision(static_cast<v1::Precision>(7));
  const absl::Status bad = ValidateJobSpec(spec);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("pipeline.precision"), std::string::npos) << bad;
  // A device that cannot run the bf16 probe (here: CUDA in a CPU-only
  // LibTorch) fails the stage naming the option and the device.
  if (!at::hasCUDA()) {
    o.compute_dtype = at::kBFloat16;
    o.device = c10::Device(c10::kCUDA, 0);
    auto gpu = Stage::Create(config, 0, 2, o);
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
    EXPECT_NE(gpu.status().message().find("pipeline.precision PRECISION_BF16: device cuda:0"),
              std::string::npos)
        << gpu.status();
  }
}

}  // namespace
}  // namespace detour::model
