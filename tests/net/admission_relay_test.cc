// The admission relay in front of the daemons' gRPC ports
// (common/net/admission_relay.h): it carries bytes both ways untouched,
// holds one source to its share of unauthenticated connections, keeps a
// caller that proved itself through any flood, and closes connections that
// prove nothing in time.
#include "common/net/admission_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/transport/test_certs.h"

namespace detour {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// A TCP connection to 127.0.0.1:port from `from` (another loopback
// address is another source); -1 on failure.
int ConnectFrom(const std::string& from, int port) { return testing::ConnectLoopback(port, from); }

// Until `done` holds or 20 s pass.
template <typename F>
bool WaitFor(F done) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (!done()) {
    if (absl::Now() > until) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

// A loopback server that reads every connection to its end, echoing it
// when asked, then ends its own side.
class Backend {
 public:
  explicit Backend(bool echo) : echo_(echo) {
    auto fd = BindTcp(HostPort{"127.0.0.1", 0}, "backend", /*listen=*/true, &port_);
    EXPECT_TRUE(fd.ok()) << fd.status();
    listen_fd_ = *fd;
    thread_ = std::thread([this] {
      while (true) {
        const int c = ::accept(listen_fd_, nullptr, nullptr);
        if (c < 0) return;
        if (stop_) {
          ::close(c);
          return;
        }
        held_.push_back(c);
        workers_.emplace_back([c, echo = echo_] {
          char buffer[65536];
          while (true) {
            const ssize_t n = ::recv(c, buffer, sizeof(buffer), 0);
            if (n <= 0) break;
            for (ssize_t sent = 0; echo && sent < n;) {
              const ssize_t w = ::send(c, buffer + sent, n - sent, MSG_NOSIGNAL);
              if (w <= 0) return;
              sent += w;
            }
          }
          ::shutdown(c, SHUT_WR);
        });
      }
    });
  }
  ~Backend() {
    stop_ = true;
    const int wake = ConnectFrom("127.0.0.1", port_);
    if (wake >= 0) ::close(wake);
    thread_.join();
    for (std::thread& t : workers_) t.join();
    for (int c : held_) ::close(c);
    ::close(listen_fd_);
  }
  int port() const { return port_; }

 private:
  const bool echo_;
  int port_ = 0, listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  std::vector<std::thread> workers_;
  std::vector<int> held_;
};

TEST(AdmissionRelayTest, CarriesBytesBothWaysAndPassesTheEnd) {
  Backend backend(/*echo=*/true);
  auto relay = AdmissionRelay::Start(HostPort{"127.0.0.1", 0}, "test", backend.port(), {});
  ASSERT_TRUE(relay.ok()) << relay.status();
  const int fd = ConnectFrom("127.0.0.1", (*relay)->port());
  ASSERT_GE(fd, 0);
  // More than the relay's buffers and the sockets' hold, so that both
  // directions fill and drain many times.
  std::string sent(8 << 20, '\0');
  for (size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>((i * 131) >> 7);
  std::thread writer([&] {
    for (size_t off = 0; off < sent.size();) {
      const ssize_t w = ::send(fd, sent.data() + off, sent.size() - off, MSG_NOSIGNAL);
      ASSERT_GT(w, 0);
      off += w;
    }
    ::shutdown(fd, SHUT_WR);
  });
  // A slow reader: the backend has sent everything and its end while the
  // relay still holds bytes for this side, which must all arrive before
  // the end does.
  std::string got;
  char buffer[65536];
  while (true) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    ASSERT_GE(n, 0);
    if (n == 0) break;  // the backend's end, passed on
    got.append(buffer, n);
    absl::SleepFor(absl::Microseconds(500));
  }
  writer.join();
  ::close(fd);
  EXPECT_EQ(got.size(), sent.size());
  EXPECT_TRUE(got == sent);
  EXPECT_TRUE(WaitFor([&] { return (*relay)->stats().open == 0; }));
  EXPECT_EQ((*relay)->stats().accepted, 1u);
}

// A client that goes away (a reset) while the relay still holds bytes for
// it ends its own connection only: the relay's write to its socket fails
// without a SIGPIPE, and another client's bytes still go both ways.
TEST(AdmissionRelayTest, AClientGoneMidStreamEndsOnlyItsConnection) {
  Backend backend(/*echo=*/true);
  auto relay = AdmissionRelay::Start(HostPort{"127.0.0.1", 0}, "test", backend.port(), {});
  ASSERT_TRUE(relay.ok()) << relay.status();
  const int gone = ConnectFrom("127.0.0.1", (*relay)->port());
  ASSERT_GE(gone, 0);
  // It sends without reading: the echo fills its receive buffer, then the
  // relay's buffer towards it.
  const std::string chunk(1 << 20, 'x');
  std::atomic<bool> writing{true};
  std::thread writer([&] {
    for (int i = 0; i < 16 && writing; ++i) {
      for (size_t off = 0; off < chunk.size() && writing;) {
        const ssize_t w =
            ::send(gone, chunk.data() + off, chunk.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
          off += static_cast<size_t>(w);
        } else {
          absl::SleepFor(absl::Milliseconds(2));
        }
      }
    }
  });
  absl::SleepFor(absl::Milliseconds(300));
  writing = false;
  writer.join();
  linger reset{1, 0};
  ::setsockopt(gone, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(gone);  // a reset, with the relay's bytes for it unread
  EXPECT_TRUE(WaitFor([&] { return (*relay)->stats().open == 0; }));

  const int other = ConnectFrom("127.0.0.1", (*relay)->port());
  ASSERT_GE(other, 0);
  ASSERT_EQ(::send(other, "ping", 4, MSG_NOSIGNAL), 4);
  ::shutdown(other, SHUT_WR);
  std::string got;
  char buffer[16];
  for (ssize_t n; (n = ::recv(other, buffer, sizeof(buffer), 0)) > 0;) got.append(buffer, n);
  ::close(other);
  EXPECT_EQ(got, "ping");
  EXPECT_TRUE(WaitFor([&] { return (*relay)->stats().open == 0; }));
  EXPECT_EQ((*relay)->stats().accepted, 2u);
}

TEST(AdmissionRelayTest, OneSourceHoldsAtMostItsShareAndOthersStillGetIn) {
  Backend backend(/*echo=*/false);
  AdmissionRelayOptions options;
  options.limits.max_unauthenticated_per_source = 4;
  auto relay = AdmissionRelay::Start(HostPort{"127.0.0.1", 0}, "test", backend.port(), options);
  ASSERT_TRUE(relay.ok()) << relay.status();
  std::vector<int> fds;
  for (int i = 0; i < 20; ++i) {
    const int fd = ConnectFrom("127.0.0.2", (*relay)->port());
    ASSERT_GE(fd, 0);
    fds.push_back(fd);
  }
  ASSERT_TRUE(
      WaitFor([&] { return (*relay)->stats().accepted + (*relay)->stats().refused >= 20; }));
  AdmissionRelay::Stats s = (*relay)->stats();
  EXPECT_EQ(s.accepted, 4u);
  EXPECT_EQ(s.refused_by_reason[static_cast<int>(RefusalReason::kSourceLimit)], 16u);
  EXPECT_EQ(s.unauthenticated, 4);
  // Another source is not held back by the first one's flood.
  const int other = ConnectFrom("127.0.0.3", (*relay)->port());
  ASSERT_GE(other, 0);
  EXPECT_TRUE(WaitFor([&] { return (*relay)->stats().unauthenticated == 5; }));
  // A refused connection is closed: its reader sees the end.
  char byte;
  EXPECT_EQ(::recv(fds.back(), &byte, 1, 0), 0);
  for (int fd : fds) ::close(fd);
  ::close(other);
  EXPECT_TRUE(WaitFor([&] { return (*relay)->stats().open == 0; }));
}

TEST(AdmissionRelayTest, AProvenCallerKeepsItsConnectionThroughAFloodFromManySources) {
  const Certs& certs = TestCerts();
  GrpcServerOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.security = certs.Load("w1");
  options.relay.limits.max_unauthenticated = 16;
  auto server = StartGrpcServer(std::move(options), "test");
  ASSERT_TRUE(server.ok()) << server.status();
  AdmissionRelay* relay = server->relay.get();
  ASSERT_NE(relay, nullptr);

  auto flood = [&](int first_host) {
    std::vector<int> fds;
    for (int host = first_host; host < first_host + 20; ++host) {
      for (int i = 0; i < 4; ++i) {
        const int fd = ConnectFrom(absl::StrCat("127.0.0.", host), server->port);
        if (fd >= 0) fds.push_back(fd);
      }
    }
    return fds;
  };
  std::vector<int> first = flood(10);
  ASSERT_TRUE(WaitFor([&] { return relay->stats().accepted + relay->stats().refused >= 80; }));
  EXPECT_EQ(relay->stats().unauthenticated, 16);

  // A worker's certificate: its handshake makes room (the oldest stranger
  // of the busiest source goes), and its first call proves it.
  auto stub = Health::NewStub(
      MakeChannel(absl::StrCat("127.0.0.1:", server->port), certs.Load("w2"), "w1"));
  HealthCheckResponse response;
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    grpc::Status status = stub->Check(&context, HealthCheckRequest(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  EXPECT_TRUE(WaitFor([&] { return relay->stats().authenticated == 1; }));
  const uint64_t accepted = relay->stats().accepted;

  // A second flood from other sources cannot take its place.
  std::vector<int> second = flood(40);
  ASSERT_TRUE(
      WaitFor([&] { return relay->stats().accepted + relay->stats().refused >= accepted + 80; }));
  {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    grpc::Status status = stub->Check(&context, HealthCheckRequest(), &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
  }
  AdmissionRelay::Stats s = relay->stats();
  EXPECT_EQ(s.authenticated, 1);
  EXPECT_LE(s.unauthenticated, 16);
  EXPECT_GT(s.refused_by_reason[static_cast<int>(RefusalReason::kUnauthenticatedLimit)], 0u);
  for (int fd : first) ::close(fd);
  for (int fd : second) ::close(fd);
}

TEST(AdmissionRelayTest, ACallerThatProvesNothingIsClosedAtTheDeadline) {
  GrpcServerOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.relay.prove_within = absl::Seconds(1);
  auto server = StartGrpcServer(std::move(options), "test");
  ASSERT_TRUE(server.ok()) << server.status();
  AdmissionRelay* relay = server->relay.get();

  // The health service answers anyone: a plaintext health check proves
  // nothing, and its connection stays unauthenticated.
  auto stub = Health::NewStub(
      MakeChannel(absl::StrCat("127.0.0.1:", server->port), TransportSecurity::Insecure()));
  HealthCheckResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub->Check(&context, HealthCheckRequest(), &response).ok());
  EXPECT_EQ(relay->stats().authenticated, 0);

  // A connection that says nothing is closed once its time is up.
  const int silent = ConnectFrom("127.0.0.4", server->port);
  ASSERT_GE(silent, 0);
  const absl::Time start = absl::Now();
  char buffer[256];
  ssize_t n;
  while ((n = ::recv(silent, buffer, sizeof(buffer), 0)) > 0) {
  }  // the server's HTTP/2 settings, then the end
  EXPECT_EQ(n, 0);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(500));
  ::close(silent);
  EXPECT_GE(relay->stats().refused_by_reason[static_cast<int>(RefusalReason::kDeadline)], 1u);
}

TEST(AdmissionRelayTest, AnAddressInUseIsNamed) {
  Backend backend(/*echo=*/false);
  auto first = AdmissionRelay::Start(HostPort{"127.0.0.1", 0}, "--listen", backend.port(), {});
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = AdmissionRelay::Start(HostPort{"127.0.0.1", (*first)->port()}, "--listen",
                                      backend.port(), {});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("--listen"), std::string::npos) << second.status();
  EXPECT_NE(second.status().message().find("in use"), std::string::npos) << second.status();
}

TEST(AdmissionRelayTest, KnownPeersAreTheirHostsLiterals) {
  Backend backend(/*echo=*/false);
  auto relay = AdmissionRelay::Start(HostPort{"127.0.0.1", 0}, "test", backend.port(), {});
  ASSERT_TRUE(relay.ok()) << relay.status();
  EXPECT_EQ((*relay)->SetKnownPeers({"10.0.0.7:7000", "10.0.0.7:7001", "[2001:db8::5]:9",
                                     "worker.example:7000", "garbage"}),
            2u);
}

TEST(AdmissionRelayTest, RaisesTheLimitOnOpenFilesToWhatItsConnectionsNeed) {
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
  if (before.rlim_max != RLIM_INFINITY && before.rlim_max < 4096) {
    GTEST_SKIP() << "the hard limit on open files is " << before.rlim_max;
  }
  rlimit low = before;
  low.rlim_cur = 256;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  Backend backend(/*echo=*/false);
  AdmissionRelayOptions options;
  options.limits.max_connections = 1000;
  auto relay = AdmissionRelay::Start(HostPort{"127.0.0.1", 0}, "test", backend.port(), options);
  rlimit after{};
  ::getrlimit(RLIMIT_NOFILE, &after);
  ::setrlimit(RLIMIT_NOFILE, &before);
  ASSERT_TRUE(relay.ok()) << relay.status();
  EXPECT_GE(after.rlim_cur, 2000u);  // two descriptors a connection, and room for the rest
}

TEST(LoopbackPeerPortTest, ReadsTheClientPortOfALoopbackPeer) {
  EXPECT_EQ(LoopbackPeerPort("ipv4:127.0.0.1:40512"), 40512);
  EXPECT_EQ(LoopbackPeerPort("ipv6:[::1]:7"), 7);
  EXPECT_EQ(LoopbackPeerPort("ipv6:[::ffff:127.0.0.1]:65535"), 65535);
  EXPECT_EQ(LoopbackPeerPort("ipv4:10.0.0.1:40512"), std::nullopt);
  EXPECT_EQ(LoopbackPeerPort("ipv4:127.0.0.1:0"), std::nullopt);
  EXPECT_EQ(LoopbackPeerPort("ipv4:127.0.0.1:65536"), std::nullopt);
  EXPECT_EQ(LoopbackPeerPort("unix:/tmp/x"), std::nullopt);
}

}  // namespace
}  // namespace detour
