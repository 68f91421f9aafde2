// The region table as lookups (common/region_links.h).
#include "common/region_links.h"

#include "gtest/gtest.h"

namespace detour {
namespace {

v1::ClusterSpec Table() {
  v1::ClusterSpec net;
  net.set_intra_region_latency_ms(0.5);
  net.set_intra_region_bandwidth_gbytes_per_s(10);
  v1::RegionLink* l = net.add_links();
  l->set_region_a("Oregon");
  l->set_region_b("Ireland");
  l->set_latency_ms(62);
  l->set_bandwidth_gbytes_per_s(0.25);
  l = net.add_links();
  l->set_region_a("Ireland");
  l->set_region_b("Tokyo");
  l->set_latency_ms(105);
  l->set_bandwidth_gbytes_per_s(0.1);
  return net;
}

TEST(RegionLinksTest, ALinkReadsTheSameInEitherOrder) {
  const RegionLinks links(Table());
  for (const auto& [a, b] :
       {std::pair<const char*, const char*>{"Oregon", "Ireland"}, {"Ireland", "Oregon"}}) {
    auto f = links.Between(a, b);
    ASSERT_TRUE(f.has_value()) << a << "-" << b;
    EXPECT_EQ(f->latency_ms, 62);
    EXPECT_EQ(f->bandwidth_gbytes_per_s, 0.25);
  }
  auto f = links.Between("Tokyo", "Ireland");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->latency_ms, 105);
}

TEST(RegionLinksTest, WithinARegionTheIntraRegionFigures) {
  auto f = RegionLinks(Table()).Between("Tokyo", "Tokyo");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->latency_ms, 0.5);
  EXPECT_EQ(f->bandwidth_gbytes_per_s, 10);
  // Unset: 0, for the caller to read as it must.
  f = RegionLinks(v1::ClusterSpec()).Between("x", "x");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->latency_ms, 0);
  EXPECT_EQ(f->bandwidth_gbytes_per_s, 0);
}

TEST(RegionLinksTest, AnUnlistedPairIsNotFound) {
  const RegionLinks links(Table());
  EXPECT_FALSE(links.Between("Oregon", "Tokyo").has_value());
  EXPECT_FALSE(links.Between("Oregon", "Mars").has_value());
  EXPECT_FALSE(RegionLinks(v1::ClusterSpec()).Between("a", "b").has_value());
}

}  // namespace
}  // namespace detour
