#include "tools/detour_wanem/control.h"

#include <string>

#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tools/detour_wanem/link_table.h"

namespace detour::wanem {
namespace {

using ::testing::HasSubstr;

constexpr char kCluster[] = R"({
  "nodes": [{"id": "a", "region": "R1"}, {"id": "b", "region": "R2"},
            {"id": "c", "region": "R2"}],
  "links": [{"region_a": "R1", "region_b": "R2", "latency_ms": 20,
             "bandwidth_gbytes_per_s": 0.5}],
  "intra_region_latency_ms": 3, "intra_region_bandwidth_gbytes_per_s": 2
})";

v1::ClusterSpec Cluster(const char* json = kCluster) {
  auto spec = ParseClusterSpecJson(json);
  EXPECT_TRUE(spec.ok()) << spec.status();
  auto normalized = NormalizeClusterSpec(*spec);
  EXPECT_TRUE(normalized.ok()) << normalized.status();
  return *normalized;
}

LinkTable Table(double scale = 1.0) {
  LinkTableOptions options;
  options.bandwidth_scale = scale;
  auto t = LinkTable::FromCluster(Cluster(), options);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(WanLinkTableTest, TakesOneWayLatencyAndScaledBandwidthFromTheSpec) {
  LinkTable t = Table(0.01);
  ASSERT_EQ(t.size(), 3);
  const int a = t.FindNode("a"), b = t.FindNode("b"), c = t.FindNode("c");
  // latency_ms is one-way in the simulator (common/sim/cost_model.cc); so here.
  EXPECT_EQ(t.link(a, b).params().delay_ms, 20);
  EXPECT_EQ(t.link(b, a).params().delay_ms, 20);
  EXPECT_DOUBLE_EQ(t.link(a, b).params().rate_bytes_per_s, 0.5e9 * 0.01);
  EXPECT_EQ(t.link(b, c).params().delay_ms, 3);
  EXPECT_DOUBLE_EQ(t.link(c, b).params().rate_bytes_per_s, 2e9 * 0.01);
  EXPECT_EQ(t.FindNode("zz"), -1);
}

TEST(WanLinkTableTest, AddressesFollowTheNodeOrder) {
  LinkTable t = Table();
  EXPECT_EQ(FormatIpv4(t.node(0).address), "10.77.0.1");
  EXPECT_EQ(FormatIpv4(t.node(2).address), "10.77.0.3");
  EXPECT_EQ(t.NodeForAddress(0x0a4d0002u), 1);
  EXPECT_EQ(t.NodeForAddress(0x0a4d0000u), -1);  // the network address
  EXPECT_EQ(t.NodeForAddress(0x0a4d0004u), -1);  // past the last node
  EXPECT_EQ(t.NodeForAddress(0x0a4e0001u), -1);  // another subnet
}

TEST(WanLinkTableTest, RejectsWhatCannotBeEmulated) {
  LinkTableOptions options;
  options.bandwidth_scale = 0;
  EXPECT_THAT(LinkTable::FromCluster(Cluster(), options).status().message(),
              HasSubstr("bandwidth_scale: 0 must be in (0, 1000]"));
  options = {};
  options.subnet = {0xc0a80000u, 30};  // two addresses for three nodes
  EXPECT_THAT(LinkTable::FromCluster(Cluster(), options).status().message(),
              HasSubstr("do not fit in 192.168.0.0/30"));
  v1::ClusterSpec spec = Cluster();
  spec.mutable_nodes(1)->set_id("b/x");
  EXPECT_THAT(LinkTable::FromCluster(spec, {}).status().message(),
              HasSubstr("nodes[1].id: 'b/x' cannot name a network namespace"));
  spec = Cluster();
  spec.mutable_nodes(2)->set_region("R3");
  EXPECT_THAT(LinkTable::FromCluster(spec, {}).status().message(),
              HasSubstr("no link between regions"));
}

TEST(WanSubnetTest, ParsesAndRejects) {
  auto s = ParseSubnet("10.78.0.0/24");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->base, 0x0a4e0000u);
  EXPECT_EQ(s->prefix_len, 24);
  for (const char* bad : {"10.78.0.0", "10.78.0/16", "10.78.0.1/16", "10.78.0.0/31", "10.78.0.0/7",
                          "10.300.0.0/16", "a.b.c.d/16", "10.78.0.0/x"}) {
    EXPECT_FALSE(ParseSubnet(bad).ok()) << bad;
  }
}

TEST(WanControlTest, SetChangesOnlyTheNamedDirection) {
  LinkTable t = Table();
  const ControlReply r =
      HandleControlLine("set a b delay_ms=7.5 jitter_ms=2 rate_mbytes=3 loss=0.25 queue_kb=10", &t);
  EXPECT_EQ(r.text, "ok\n");
  EXPECT_FALSE(r.quit);
  const LinkParams& p = t.link(0, 1).params();
  EXPECT_EQ(p.delay_ms, 7.5);
  EXPECT_EQ(p.jitter_ms, 2);
  EXPECT_EQ(p.rate_bytes_per_s, 3e6);
  EXPECT_EQ(p.loss, 0.25);
  EXPECT_EQ(p.queue_bytes, 10 * 1024);
  EXPECT_EQ(t.link(1, 0).params().delay_ms, 20) << "the reverse direction changed";
}

TEST(WanControlTest, BothAndWildcardsCoverTheirLinks) {
  LinkTable t = Table();
  EXPECT_EQ(HandleControlLine("set a b both loss=0.5", &t).text, "ok\n");
  EXPECT_EQ(t.link(0, 1).params().loss, 0.5);
  EXPECT_EQ(t.link(1, 0).params().loss, 0.5);
  EXPECT_EQ(t.link(0, 2).params().loss, 0);
  EXPECT_EQ(HandleControlLine("cut * c", &t).text, "ok\n");
  EXPECT_TRUE(t.link(0, 2).params().cut);
  EXPECT_TRUE(t.link(1, 2).params().cut);
  EXPECT_FALSE(t.link(2, 0).params().cut);
  EXPECT_EQ(HandleControlLine("restore * *", &t).text, "ok\n");
  for (int s = 0; s < 3; ++s) {
    for (int d = 0; d < 3; ++d) EXPECT_FALSE(t.link(s, d).params().cut);
  }
}

TEST(WanControlTest, ShowStatsAndNodesPrintLinesThenOk) {
  LinkTable t = Table();
  ASSERT_EQ(HandleControlLine("cut a b", &t).text, "ok\n");
  EXPECT_EQ(HandleControlLine("show a b", &t).text,
            "a b delay_ms=20 jitter_ms=0 rate_mbytes=500 loss=0 queue_kb=19531(auto) reorder=0 "
            "cut\nok\n");
  EXPECT_EQ(HandleControlLine("stats", &t).text, "ok\n") << "links without traffic are left out";
  t.link(0, 1).Admit(0, 100);
  t.link(0, 1).Admit(0, 100);
  EXPECT_EQ(HandleControlLine("stats", &t).text,
            "a b delivered_packets=0 delivered_bytes=0 admitted_packets=0 dropped_loss=0 "
            "dropped_cut=2 dropped_queue=0\nok\n");
  EXPECT_EQ(HandleControlLine("nodes", &t).text,
            "a R1 10.77.0.1\nb R2 10.77.0.2\nc R2 10.77.0.3\nok\n");
  EXPECT_EQ(HandleControlLine("ping", &t).text, "ok\n");
  const ControlReply quit = HandleControlLine("quit", &t);
  EXPECT_EQ(quit.text, "ok\n");
  EXPECT_TRUE(quit.quit);
}

TEST(WanControlTest, BadLinesGetSpecificErrors) {
  LinkTable t = Table();
  const struct {
    std::string line;
    std::string error;
  } cases[] = {
      {"", "error: empty command\n"},
      {"   ", "error: empty command\n"},
      {"frobnicate a b", "error: unknown command 'frobnicate'"},
      {"set a", "error: set needs SRC DST"},
      {"cut a", "error: cut needs SRC DST"},
      {"set a zz delay_ms=1", "error: unknown node 'zz'"},
      {"set a a delay_ms=1", "error: a a: a node has no link to itself"},
      {"set a b", "error: set needs at least one key=value"},
      {"set a b both", "error: set needs at least one key=value"},
      {"set a b delay_ms", "error: 'delay_ms' is not key=value"},
      {"set a b delay_ms=", "error: delay_ms= is not a number"},
      {"set a b delay_ms=abc", "error: delay_ms=abc is not a number"},
      {"set a b delay_ms=nan", "error: delay_ms=nan is not a number"},
      {"set a b delay_ms=-1", "error: delay_ms=-1 is outside [0, 60000]"},
      {"set a b delay_ms=60001", "error: delay_ms=60001 is outside [0, 60000]"},
      {"set a b jitter_ms=1e9", "error: jitter_ms=1e9 is outside [0, 60000]"},
      {"set a b loss=1.5", "error: loss=1.5 is outside [0, 1]"},
      {"set a b rate_mbytes=100001", "error: rate_mbytes=100001 is outside [0, 100000]"},
      {"set a b queue_kb=1.5", "error: queue_kb=1.5 is not a whole number"},
      {"set a b queue_kb=-1", "error: queue_kb=-1 is outside [0, 1048576]"},
      {"set a b reorder=yes", "error: reorder=yes must be 0 or 1"},
      {"set a b delay_ms=1 delay_ms=2", "error: delay_ms given twice"},
      {"set a b colour=red", "error: unknown parameter 'colour'"},
      {"cut a b sideways", "error: cut: unexpected argument 'sideways'"},
      {"stats a", "error: stats needs SRC DST"},
      {"ping now", "error: ping: unexpected argument 'now'"},
      {"set a b\x01 delay_ms=1", "error: line holds a control character"},
      {std::string(1025, 'x'), "error: line is 1025 bytes, the limit is 1024"},
  };
  for (const auto& c : cases) {
    const ControlReply r = HandleControlLine(c.line, &t);
    EXPECT_THAT(r.text, HasSubstr(c.error)) << "line: " << c.line.substr(0, 40);
    EXPECT_EQ(r.text.back(), '\n');
    EXPECT_FALSE(r.quit);
  }
  // Nothing of the rejected lines took effect.
  EXPECT_EQ(t.link(0, 1).params().delay_ms, 20);
  EXPECT_FALSE(t.link(0, 1).params().cut);
}

TEST(WanControlTest, AcceptsCarriageReturnAndTabs) {
  LinkTable t = Table();
  EXPECT_EQ(HandleControlLine("set\ta b\tloss=0.1\r", &t).text, "ok\n");
  EXPECT_EQ(t.link(0, 1).params().loss, 0.1);
}

}  // namespace
}  // namespace detour::wanem
