// The direct transport (direct_link.h, direct_server.h, PeerSender with a
// direct address) on loopback, plaintext and mutual TLS: tensors arrive
// intact into the sink, the ActivationServer's checks and counters apply,
// and bad peers — wrong preface, oversized or malformed framing, no or a
// foreign certificate, a sender the certificate does not name, a server
// that is not the expected worker — are refused without harm.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/tcp_relay.h"
#include "tests/transport/recording_sink.h"
#include "tests/transport/test_certs.h"
#include "tests/test_paths.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/direct_link.h"
#include "worker/transport/direct_server.h"
#include "worker/transport/peer_sender.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// What a v2 client sends first: the preface and a one-stripe hello.
std::string PrefaceAndHello(DirectHello hello = {}) {
  char out[sizeof(kDirectPreface) + kDirectHelloBytes];
  std::memcpy(out, kDirectPreface, sizeof(kDirectPreface));
  EncodeDirectHello(hello, out + sizeof(kDirectPreface));
  return std::string(out, sizeof(out));
}

v1::FrameHeader Header(uint32_t microbatch, int64_t elements, const std::string& sender = "w1",
                       const std::string& job = "job-1") {
  v1::FrameHeader h;
  h.set_job_id(job);
  h.set_iteration(3);
  h.set_microbatch(microbatch);
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_sender(sender);
  h.set_hop(1);
  h.add_shape(elements);
  h.set_dtype(v1::DTYPE_FP32);
  return h;
}

// A socket listening on a loopback port that no server answers on: the
// tests play the receiver on it by hand. Returns the socket and its port.
std::pair<int, int> LoopbackListener() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(fd, 8), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  return {fd, ntohs(addr.sin_port)};
}

std::shared_ptr<std::vector<char>> Pattern(size_t n, int seed) {
  auto v = std::make_shared<std::vector<char>>(n);
  for (size_t i = 0; i < n; ++i) (*v)[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return v;
}

TensorView View(std::shared_ptr<std::vector<char>> bytes) {
  TensorView v;
  v.data = bytes->data();
  v.bytes = bytes->size();
  v.keepalive = bytes;
  return v;
}

absl::Status SendAndWait(PeerSender& sender, v1::FrameHeader h, TensorView v) {
  absl::Notification done;
  absl::Status result;
  sender.Send(std::move(h), std::move(v), [&](absl::Status s, double) {
    result = s;
    done.Notify();
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  return result;
}

class DirectFixture : public ::testing::Test {
 protected:
  virtual bool tls() const { return false; }

  void StartServer(const std::string& name = "w2") {
    ActivationServerOptions o;
    o.max_tensor_bytes = 64 << 20;
    o.require_peer_certificates = tls();
    activations_ = std::make_unique<ActivationServer>(&sink_, o);
    DirectServerOptions d;
    d.listen = HostPort{"127.0.0.1", 0};
    d.handshake_timeout = absl::Seconds(2);
    if (tls()) d.security = TestCerts().Load(name);
    auto started = DirectServer::Start(activations_.get(), d);
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = *std::move(started);
    address_ = absl::StrCat("127.0.0.1:", server_->port());
  }

  PeerSenderOptions SenderOptions(const std::string& me = "w1", bool other_ca = false) {
    PeerSenderOptions o;
    o.direct_address = address_;
    o.peer_name = "w2";
    o.connect_timeout = absl::Seconds(3);
    if (tls()) o.security = TestCerts().Load(me, other_ca);
    return o;
  }

  // A raw TCP connection to the server (plaintext tests of the framing).
  int RawConnect() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server_->port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  }

  // Reads until the server closes the connection (or 5 s pass).
  static bool ClosedByServer(int fd) {
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char buffer[4096];
    while (true) {
      const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
      if (n < 0) return false;
    }
  }

  template <typename Pred>
  static bool Eventually(Pred pred) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      if (pred()) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return pred();
  }

  RecordingSink sink_;
  std::unique_ptr<ActivationServer> activations_;
  std::unique_ptr<DirectServer> server_;
  std::string address_;
};

class DirectTransportTest : public DirectFixture, public ::testing::WithParamInterface<bool> {
 protected:
  bool tls() const override { return GetParam(); }
};

TEST_P(DirectTransportTest, ChunkedTensorsArriveIntact) {
  StartServer();
  PeerSenderOptions o = SenderOptions();
  o.chunk_bytes = 1 << 20;  // the 10 MB tensor takes 10 chunks
  PeerSender sender("w2", o);
  EXPECT_STREQ(sender.transport(), "direct");
  const size_t sizes[] = {4 * 8, 4 * 1000, 4 * 2500000, 0};
  std::vector<std::shared_ptr<std::vector<char>>> sent;
  for (uint32_t i = 0; i < 4; ++i) {
    sent.push_back(Pattern(sizes[i], static_cast<int>(i)));
    ASSERT_TRUE(
        SendAndWait(sender, Header(i, static_cast<int64_t>(sizes[i] / 4)), View(sent[i])).ok());
  }
  auto got = sink_.received();
  ASSERT_EQ(got.size(), 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i].first.microbatch(), i);
    EXPECT_EQ(got[i].second, *sent[i]) << "tensor " << i;
  }
  ActivationServer::Stats s = activations_->stats();
  EXPECT_EQ(s.tensors, 4u);
  EXPECT_EQ(s.frames, 1u + 1 + 10 + 1);
  EXPECT_EQ(s.malformed + s.rejected + s.unauthorized, 0u);
  EXPECT_EQ(s.partial_tensors, 0u);
  EXPECT_EQ(server_->stats().accepted, 1u);
}

TEST_P(DirectTransportTest, SinkRejectionIsAcknowledgedAndTheConnectionGoesOn) {
  StartServer();
  PeerSender sender("w2", SenderOptions());
  auto data = Pattern(4 * 300000, 1);
  absl::Status refused = SendAndWait(sender, Header(0, 300000, "w1", "job-other"), View(data));
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("unknown job job-other"));
  EXPECT_TRUE(SendAndWait(sender, Header(1, 300000), View(data)).ok());
  EXPECT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(activations_->stats().rejected, 1u);
  EXPECT_EQ(server_->stats().accepted, 1u);  // the same connection carried both
}

TEST_P(DirectTransportTest, ServerLimitsApply) {
  StartServer();
  PeerSender sender("w2", SenderOptions());
  auto big = Pattern(size_t{80} << 20, 2);  // over max_tensor_bytes (64 MiB)
  absl::Status refused = SendAndWait(sender, Header(0, (int64_t{80} << 20) / 4), View(big));
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.message(), HasSubstr("exceeds the limit"));
  EXPECT_TRUE(sink_.received().empty());
}

TEST_P(DirectTransportTest, UnreachablePeerFailsFastWithItsAddress) {
  StartServer();
  const int port = server_->port();
  server_.reset();  // nothing listens there any more
  PeerSenderOptions o = SenderOptions();
  o.direct_address = absl::StrCat("127.0.0.1:", port);
  PeerSender sender("w2", o);
  const absl::Time start = absl::Now();
  absl::Status s = SendAndWait(sender, Header(0, 4), View(Pattern(16, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr(o.direct_address));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_P(DirectTransportTest, CloseDuringAHandshakeOrAWaitReturnsPromptly) {
  // A peer whose kernel completes the TCP connection but whose process never
  // accepts it: a TLS handshake waits (up to connect_timeout), a plaintext
  // tensor waits for an ack that never comes. Close must not wait for either.
  const std::pair<int, int> listening = LoopbackListener();
  const int listener = listening.first, port = listening.second;
  PeerSenderOptions o;
  o.direct_address = absl::StrCat("127.0.0.1:", port);
  o.peer_name = "w2";
  o.connect_timeout = absl::Seconds(30);
  if (tls()) o.security = TestCerts().Load("w1");
  auto sender = std::make_unique<PeerSender>("w2", o);
  absl::Notification done;
  absl::Status result;
  sender->Send(Header(0, 4), View(Pattern(16, 0)), [&](absl::Status s, double) {
    result = s;
    done.Notify();
  });
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(done.HasBeenNotified());
  const absl::Time start = absl::Now();
  sender->Close();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  ASSERT_TRUE(done.HasBeenNotified());
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled);
  ::close(listener);
}

// A receiver that accepts connections and closes them at once, as its
// connection admission does under a flood, is tried again (with a new
// session each time) until it lets one through.
TEST_P(DirectTransportTest, AReceiverThatClosesConnectionsIsTriedAgain) {
  StartServer();
  detour::testing::TcpRelay relay;
  ASSERT_TRUE(relay.Listen().ok());
  relay.Start(server_->port());
  relay.Cut();  // from here every connection is accepted and closed at once
  PeerSenderOptions o = SenderOptions();
  o.direct_address = relay.address();
  o.connect_timeout = absl::Seconds(20);
  o.direct_connections = 3;
  PeerSender sender("w2", o);
  std::thread restore([&relay] {
    absl::SleepFor(absl::Milliseconds(400));
    relay.Restore();
  });
  const absl::Status s = SendAndWait(sender, Header(0, 4), View(Pattern(16, 0)));
  restore.join();
  EXPECT_TRUE(s.ok()) << s;
  const DirectConnectionInfo info = sender.direct_info();
  EXPECT_EQ(info.connections, 3);
  // 50 ms, 100 ms, 200 ms, ... apart: 400 ms of refusals take 3 to 5 tries.
  EXPECT_GE(info.connect_attempts, 2);
  EXPECT_LE(info.connect_attempts, 8);
  EXPECT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(server_->stats().accepted, 3u);  // only the stripes of the last try
}

TEST_P(DirectTransportTest, AReceiverThatKeepsClosingConnectionsFailsAtTheConnectTimeout) {
  StartServer();
  detour::testing::TcpRelay relay;
  ASSERT_TRUE(relay.Listen().ok());
  relay.Start(server_->port());
  relay.Cut();
  PeerSenderOptions o = SenderOptions();
  o.direct_address = relay.address();
  o.connect_timeout = absl::Milliseconds(1500);
  PeerSender sender("w2", o);
  const absl::Time start = absl::Now();
  const absl::Status s = SendAndWait(sender, Header(0, 4), View(Pattern(16, 0)));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("closed by the receiver at each of"));
  EXPECT_THAT(s.message(), HasSubstr(relay.address()));
  EXPECT_GE(took, absl::Milliseconds(700));
  EXPECT_LT(took, absl::Seconds(15));
  EXPECT_TRUE(sink_.received().empty());
}

TEST_P(DirectTransportTest, ShutdownEndsIdleConnectionsPromptly) {
  StartServer();
  PeerSender sender("w2", SenderOptions());
  ASSERT_TRUE(SendAndWait(sender, Header(0, 4), View(Pattern(16, 0))).ok());
  EXPECT_EQ(server_->stats().open, 1);
  const absl::Time start = absl::Now();
  server_->Shutdown();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  EXPECT_EQ(server_->stats().open, 0);
  // The sender notices and fails the next tensor instead of hanging.
  const absl::Time send = absl::Now();
  absl::Status s = SendAndWait(sender, Header(1, 4), View(Pattern(16, 1)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - send, absl::Seconds(2));
}

TEST_P(DirectTransportTest, ALargeTensorIsStripedOverSeveralConnections) {
  StartServer();
  PeerSenderOptions o = SenderOptions();
  o.direct_connections = 4;
  PeerSender sender("w2", o);
  auto big = Pattern(64 << 20, 5);  // 16 chunks of 4 MiB, 4 per connection
  ASSERT_TRUE(SendAndWait(sender, Header(0, (64 << 20) / 4), View(big)).ok());
  auto small = Pattern(4 << 10, 6);  // below the threshold: one connection
  ASSERT_TRUE(SendAndWait(sender, Header(1, (4 << 10) / 4), View(small)).ok());
  auto got = sink_.received();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_TRUE(got[0].second == *big);
  EXPECT_EQ(got[1].second, *small);
  EXPECT_EQ(sender.direct_info().connections, 4);
  EXPECT_FALSE(sender.direct_info().congestion_control.empty());
  const std::vector<uint64_t> written = sender.direct_info().written;
  ASSERT_EQ(written.size(), 4u);
  EXPECT_EQ(std::accumulate(written.begin(), written.end(), uint64_t{0}), (64u << 20) + (4u << 10));
  // Each stripe is a connection of its own, with its own handshake, all in
  // one session on the receiver.
  EXPECT_EQ(server_->stats().accepted, 4u);
  EXPECT_EQ(server_->stats().open, 4);
  EXPECT_EQ(server_->stats().sessions, 1);
  ActivationServer::Stats s = activations_->stats();
  EXPECT_EQ(s.frames, 16u + 1);
  EXPECT_EQ(s.malformed + s.rejected + s.unauthorized + s.duplicates, 0u);
  EXPECT_EQ(s.partial_tensors, 0u);
  sender.Close();
  EXPECT_TRUE(Eventually([&] { return server_->stats().sessions == 0; }));
}

// A TCP relay on loopback between a sender and the server, as a path of a
// WAN: it can cut one connection (the `victim`-th it accepts) after
// `cut_after` bytes from the sender, as a lost path would, and hold what the
// sender of a connection sends (Hold), as a loss or a slow path holds a
// connection up, while the server's answers still flow back.
class TestRelay {
 public:
  explicit TestRelay(int target_port, int victim = -1, size_t cut_after = 0)
      : target_port_(target_port), victim_(victim), cut_after_(cut_after) {
    auto [fd, port] = LoopbackListener();
    listener_ = fd;
    port_ = port;
    acceptor_ = std::thread([this] { Accept(); });
  }
  ~TestRelay() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    ::shutdown(listener_, SHUT_RDWR);
    acceptor_.join();
    {
      absl::MutexLock lock(&mu_);
      for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
    }
    for (auto& t : pumps_) t.join();
    for (int fd : fds_) ::close(fd);
    ::close(listener_);
  }
  int port() const { return port_; }
  bool cut() {
    absl::MutexLock lock(&mu_);
    return cut_;
  }
  size_t connections() {
    absl::MutexLock lock(&mu_);
    return accepted_;
  }
  // Holds (or releases) what the sender of the `index`th connection sends.
  void Hold(size_t index, bool held) {
    absl::MutexLock lock(&mu_);
    if (held_.size() <= index) held_.resize(index + 1, false);
    held_[index] = held;
  }

 private:
  void Accept() {
    while (true) {
      const int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) return;
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(target_port_));
      if (::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        ::close(client);
        ::close(server);
        continue;
      }
      absl::MutexLock lock(&mu_);
      const size_t n = accepted_++;
      fds_.push_back(client);
      fds_.push_back(server);
      pumps_.emplace_back([this, client, server, n] { Pump(client, server, n); });
      pumps_.emplace_back([this, server, client] { Pump(server, client, kAnswers); });
    }
  }
  // Copies from `from` to `to` until either ends. `index`: the connection's
  // place in accept order, for what its sender sends; kAnswers for the way
  // back (never held or cut).
  void Pump(int from, int to, size_t index) {
    std::vector<char> buffer(64 << 10);
    size_t moved = 0;
    while (true) {
      if (index != kAnswers) {
        absl::MutexLock lock(&mu_);
        auto released = [this, index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || index >= held_.size() || !held_[index];
        };
        mu_.Await(absl::Condition(&released));
        if (stopping_) break;
      }
      const ssize_t n = ::recv(from, buffer.data(), buffer.size(), 0);
      if (n <= 0) break;
      if (::send(to, buffer.data(), static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
      moved += static_cast<size_t>(n);
      if (index != kAnswers && static_cast<int>(index) == victim_ && moved >= cut_after_) {
        absl::MutexLock lock(&mu_);
        cut_ = true;
        break;
      }
    }
    ::shutdown(from, SHUT_RDWR);
    ::shutdown(to, SHUT_RDWR);
  }

  static constexpr size_t kAnswers = SIZE_MAX;
  const int target_port_;
  const int victim_;
  const size_t cut_after_;
  int listener_ = -1;
  int port_ = 0;
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_;  // acceptor thread, then the destructor
  size_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<bool> held_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool cut_ ABSL_GUARDED_BY(mu_) = false;
};

// The connections of a striped session take chunks as each is free: one
// that is held up (a loss, a slow path) takes no more once its socket stops
// taking data, and the tensors the others carry complete without it. When
// each connection had its fixed range of every tensor, every striped tensor
// waited for the held connection.
TEST_P(DirectTransportTest, AHeldUpConnectionDoesNotHoldTheOthersTensors) {
  StartServer();
  TestRelay relay(server_->port());
  PeerSenderOptions o = SenderOptions();
  o.direct_address = absl::StrCat("127.0.0.1:", relay.port());
  o.direct_connections = 2;
  PeerSender sender("w2", o);
  auto opening = Pattern(4 << 10, 1);
  ASSERT_TRUE(SendAndWait(sender, Header(0, (4 << 10) / 4), View(opening)).ok());
  ASSERT_EQ(relay.connections(), 2u);
  relay.Hold(1, true);

  constexpr int kTensors = 6;  // 8 MiB each: striped, 4 chunks of 2 MiB
  std::vector<std::shared_ptr<std::vector<char>>> sent;
  absl::Mutex mu;
  int done = 0, failed = 0;
  for (uint32_t mb = 1; mb <= kTensors; ++mb) {
    sent.push_back(Pattern(8 << 20, static_cast<int>(mb)));
    sender.Send(Header(mb, (8 << 20) / 4), View(sent.back()), [&](absl::Status s, double) {
      absl::MutexLock lock(&mu);
      ++(s.ok() ? done : failed);
    });
  }
  // All but the one tensor whose chunk the held connection took.
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&mu);
    return done >= kTensors - 1;
  })) << "tensors done while one connection was held: "
      << done;
  const std::vector<uint64_t> written = sender.direct_info().written;
  ASSERT_EQ(written.size(), 2u);
  EXPECT_LE(std::min(written[0], written[1]), uint64_t{4} << 20)
      << "the held connection took " << std::min(written[0], written[1]) << " bytes";

  relay.Hold(1, false);
  EXPECT_TRUE(Eventually([&] {
    absl::MutexLock lock(&mu);
    return done == kTensors;
  }));
  EXPECT_EQ(failed, 0);
  auto got = sink_.received();
  ASSERT_EQ(got.size(), static_cast<size_t>(kTensors) + 1);
  for (const auto& [header, bytes] : got) {
    if (header.microbatch() == 0) continue;
    EXPECT_TRUE(bytes == *sent[header.microbatch() - 1]) << header.microbatch();
  }
  sender.Close();
}

// A receiver that does not know the sender (no peer list named it) lets one
// source hold only so many handshakes at once: a sender with more stripes
// than half of that opens that many first, and the rest once they have
// greeted the receiver and made the source trusted. Opened all at once over
// TLS, the stripes beyond the source's share were closed during their
// handshakes, and the session failed at every try.
TEST_P(DirectTransportTest, MoreStripesThanAStrangerMayHandshakeStillOpen) {
  StartServer();
  PeerSenderOptions o = SenderOptions();
  o.direct_connections = 16;
  o.link.rtt = absl::Milliseconds(20);
  o.link.rate_bytes_per_s = 1e8;
  PeerSender sender("w2", o);
  auto big = Pattern(16 << 20, 9);
  ASSERT_TRUE(SendAndWait(sender, Header(0, (16 << 20) / 4), View(big)).ok());
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_TRUE(sink_.received()[0].second == *big);
  EXPECT_EQ(sender.direct_info().connections, 16);
  EXPECT_EQ(server_->stats().accepted, 16u);
  EXPECT_EQ(server_->stats().sessions, 1);
}

// Connect() opens every stripe (handshakes and hello) before the first
// tensor, which then goes over them, each connection with the same number of
// chunks (16 MiB over 3 is 6 chunks, two each, not 4 of 4 MiB of which one
// connection carries two); a failed early connect is no error of its own,
// and the next tensor reports the address it could not reach.
TEST_P(DirectTransportTest, ConnectOpensTheStripesBeforeTheFirstTensor) {
  StartServer();
  PeerSenderOptions o = SenderOptions();
  o.direct_connections = 3;
  PeerSender sender("w2", o);
  sender.Connect();
  ASSERT_TRUE(Eventually([&] {
    return server_->stats().accepted == 3 && server_->stats().sessions == 1 &&
           sender.direct_info().connections == 3;
  })) << server_->stats().accepted
      << " " << sender.direct_info().connections;
  sender.Connect();  // connected: nothing more opens
  auto big = Pattern(16 << 20, 7);
  ASSERT_TRUE(SendAndWait(sender, Header(0, (16 << 20) / 4), View(big)).ok());
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_TRUE(sink_.received()[0].second == *big);
  EXPECT_EQ(server_->stats().accepted, 3u);
  EXPECT_EQ(server_->stats().sessions, 1);
  ActivationServer::Stats stats = activations_->stats();
  EXPECT_EQ(stats.frames, 6u);
  EXPECT_EQ(stats.malformed + stats.rejected + stats.unauthorized + stats.duplicates, 0u);

  const int port = server_->port();
  sender.Close();
  server_.reset();  // nothing listens there any more
  PeerSenderOptions gone = SenderOptions();
  gone.direct_address = absl::StrCat("127.0.0.1:", port);
  PeerSender late("w2", gone);
  late.Connect();
  absl::SleepFor(absl::Milliseconds(200));  // let the early connect fail first
  const absl::Status s = SendAndWait(late, Header(1, 4), View(Pattern(16, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr(gone.direct_address));
}

TEST_P(DirectTransportTest, OverLoopbackTheBandwidthDelayProductAsksForOneConnection) {
  StartServer();
  PeerSenderOptions o = SenderOptions();
  o.link.rate_bytes_per_s = 1e9;  // RTT: measured at connect (microseconds here)
  PeerSender sender("w2", o);
  auto data = Pattern(1 << 20, 7);
  ASSERT_TRUE(SendAndWait(sender, Header(0, (1 << 20) / 4), View(data)).ok());
  EXPECT_EQ(sender.direct_info().connections, 1);
  EXPECT_LT(sender.direct_info().rtt, absl::Milliseconds(50));
  EXPECT_EQ(server_->stats().accepted, 1u);
}

INSTANTIATE_TEST_SUITE_P(PlaintextAndTls, DirectTransportTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Tls" : "Plaintext";
                         });

// --- plaintext framing attacks ----------------------------------------------

class DirectFramingTest : public DirectFixture {};

TEST_F(DirectFramingTest, WrongPrefaceIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const int fd = RawConnect();
  const char http[] = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_GT(::send(fd, http, sizeof(http) - 1, 0), 0);
  EXPECT_TRUE(ClosedByServer(fd));
  ::close(fd);
  EXPECT_TRUE(Eventually([&] { return server_->stats().refused == 1; }));
  EXPECT_EQ(server_->stats().accepted, 0u);
}

TEST_F(DirectFramingTest, AVersion1SenderIsRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  const int fd = RawConnect();
  char prefix[kDirectFramePrefixBytes];
  EncodeDirectFramePrefix(8, 16, prefix);
  std::string bytes(kDirectPrefaceV1, sizeof(kDirectPrefaceV1));
  bytes += std::string(prefix, sizeof(prefix)) + std::string(24, '\0');
  ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
  EXPECT_TRUE(ClosedByServer(fd));
  ::close(fd);
  EXPECT_TRUE(Eventually([&] { return server_->stats().refused == 1; }));
  EXPECT_EQ(activations_->stats().frames, 0u);
}

TEST_F(DirectFramingTest, AVersion2SenderToAVersion1ReceiverGetsAClearError) {
  // A v1 receiver reads the preface, does not know it, and closes.
  const std::pair<int, int> listening = LoopbackListener();
  const int listener = listening.first, port = listening.second;
  std::thread v1([listener] {
    const int fd = ::accept(listener, nullptr, nullptr);
    char preface[8];
    (void)!::recv(fd, preface, sizeof(preface), MSG_WAITALL);
    ::close(fd);
  });
  auto link = DirectLink::Open(absl::StrCat("127.0.0.1:", port), nullptr, "w2", absl::Seconds(3));
  ASSERT_TRUE(link.ok()) << link.status();
  const absl::Status greeted = (*link)->Greet(DirectHello{}, absl::Seconds(3));
  v1.join();
  ::close(listener);
  ASSERT_FALSE(greeted.ok());
  EXPECT_EQ(greeted.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(greeted.message()), HasSubstr("speaks only v1"));
}

// With the round trip known (a link probe measured it), every stripe opens
// at once: none waits for another's greeting, so a new pair pays its
// handshakes' round trips once. This receiver answers no hello before all
// three stripes of the session have greeted it; a sender that waited for the
// first stripe's answer before opening the others would wait until its
// connect timeout.
TEST_F(DirectFramingTest, WithTheRoundTripKnownNoStripeWaitsForAnothersGreeting) {
  const std::pair<int, int> listening = LoopbackListener();
  const int listener = listening.first, port = listening.second;
  std::vector<int> greeted;
  std::vector<uint32_t> stripes;
  std::thread receiver([&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (greeted.size() < 3 && absl::Now() < deadline) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const int fd = ::accept(listener, nullptr, nullptr);
      if (fd < 0) continue;
      timeval tv{5, 0};
      ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      char in[sizeof(kDirectPreface) + kDirectHelloBytes];
      if (::recv(fd, in, sizeof(in), MSG_WAITALL) != static_cast<ssize_t>(sizeof(in))) {
        ::close(fd);
        continue;
      }
      auto hello = DecodeDirectHello(in + sizeof(kDirectPreface));
      if (hello.ok()) stripes.push_back(hello->stripe);
      greeted.push_back(fd);
    }
    if (greeted.size() == 3) {
      for (int fd : greeted) (void)!::send(fd, kDirectPreface, sizeof(kDirectPreface), 0);
    }
  });
  PeerSenderOptions o;
  o.direct_address = absl::StrCat("127.0.0.1:", port);
  o.peer_name = "w2";
  o.connect_timeout = absl::Seconds(5);
  o.direct_connections = 3;
  o.link.rtt = absl::Milliseconds(20);
  o.link.rate_bytes_per_s = 1e8;
  PeerSender sender("w2", o);
  sender.Connect();
  receiver.join();
  EXPECT_TRUE(Eventually([&] { return sender.direct_info().connections == 3; }))
      << greeted.size() << " of 3 stripes greeted the receiver";
  std::sort(stripes.begin(), stripes.end());
  EXPECT_EQ(stripes, (std::vector<uint32_t>{0, 1, 2}));
  sender.Close();
  for (int fd : greeted) ::close(fd);
  ::close(listener);
}

// A TLS sender at a plaintext receiver gets a TLS alert, which it reports at
// once instead of trying again until its connect timeout.
TEST_F(DirectFramingTest, ATlsSenderAtAPlaintextReceiverFailsAtOnce) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  PeerSenderOptions o = SenderOptions();
  o.connect_timeout = absl::Seconds(10);
  o.security = TestCerts().Load("w1");
  PeerSender sender("w2", o);
  const absl::Time start = absl::Now();
  const absl::Status s = SendAndWait(sender, Header(0, 4), View(Pattern(16, 0)));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(s.message(), HasSubstr("alert")) << s;
  EXPECT_THAT(s.message(), Not(HasSubstr("closed by the receiver"))) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(sink_.received().empty());
}

TEST_F(DirectFramingTest, StripesThatConflictWithTheirSessionAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  auto answered = [](int fd) {
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char answer[8];
    return ::recv(fd, answer, sizeof(answer), MSG_WAITALL) == 8 &&
           std::memcmp(answer, kDirectPreface, 8) == 0;
  };
  const int first = RawConnect();
  std::string hello = PrefaceAndHello(DirectHello{7, 0, 2});
  ASSERT_EQ(::send(first, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  ASSERT_TRUE(answered(first));
  const DirectHello refused[] = {
      {7, 0, 2},   // the same stripe twice
      {7, 1, 3},   // a stripe count the session does not have
      {8, 2, 2},   // a stripe beyond the count
      {9, 0, 17},  // more stripes than allowed
  };
  for (const DirectHello& h : refused) {
    SCOPED_TRACE(absl::StrCat(h.session, ": ", h.stripe, " of ", h.stripes));
    const int fd = RawConnect();
    hello = PrefaceAndHello(h);
    ASSERT_EQ(::send(fd, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
    EXPECT_TRUE(ClosedByServer(fd));
    ::close(fd);
  }
  EXPECT_TRUE(Eventually([&] { return server_->stats().refused == 4; }));
  // The session's own second stripe still joins.
  const int second = RawConnect();
  hello = PrefaceAndHello(DirectHello{7, 1, 2});
  ASSERT_EQ(::send(second, hello.data(), hello.size(), 0), static_cast<ssize_t>(hello.size()));
  EXPECT_TRUE(answered(second));
  EXPECT_EQ(server_->stats().sessions, 1);
  // One stripe that ends ends its session: the other is closed too.
  ::close(first);
  EXPECT_TRUE(ClosedByServer(second));
  ::close(second);
  EXPECT_TRUE(Eventually([&] { return server_->stats().sessions == 0; }));
}

TEST_F(DirectFramingTest, ALostStripeFailsTheTensorAndTheReceiverFreesIt) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  // The second connection of the session is cut 1 MiB into its stripe.
  TestRelay relay(server_->port(), /*victim=*/1, 1 << 20);
  PeerSenderOptions o = SenderOptions();
  o.direct_address = absl::StrCat("127.0.0.1:", relay.port());
  o.direct_connections = 4;
  o.ack_timeout = absl::Seconds(8);
  PeerSender sender("w2", o);
  auto big = Pattern(64 << 20, 9);
  const absl::Time start = absl::Now();
  absl::Status sent = SendAndWait(sender, Header(0, (64 << 20) / 4), View(big));
  EXPECT_FALSE(sent.ok());
  EXPECT_EQ(sent.code(), absl::StatusCode::kUnavailable) << sent;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // not the ack timeout
  EXPECT_TRUE(relay.cut());
  // The receiver ended the whole session and gave the half tensor back.
  EXPECT_TRUE(Eventually([&] {
    return server_->stats().sessions == 0 && activations_->stats().partial_tensors == 0 &&
           activations_->stats().partial_bytes == 0;
  }));
  EXPECT_TRUE(sink_.received().empty());
  // The next tensor goes over a new session.
  auto next = Pattern(64 << 10, 10);
  ASSERT_TRUE(SendAndWait(sender, Header(1, (64 << 10) / 4), View(next)).ok());
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(sink_.received()[0].second, *next);
}

TEST_F(DirectFramingTest, SilentClientIsDroppedAfterTheHandshakeTimeout) {
  ASSERT_NO_FATAL_FAILURE(StartServer());  // handshake_timeout 2 s
  const int fd = RawConnect();
  const absl::Time start = absl::Now();
  EXPECT_TRUE(ClosedByServer(fd));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));
  ::close(fd);
}

TEST_F(DirectFramingTest, OversizedAndMalformedFramingEndsTheConnection) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  struct Case {
    std::string name;
    std::string bytes;
  };
  std::vector<Case> cases;
  {
    char prefix[kDirectFramePrefixBytes];
    EncodeDirectFramePrefix(kMaxDirectMessageBytes + 1, 0, prefix);
    cases.push_back({"header too long", std::string(prefix, sizeof(prefix))});
  }
  {
    char prefix[kDirectFramePrefixBytes];
    EncodeDirectFramePrefix(5, 0, prefix);
    cases.push_back(
        {"unparseable header", std::string(prefix, sizeof(prefix)) + "\xff\xff\xff\xff\xff"});
  }
  {
    // A valid header announcing 2^60 data bytes: refused by the header
    // checks, and far more than a tensor may be, so not read on.
    v1::FrameHeader h = Header(0, 4);
    h.set_total_bytes(16);
    h.set_num_chunks(1);
    const std::string header = h.SerializeAsString();
    char prefix[kDirectFramePrefixBytes];
    EncodeDirectFramePrefix(static_cast<uint32_t>(header.size()), uint64_t{1} << 60, prefix);
    cases.push_back({"data beyond any tensor", std::string(prefix, sizeof(prefix)) + header});
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const uint64_t malformed_before = activations_->stats().malformed;
    const int fd = RawConnect();
    std::string bytes = PrefaceAndHello();
    bytes += c.bytes;
    ASSERT_EQ(::send(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    EXPECT_TRUE(ClosedByServer(fd));
    ::close(fd);
    EXPECT_TRUE(
        Eventually([&] { return activations_->stats().malformed == malformed_before + 1; }));
  }
  EXPECT_TRUE(sink_.received().empty());
  EXPECT_TRUE(Eventually([&] { return server_->stats().open == 0; }));
  EXPECT_EQ(activations_->stats().partial_tensors, 0u);
}

// --- TLS identity -----------------------------------------------------------

// Worker w2's direct server over TLS, taking frames only from workers
// whose certificates the test CA signed.
class DirectTlsIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ActivationServerOptions ao;
    ao.require_peer_certificates = true;
    activations_ = std::make_unique<ActivationServer>(&sink_, ao);
    DirectServerOptions d;
    d.listen = HostPort{"127.0.0.1", 0};
    d.handshake_timeout = absl::Seconds(2);
    d.security = TestCerts().Load("w2");
    auto server = DirectServer::Start(activations_.get(), d);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    address_ = absl::StrCat("127.0.0.1:", server_->port());
  }

  RecordingSink sink_;
  std::unique_ptr<ActivationServer> activations_;
  std::unique_ptr<DirectServer> server_;  // stops before activations_ goes
  std::string address_;
};

TEST_F(DirectTlsIdentityTest, ForeignCaPlaintextAndImpostorsAreRefused) {
  auto data = Pattern(64, 3);

  {  // a certificate from another CA: the handshake fails
    PeerSenderOptions o;
    o.direct_address = address_;
    o.peer_name = "w2";
    o.security = TestCerts().Load("intruder", /*other_ca=*/true);
    PeerSender sender("w2", o);
    absl::Status s = SendAndWait(sender, Header(0, 16, "intruder"), View(data));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  }
  {  // plaintext to a TLS server
    PeerSenderOptions o;
    o.direct_address = address_;
    o.peer_name = "w2";
    o.connect_timeout = absl::Seconds(3);
    PeerSender sender("w2", o);
    const absl::Status s = SendAndWait(sender, Header(1, 16), View(data));
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(s.message(), HasSubstr("requires TLS")) << s;
  }
  {  // a cluster certificate, but frames sent in another worker's name
    PeerSenderOptions o;
    o.direct_address = address_;
    o.peer_name = "w2";
    o.security = TestCerts().Load("w1");
    PeerSender sender("w2", o);
    absl::Status s = SendAndWait(sender, Header(2, 16, "w2"), View(data));
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(SendAndWait(sender, Header(3, 16, "w1"), View(data)).ok());
  }
  {  // the server is not the worker we meant to reach
    PeerSenderOptions o;
    o.direct_address = address_;
    o.peer_name = "w3";
    o.security = TestCerts().Load("w1");
    PeerSender sender("w3", o);
    absl::Status s = SendAndWait(sender, Header(4, 16, "w1"), View(data));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(s.message(), HasSubstr("w3"));
  }
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(sink_.received()[0].first.microbatch(), 3u);
  ActivationServer::Stats s = activations_->stats();
  EXPECT_GE(s.unauthorized, 3u);  // the foreign CA, plaintext, the impersonation
  EXPECT_EQ(s.tensors, 1u);
}

// The sender checks the receiver too: a server whose certificate names the
// peer it meant to reach but is not a worker's (here a user's, "alice") is
// not handed a tensor.
TEST(DirectReceiverIdentityTest, AReceiverWithoutAWorkersCertificateIsNotSentTo) {
  RecordingSink sink;
  ActivationServerOptions ao;
  ao.require_peer_certificates = true;
  ActivationServer activations(&sink, ao);
  DirectServerOptions d;
  d.listen = HostPort{"127.0.0.1", 0};
  d.handshake_timeout = absl::Seconds(2);
  d.security = TestCerts().Load("alice");
  auto server = DirectServer::Start(&activations, d);
  ASSERT_TRUE(server.ok()) << server.status();
  PeerSenderOptions o;
  o.direct_address = absl::StrCat("127.0.0.1:", (*server)->port());
  o.peer_name = "alice";
  o.connect_timeout = absl::Seconds(5);
  o.security = TestCerts().Load("w1");
  PeerSender sender("alice", o);
  auto data = Pattern(64, 9);
  const absl::Status s = SendAndWait(sender, Header(0, 16, "w1"), View(data));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("expecting worker alice"));
  EXPECT_THAT(s.message(), HasSubstr("client"));
  EXPECT_TRUE(sink.received().empty());
  sender.Close();
}

TEST_F(DirectTlsIdentityTest, OnlyAWorkersCertificateMaySend) {
  auto data = Pattern(64, 5);
  auto send_as = [&](const std::string& me, uint32_t microbatch) {
    PeerSenderOptions o;
    o.direct_address = address_;
    o.peer_name = "w2";
    o.connect_timeout = absl::Seconds(5);
    o.security = TestCerts().Load(me);
    PeerSender sender("w2", o);
    return SendAndWait(sender, Header(microbatch, 16, me), View(data));
  };
  // A client's certificate from the cluster CA gets through TLS but is not
  // a worker's: the connection ends before any frame, counted as identity,
  // and the receiver's answer says so, so the sender does not try again.
  const absl::Time start = absl::Now();
  const absl::Status refused = send_as("alice", 0);
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.message(), HasSubstr("refused this sender"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(4));  // connect_timeout is 5 s
  EXPECT_TRUE(send_as("w1", 1).ok());
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(sink_.received()[0].first.microbatch(), 1u);
  const DirectServer::Stats stats = server_->stats();
  EXPECT_GE(stats.refused_by_reason[static_cast<int>(RefusalReason::kIdentity)], 1u);
  EXPECT_GE(activations_->stats().unauthorized, 1u);
}

}  // namespace
}  // namespace detour
