// What answers at an address gRPC could not reach: servers on loopback
// that answer like a metrics port, a TLS server and an --insecure gRPC one.
#include "common/net/port_probe.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/net/address.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

// Accepts one connection, reads the request and answers `reply`.
class OneShotServer {
 public:
  explicit OneShotServer(std::string reply) {
    int port = 0;
    auto fd = BindTcp(HostPort{"127.0.0.1", 0}, "test", /*listen=*/true, &port);
    EXPECT_TRUE(fd.ok()) << fd.status();
    fd_ = fd.ok() ? *fd : -1;
    address_ = absl::StrCat("127.0.0.1:", port);
    thread_ = std::thread([this, reply = std::move(reply)] {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      char buffer[64];
      (void)::recv(c, buffer, sizeof(buffer), 0);
      (void)::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
      ::close(c);
    });
  }
  ~OneShotServer() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  const std::string& address() const { return address_; }

 private:
  int fd_ = -1;
  std::string address_;
  std::thread thread_;
};

TEST(PortProbe, RecognisesHttpTlsAndPlaintextHttp2) {
  {
    OneShotServer metrics("HTTP/1.1 404 Not Found\r\n\r\n");
    const PortAnswer a = ProbePort(metrics.address(), absl::Seconds(5));
    EXPECT_EQ(a, PortAnswer::kHttp1);
    EXPECT_THAT(PortHint(metrics.address(), true, a), HasSubstr("is it a metrics port?"));
    EXPECT_THAT(PortHint(metrics.address(), false, a), HasSubstr("is it a metrics port?"));
  }
  {
    OneShotServer tls(std::string("\x15\x03\x03\x00\x02\x02\x46", 7));  // a TLS alert
    const PortAnswer a = ProbePort(tls.address(), absl::Seconds(5));
    EXPECT_EQ(a, PortAnswer::kTls);
    EXPECT_THAT(PortHint(tls.address(), false, a), HasSubstr("drop --insecure"));
    EXPECT_EQ(PortHint(tls.address(), true, a), "");  // TLS was used: no mismatch
  }
  {
    // An empty SETTINGS frame, as an HTTP/2 server sends first.
    OneShotServer h2(std::string("\x00\x00\x00\x04\x00\x00\x00\x00\x00", 9));
    const PortAnswer a = ProbePort(h2.address(), absl::Seconds(5));
    EXPECT_EQ(a, PortAnswer::kHttp2Plain);
    EXPECT_THAT(PortHint(h2.address(), true, a), HasSubstr("use --insecure"));
  }
  {
    OneShotServer silent("");
    EXPECT_EQ(ProbePort(silent.address(), absl::Seconds(5)), PortAnswer::kNothing);
  }
  // Nothing listening, and not an address.
  int port = 0;
  auto fd = BindTcp(HostPort{"127.0.0.1", 0}, "test", /*listen=*/false, &port);
  ASSERT_TRUE(fd.ok());
  ::close(*fd);
  EXPECT_EQ(ProbePort(absl::StrCat("127.0.0.1:", port), absl::Seconds(2)), PortAnswer::kNothing);
  EXPECT_EQ(ProbePort("not an address", absl::Seconds(2)), PortAnswer::kNothing);
}

}  // namespace
}  // namespace detour
