// The worker's control client against a fake coordinator on loopback: job
// messages never block their sender or the heartbeats, a session whose
// writes stall is replaced, the outbox is bounded.
#include "worker/control_client.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "gtest/gtest.h"
#include "worker/term_fence.h"

namespace detour {
namespace {

// Registers everyone as "w1"; the first session reads one message and then
// stops reading (a coordinator that hangs, or a link that stalls), until
// the session is cancelled; later sessions read everything.
class FakeCoordinator final : public v1::ControlService::Service {
 public:
  explicit FakeCoordinator(bool stall_first) : stall_first_(stall_first) {}

  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest*,
                        v1::RegisterResponse* response) override {
    registrations_.fetch_add(1);
    if (!redirect_to_.empty()) {  // a follower naming the leader
      context->AddTrailingMetadata("detour-leader", redirect_to_);
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "not the leader");
    }
    response->set_leader_term(register_term_);
    response->set_worker_id("w1");
    response->set_session_token("token");
    response->set_heartbeat_interval_ms(100);
    return grpc::Status::OK;
  }

  grpc::Status Session(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::CoordinatorMessage, v1::WorkerMessage>* stream) override {
    int number;
    {
      absl::MutexLock lock(&mu_);
      number = ++sessions_;
    }
    for (int64_t term : session_terms_) {  // one plan per term, in order
      v1::CoordinatorMessage m;
      m.set_leader_term(term);
      m.mutable_plan()->set_iteration(static_cast<uint64_t>(term));
      stream->Write(m);
    }
    v1::WorkerMessage message;
    if (number == 1 && stall_first_) {
      if (stream->Read(&message)) Record(number, message);
      first_session_read_.Notify();
      while (!context->IsCancelled() && !stopping_.HasBeenNotified()) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      return grpc::Status(grpc::StatusCode::CANCELLED, "stalled session ended");
    }
    while (stream->Read(&message)) Record(number, message);
    return grpc::Status::OK;
  }

  void Record(int session, const v1::WorkerMessage& message) {
    absl::MutexLock lock(&mu_);
    if (message.has_heartbeat()) {
      heartbeats_[session]++;
    } else {
      other_.push_back(message);
    }
  }

  int HeartbeatsOn(int session) {
    absl::MutexLock lock(&mu_);
    return heartbeats_[session];
  }
  std::vector<v1::WorkerMessage> others() {
    absl::MutexLock lock(&mu_);
    return other_;
  }

  const bool stall_first_;
  std::string redirect_to_;
  int64_t register_term_ = 0;
  std::vector<int64_t> session_terms_;
  std::atomic<int> registrations_{0};
  absl::Notification first_session_read_;
  absl::Notification stopping_;

 private:
  absl::Mutex mu_;
  int sessions_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int, int> heartbeats_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::WorkerMessage> other_ ABSL_GUARDED_BY(mu_);
};

// Serves `fake` on a free loopback port; returns the server and its address.
std::unique_ptr<grpc::Server> Serve(FakeCoordinator* fake, std::string* address) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(fake);
  auto server = builder.BuildAndStart();
  *address = absl::StrCat("127.0.0.1:", port);
  return server;
}

class ControlClientTest : public ::testing::Test {
 protected:
  void Start(bool stall_first) {
    fake_ = std::make_unique<FakeCoordinator>(stall_first);
    StartServer();
  }

  void StartServer() {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(fake_.get());
    // A small receive window, so a big message fills it at once.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 10);
    builder.SetMaxReceiveMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
  }

  void TearDown() override {
    // Server first: it ends every call, so even a client stuck in a write
    // (the defect this file tests) gets free and Stop() returns.
    if (fake_ && !fake_->stopping_.HasBeenNotified()) fake_->stopping_.Notify();
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
    if (client_) client_->Stop();
  }

  ControlClient::Options ClientOptions() {
    ControlClient::Options options;
    options.coordinator = address_;
    options.registration.set_region("test");
    options.rpc_timeout = absl::Seconds(1);
    return options;
  }

  static v1::WorkerMessage BigError(size_t bytes) {
    v1::WorkerMessage m;
    m.mutable_error()->set_job_id("job-1");
    m.mutable_error()->set_message(std::string(bytes, 'e'));
    return m;
  }

  // Polls `done` for up to a minute (nothing is timed: this only bounds how
  // long a broken client can hang the test).
  static bool Eventually(const std::function<bool()>& done) {
    for (int i = 0; i < 6000; ++i) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return done();
  }

  std::unique_ptr<FakeCoordinator> fake_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::unique_ptr<ControlClient> client_;
};

TEST_F(ControlClientTest, DeliversJobMessagesInOrderWithHeartbeats) {
  Start(/*stall_first=*/false);
  client_ = std::make_unique<ControlClient>(ClientOptions(), ControlClient::Hooks{});
  ASSERT_TRUE(client_->Start().ok());
  ASSERT_TRUE(Eventually([&] { return client_->Send(BigError(1)).ok(); }));
  for (int i = 0; i < 50; ++i) {
    v1::WorkerMessage m;
    m.mutable_error()->set_job_id("job-1");
    m.mutable_error()->set_iteration(i);
    ASSERT_TRUE(client_->Send(m).ok());
  }
  ASSERT_TRUE(Eventually([&] { return fake_->others().size() == 51u; }));
  auto got = fake_->others();
  for (int i = 0; i < 50; ++i) {
    EXPECT_EQ(got[i + 1].error().iteration(), static_cast<uint64_t>(i));
    EXPECT_EQ(got[i + 1].session_token(), "token");
  }
  EXPECT_TRUE(Eventually([&] { return fake_->HeartbeatsOn(1) >= 3; }));
}

// Regression: Send wrote on the session under the mutex the
// heartbeat also needed, so a job message blocked on a stalled stream
// blocked its caller (the job runtime) and stopped every heartbeat: the
// worker went silent and never recovered. Now Send only queues; the
// session whose write stalls is cancelled and a new one carries the
// heartbeats.
TEST_F(ControlClientTest, AStalledWriteBlocksNeitherSendNorHeartbeats) {
  Start(/*stall_first=*/true);
  client_ = std::make_unique<ControlClient>(ClientOptions(), ControlClient::Hooks{});
  ASSERT_TRUE(client_->Start().ok());
  ASSERT_TRUE(fake_->first_session_read_.WaitForNotificationWithTimeout(absl::Seconds(60)));
  // 8 MiB: far more than the stalled stream's window.
  absl::Notification sent;
  std::thread sender([&] {
    absl::Status s = client_->Send(BigError(8 << 20));
    EXPECT_TRUE(s.ok()) << s;
    sent.Notify();
  });
  const bool returned = sent.WaitForNotificationWithTimeout(absl::Seconds(60));
  EXPECT_TRUE(returned) << "Send blocked on the stalled stream";
  EXPECT_TRUE(Eventually([&] { return fake_->HeartbeatsOn(2) >= 2; }))
      << "no heartbeats after the stall";
  fake_->stopping_.Notify();
  server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  sender.join();
}

TEST_F(ControlClientTest, OutboxIsBounded) {
  Start(/*stall_first=*/true);
  ControlClient::Options options = ClientOptions();
  options.max_outbox_messages = 8;
  options.write_stall_timeout = absl::Minutes(10);  // keep the stalled session
  client_ = std::make_unique<ControlClient>(options, ControlClient::Hooks{});
  ASSERT_TRUE(client_->Start().ok());
  ASSERT_TRUE(fake_->first_session_read_.WaitForNotificationWithTimeout(absl::Seconds(60)));
  ASSERT_TRUE(client_->Send(BigError(8 << 20)).ok());  // taken by the writer, stuck
  absl::Status s;
  int queued = 0;
  for (; queued < 100; ++queued) {
    s = client_->Send(BigError(10));
    if (!s.ok()) break;
  }
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("8 messages"), std::string::npos) << s;
  EXPECT_LE(queued, 9);
}

TEST_F(ControlClientTest, SendWithoutSessionIsUnavailable) {
  Start(/*stall_first=*/false);
  ControlClient client(ClientOptions(), ControlClient::Hooks{});
  EXPECT_EQ(client.Send(BigError(1)).code(), absl::StatusCode::kUnavailable);
}

TEST(TermFenceTest, RefusesOlderTermsOnly) {
  TermFence fence;
  EXPECT_TRUE(fence.Admit(0));  // no election: always
  EXPECT_TRUE(fence.Admit(7));
  EXPECT_TRUE(fence.Admit(7));
  EXPECT_FALSE(fence.Admit(6));  // a deposed leader
  EXPECT_FALSE(fence.Admit(-1));
  EXPECT_TRUE(fence.Admit(0));
  EXPECT_TRUE(fence.Admit(9));
  EXPECT_FALSE(fence.Admit(7));
  EXPECT_EQ(fence.newest(), 9);
  EXPECT_EQ(fence.refused(), 3u);
}

TEST(TermFenceTest, ConcurrentAdmitsKeepTheNewest) {
  TermFence fence;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&fence, t] {
      for (int64_t term = 1; term <= 1000; ++term) fence.Admit(term * 4 + t);
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(fence.newest(), 4003);
}

// Messages of a term older than the newest seen (a deposed leader's) never
// reach the worker's handler; the registration's term counts as seen.
TEST_F(ControlClientTest, DropsMessagesOfOlderTerms) {
  fake_ = std::make_unique<FakeCoordinator>(/*stall_first=*/false);
  fake_->register_term_ = 4;
  fake_->session_terms_ = {5, 3, 5, 6, 4, 2, 6};
  StartServer();
  absl::Mutex mu;
  std::vector<uint64_t> got;
  ControlClient::Hooks hooks;
  hooks.on_message = [&](const v1::CoordinatorMessage& m) {
    absl::MutexLock lock(&mu);
    got.push_back(m.plan().iteration());
  };
  client_ = std::make_unique<ControlClient>(ClientOptions(), hooks);
  ASSERT_TRUE(client_->Start().ok());
  ASSERT_TRUE(Eventually([&] { return client_->fence().refused() == 3u; }));
  ASSERT_TRUE(Eventually([&] {
    absl::MutexLock lock(&mu);
    return got.size() == 4u;
  }));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(got, (std::vector<uint64_t>{5, 5, 6, 6}));
  EXPECT_EQ(client_->fence().newest(), 6);
}

// A follower's refusal names the leader: the client registers there at
// once. An unreachable address in the list is skipped.
TEST_F(ControlClientTest, FollowsTheLeaderAmongSeveralCoordinators) {
  Start(/*stall_first=*/false);  // the leader, at address_
  FakeCoordinator follower(/*stall_first=*/false);
  follower.redirect_to_ = address_;
  std::string follower_address;
  auto follower_server = Serve(&follower, &follower_address);
  ASSERT_NE(follower_server, nullptr);
  // A port nobody listens on: the follower's own, once it is shut down.
  FakeCoordinator gone(false);
  std::string gone_address;
  Serve(&gone, &gone_address)->Shutdown();

  ControlClient::Options options = ClientOptions();
  options.coordinator = absl::StrCat(gone_address, ",", follower_address);
  options.initial_backoff = absl::Milliseconds(10);
  client_ = std::make_unique<ControlClient>(options, ControlClient::Hooks{});
  ASSERT_TRUE(client_->Start().ok());
  EXPECT_EQ(client_->coordinator(), address_);
  EXPECT_EQ(follower.registrations_.load(), 1);
  EXPECT_TRUE(Eventually([&] { return fake_->HeartbeatsOn(1) >= 1; }));
  follower_server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

}  // namespace
}  // namespace detour
