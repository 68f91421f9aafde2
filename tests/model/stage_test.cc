#include "worker/model/stage.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "model_test_util.h"
#include "tests/heap_in_use.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

using testing::MaxAbsDiff;
using testing::SmallSpec;
using testing::ToMap;

class StageTest : public ::testing::Test {
 protected:
  void SetUp() override { at::set_num_threads(1); }
};

TEST(LayerSplitTest, EvenAsPossibleAndContiguous) {
  for (int layers = 1; layers <= 33; ++layers) {
    for (int stages = 1; stages <= layers; ++stages) {
      int next = 0;
      for (int s = 0; s < stages; ++s) {
        auto r = StageLayerRange(layers, stages, s);
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->begin, next);
        EXPECT_GE(r->size(), layers / stages);
        EXPECT_LE(r->size(), layers / stages + 1);
        next = r->end;
      }
      EXPECT_EQ(next, layers);
    }
  }
  EXPECT_EQ(StageLayerRange(8, 3, 0)->size(), 2);  // stage 0 also has the head
  EXPECT_EQ(StageLayerRange(8, 3, 2)->size(), 3);
  EXPECT_FALSE(StageLayerRange(4, 5, 0).ok());
  EXPECT_FALSE(StageLayerRange(4, 2, 2).ok());
}

TEST(ModelConfigTest, PresetsAndErrors) {
  v1::ModelShape shape;
  shape.set_preset("8b");
  auto c = ModelConfigFromShape(shape);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim(), 128);
  shape.set_preset("tiny");
  c = ModelConfigFromShape(shape);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->num_layers, 8);
  EXPECT_GT(c->TotalParameters(), 1000000);
  shape.set_num_heads(3);
  c = ModelConfigFromShape(shape);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("num_heads"), std::string::npos);
}

TEST_F(StageTest, StagesHoldTheMonolithicParameters) {
  v1::JobSpec spec = SmallSpec();
  auto config = ModelConfigFromShape(spec.model());
  ASSERT_TRUE(config.ok());
  Transformer reference(*config, spec.seed(), at::Device(at::kCPU));
  auto ref = ToMap(reference->GlobalParameters());
  size_t total = 0;
  for (int s = 0; s < 4; ++s) {
    auto stage = Stage::FromJobSpec(spec, s, at::Device(at::kCPU));
    ASSERT_TRUE(stage.ok()) << stage.status();
    for (const auto& [name, p] : (*stage)->Parameters()) {
      ASSERT_EQ(ref.count(name), 1u) << name;
      EXPECT_TRUE(at::equal(p, ref[name])) << name;
      ++total;
    }
  }
  EXPECT_EQ(total, ref.size());
  // A different seed gives different weights.
  auto other = Stage::FromJobSpec(SmallSpec(8), 1, at::Device(at::kCPU));
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(at::equal((*other)->Parameters()[1].second, ref[(*other)->Parameters()[1].first]));
}

TEST_F(StageTest, MemorySlotsAndMicrobatchBookkeeping) {
  v1::JobSpec spec = SmallSpec();
  spec.mutable_pipeline()->set_memory_slots(2);
  auto stage = Stage::FromJobSpec(spec, 2, at::Device(at::kCPU));
  ASSERT_TRUE(stage.ok());
  at::Tensor h = at::randn({2, 16, 32});
  ASSERT_TRUE((*stage)->Forward(0, h).ok());
  EXPECT_EQ((*stage)->Forward(0, h).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE((*stage)->Forward(1, h).ok());
  auto third = (*stage)->Forward(2, h);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("stage 2"), std::string::npos);
  EXPECT_EQ((*stage)->Backward(7, h).status().code(), absl::StatusCode::kNotFound);
  auto g = (*stage)->Backward(0, at::ones({2, 16, 32}));
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->sizes(), h.sizes());
  EXPECT_EQ((*stage)->visits(), 1);
  EXPECT_EQ((*stage)->in_flight(), 1);
  ASSERT_TRUE((*stage)->Forward(2, h).ok());
  (*stage)->DropAll();
  EXPECT_EQ((*stage)->in_flight(), 0);
}

// Activation recomputation changes memory, not results: outputs, input
// gradients and parameter gradients are bit-identical to keeping the graph,
// on stage 0 (tokens, with the loss) and on a middle stage.
TEST_F(StageTest, RecomputedActivationsGiveIdenticalGradients) {
  for (int index : {0, 2}) {
    SCOPED_TRACE(index);
    v1::JobSpec spec = SmallSpec();
    spec.mutable_pipeline()->set_memory_slots(5);
    auto plain = Stage::FromJobSpec(spec, index, at::Device(at::kCPU));
    spec.mutable_pipeline()->set_recompute_activations(true);
    auto again = Stage::FromJobSpec(spec, index, at::Device(at::kCPU));
    ASSERT_TRUE(plain.ok() && again.ok());
    at::manual_seed(3);
    const at::Tensor in =
        index == 0 ? at::randint(0, 256, {2, 16}, at::kLong) : at::randn({2, 16, 32});
    const at::Tensor grad = at::randn({2, 16, 32});
    for (Stage* st : {plain->get(), again->get()}) {
      for (uint32_t mb : {0u, 1u}) ASSERT_TRUE(st->Forward(mb, in).ok());
    }
    auto a = (*plain)->Forward(5, in);
    auto b = (*again)->Forward(5, in);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(at::equal(*a, *b));
    EXPECT_FALSE(b->requires_grad());
    // What it is for: a slot without the graph holds a small part of the
    // heap a slot with it holds (the allocator's count of bytes in use).
    auto heap = ::detour::testing::HeapBytesInUse;
    const double h0 = heap();
    ASSERT_TRUE((*plain)->Forward(6, in).ok());
    const double kept = heap() - h0;
    const double h1 = heap();
    ASSERT_TRUE((*again)->Forward(6, in).ok());
    const double recomputed = heap() - h1;
    EXPECT_LT(recomputed, 0.5 * kept) << recomputed << " vs " << kept;
    (*plain)->Drop(6);
    (*again)->Drop(6);
    for (uint32_t mb : {0u, 1u, 5u}) {
      auto ga = (*plain)->Backward(mb, grad);
      auto gb = (*again)->Backward(mb, grad);
      ASSERT_TRUE(ga.ok() && gb.ok()) << ga.status() << gb.status();
      EXPECT_EQ(ga->defined(), gb->defined());
      if (ga->defined()) {
        EXPECT_TRUE(at::equal(*ga, *gb));
      }
    }
    EXPECT_EQ((*again)->Backward(1, grad).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*again)->Forward(9, in).ok(), true);
    EXPECT_EQ((*again)->Backward(9, at::ones({2, 16, 31})).status().code(),
              absl::StatusCode::kInvalidArgument);
    auto pa = (*plain)->Parameters();
    auto pb = (*again)->Parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      if (!pa[i].second.grad().defined()) {
        EXPECT_FALSE(pb[i].second.grad().defined()) << pa[i].first;
        continue;
      }
      EXPECT_TRUE(at::equal(pa[i].second.grad(), pb[i].second.grad())) << pa[i].first;
    }
  }
}

// The gradients of four microbatches summed with their backwards in two
// different orders: ordered accumulation gives the same bits, on stage 0
// (the loss's pass, then the blocks' pass of each microbatch, interleaved
// with the others') and on a middle stage; summed as they run, they differ
// (float addition does not associate).
TEST_F(StageTest, OrderedAccumulationSumsInMicrobatchOrderWhateverTheRunOrder) {
  auto run = [](int index, bool ordered, const std::vector<uint32_t>& order) {
    v1::JobSpec spec = SmallSpec();
    spec.mutable_pipeline()->set_memory_slots(4);
    auto stage = Stage::FromJobSpec(spec, index, at::Device(at::kCPU));
    EXPECT_TRUE(stage.ok()) << stage.status();
    (*stage)->SetOrderedAccumulation(ordered);
    at::manual_seed(11);
    std::map<uint32_t, at::Tensor> grad, targets, hidden;
    for (uint32_t mb = 0; mb < 4; ++mb) {
      const at::Tensor in =
          index == 0 ? at::randint(0, 256, {2, 16}, at::kLong) : at::randn({2, 16, 32});
      grad[mb] = at::randn({2, 16, 32}) * static_cast<double>(mb + 1) * 1e3;
      targets[mb] = at::randint(0, 256, {2, 16}, at::kLong);
      hidden[mb] = at::randn({2, 16, 32}) * static_cast<double>(mb + 1);
      EXPECT_TRUE((*stage)->Forward(mb, in).ok());
    }
    for (uint32_t mb : order) {
      if (index == 0) {
        auto loss = (*stage)->LossAndBackward(mb, hidden[mb], targets[mb]);
        EXPECT_TRUE(loss.ok()) << loss.status();
      }
    }
    for (uint32_t mb : order) EXPECT_TRUE((*stage)->Backward(mb, grad[mb]).ok());
    EXPECT_EQ((*stage)->kept_gradients(), ordered ? 4u : 0u);
    EXPECT_TRUE((*stage)->FoldGradients(2).ok());
    EXPECT_EQ((*stage)->kept_gradients(), ordered ? 2u : 0u);
    EXPECT_TRUE((*stage)->FoldGradients().ok());
    EXPECT_EQ((*stage)->kept_gradients(), 0u);
    EXPECT_EQ((*stage)->visits(), 4);
    std::vector<at::Tensor> out;
    for (const auto& [name, p] : (*stage)->Parameters()) out.push_back(p.grad().clone());
    return out;
  };
  auto same = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].defined() != b[i].defined()) return false;
      if (a[i].defined() && !at::equal(a[i], b[i])) return false;
    }
    return true;
  };
  for (int index : {0, 2}) {
    SCOPED_TRACE(index);
    const std::vector<uint32_t> forward = {0, 1, 2, 3};
    const std::vector<uint32_t> shuffled = {3, 1, 0, 2};
    EXPECT_TRUE(same(run(index, true, forward), run(index, true, shuffled)));
    EXPECT_FALSE(same(run(index, false, forward), run(index, false, shuffled)));
    // In order, ordered accumulation is the plain sum.
    EXPECT_TRUE(same(run(index, true, forward), run(index, false, forward)));
  }
}

TEST_F(StageTest, BadInputsAreStatusesWithContext) {
  v1::JobSpec spec = SmallSpec();
  auto s2 = Stage::FromJobSpec(spec, 2, at::Device(at::kCPU));
  auto s0 = Stage::FromJobSpec(spec, 0, at::Device(at::kCPU));
  ASSERT_TRUE(s2.ok() && s0.ok());
  auto bad = (*s2)->Forward(0, at::randn({4, 16, 48}));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("stage 2 forward mb 0: shape [4,16,48]"), std::string::npos)
      << bad.status();
  EXPECT_NE(bad.status().message().find("32]"), std::string::npos);
  // Too long for the context.
  EXPECT_FALSE((*s2)->Forward(0, at::randn({1, 17, 32})).ok());
  // Stage 0 wants token ids, and ids inside the vocabulary.
  EXPECT_FALSE((*s0)->Forward(0, at::randn({1, 8, 32})).ok());
  auto oob = (*s0)->Forward(1, at::full({1, 8}, 999, at::kLong));
  EXPECT_FALSE(oob.ok());
  EXPECT_NE(oob.status().message().find("stage 0 forward mb 1"), std::string::npos);
  EXPECT_EQ((*s0)->in_flight(), 0);
  // Loss only on stage 0; wrong gradient shape refused.
  EXPECT_EQ((*s2)
                ->LossAndBackward(0, at::randn({1, 8, 32}), at::zeros({1, 8}, at::kLong))
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*s2)->Forward(3, at::randn({1, 8, 32})).ok());
  EXPECT_EQ((*s2)->Backward(3, at::randn({1, 8, 31})).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(StageTest, GradientNormalizationScale) {
  EXPECT_DOUBLE_EQ(GradNormalizationScale(v1::GRAD_NORM_VISITS, 3, 8), 1.0 / 3);
  EXPECT_DOUBLE_EQ(GradNormalizationScale(v1::GRAD_NORM_TOTAL, 3, 8), 1.0 / 8);
  EXPECT_DOUBLE_EQ(GradNormalizationScale(v1::GRAD_NORM_UNSPECIFIED, 4, 8), 0.25);
  EXPECT_DOUBLE_EQ(GradNormalizationScale(v1::GRAD_NORM_VISITS, 0, 8), 0.0);
}

TEST_F(StageTest, RotaryIsARotation) {
  ModelConfig c;
  c.num_layers = 1;
  c.d_model = 16;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.context_length = 8;
  RotaryTables rope = RotaryTables::Make(c, at::Device(at::kCPU));
  at::Tensor x = at::randn({1, 2, 8, 8});
  at::Tensor y = ApplyRotary(x, rope);
  // Norm preserved per position; position 0 unchanged.
  EXPECT_LT(MaxAbsDiff(x.norm(2, -1), y.norm(2, -1)), 1e-5);
  EXPECT_LT(MaxAbsDiff(x.select(2, 0), y.select(2, 0)), 1e-7);
  // Relative: <R_m q, R_n k> depends only on m-n.
  at::Tensor q = at::randn({8});
  at::Tensor k = at::randn({8});
  auto rot = [&](const at::Tensor& v, int pos) {
    at::Tensor t = v.view({1, 1, 1, 8}).expand({1, 1, 8, 8}).contiguous();
    return ApplyRotary(t, rope).select(2, pos).flatten();
  };
  const double d1 = at::dot(rot(q, 5), rot(k, 3)).item<double>();
  const double d2 = at::dot(rot(q, 2), rot(k, 0)).item<double>();
  EXPECT_NEAR(d1, d2, 1e-5);
}

}  // namespace
}  // namespace detour::model
