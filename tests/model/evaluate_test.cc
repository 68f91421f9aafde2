#include "worker/model/evaluate.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "model_test_util.h"
#include "worker/model/corpus.h"
#include "worker/model/engine.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

using testing::SmallSpec;

TEST(SpreadRouteTest, HalfOfTheStages) {
  EXPECT_EQ(SpreadRoute(4, 0.5), (std::vector<int>{0, 2}));
  EXPECT_EQ(SpreadRoute(6, 0.5), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(SpreadRoute(8, 0.5), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(SpreadRoute(4, 1.0), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(SpreadRoute(4, 0.0), (std::vector<int>{0}));
}

// Perplexity through all stages / a subset equals exp of the monolithic
// model's mean loss with the same layers.
TEST(PerplexityTest, MatchesTheMonolithicModel) {
  at::set_num_threads(1);
  v1::JobSpec spec = SmallSpec();
  auto engine = PipelineEngine::Create(spec, at::Device(at::kCPU));
  ASSERT_TRUE(engine.ok());
  auto config = ModelConfigFromShape(spec.model());
  Transformer model(*config, spec.seed(), at::Device(at::kCPU));
  const TokenSequence all = SplitText(GenerateCorpus(9, 3000), 0.0)->train;
  const std::vector<int32_t> tokens = all.Slice(0, all.size());
  const int64_t n = NumSamples(tokens.size(), 16);
  at::Tensor data = at::empty({n, 17}, at::kLong);
  for (int64_t i = 0; i < n; ++i) {
    auto s = SampleTokens(tokens, i, 16);
    for (int t = 0; t < 17; ++t) data[i][t] = s[t];
  }
  c10::NoGradGuard no_grad;
  struct Case {
    std::vector<int> route;
    std::vector<int> layers;
  };
  for (const Case& c : std::vector<Case>{{{}, {}}, {{0, 2}, {0, 2}}, {{0, 3, 1}, {0, 3, 1}}}) {
    EvalOptions options;
    options.route = c.route;
    options.batch_size = 5;  // does not divide n: a short last batch
    auto r = Perplexity((*engine)->stages(), tokens, options);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->samples, n);
    EXPECT_EQ(r->tokens, n * 16);
    const double ref =
        model->Loss(data.narrow(1, 0, 16), data.narrow(1, 1, 16), c.layers).item<double>();
    EXPECT_NEAR(r->mean_nll, ref, 1e-5);
    EXPECT_NEAR(r->perplexity, std::exp(ref), 1e-3);
  }
  EvalOptions bad;
  bad.route = {0, 1, 1};
  EXPECT_FALSE(Perplexity((*engine)->stages(), tokens, bad).ok());
  bad.route = {2, 0};
  EXPECT_FALSE(Perplexity((*engine)->stages(), tokens, bad).ok());
  EXPECT_EQ(Perplexity((*engine)->stages(), std::vector<int32_t>(10, 1), {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace detour::model
