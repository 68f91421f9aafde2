// The shared K-FAC workload description: names, dimensions, FLOPs, bytes and
// the replica-sync choice read from a spec.
#include "common/kfac_workload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>

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

// The lightest heaviest run over every split of `w` into `parts` runs
// (exhaustive, for checking SplitIntoParts).
int64_t BestHeaviest(const std::vector<int64_t>& w, int parts) {
  const int n = static_cast<int>(w.size());
  int64_t best = std::numeric_limits<int64_t>::max();
  // Cut masks over the n-1 gaps with exactly parts-1 cuts.
  for (uint32_t mask = 0; mask < (1u << (n - 1)); ++mask) {
    if (__builtin_popcount(mask) != parts - 1) continue;
    int64_t heaviest = 0, sum = 0;
    for (int i = 0; i < n; ++i) {
      sum += w[i];
      if (i == n - 1 || (mask >> i) & 1u) {
        heaviest = std::max(heaviest, sum);
        sum = 0;
      }
    }
    best = std::min(best, heaviest);
  }
  return best;
}

int64_t Heaviest(const std::vector<int64_t>& w, const std::vector<int>& bounds) {
  int64_t heaviest = 0;
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    int64_t sum = 0;
    for (int i = bounds[p]; i < bounds[p + 1]; ++i) sum += w[i];
    heaviest = std::max(heaviest, sum);
  }
  return heaviest;
}

TEST(KfacGranules, SplitIntoPartsByHand) {
  // BERT-Large's B curvature (d 1024, ffn 4096) in units of d²: q k v o
  // gate up down.
  const std::vector<int64_t> b = {1, 1, 1, 1, 16, 16, 1};
  EXPECT_EQ(SplitIntoParts(b, 1), (std::vector<int>{0, 7}));
  EXPECT_EQ(SplitIntoParts(b, 4), (std::vector<int>{0, 4, 5, 6, 7}));
  EXPECT_EQ(SplitIntoParts(b, 3), (std::vector<int>{0, 4, 5, 7}));  // 4, 16, 17
  EXPECT_EQ(SplitIntoParts(b, 7), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(SplitIntoParts(b, 99), SplitIntoParts(b, 7));  // clamped
  EXPECT_EQ(SplitIntoParts(b, 0), SplitIntoParts(b, 1));
  EXPECT_EQ(SplitIntoParts({}, 3), (std::vector<int>{0}));
  EXPECT_EQ(PartsForMaxWeight(b, 37), 1);
  EXPECT_EQ(PartsForMaxWeight(b, 16), 4);
  EXPECT_EQ(PartsForMaxWeight(b, 15), 7);  // gate alone is heavier: finest
  // 37 units take 37 ms: a 20 ms cap allows 20 units per part.
  EXPECT_EQ(PartsForCap(b, 0.037, 0.020), 2);  // q k v o gate | up down
  EXPECT_EQ(PartsForCap(b, 0.037, 0.037), 1);
  EXPECT_EQ(PartsForCap(b, 0.037, 0.001), 7);
  EXPECT_EQ(PartsForCap(b, 0.037, 0), 1);  // no cap
}

TEST(KfacGranules, SplitIntoPartsIsOptimalAndCoversEverything) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 400; ++round) {
    const int n = std::uniform_int_distribution<int>(1, 10)(rng);
    std::vector<int64_t> w(n);
    for (int64_t& v : w) v = std::uniform_int_distribution<int64_t>(0, 50)(rng);
    for (int parts = 1; parts <= n; ++parts) {
      SCOPED_TRACE(testing::Message() << "round " << round << " parts " << parts);
      const std::vector<int> bounds = SplitIntoParts(w, parts);
      ASSERT_EQ(bounds.size(), static_cast<size_t>(parts + 1));
      EXPECT_EQ(bounds.front(), 0);
      EXPECT_EQ(bounds.back(), n);
      for (size_t i = 1; i < bounds.size(); ++i) EXPECT_LT(bounds[i - 1], bounds[i]);
      EXPECT_EQ(Heaviest(w, bounds), BestHeaviest(w, parts));
      // The fewest parts under a bound reach it.
      const int64_t bound = Heaviest(w, bounds);
      const int fewest = PartsForMaxWeight(w, bound);
      EXPECT_LE(fewest, parts);
      EXPECT_LE(Heaviest(w, SplitIntoParts(w, fewest)), bound);
    }
  }
}

TEST(KfacGranules, InversionUnits) {
  EXPECT_EQ(InversionBlocks(1), 1);
  EXPECT_EQ(InversionBlocks(kUnblockedInversion), 1);
  EXPECT_EQ(InversionBlocks(kUnblockedInversion + 1), 5);  // 1025 / 256
  EXPECT_EQ(InversionBlocks(4096), 16);
  EXPECT_EQ(InversionBlocks(1 << 20), kMaxInversionBlocks);
  // Blocks tile [0, n) with widths differing by at most one... but the last.
  for (int64_t n : {1025, 2048, 3000, 4096, 8192, 100000}) {
    const int blocks = InversionBlocks(n);
    EXPECT_EQ(InversionBlockStart(n, 0), 0);
    EXPECT_EQ(InversionBlockStart(n, blocks), n);
    for (int b = 0; b < blocks; ++b) {
      EXPECT_LT(InversionBlockStart(n, b), InversionBlockStart(n, b + 1)) << n << " " << b;
    }
  }
  // Unblocked: Cholesky n³/3 and the inverse 2n³/3 (weights are 3·FLOPs).
  EXPECT_EQ(InversionUnitWeights(8), (std::vector<int64_t>{512, 1024}));
  EXPECT_TRUE(InversionUnitWeights(0).empty());
  // Blocked: 2 units per block, about n³ FLOPs in all, each a bounded share.
  for (int64_t n : {2048, 4096, 8192}) {
    const std::vector<int64_t> w = InversionUnitWeights(n);
    ASSERT_EQ(w.size(), 2u * InversionBlocks(n));
    double total = 0, heaviest = 0;
    for (int64_t v : w) {
      EXPECT_GT(v, 0);
      total += v;
      heaviest = std::max(heaviest, static_cast<double>(v));
    }
    const double cube = static_cast<double>(n) * n * n;
    EXPECT_GT(total / 3, cube) << n;
    EXPECT_LT(total / 3, 1.4 * cube) << n;
    EXPECT_LT(heaviest / total, 2.5 / InversionBlocks(n)) << n;
  }
  BlockShape s;
  s.d_model = 1024;
  s.kv_dim = 1024;
  s.ffn_dim = 4096;
  const BlockWorkload b(s);
  double w = 0;
  for (int64_t v : InversionUnitWeights(4096)) w += v;
  EXPECT_DOUBLE_EQ(b.InvertBFlops(4), w / 3);                 // gate: 4096 wide
  EXPECT_DOUBLE_EQ(b.InvertAFlops(0), 1024.0 * 1024 * 1024);  // unblocked
  EXPECT_EQ(b.CurvatureItemWeights(true),
            (std::vector<int64_t>{1 << 20, 1 << 20, 1 << 20, 1 << 24}));
  EXPECT_EQ(b.CurvatureItemWeights(false),
            (std::vector<int64_t>{1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 24, 1 << 24, 1 << 20}));
}

}  // namespace
}  // namespace detour::kfac
