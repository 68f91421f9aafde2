// The stage split, driven by the engine, against the plain monolithic model.
#include "worker/model/engine.h"

#include <map>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "model_test_util.h"
#include "worker/model/corpus.h"
#include "worker/model/routes.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

using testing::MaxAbsDiff;
using testing::SmallSpec;

constexpr double kTol = 1e-5;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { at::set_num_threads(1); }

  std::vector<Microbatch> Batches(const v1::JobSpec& spec, uint64_t iteration) {
    static const TokenSequence* tokens = [] {
      auto ds = SplitText(GenerateCorpus(1, 20000), 0.0);
      return new TokenSequence(ds->train);
    }();
    auto mbs = IterationMicrobatches(spec, *tokens, iteration, at::Device(at::kCPU));
    EXPECT_TRUE(mbs.ok()) << mbs.status();
    return *mbs;
  }
};

// Layer order of a route: each visited stage's block group, in visiting order.
std::vector<int> LayerOrder(const v1::JobSpec& spec, const v1::Route& route) {
  std::vector<int> order;
  for (uint32_t s : route.stages()) {
    auto r = StageLayerRange(spec.model().num_layers(), spec.pipeline().num_stages(), s);
    for (int l = r->begin; l < r->end; ++l) order.push_back(l);
  }
  return order;
}

// Reference gradients: for each microbatch, the monolithic model with the
// route's layer order; per-parameter sums, normalised per layer by the number
// of microbatches that used it (VISITS) or by the total (TOTAL).
std::map<std::string, at::Tensor> ReferenceGradients(const v1::JobSpec& spec, Transformer& model,
                                                     const std::vector<v1::Route>& routes,
                                                     const std::vector<Microbatch>& mbs,
                                                     bool visits_mode, double* mean_loss) {
  std::map<std::string, at::Tensor> sum;
  std::map<std::string, int> count;
  double loss_sum = 0;
  for (const auto& route : routes) {
    for (auto& [name, p] : model->GlobalParameters()) p.mutable_grad() = at::Tensor();
    const auto& mb = mbs[route.microbatch()];
    at::Tensor loss = model->Loss(mb.tokens, mb.targets, LayerOrder(spec, route));
    loss_sum += loss.item<double>();
    torch::autograd::backward({loss});
    for (auto& [name, p] : model->GlobalParameters()) {
      if (!p.grad().defined()) continue;
      if (sum.count(name) == 0) sum[name] = at::zeros_like(p);
      sum[name] += p.grad();
      count[name] += 1;
    }
  }
  for (auto& [name, g] : sum) {
    g /= visits_mode ? count[name] : static_cast<int>(routes.size());
  }
  *mean_loss = loss_sum / routes.size();
  return sum;
}

void ExpectGradientsMatch(PipelineEngine& engine, const std::map<std::string, at::Tensor>& ref) {
  size_t seen = 0;
  for (int s = 0; s < engine.num_stages(); ++s) {
    for (const auto& [name, p] : engine.stage(s).Parameters()) {
      auto it = ref.find(name);
      if (it == ref.end()) {
        EXPECT_FALSE(p.grad().defined() && p.grad().abs().max().item<double>() > 0)
            << name << " has a gradient but no visiting microbatch used it";
        continue;
      }
      ++seen;
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_LT(MaxAbsDiff(p.grad(), it->second), kTol) << name;
      // Not vacuous: relative to the gradient's own size the error is small
      // too (early attention gradients are ~1e-5, near the absolute bound).
      const double scale = it->second.abs().max().item<double>();
      EXPECT_GT(scale, 1e-7) << name;
      EXPECT_LT(MaxAbsDiff(p.grad(), it->second), 1e-3 * scale) << name;
    }
  }
  EXPECT_EQ(seen, ref.size());
}

TEST_F(EngineTest, FullPipelineEqualsMonolithicForSeveralSteps) {
  v1::JobSpec spec = SmallSpec();
  spec.mutable_optimizer()->mutable_adamw()->set_lr(3e-3);
  spec.mutable_optimizer()->set_grad_clip_norm(0.5);  // exercises clipping
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto config = ModelConfigFromShape(spec.model());
  Transformer model(*config, spec.seed(), at::Device(at::kCPU));
  AdamW ref_opt(model->GlobalParameters(), spec.optimizer().adamw());

  std::vector<v1::Route> routes;
  for (uint32_t mb = 0; mb < 4; ++mb) routes.push_back(MakeRoute(mb, {0, 1, 2, 3}));
  for (uint64_t it = 0; it < 3; ++it) {
    auto mbs = Batches(spec, it);
    double ref_loss = 0;
    auto ref = ReferenceGradients(spec, model, routes, mbs, true, &ref_loss);
    auto loss = (*engine)->Accumulate(routes, mbs);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, ref_loss, kTol);
    ASSERT_TRUE((*engine)->NormalizeGradients(4).ok());
    ExpectGradientsMatch(**engine, ref);

    // Step both: same clipping, same lr.
    double sq = 0;
    for (auto& [name, p] : model->GlobalParameters()) {
      p.mutable_grad() = ref[name].clone();
      sq += ref[name].pow(2).sum().item<double>();
    }
    const double lr = ScheduledLearningRate(spec.optimizer(), it, spec.iterations());
    ASSERT_TRUE(ref_opt.Step(lr, GlobalClipScale(sq, 0.5)).ok());
    auto stats = (*engine)->Step(it, 4);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_NEAR(stats->grad_norm, std::sqrt(sq), 1e-5);
    EXPECT_DOUBLE_EQ(stats->learning_rate, lr);
    auto ref_params = testing::ToMap(model->GlobalParameters());
    for (int s = 0; s < 4; ++s) {
      for (const auto& [name, p] : (*engine)->stage(s).Parameters()) {
        EXPECT_LT(MaxAbsDiff(p, ref_params[name]), kTol) << name << " step " << it;
      }
    }
  }
}

TEST_F(EngineTest, SkippingRouteEqualsModelWithoutThoseLayers) {
  v1::JobSpec spec = SmallSpec();
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok());
  auto config = ModelConfigFromShape(spec.model());
  Transformer model(*config, spec.seed(), at::Device(at::kCPU));
  std::vector<v1::Route> routes;
  for (uint32_t mb = 0; mb < 4; ++mb) routes.push_back(MakeRoute(mb, {0, 2, 3}));
  auto mbs = Batches(spec, 0);
  double ref_loss = 0;
  auto ref = ReferenceGradients(spec, model, routes, mbs, true, &ref_loss);
  EXPECT_EQ(ref.count("layers.1.wq"), 0u);  // layer 1 is stage 1's
  auto loss = (*engine)->Accumulate(routes, mbs);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, ref_loss, kTol);
  EXPECT_EQ((*engine)->stage(1).visits(), 0);
  ASSERT_TRUE((*engine)->NormalizeGradients(4).ok());
  ExpectGradientsMatch(**engine, ref);
}

TEST_F(EngineTest, ReorderedRouteEqualsPermutedModel) {
  v1::JobSpec spec = SmallSpec();
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok());
  auto config = ModelConfigFromShape(spec.model());
  Transformer model(*config, spec.seed(), at::Device(at::kCPU));
  std::vector<v1::Route> routes = {MakeRoute(0, {0, 2, 1, 3}), MakeRoute(1, {0, 3, 1}),
                                   MakeRoute(2, {0, 1, 3, 2}), MakeRoute(3, {0, 2, 1, 3})};
  auto mbs = Batches(spec, 1);
  double ref_loss = 0;
  auto ref = ReferenceGradients(spec, model, routes, mbs, true, &ref_loss);
  auto loss = (*engine)->Accumulate(routes, mbs);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, ref_loss, kTol);
  ASSERT_TRUE((*engine)->NormalizeGradients(4).ok());
  ExpectGradientsMatch(**engine, ref);
  // The order matters: the in-order model gives another loss.
  double in_order = 0;
  std::vector<v1::Route> sorted = {MakeRoute(0, {0, 1, 2, 3})};
  ReferenceGradients(spec, model, sorted, mbs, true, &in_order);
  double permuted = 0;
  ReferenceGradients(spec, model, {routes[0]}, mbs, true, &permuted);
  EXPECT_GT(std::abs(in_order - permuted), 1e-6);
}

// Mixed skips: VISITS divides each stage by its own visit count, TOTAL by
// the number of microbatches — each checked against the monolithic model.
TEST_F(EngineTest, GradientNormalizationModes) {
  std::vector<v1::Route> routes = {MakeRoute(0, {0, 1, 2}), MakeRoute(1, {0, 2, 3}),
                                   MakeRoute(2, {0, 3}), MakeRoute(3, {0, 2})};
  for (bool visits_mode : {true, false}) {
    v1::JobSpec spec = SmallSpec();
    spec.mutable_pipeline()->set_grad_normalization(visits_mode ? v1::GRAD_NORM_VISITS
                                                                : v1::GRAD_NORM_TOTAL);
    auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
    ASSERT_TRUE(engine.ok());
    auto config = ModelConfigFromShape(spec.model());
    Transformer model(*config, spec.seed(), at::Device(at::kCPU));
    auto mbs = Batches(spec, 2);
    double ref_loss = 0;
    auto ref = ReferenceGradients(spec, model, routes, mbs, visits_mode, &ref_loss);
    ASSERT_TRUE((*engine)->Accumulate(routes, mbs).ok());
    EXPECT_EQ((*engine)->stage(1).visits(), 1);
    EXPECT_EQ((*engine)->stage(2).visits(), 3);
    EXPECT_EQ((*engine)->stage(3).visits(), 2);
    ASSERT_TRUE((*engine)->NormalizeGradients(4).ok());
    ExpectGradientsMatch(**engine, ref);
    // Stage 1 was visited once: VISITS keeps its single gradient at full
    // weight, TOTAL shrinks it to a quarter.
    const double w = (*engine)->stage(1).Parameters()[1].second.grad().abs().sum().item<double>();
    double single = 0;
    auto one = ReferenceGradients(spec, model, {routes[0]}, mbs, true, &single);
    const double full = one["layers.1.wq"].abs().sum().item<double>();
    EXPECT_NEAR(w / full, visits_mode ? 1.0 : 0.25, 1e-4);
  }
}

TEST_F(EngineTest, BadRoutesAreRefused) {
  v1::JobSpec spec = SmallSpec();
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok());
  auto mbs = Batches(spec, 0);
  for (const auto& stages : std::vector<std::vector<int>>{{1, 2}, {0, 2, 2}, {0, 4}, {0, 0}}) {
    auto s = (*engine)->Accumulate({MakeRoute(0, stages)}, mbs);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_FALSE((*engine)->Accumulate({MakeRoute(9, {0, 1})}, mbs).ok());
  for (int s = 0; s < 4; ++s) EXPECT_EQ((*engine)->stage(s).in_flight(), 0);
}

TEST_F(EngineTest, LossFallsOnTheCorpus) {
  v1::JobSpec spec = SmallSpec();
  spec.mutable_optimizer()->mutable_adamw()->set_lr(3e-3);
  spec.set_iterations(40);
  spec.mutable_pipeline()->set_skip_ratio(0.25);
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok());
  double first = 0, last = 0;
  for (uint64_t it = 0; it < 40; ++it) {
    auto routes = GenerateRoutes(spec.pipeline(), 4, spec.seed(), it);
    ASSERT_TRUE(routes.ok()) << routes.status();
    auto stats = (*engine)->RunIteration(it, *routes, Batches(spec, it));
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (it < 5) first += stats->loss / 5;
    if (it >= 35) last += stats->loss / 5;
  }
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

}  // namespace
}  // namespace detour::model
