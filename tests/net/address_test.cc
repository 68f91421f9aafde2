#include "common/net/address.h"

#include <unistd.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

TEST(ParseHostPort, AcceptsForms) {
  auto a = ParseHostPort("127.0.0.1:7070", "--listen", false);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 7070);
  auto b = ParseHostPort("[::1]:80", "--listen", false);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "::1");
  EXPECT_EQ(b->ToString(), "[::1]:80");
  auto c = ParseHostPort(":0", "--listen", true);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "0.0.0.0");
  EXPECT_EQ(c->port, 0);
}

TEST(ParseHostPort, RejectsWithFlagName) {
  for (const char* bad : {"nohost", "h:port", "h:70000", "h:-1", "::1:80", "[::1:80"}) {
    auto r = ParseHostPort(bad, "--coordinator", false);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_THAT(r.status().message(), HasSubstr("--coordinator")) << bad;
  }
  EXPECT_FALSE(ParseHostPort("h:0", "--coordinator", false).ok());
}

TEST(CheckPortFree, ReportsBusyPort) {
  auto [fd, port] = testing::OccupyPort();
  absl::Status s = CheckPortFree(HostPort{"127.0.0.1", port}, "--listen");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("already in use"));
  ::close(fd);
  EXPECT_TRUE(CheckPortFree(HostPort{"127.0.0.1", port}, "--listen").ok());
}

}  // namespace
}  // namespace detour
