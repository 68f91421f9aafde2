// The shared K-FAC workload description: names, dimensions, FLOPs, bytes and
// the replica-sync choice read from a spec.
#include "common/kfac_workload.h"

#include <gtest/gtest.h>

#include "common/spec.h"

namespace detour::kfac {
namespace {

TEST(KfacWorkload, ProjectionsAndShapes) {
  ASSERT_EQ(ModuleNames().size(), static_cast<size_t>(kNumProjections));
  EXPECT_EQ(ModuleNames()[0], "q");
  EXPECT_EQ(ModuleNames()[6], "down");
  EXPECT_EQ(ModuleIndex("gate"), 4);
  EXPECT_EQ(ModuleIndex("nope"), -1);
  EXPECT_STREQ(Projections()[6].param_suffix, "w_down");
  EXPECT_EQ(Projections()[2].input, kAttnIn);
  EXPECT_EQ(Projections()[5].input, kMlpIn);

  // The 1.5b preset after defaults: d 2048, 16 heads, ffn 8192.
  auto preset = ModelPreset("1.5b");
  ASSERT_TRUE(preset.ok());
  const BlockWorkload b(*preset);
  EXPECT_EQ(b.f_in(6), 8192);
  EXPECT_EQ(b.f_out(4), 8192);
  EXPECT_EQ(b.input_dim(kMlpHidden), 8192);
  // Factors: A 3·2048² + 8192², B 5·2048² (q k v o down) + 2·8192², 2 counts.
  const int64_t d2 = 2048LL * 2048, f2 = 8192LL * 8192;
  EXPECT_EQ(b.FactorSyncElements(), 3 * d2 + f2 + 5 * d2 + 2 * f2 + 2);
  EXPECT_EQ(b.ProjectionElements(), 4 * d2 + 3 * 2048LL * 8192);
  // Default ffn as the model's: 8d/3 rounded up to 64; kv from the heads.
  v1::ModelShape s;
  s.set_d_model(96);
  s.set_num_heads(4);
  s.set_num_kv_heads(1);
  const BlockShape shape = BlockShapeOf(s);
  EXPECT_EQ(shape.ffn_dim, 256);
  EXPECT_EQ(shape.kv_dim, 24);
}

TEST(KfacWorkload, Flops) {
  BlockShape s;
  s.d_model = 4;
  s.kv_dim = 2;
  s.ffn_dim = 8;
  const BlockWorkload b(s);
  EXPECT_DOUBLE_EQ(b.CurvatureAFlops(10), 2 * 10 * (16 + 16 + 16 + 64));
  EXPECT_DOUBLE_EQ(b.CurvatureBFlops(10), 2 * 10 * (16 + 4 + 4 + 16 + 64 + 64 + 16));
  EXPECT_DOUBLE_EQ(b.InvertAFlops(6), 512);
  EXPECT_DOUBLE_EQ(b.InvertBFlops(1), 8);
}

TEST(KfacWorkload, ReplicaSync) {
  BlockShape s;
  s.d_model = 8;
  s.kv_dim = 8;
  s.ffn_dim = 16;
  const BlockWorkload b(s);
  const double bytes = 4.0 * b.FactorSyncElements();
  EXPECT_DOUBLE_EQ(SyncSeconds(b, ReplicaSync::kFactors, 3, 1e3), bytes / 1e3);
  EXPECT_EQ(SyncSeconds(b, ReplicaSync::kFactors, 1, 1e3), 0);
  EXPECT_EQ(SyncSeconds(b, ReplicaSync::kPreconditioned, 3, 1e3), 0);
  EXPECT_EQ(SyncSeconds(b, ReplicaSync::kNone, 3, 1e3), 0);
  EXPECT_EQ(SyncSeconds(b, ReplicaSync::kFactors, 3, 0), 0);

  v1::KfacSpec k;
  EXPECT_EQ(ReplicaSyncOf(k), ReplicaSync::kNone);
  k.set_sync_factors(true);
  EXPECT_EQ(ReplicaSyncOf(k), ReplicaSync::kFactors);
  k.set_sync_factors(false);
  k.set_replica_sync(v1::KFAC_REPLICA_SYNC_PRECONDITIONED);
  EXPECT_EQ(ReplicaSyncOf(k), ReplicaSync::kPreconditioned);
}

}  // namespace
}  // namespace detour::kfac
