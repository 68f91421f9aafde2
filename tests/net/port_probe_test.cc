// What answers at an address gRPC could not reach: servers on loopback
// that answer like a metrics port, a TLS server (one that answers anything,
// and one that, as gRPC's, answers only a ClientHello) and an --insecure
// gRPC one.
#include "common/net/port_probe.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/net/address.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

// Accepts up to `connections` connections, one at a time, reads each one's
// request and answers what `reply` makes of it, then closes it.
class OneShotServer {
 public:
  explicit OneShotServer(std::string reply)
      : OneShotServer([reply](const std::string&) { return reply; }, 1) {}
  OneShotServer(std::function<std::string(const std::string&)> reply, int connections) {
    int port = 0;
    auto fd = BindTcp(HostPort{"127.0.0.1", 0}, "test", /*listen=*/true, &port);
    EXPECT_TRUE(fd.ok()) << fd.status();
    fd_ = fd.ok() ? *fd : -1;
    address_ = absl::StrCat("127.0.0.1:", port);
    thread_ = std::thread([this, reply = std::move(reply), connections] {
      for (int i = 0; i < connections; ++i) {
        const int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        char buffer[64];
        const ssize_t n = ::recv(c, buffer, sizeof(buffer), 0);
        const std::string answer =
            reply(std::string(buffer, n > 0 ? static_cast<size_t>(n) : size_t{0}));
        (void)::send(c, answer.data(), answer.size(), MSG_NOSIGNAL);
        ::close(c);
      }
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
    // As gRPC's TLS server: a plain request gets nothing, a TLS ClientHello
    // (a handshake record, 22, version 3.x) an answer; the probe asks again
    // with one.
    OneShotServer grpc_tls(
        [](const std::string& request) {
          const bool hello = request.size() >= 3 && request[0] == 22 && request[1] == 3;
          return hello ? std::string("\x15\x03\x03\x00\x02\x02\x74", 7) : std::string();
        },
        2);
    const PortAnswer a = ProbePort(grpc_tls.address(), absl::Seconds(5));
    EXPECT_EQ(a, PortAnswer::kTls);
    EXPECT_THAT(PortHint(grpc_tls.address(), false, a), HasSubstr("drop --insecure"));
  }
  {
    OneShotServer silent("");
    EXPECT_EQ(ProbePort(silent.address(), absl::Seconds(1)), PortAnswer::kNothing);
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
