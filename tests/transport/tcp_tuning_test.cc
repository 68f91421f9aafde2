// The direct transport's connection count and socket buffers from the
// bandwidth-delay product (tcp_tuning.h): parsing of /proc/sys files, the
// plan for given limits, the start-up warnings. No sockets but BBR's probe.
#include "worker/transport/tcp_tuning.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

// A throwaway /proc/sys-like tree.
class ProcDir {
 public:
  ProcDir() {
    char pattern[] = "/tmp/detour-tcp-tuning.XXXXXX";
    root_ = ::mkdtemp(pattern);
    std::filesystem::create_directories(root_ + "/net/core");
    std::filesystem::create_directories(root_ + "/net/ipv4");
  }
  ~ProcDir() { std::filesystem::remove_all(root_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(root_ + "/" + name) << text;
  }
  const std::string& root() const { return root_; }

 private:
  std::string root_;
};

TcpLimits Defaults() { return TcpLimits{}; }  // the kernel's own defaults

TEST(ParseSysctlIntsTest, AcceptsTheKernelsFormats) {
  auto one = ParseSysctlInts("212992\n", 1, "wmem_max");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, std::vector<int64_t>{212992});
  auto three = ParseSysctlInts("4096\t16384\t4194304\n", 3, "tcp_wmem");
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(*three, (std::vector<int64_t>{4096, 16384, 4194304}));
  auto spaced = ParseSysctlInts("  4096   87380 6291456", 3, "tcp_rmem");
  ASSERT_TRUE(spaced.ok()) << spaced.status();
  EXPECT_EQ((*spaced)[2], 6291456);
}

TEST(ParseSysctlIntsTest, RefusesAnythingElseNamingTheFile) {
  const struct {
    const char* text;
    int count;
  } bad[] = {{"", 1},
             {"\n", 1},
             {"1 2", 3},
             {"1 2 3 4", 3},
             {"-5", 1},
             {"+5", 1},
             {"12abc", 1},
             {"0x10", 1},
             {"1.5", 1},
             {"99999999999999999999", 1},
             {"4096 16384 x", 3}};
  for (const auto& b : bad) {
    auto parsed = ParseSysctlInts(b.text, b.count, "/proc/sys/net/x");
    EXPECT_FALSE(parsed.ok()) << "\"" << b.text << "\"";
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("/proc/sys/net/x"));
  }
}

TEST(ReadTcpLimitsTest, ReadsTheFourFiles) {
  ProcDir dir;
  dir.Write("net/core/wmem_max", "1000000\n");
  dir.Write("net/core/rmem_max", "2000000\n");
  dir.Write("net/ipv4/tcp_wmem", "4096\t16384\t3000000\n");
  dir.Write("net/ipv4/tcp_rmem", "4096\t131072\t5000000\n");
  std::vector<std::string> problems;
  TcpLimits l = ReadTcpLimits(dir.root(), &problems);
  EXPECT_TRUE(problems.empty()) << absl::StrJoin(problems, "\n");
  EXPECT_EQ(l.wmem_max, 1000000);
  EXPECT_EQ(l.rmem_max, 2000000);
  EXPECT_EQ(l.tcp_wmem[2], 3000000);
  EXPECT_EQ(l.tcp_rmem[1], 131072);
  EXPECT_EQ(l.tcp_rmem[2], 5000000);
}

TEST(ReadTcpLimitsTest, MissingOrBadFilesKeepTheDefaultsAndSaySo) {
  ProcDir dir;
  dir.Write("net/core/wmem_max", "garbage\n");
  dir.Write("net/ipv4/tcp_wmem", "4096 16384\n");  // one value short
  dir.Write("net/ipv4/tcp_rmem", "4096 131072 9000000\n");
  std::vector<std::string> problems;
  TcpLimits l = ReadTcpLimits(dir.root(), &problems);
  ASSERT_EQ(problems.size(), 3u) << absl::StrJoin(problems,
                                                  "\n");  // wmem, rmem (missing), tcp_wmem
  EXPECT_THAT(problems[0], HasSubstr("net/core/wmem_max"));
  EXPECT_THAT(problems[1], HasSubstr("net/core/rmem_max"));
  EXPECT_THAT(problems[2], HasSubstr("net/ipv4/tcp_wmem"));
  EXPECT_EQ(l.wmem_max, Defaults().wmem_max);
  EXPECT_EQ(l.tcp_wmem[2], Defaults().tcp_wmem[2]);
  EXPECT_EQ(l.tcp_rmem[2], 9000000);
  // No directory at all: every value is the default.
  problems.clear();
  l = ReadTcpLimits(dir.root() + "/nonexistent", &problems);
  EXPECT_EQ(problems.size(), 4u);
  EXPECT_EQ(l.rmem_max, Defaults().rmem_max);
}

TEST(PlanStripesTest, DefaultLimitsOverALongFastLinkUseTheMostConnectionsAndAutotuning) {
  // Defaults: tcp_wmem max 4 MiB, wmem_max 208 KiB (explicit would be
  // smaller than autotuning: 2 × 212992 < 4 MiB), tcp_rmem max 6 MiB.
  const StripePlan p = PlanStripes({1.16e9, absl::Milliseconds(100)}, Defaults());
  EXPECT_EQ(p.send_buffer, 4194304);
  EXPECT_EQ(p.receive_buffer, 6291456);
  EXPECT_NEAR(p.per_connection_rate, 0.5 * 4194304 / 0.1, 1);  // 21 MB/s
  // 1.5 × 116 MB in flight / 2 MiB usable per connection = 83 > 16.
  EXPECT_EQ(p.connections, kMaxDirectStripes);
  EXPECT_NEAR(p.total_rate, 16 * p.per_connection_rate, 1);
  EXPECT_EQ(p.sndbuf_request, 0);
  EXPECT_EQ(p.rcvbuf_request, 0);
}

TEST(PlanStripesTest, EnoughConnectionsForTheBandwidthDelayProduct) {
  // 250 MB/s × 50 ms = 12.5 MB in flight, planned with half again as much
  // room (18.75 MB); 2 MiB usable per connection: 9.
  const StripePlan p = PlanStripes({250e6, absl::Milliseconds(50)}, Defaults());
  EXPECT_EQ(p.connections, static_cast<int>(std::ceil(1.5 * 12.5e6 / (0.5 * 4194304))));
  EXPECT_EQ(p.connections, 9);
  EXPECT_GE(p.total_rate, kStripeHeadroom * 250e6);
  // Within a region (1 ms): one connection is plenty.
  EXPECT_EQ(PlanStripes({1.16e9, absl::Milliseconds(1)}, Defaults()).connections, 1);
  // The bound.
  EXPECT_EQ(PlanStripes({1.16e9, absl::Milliseconds(100)}, Defaults(), 4).connections, 4);
  EXPECT_EQ(PlanStripes({1.16e9, absl::Milliseconds(100)}, Defaults(), 0).connections, 1);
  EXPECT_EQ(PlanStripes({1.16e9, absl::Milliseconds(100)}, Defaults(), 99).connections,
            kMaxDirectStripes);
}

TEST(PlanStripesTest, UnknownOrNonsenseHintsGiveOneConnection) {
  for (LinkHint h :
       {LinkHint{}, LinkHint{1e9, absl::ZeroDuration()}, LinkHint{0, absl::Milliseconds(100)},
        LinkHint{-1, absl::Milliseconds(100)}, LinkHint{std::nan(""), absl::Milliseconds(100)},
        LinkHint{INFINITY, absl::Milliseconds(100)}, LinkHint{1e9, -absl::Milliseconds(5)}}) {
    const StripePlan p = PlanStripes(h, Defaults());
    EXPECT_EQ(p.connections, 1);
    EXPECT_EQ(p.sndbuf_request, 0);
    EXPECT_EQ(p.per_connection_rate, 0);
  }
}

TEST(PlanStripesTest, RaisedCoreCapsAreRequestedExplicitlyWhenAutotuningFallsShort) {
  // An administrator raised net.core.*mem_max to 64 MiB but left tcp_*mem.
  TcpLimits l;
  l.wmem_max = l.rmem_max = 64 << 20;
  const StripePlan p = PlanStripes({1.16e9, absl::Milliseconds(100)}, l);
  EXPECT_EQ(p.send_buffer, int64_t{128} << 20);  // the kernel doubles the request
  // 1.5 × 116 MB / (0.5 × 128 MiB) = 2.6: three connections, each needing
  // 116 MB of buffer, requested as half (58 MB), within the 64 MiB cap.
  EXPECT_EQ(p.connections, 3);
  EXPECT_EQ(p.sndbuf_request, 58000000);
  EXPECT_EQ(p.rcvbuf_request, 58000000);
  // A smaller cap: more connections (174 MB / (0.5 × 64 MiB) = 5.2), each
  // asking for its share (174 MB / 6 / 0.5 / 2).
  l.wmem_max = 32 << 20;
  const StripePlan smaller = PlanStripes({1.16e9, absl::Milliseconds(100)}, l);
  EXPECT_EQ(smaller.connections, 6);
  EXPECT_EQ(smaller.sndbuf_request, 29000000);
  // A request never exceeds the cap.
  l.wmem_max = 16 << 20;
  l.rmem_max = 16 << 20;
  const StripePlan capped = PlanStripes({4e9, absl::Milliseconds(200)}, l);
  EXPECT_EQ(capped.connections, kMaxDirectStripes);
  EXPECT_EQ(capped.sndbuf_request, 16 << 20);
  // Autotuning that reaches far enough is kept, whatever the core cap.
  TcpLimits tuned;
  tuned.wmem_max = tuned.rmem_max = 512 << 20;
  tuned.tcp_wmem[2] = tuned.tcp_rmem[2] = 512 << 20;
  const StripePlan t = PlanStripes({1.16e9, absl::Milliseconds(100)}, tuned);
  EXPECT_EQ(t.connections, 1);  // 174 MB / (0.5 × 1 GiB) = 0.3
  EXPECT_EQ(t.sndbuf_request, 0);
  EXPECT_EQ(t.rcvbuf_request, 0);
}

TEST(StripeChunkBytesTest, EveryStripeGetsTheSameNumberOrMebibyteChunks) {
  constexpr size_t kMiB = 1 << 20, k4 = 4 * kMiB, k8 = 8 * kMiB;
  // 64 MiB over 11: 4 MiB would leave some stripes two chunks and some one;
  // 22 chunks of under 3 MiB give each two.
  const size_t c64 = StripeChunkBytes(64 * kMiB, 11, k4, k8);
  EXPECT_LE(c64, k4);
  EXPECT_EQ(c64 % 4096, 0u);
  EXPECT_EQ((64 * kMiB + c64 - 1) / c64, 22u);
  // 16 MiB over 3: two chunks each, not 4 MiB chunks two on one stripe.
  const size_t c16 = StripeChunkBytes(16 * kMiB, 3, k4, k8);
  EXPECT_EQ((16 * kMiB + c16 - 1) / c16, 6u);
  // 16 MiB over 4 and 64 MiB over 4: the longest chunk already fits.
  EXPECT_EQ(StripeChunkBytes(16 * kMiB, 4, k4, k8), k4);
  EXPECT_EQ(StripeChunkBytes(64 * kMiB, 4, k4, k8), k4);
  // Less than a longest chunk per stripe (16 MiB over 11, 8 MiB over 4):
  // 1 MiB chunks, more than the stripes, so that every stripe can take some.
  EXPECT_EQ(StripeChunkBytes(16 * kMiB, 11, k4, k8), kMiB);
  EXPECT_EQ(StripeChunkBytes(k8, 4, k4, k8), kMiB);
  EXPECT_EQ(StripeChunkBytes(k8, 16, k4, k8), kMiB);
  // Below the threshold, over one connection or none known: the longest.
  EXPECT_EQ(StripeChunkBytes(7 * kMiB, 11, k4, k8), k4);
  EXPECT_EQ(StripeChunkBytes(16 * kMiB, 1, k4, k8), k4);
  EXPECT_EQ(StripeChunkBytes(16 * kMiB, 0, k4, k8), k4);
  // Never under 4 KiB, nor over the longest however large the stripes' share.
  EXPECT_EQ(StripeChunkBytes(size_t{1} << 40, 16, k4, k8), k4);
  EXPECT_EQ(StripeChunkBytes(k8, 16, 1, k8), 4096u);
}

TEST(TcpLimitWarningsTest, NamesTheSettingTheRateAndWhatWouldSuffice) {
  const LinkHint hint{1.16e9, absl::Milliseconds(100)};
  TcpLimits l;  // defaults: both directions cap the link
  const std::vector<std::string> w = TcpLimitWarnings(hint, l, PlanStripes(hint, l));
  ASSERT_EQ(w.size(), 2u);
  EXPECT_THAT(w[0], HasSubstr("net.ipv4.tcp_wmem's max of 4194304 caps one connection at 21 MB/s "
                              "over a 100 ms round trip (expected 1160 MB/s)"));
  EXPECT_THAT(w[0], HasSubstr("even 16 connections carry only 336 MB/s"));
  EXPECT_THAT(w[0], HasSubstr("raise net.core.wmem_max and net.ipv4.tcp_wmem's max to 232000000"));
  EXPECT_THAT(w[1], HasSubstr("net.ipv4.tcp_rmem's max of 6291456 caps one connection at 31 MB/s"));
  // The core cap is named when it is what binds (explicit buffers).
  l.wmem_max = 8 << 20;
  const std::vector<std::string> core = TcpLimitWarnings(hint, l, PlanStripes(hint, l));
  ASSERT_FALSE(core.empty());
  EXPECT_THAT(core[0], HasSubstr("net.core.wmem_max=8388608 caps one connection at 84 MB/s"));
  // Enough connections for the rate: said so.
  const LinkHint modest{100e6, absl::Milliseconds(100)};
  const std::vector<std::string> m =
      TcpLimitWarnings(modest, Defaults(), PlanStripes(modest, Defaults()));
  ASSERT_FALSE(m.empty());
  // 1.5 × 10 MB in flight / 2 MiB usable = 7.2.
  EXPECT_THAT(m[0], HasSubstr("8 connections are used"));
}

TEST(TcpLimitWarningsTest, SilentWhenNothingCapsTheLinkOrTheHintIsUnknown) {
  TcpLimits l;
  l.tcp_wmem[2] = l.tcp_rmem[2] = 256 << 20;
  const LinkHint hint{1.16e9, absl::Milliseconds(100)};
  EXPECT_TRUE(TcpLimitWarnings(hint, l, PlanStripes(hint, l)).empty());
  EXPECT_TRUE(
      TcpLimitWarnings(LinkHint{}, Defaults(), PlanStripes(LinkHint{}, Defaults())).empty());
  const LinkHint near{1.16e9, absl::Milliseconds(1)};
  EXPECT_TRUE(TcpLimitWarnings(near, Defaults(), PlanStripes(near, Defaults())).empty());
}

TEST(BbrTest, ListsBbrReadsTheAvailableList) {
  EXPECT_TRUE(ListsBbr("reno cubic bbr\n"));
  EXPECT_TRUE(ListsBbr("bbr"));
  EXPECT_FALSE(ListsBbr("reno cubic\n"));
  EXPECT_FALSE(ListsBbr("reno bbr2 cubic"));
  EXPECT_FALSE(ListsBbr(""));
}

TEST(DirectTransportTuningReportTest, ReportsLimitsPlanAndWarnings) {
  ProcDir dir;
  dir.Write("net/core/wmem_max", "212992\n");
  dir.Write("net/core/rmem_max", "212992\n");
  dir.Write("net/ipv4/tcp_wmem", "4096\t16384\t4194304\n");
  dir.Write("net/ipv4/tcp_rmem", "4096\t131072\t6291456\n");
  const std::vector<std::string> lines =
      DirectTransportTuningReport(LinkHint{}, /*use_bbr=*/false, dir.root());
  ASSERT_EQ(lines.size(), 3u) << absl::StrJoin(lines, "\n");
  EXPECT_THAT(lines[0], HasSubstr("net.core.wmem_max=212992"));
  EXPECT_THAT(lines[0], HasSubstr("16 connections of 21 MB/s each"));
  EXPECT_THAT(lines[0], HasSubstr("BBR turned off"));
  EXPECT_THAT(lines[1], HasSubstr("caps one connection"));
  // Unreadable files are part of the report.
  const std::vector<std::string> missing =
      DirectTransportTuningReport(LinkHint{}, false, dir.root() + "/none");
  EXPECT_THAT(missing[0], HasSubstr("assuming the default"));
}

}  // namespace
}  // namespace detour
