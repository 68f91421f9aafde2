// The WAN test bed end to end: real namespaces made by tools/wan_testbed.sh,
// detour-wanem between them, ping and iperf3 through it. Needs root
// (CAP_NET_ADMIN, CAP_SYS_ADMIN) and /dev/net/tun; skipped otherwise. Each
// test brings its own bed up under a prefix of its own and takes it down in
// TearDown, which gtest runs after a failed assertion too.
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/json.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"
#include "tests/wanem/wan_test_support.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using testing::HaveCapability;
using testing::MissingPrivileges;
using testing::Sh;
using testing::ShellResult;

// a in region R1; b and c in R2. a <-> b: 20 ms one-way, 2 MB/s; b <-> c:
// the intra-region 4 ms.
constexpr char kCluster[] = R"({
  "name": "wanem-netns-test",
  "nodes": [{"id": "a", "region": "R1"}, {"id": "b", "region": "R2"},
            {"id": "c", "region": "R2"}],
  "links": [{"region_a": "R1", "region_b": "R2", "latency_ms": 20,
             "bandwidth_gbytes_per_s": 0.002}],
  "intra_region_latency_ms": 4
})";

class WanNetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = MissingPrivileges(); !why.empty()) GTEST_SKIP() << why;
    for (const char* tool : {"ping", "iperf3", "ss"}) {
      if (Sh(absl::StrCat("command -v ", tool)).code != 0) {
        GTEST_SKIP() << tool << " is missing (tools/install_deps.sh installs it)";
      }
    }
    script_ = testing::SourceDir() + "/tools/wan_testbed.sh";
    binary_ = testing::BuildDir() + "/tools/detour_wanem/detour-wanem";
    ASSERT_EQ(::access(binary_.c_str(), X_OK), 0) << binary_ << " is not built";
    prefix_ = absl::StrCat("wt", ::getpid());
    dir_ = absl::StrCat(::testing::TempDir(), "/wanem_netns_", ::getpid());
    ASSERT_EQ(Sh("mkdir -p " + dir_).code, 0);
    cluster_ = dir_ + "/cluster.json";
    std::ofstream(cluster_) << kCluster;
    up_ = true;
    const ShellResult up = Sh(absl::StrCat("timeout 30 ", script_, " up --cluster ", cluster_,
                                           " --prefix ", prefix_, " --binary ", binary_));
    ASSERT_EQ(up.code, 0) << up.output;
    ASSERT_THAT(up.output, HasSubstr("10.77.0.2"));
  }

  void TearDown() override {
    if (!up_) return;
    const ShellResult down = Sh(absl::StrCat("timeout 30 ", script_, " down --prefix ", prefix_));
    EXPECT_EQ(down.code, 0) << down.output;
    const ShellResult list = Sh("ip netns list");
    EXPECT_THAT(list.output, ::testing::Not(HasSubstr(prefix_ + "-"))) << "namespaces left";
    Sh("rm -rf " + dir_);
  }

  ShellResult In(const std::string& node, const std::string& command) {
    return Sh(absl::StrCat("timeout 20 ", script_, " exec --prefix ", prefix_, " ", node, " -- ",
                           command));
  }
  ShellResult Ctl(const std::string& command) {
    return Sh(absl::StrCat("timeout 10 ", script_, " ctl --prefix ", prefix_, " ", command));
  }

  // Starts an iperf3 server in `node` (ended by `down`) and waits until it
  // listens.
  void StartIperfServer(const std::string& node) {
    ASSERT_EQ(In(node, "iperf3 -s -D -p 5201").code, 0);
    for (int i = 0; i < 50; ++i) {
      if (In(node, "ss -ltn").output.find(":5201") != std::string::npos) return;
      ::usleep(100000);
    }
    FAIL() << "iperf3 server in " << node << " did not listen within 5 s";
  }

  // min and max of ping's round trip times, in ms.
  void PingRtt(const std::string& from, const std::string& to, double* min, double* max) {
    const ShellResult r = In(from, "ping -c 5 -i 0.2 -W 2 " + to);
    ASSERT_EQ(r.code, 0) << r.output;
    const size_t at = r.output.find("min/avg/max/mdev = ");
    ASSERT_NE(at, std::string::npos) << r.output;
    std::istringstream in(r.output.substr(at + 19));
    char slash;
    double avg;
    ASSERT_TRUE(in >> *min >> slash >> avg >> slash >> *max) << r.output;
  }

  std::string script_, binary_, prefix_, dir_, cluster_;
  bool up_ = false;
};

TEST_F(WanNetnsTest, PingRoundTripIsTwiceTheOneWayDelay) {
  double min = 0, max = 0;
  PingRtt("a", "10.77.0.2", &min, &max);  // 20 ms each way
  EXPECT_GE(min, 40.0);
  EXPECT_LT(max, 40.0 + 15.0);
  PingRtt("b", "10.77.0.3", &min, &max);  // intra-region: 4 ms each way
  EXPECT_GE(min, 8.0);
  EXPECT_LT(max, 8.0 + 15.0);
  // A change at run time takes effect for the next packets.
  ASSERT_EQ(Ctl("set b c both delay_ms=30").code, 0);
  PingRtt("b", "10.77.0.3", &min, &max);
  EXPECT_GE(min, 60.0);
  EXPECT_LT(max, 60.0 + 15.0);
}

TEST_F(WanNetnsTest, TcpTransferRunsAtTheLinkRate) {
  StartIperfServer("b");
  // 4 s after a 1 s warm-up (slow start) at the spec's 2 MB/s.
  const ShellResult r = In("a", "iperf3 -c 10.77.0.2 -p 5201 -t 4 -O 1 -J");
  ASSERT_EQ(r.code, 0) << r.output;
  auto json = ParseJson(r.output);
  ASSERT_TRUE(json.ok()) << json.status() << "\n" << r.output;
  const JsonValue* end = json->Find("end");
  ASSERT_NE(end, nullptr) << r.output;
  const JsonValue* received = end->Find("sum_received");
  ASSERT_NE(received, nullptr) << r.output;
  const JsonValue* bps = received->Find("bits_per_second");
  ASSERT_NE(bps, nullptr) << r.output;
  // The link's 2e6 bytes/s count IP packets; TCP payload is 1448 of 1500.
  const double expected = 2e6 * 8 * 1448 / 1500;
  EXPECT_GT(bps->number(), 0.8 * expected);
  EXPECT_LT(bps->number(), 1.2 * expected);
  const ShellResult stats = Ctl("stats a b");
  EXPECT_THAT(stats.output, HasSubstr("a b delivered_packets="));
}

TEST_F(WanNetnsTest, CutDropsTheLinkAndRestoreBringsItBack) {
  StartIperfServer("b");
  const std::string probe = "iperf3 -c 10.77.0.2 -p 5201 -t 1 --connect-timeout 1500";
  ASSERT_EQ(In("a", probe).code, 0) << "the link works before the cut";
  ASSERT_EQ(Ctl("cut a b both").code, 0);
  const ShellResult cut = In("a", probe);
  EXPECT_NE(cut.code, 0) << cut.output;
  EXPECT_NE(In("a", "ping -c 2 -i 0.2 -W 1 10.77.0.2").code, 0) << "ping crossed a cut link";
  // Only that link: a still reaches c.
  EXPECT_EQ(In("a", "ping -c 1 -W 2 10.77.0.3").code, 0);
  const ShellResult stats = Ctl("stats a b");
  EXPECT_THAT(stats.output, ::testing::ContainsRegex("dropped_cut=[1-9]"));
  ASSERT_EQ(Ctl("restore a b both").code, 0);
  const ShellResult back = In("a", probe);
  EXPECT_EQ(back.code, 0) << back.output;
}

TEST_F(WanNetnsTest, ControlErrorsAreSpecific) {
  const ShellResult r = Ctl("set a b loss=2");
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("error: loss=2 is outside [0, 1]"));
  const ShellResult unknown = In("zz", "true");
  EXPECT_NE(unknown.code, 0);
  EXPECT_THAT(unknown.output, HasSubstr("no node zz"));
}

TEST(WanTestbedScriptTest, RefusesWithoutNetAdmin) {
  if (!HaveCapability(12) || Sh("command -v setpriv").code != 0) {
    GTEST_SKIP() << "needs root and setpriv to run the script without capabilities";
  }
  const std::string script = testing::SourceDir() + "/tools/wan_testbed.sh";
  const ShellResult r =
      Sh(absl::StrCat("timeout 10 setpriv --reuid=65534 --regid=65534 --clear-groups ", script,
                      " up --cluster /dev/null --prefix wtnocap"));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("needs CAP_NET_ADMIN"));
}

}  // namespace
}  // namespace detour
