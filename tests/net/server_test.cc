// The shared gRPC server set-up bounds what one client can make it hold:
// streams per connection wait beyond max_concurrent_streams. Its channels
// connect through slow handshakes.
#include "common/net/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace detour {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

struct Watch {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
};

std::unique_ptr<Watch> StartWatch(Health::Stub* stub, absl::Duration deadline) {
  auto w = std::make_unique<Watch>();
  w->context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  w->reader = stub->Watch(&w->context, HealthCheckRequest());
  return w;
}

TEST(GrpcServer, StreamsBeyondTheConnectionLimitWait) {
  GrpcServerOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.max_concurrent_streams = 2;
  options.memory_quota_bytes = 64 << 20;
  auto server = StartGrpcServer(std::move(options), "test");
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Health::NewStub(
      MakeChannel(absl::StrCat("127.0.0.1:", server->port), TransportSecurity::Insecure()));
  HealthCheckResponse response;
  auto first = StartWatch(stub.get(), absl::Seconds(30));
  auto second = StartWatch(stub.get(), absl::Seconds(30));
  ASSERT_TRUE(first->reader->Read(&response));
  ASSERT_TRUE(second->reader->Read(&response));
  // A third stream on the same connection is not served while two are open.
  auto third = StartWatch(stub.get(), absl::Seconds(1));
  EXPECT_FALSE(third->reader->Read(&response));
  EXPECT_EQ(third->reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Once one ends, a new one is.
  first->context.TryCancel();
  first->reader->Finish();
  auto fourth = StartWatch(stub.get(), absl::Seconds(10));
  EXPECT_TRUE(fourth->reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  second->context.TryCancel();
  second->reader->Finish();
  fourth->context.TryCancel();
  fourth->reader->Finish();
  server->server->Shutdown(absl::ToChronoTime(absl::Now()));
}

// A TCP proxy on 127.0.0.1 that holds back the server's first bytes on each
// connection for `delay`: a handshake as slow as a loaded (or sanitized)
// server's, or a few round trips on a long-distance link.
class SlowProxy {
 public:
  SlowProxy(int upstream_port, absl::Duration delay)
      : upstream_port_(upstream_port), delay_(delay) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(listen_fd_, 8);
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { AcceptLoop(); });
  }
  ~SlowProxy() {
    stop_ = true;
    acceptor_.join();
    std::vector<std::thread> pumps;
    {
      absl::MutexLock lock(&mu_);
      pumps.swap(pumps_);
    }
    for (std::thread& t : pumps) t.join();
    absl::MutexLock lock(&mu_);
    for (int fd : fds_) ::close(fd);
    ::close(listen_fd_);
  }
  int port() const { return port_; }

 private:
  // Waits up to 50 ms for `fd` to be readable; false once stopping.
  bool WaitReadable(int fd) {
    pollfd p{fd, POLLIN, 0};
    while (!stop_) {
      if (::poll(&p, 1, 50) > 0) return true;
    }
    return false;
  }
  void AcceptLoop() {
    while (WaitReadable(listen_fd_)) {
      const int client = ::accept(listen_fd_, nullptr, nullptr);
      if (client < 0) continue;
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_port = htons(static_cast<uint16_t>(upstream_port_));
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      absl::MutexLock lock(&mu_);
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server] { Pump(client, server, absl::ZeroDuration()); });
      pumps_.emplace_back([this, client, server] { Pump(server, client, delay_); });
    }
  }
  void Pump(int from, int to, absl::Duration first_delay) {
    char buffer[16384];
    bool first = true;
    while (WaitReadable(from)) {
      const ssize_t n = ::read(from, buffer, sizeof(buffer));
      if (n <= 0) break;
      if (first) {
        const absl::Time until = absl::Now() + first_delay;
        while (!stop_ && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
        first = false;
      }
      for (ssize_t done = 0; done < n;) {
        const ssize_t w = ::write(to, buffer + done, static_cast<size_t>(n - done));
        if (w <= 0) return;
        done += w;
      }
    }
    ::shutdown(to, SHUT_WR);
  }

  const int upstream_port_;
  const absl::Duration delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
};

// Found by the sanitized e2e runs: the channels gave a connection attempt
// only 200 ms (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS is gRPC's minimum connect
// timeout), so a server whose handshake took longer was unreachable for every
// call without wait_for_ready. A 1 s handshake must connect.
TEST(GrpcServer, ASlowHandshakeStillConnects) {
  GrpcServerOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  auto server = StartGrpcServer(std::move(options), "test");
  ASSERT_TRUE(server.ok()) << server.status();
  {
    SlowProxy proxy(server->port, absl::Seconds(1));
    auto stub = Health::NewStub(
        MakeChannel(absl::StrCat("127.0.0.1:", proxy.port()), TransportSecurity::Insecure()));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    HealthCheckResponse response;
    const absl::Time start = absl::Now();
    const grpc::Status status = stub->Check(&context, HealthCheckRequest(), &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(900));  // the proxy did delay it
  }
  server->server->Shutdown(absl::ToChronoTime(absl::Now()));
}

// A connection that never does its TLS handshake is closed after the
// server's handshake_timeout (gRPC's own default held it 120 s), and one
// that does it is served.
TEST(GrpcServer, ASilentConnectionIsClosedAfterTheHandshakeTimeout) {
  char pattern[] = "/tmp/detour-server-test.XXXXXX";
  const std::string dir = ::mkdtemp(pattern);
  const std::string gen = absl::StrCat(testing::SourceDir(), "/tools/gen_certs.sh ", dir,
                                       " --coordinator coordinator --client alice > /dev/null");
  ASSERT_EQ(std::system(gen.c_str()), 0) << gen;
  TlsFiles files;
  files.ca = dir + "/ca.crt";
  files.cert = dir + "/coordinator.crt";
  files.key = dir + "/coordinator.key";
  auto security = TransportSecurity::Load(files, /*client=*/false);
  ASSERT_TRUE(security.ok()) << security.status();
  GrpcServerOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.security = *security;
  options.handshake_timeout = absl::Seconds(1);
  auto server = StartGrpcServer(std::move(options), "test");
  ASSERT_TRUE(server.ok()) << server.status();

  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(server->port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const absl::Time start = absl::Now();
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 30000), 1) << "still open after 30 s";
  char byte;
  EXPECT_LE(::recv(fd, &byte, 1, 0), 0);  // closed, nothing sent
  const absl::Duration open = absl::Now() - start;
  EXPECT_GE(open, absl::Milliseconds(900));
  EXPECT_LT(open, absl::Seconds(30));
  ::close(fd);

  TlsFiles client;
  client.ca = files.ca;
  client.cert = dir + "/alice.crt";
  client.key = dir + "/alice.key";
  auto client_security = TransportSecurity::Load(client, /*client=*/true);
  ASSERT_TRUE(client_security.ok()) << client_security.status();
  auto stub = Health::NewStub(
      MakeChannel(absl::StrCat("127.0.0.1:", server->port), *client_security, "coordinator"));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, HealthCheckRequest(), &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  server->server->Shutdown(absl::ToChronoTime(absl::Now()));
  std::system(absl::StrCat("rm -rf ", dir).c_str());
}

}  // namespace
}  // namespace detour
