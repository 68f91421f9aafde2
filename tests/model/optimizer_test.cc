#include "worker/model/optimizer.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

namespace detour::model {
namespace {

TEST(ScheduleTest, WarmupThenCosineToTheFloor) {
  v1::OptimizerSpec spec;
  spec.mutable_adamw()->set_lr(1e-3);
  spec.set_warmup_iterations(10);
  spec.set_min_lr_ratio(0.1);
  EXPECT_NEAR(ScheduledLearningRate(spec, 0, 110), 1e-4, 1e-12);
  EXPECT_NEAR(ScheduledLearningRate(spec, 4, 110), 5e-4, 1e-12);
  EXPECT_NEAR(ScheduledLearningRate(spec, 10, 110), 1e-3, 1e-12);
  EXPECT_NEAR(ScheduledLearningRate(spec, 109, 110), 1e-4, 1e-12);
  // Halfway through the decay: the mean of peak and floor.
  EXPECT_NEAR(ScheduledLearningRate(spec, 10 + 99 / 2.0, 110), 5.5e-4, 1e-5);
  double prev = 1;
  for (uint64_t it = 10; it < 110; ++it) {
    const double lr = ScheduledLearningRate(spec, it, 110);
    EXPECT_LE(lr, prev);
    prev = lr;
  }
  spec.set_constant_lr(true);
  EXPECT_NEAR(ScheduledLearningRate(spec, 100, 110), 1e-3, 1e-12);
}

TEST(ClipTest, GlobalNorm) {
  EXPECT_DOUBLE_EQ(GlobalClipScale(0.25, 1.0), 1.0);
  EXPECT_NEAR(GlobalClipScale(16.0, 1.0), 0.25, 1e-6);
  EXPECT_DOUBLE_EQ(GlobalClipScale(16.0, 0.0), 1.0);
}

// One step against the AdamW formula written out by hand.
TEST(AdamWTest, MatchesTheFormula) {
  at::Tensor w = at::tensor({1.0f, -2.0f, 0.5f, 3.0f}).reshape({2, 2}).requires_grad_(true);
  at::Tensor n = at::tensor({1.0f, 1.0f}).requires_grad_(true);
  v1::AdamWSpec spec;
  spec.set_beta1(0.9);
  spec.set_beta2(0.95);
  spec.set_eps(1e-8);
  spec.set_weight_decay(0.1);
  AdamW opt({{"layers.0.wq", w}, {"layers.0.attn_norm", n}}, spec);
  const double lr = 0.01;
  at::Tensor g = at::tensor({0.1f, 0.2f, -0.3f, 0.4f}).reshape({2, 2});
  for (int step = 1; step <= 2; ++step) {
    w.mutable_grad() = g.clone();
    n.mutable_grad() = at::tensor({0.5f, -0.5f});
    at::Tensor w0 = w.detach().clone();
    at::Tensor n0 = n.detach().clone();
    ASSERT_TRUE(opt.Step(lr, 0.5).ok());
    // After scaling by 0.5 every step, m and v are those of g/2 (constant),
    // so m̂ = g/2 and v̂ = g²/4 after bias correction.
    at::Tensor gs = g * 0.5;
    at::Tensor expect_w = w0 * (1 - lr * 0.1) - lr * gs / (gs.abs() + 1e-8);
    EXPECT_LT((w.detach() - expect_w).abs().max().item<double>(), 1e-6) << step;
    // 1-D parameters are not decayed.
    at::Tensor ns = at::tensor({0.25f, -0.25f});
    at::Tensor expect_n = n0 - lr * ns / (ns.abs() + 1e-8);
    EXPECT_LT((n.detach() - expect_n).abs().max().item<double>(), 1e-6);
  }
  // A parameter without a gradient does not move.
  w.mutable_grad() = at::Tensor();
  n.mutable_grad() = at::tensor({0.5f, -0.5f});
  at::Tensor w_before = w.detach().clone();
  ASSERT_TRUE(opt.Step(lr).ok());
  EXPECT_TRUE(at::equal(w.detach(), w_before));
}

class ScaleHook : public PreconditionHook {
 public:
  absl::Status Precondition(int layer, const std::vector<NamedTensor>& params, double lr,
                            std::set<std::string>* self_updated) override {
    layers.push_back(layer);
    for (const auto& [name, p] : params) {
      if (name.find("wk") != std::string::npos) {
        self_updated->insert(name);
      } else {
        p.grad().zero_();
      }
    }
    return fail ? absl::InternalError("boom") : absl::OkStatus();
  }
  std::vector<int> layers;
  bool fail = false;
};

TEST(AdamWTest, PreconditionHookRunsPerLayerAndCanTakeOver) {
  at::Tensor a = at::ones({2, 2}).requires_grad_(true);
  at::Tensor b = at::ones({2, 2}).requires_grad_(true);
  at::Tensor e = at::ones({2, 2}).requires_grad_(true);
  v1::AdamWSpec spec;
  AdamW opt({{"embed.weight", e}, {"layers.3.wq", a}, {"layers.5.wk", b}}, spec);
  ScaleHook hook;
  opt.set_precondition_hook(&hook);
  for (auto* t : {&a, &b, &e}) t->mutable_grad() = at::ones({2, 2});
  ASSERT_TRUE(opt.Step(0.1).ok());
  EXPECT_EQ(hook.layers, (std::vector<int>{3, 5}));
  // wq: gradient zeroed by the hook → Adam moves it by 0 (no decay set).
  EXPECT_TRUE(at::equal(a.detach(), at::ones({2, 2})));
  // wk: taken over by the hook → untouched by AdamW.
  EXPECT_TRUE(at::equal(b.detach(), at::ones({2, 2})));
  // embedding: no hook, AdamW moved it.
  EXPECT_FALSE(at::equal(e.detach(), at::ones({2, 2})));
  hook.fail = true;
  at::Tensor before = e.detach().clone();
  auto s = opt.Step(0.1);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("layer 3"), std::string::npos);
  EXPECT_TRUE(at::equal(e.detach(), before));
}

TEST(AdamWTest, StateRoundTripAndValidation) {
  at::Tensor w = at::ones({3}).requires_grad_(true);
  AdamW opt({{"p", w}}, v1::AdamWSpec());
  w.mutable_grad() = at::ones({3});
  ASSERT_TRUE(opt.Step(0.1).ok());
  auto state = opt.State();
  ASSERT_EQ(state.size(), 3u);
  std::map<std::string, at::Tensor> table(state.begin(), state.end());
  EXPECT_EQ(table["p.adam_step"].item<int64_t>(), 1);
  at::Tensor w2 = at::ones({3}).requires_grad_(true);
  AdamW other({{"p", w2}}, v1::AdamWSpec());
  ASSERT_TRUE(other.LoadState(table).ok());
  table["p.adam_m"] = at::zeros({4});
  auto bad = other.LoadState(table);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("p.adam_m"), std::string::npos);
}

}  // namespace
}  // namespace detour::model
