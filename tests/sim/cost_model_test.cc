#include "common/sim/cost_model.h"

#include <gtest/gtest.h>

#include <string>

#include "common/spec.h"
#include "tests/test_paths.h"

namespace detour::sim {
namespace {

using detour::testing::SourceDir;

v1::ClusterSpec TwoRegionCluster() {
  v1::ClusterSpec c;
  c.set_name("two");
  auto* a = c.add_nodes();
  a->set_id("a");
  a->set_region("east");
  auto* b = c.add_nodes();
  b->set_id("b");
  b->set_region("west");
  b->set_speed(2.0);
  auto* c2 = c.add_nodes();
  c2->set_id("c");
  c2->set_region("east");
  auto* l = c.add_links();
  l->set_region_a("east");
  l->set_region_b("west");
  l->set_latency_ms(50);
  l->set_bandwidth_gbytes_per_s(0.5);
  return c;
}

v1::JobSpec SmallJob() {
  v1::JobSpec j;
  j.set_name("j");
  j.set_iterations(1);
  j.mutable_model()->set_preset("1.5b");
  auto* p = j.mutable_pipeline();
  p->set_num_stages(2);
  p->set_samples_per_microbatch(2);
  return j;
}

TEST(CostModelTest, ModelArithmeticFor15B) {
  v1::ModelShape shape;
  shape.set_d_model(2048);
  shape.set_num_heads(16);
  shape.set_ffn_dim(8192);
  shape.set_context_length(4096);
  shape.set_vocab_size(32000);
  ModelCosts c = ComputeModelCosts(shape);
  const double params = 4.0 * 2048 * 2048 + 3.0 * 2048 * 8192 + 2 * 2048;
  EXPECT_DOUBLE_EQ(c.params_per_layer, params);
  EXPECT_DOUBLE_EQ(c.forward_flops_per_token_per_layer, 2 * params + 2.0 * 4096 * 2048);
  EXPECT_DOUBLE_EQ(c.stage0_extra_params, 2.0 * 32000 * 2048 + 2048);
  // Grouped-query attention shrinks k and v.
  shape.set_num_kv_heads(4);
  EXPECT_DOUBLE_EQ(ComputeModelCosts(shape).params_per_layer, params - 2.0 * 2048 * 2048 * 3 / 4);
}

TEST(CostModelTest, LayersSplitEvenlyWithRemainderAtTheEnd) {
  EXPECT_EQ(LayersPerStage(24, 6), std::vector<int>({4, 4, 4, 4, 4, 4}));
  EXPECT_EQ(LayersPerStage(8, 3), std::vector<int>({2, 3, 3}));
}

TEST(CostModelTest, CreateDerivesTimesFromSpecs) {
  auto m = CostModel::Create(TwoRegionCluster(), SmallJob());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_nodes(), 3);
  EXPECT_EQ(m->num_stages(), 2);
  EXPECT_EQ(m->NodeIndex("b"), 1);
  EXPECT_EQ(m->NodeIndex("zz"), -1);
  // 12 layers per stage, 8192 tokens, 100 TFLOP/s by default.
  v1::ModelShape shape = *ModelPreset("1.5b");
  const double flops = 12 * ComputeModelCosts(shape).forward_flops_per_token_per_layer * 8192;
  EXPECT_NEAR(m->ForwardTime(0, 1), flops / 100e12, 1e-12);
  EXPECT_NEAR(m->ForwardTime(1, 1), flops / 200e12, 1e-12);  // speed 2
  EXPECT_NEAR(m->BackwardTime(0, 1), 2 * m->ForwardTime(0, 1), 1e-12);
  EXPECT_NEAR(m->LossTime(0), 0.25 * m->ForwardTime(0, 0), 1e-12);
  // 8192 tokens × 2048 × 2 bytes.
  EXPECT_DOUBLE_EQ(m->activation_bytes(), 8192.0 * 2048 * 2);
  EXPECT_DOUBLE_EQ(m->Latency(0, 1), 0.05);
  EXPECT_DOUBLE_EQ(m->Bandwidth(1, 0), 0.5e9);
  EXPECT_DOUBLE_EQ(m->Latency(0, 2), 0.001);  // Intra-region default.
  EXPECT_DOUBLE_EQ(m->Bandwidth(0, 2), 5e9);
  EXPECT_NEAR(m->TransferTime(0, 1), 0.05 + 8192.0 * 2048 * 2 / 0.5e9, 1e-12);
  // Override the hardware constant.
  auto fast = CostModel::Create(TwoRegionCluster(), SmallJob(), 200);
  ASSERT_TRUE(fast.ok());
  EXPECT_NEAR(fast->ForwardTime(0, 1), m->ForwardTime(0, 1) / 2, 1e-12);
}

TEST(CostModelTest, MissingRegionPairIsAnError) {
  v1::ClusterSpec c = TwoRegionCluster();
  c.mutable_nodes(2)->set_region("north");
  auto m = CostModel::Create(c, SmallJob());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("north"), std::string::npos) << m.status();
}

TEST(CostModelTest, ZeroBandwidthIsAnError) {
  v1::ClusterSpec c = TwoRegionCluster();
  c.mutable_links(0)->set_bandwidth_gbytes_per_s(0);
  auto m = CostModel::Create(c, SmallJob());
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("bandwidth"), std::string::npos) << m.status();
}

TEST(CostModelTest, TablesAreChecked) {
  CostTables t;
  EXPECT_FALSE(CostModel::FromTables(t).ok());
  t.node_ids = {"a", "b"};
  t.memory_slots = {1, 1};
  t.forward_s = t.backward_s = {{1}, {1}};
  t.loss_s = {1, 1};
  t.latency_s = {{0, 0}, {0, 0}};
  t.bandwidth_bytes_per_s = {{0, 1}, {0, 0}};
  t.stage_gradient_bytes = {0};
  auto m = CostModel::FromTables(t);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("b -> a"), std::string::npos) << m.status();
}

TEST(CostModelTest, ShippedExampleLoads) {
  auto cluster = LoadClusterSpec(SourceDir() + "/examples/clusters/geo20.json");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto job = LoadJobSpec(SourceDir() + "/examples/jobs/geo20_1.5b.json");
  ASSERT_TRUE(job.ok()) << job.status();
  auto m = CostModel::Create(*cluster, *job);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_nodes(), 20);
  EXPECT_EQ(m->num_stages(), 6);
  EXPECT_GT(m->AllReduceTime({0, 1, 2}, 1), 0);
}

}  // namespace
}  // namespace detour::sim
