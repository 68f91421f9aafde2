// ActivationService transport on loopback: chunked tensors arrive intact,
// bad frames are rejected and counted, emulation delays and rate-limits.
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/frame_codec.h"
#include "worker/transport/peer_sender.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

// Accepts tensors of job "job-1" into fresh vectors; refuses others.
class RecordingSink : public TensorSink {
 public:
  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) override {
    if (h.job_id() != "job-1") {
      return absl::FailedPreconditionError(absl::StrCat("unknown job ", h.job_id()));
    }
    auto storage = std::make_shared<std::vector<char>>(h.total_bytes());
    MutableBuffer b;
    b.data = storage->data();
    b.bytes = storage->size();
    b.keepalive = storage;
    return b;
  }
  void Deliver(const v1::FrameHeader& h, MutableBuffer buffer) override {
    absl::MutexLock lock(&mu_);
    auto storage = std::static_pointer_cast<std::vector<char>>(buffer.keepalive);
    received_.push_back({h, *storage});
  }
  std::vector<std::pair<v1::FrameHeader, std::vector<char>>> received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<v1::FrameHeader, std::vector<char>>> received_ ABSL_GUARDED_BY(mu_);
};

class TransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<ActivationServer>(&sink_, ActivationServerOptions{64 << 20});
    GrpcServerOptions options;
    options.listen = HostPort{"127.0.0.1", 0};
    options.generic_service = server_.get();
    auto running = StartGrpcServer(std::move(options), "test");
    ASSERT_TRUE(running.ok()) << running.status();
    running_ = std::move(*running);
    address_ = absl::StrCat("127.0.0.1:", running_.port);
  }
  void TearDown() override { running_.server->Shutdown(); }

  static v1::FrameHeader Header(uint32_t microbatch, std::vector<int64_t> shape,
                                v1::DType dtype = v1::DTYPE_FP32) {
    v1::FrameHeader h;
    h.set_job_id("job-1");
    h.set_iteration(3);
    h.set_microbatch(microbatch);
    h.set_direction(v1::DIRECTION_FORWARD);
    h.set_sender("w1");
    h.set_hop(1);
    for (int64_t d : shape) h.add_shape(d);
    h.set_dtype(dtype);
    return h;
  }

  static TensorView View(std::shared_ptr<std::vector<char>> bytes) {
    TensorView v;
    v.data = bytes->data();
    v.bytes = bytes->size();
    v.keepalive = bytes;
    return v;
  }

  // Sends and waits; returns the completion status.
  static absl::Status SendAndWait(PeerSender& sender, v1::FrameHeader h, TensorView v,
                                  double* seconds = nullptr) {
    absl::Notification done;
    absl::Status result;
    sender.Send(std::move(h), std::move(v), [&](absl::Status s, double t) {
      result = s;
      if (seconds) *seconds = t;
      done.Notify();
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    return result;
  }

  RecordingSink sink_;
  std::unique_ptr<ActivationServer> server_;
  RunningServer running_;
  std::string address_;
};

std::shared_ptr<std::vector<char>> Pattern(size_t n, int seed) {
  auto v = std::make_shared<std::vector<char>>(n);
  for (size_t i = 0; i < n; ++i) (*v)[i] = static_cast<char>((i * 131 + seed) & 0xff);
  return v;
}

TEST_F(TransportTest, ChunkedTensorsArriveIntact) {
  PeerSenderOptions options;
  options.chunk_bytes = 1 << 20;  // 1 MiB: the 10 MB tensor takes 10 chunks
  PeerSender sender(address_, options);
  const size_t sizes[] = {4 * 8, 4 * 1000, 4 * 2500000};
  for (uint32_t mb = 0; mb < 3; ++mb) {
    auto bytes = Pattern(sizes[mb], mb);
    ASSERT_TRUE(SendAndWait(sender, Header(mb, {static_cast<int64_t>(sizes[mb] / 4)}),
                            View(bytes))
                    .ok());
    auto got = sink_.received();
    ASSERT_EQ(got.size(), mb + 1);
    EXPECT_EQ(got.back().first.microbatch(), mb);
    EXPECT_TRUE(got.back().second == *bytes) << "tensor " << mb << " differs";
  }
  EXPECT_EQ(server_->stats().tensors, 3u);
  EXPECT_EQ(server_->stats().frames, 1u + 1u + 10u);
  EXPECT_EQ(server_->stats().malformed, 0u);
}

TEST_F(TransportTest, ManyConcurrentTransfersOnOneStream) {
  PeerSenderOptions options;
  options.chunk_bytes = 64 << 10;
  PeerSender sender(address_, options);
  absl::Mutex mu;
  int ok = 0, done = 0;
  std::vector<std::shared_ptr<std::vector<char>>> data;
  for (uint32_t mb = 0; mb < 16; ++mb) {
    data.push_back(Pattern(4 * 100000, mb));
    sender.Send(Header(mb, {100000}), View(data.back()), [&](absl::Status s, double) {
      absl::MutexLock lock(&mu);
      ok += s.ok();
      ++done;
    });
  }
  absl::MutexLock lock(&mu);
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(+[](int* d) { return *d == 16; }, &done),
                                  absl::Seconds(30)));
  EXPECT_EQ(ok, 16);
  auto got = sink_.received();
  ASSERT_EQ(got.size(), 16u);
  for (const auto& [h, bytes] : got) EXPECT_TRUE(bytes == *data[h.microbatch()]);
}

TEST_F(TransportTest, WrongJobIsRejectedAndCounted) {
  PeerSender sender(address_, PeerSenderOptions());
  v1::FrameHeader h = Header(0, {4});
  h.set_job_id("job-other");
  absl::Status s = SendAndWait(sender, h, View(Pattern(16, 1)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("unknown job job-other"));
  EXPECT_EQ(server_->stats().rejected, 1u);
  EXPECT_TRUE(sink_.received().empty());
}

// Sends raw buffers on a stream, bypassing PeerSender, and collects acks.
std::vector<v1::FrameAck> SendRaw(const std::string& address,
                                  std::vector<grpc::ByteBuffer> frames) {
  auto channel = MakeChannel(address);
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&context, "/detour.v1.ActivationService/Stream", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  for (auto& f : frames) {
    call->Write(f, reinterpret_cast<void*>(2));
    cq.Next(&tag, &ok);
  }
  call->WritesDone(reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  std::vector<v1::FrameAck> acks;
  while (true) {
    grpc::ByteBuffer buffer;
    call->Read(&buffer, reinterpret_cast<void*>(4));
    cq.Next(&tag, &ok);
    if (!ok) break;
    grpc::Slice slice;
    EXPECT_TRUE(buffer.DumpToSingleSlice(&slice).ok());
    v1::FrameAck ack;
    ack.ParseFromArray(slice.begin(), static_cast<int>(slice.size()));
    acks.push_back(ack);
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return acks;
}

TEST_F(TransportTest, MalformedOversizedAndDuplicateFramesAreDroppedAndCounted) {
  auto bytes = Pattern(32, 0);
  TensorView view = View(bytes);
  std::vector<grpc::ByteBuffer> frames;
  // Garbage that is not a TensorFrame.
  const char junk[] = "\xff\xff\xff garbage";
  grpc::Slice junk_slice(junk, sizeof(junk));
  frames.emplace_back(&junk_slice, 1);
  // Shape says 8 floats, total_bytes says 16.
  v1::FrameHeader bad = Header(1, {8});
  bad.set_total_bytes(16);
  bad.set_num_chunks(1);
  frames.push_back(EncodeFrame(bad, view, 0, 16));
  // Oversized: 1e9 floats exceed the 64 MiB limit.
  v1::FrameHeader huge = Header(2, {1000000000});
  huge.set_total_bytes(4000000000ull);
  huge.set_num_chunks(1000);
  frames.push_back(EncodeFrame(huge, view, 0, 32));
  // A two-chunk tensor (chunks of the smallest allowed size) whose first
  // chunk is sent twice.
  auto big = Pattern(2 * kMinChunkBytes, 1);
  TensorView big_view = View(big);
  v1::FrameHeader good = Header(3, {static_cast<int64_t>(2 * kMinChunkBytes / 4)});
  good.set_total_bytes(2 * kMinChunkBytes);
  good.set_num_chunks(2);
  good.set_chunk_index(0);
  good.set_offset(0);
  frames.push_back(EncodeFrame(good, big_view, 0, kMinChunkBytes));
  frames.push_back(EncodeFrame(good, big_view, 0, kMinChunkBytes));
  good.set_chunk_index(1);
  good.set_offset(kMinChunkBytes);
  frames.push_back(EncodeFrame(good, big_view, kMinChunkBytes, kMinChunkBytes));

  auto acks = SendRaw(address_, std::move(frames));
  ASSERT_EQ(acks.size(), 4u);
  EXPECT_FALSE(acks[0].ok());
  EXPECT_THAT(acks[0].error(), HasSubstr("frame"));
  EXPECT_FALSE(acks[1].ok());
  EXPECT_THAT(acks[1].error(), HasSubstr("needs 32 bytes, total_bytes says 16"));
  EXPECT_FALSE(acks[2].ok());
  EXPECT_THAT(acks[2].error(), HasSubstr("exceeds the limit"));
  EXPECT_TRUE(acks[3].ok());
  const auto stats = server_->stats();
  EXPECT_EQ(stats.malformed, 3u);
  EXPECT_EQ(stats.duplicates, 1u);
  EXPECT_EQ(stats.tensors, 1u);
  auto got = sink_.received();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].second == *big);
}

// Issue 12: a 50-byte frame announcing 2^32-1 chunks made the receiver
// reserve ~512 MiB of chunk book-keeping, even for a job it does not hold;
// now a header may announce no more chunks than its bytes justify, and a
// stream holds a bounded number of half-received tensors.
TEST_F(TransportTest, ChunkCountsAndHalfReceivedTensorsAreBounded) {
  auto bytes = Pattern(32, 0);
  std::vector<grpc::ByteBuffer> frames;
  v1::FrameHeader liar = Header(1, {8});
  liar.set_total_bytes(32);
  liar.set_num_chunks(0xffffffffu);
  frames.push_back(EncodeFrame(liar, View(bytes), 0, 16));
  // 300 tensors, each announcing two chunks and sending only the first.
  auto big = Pattern(2 * kMinChunkBytes, 2);
  for (uint32_t mb = 0; mb < 300; ++mb) {
    v1::FrameHeader h = Header(100 + mb, {static_cast<int64_t>(2 * kMinChunkBytes / 4)});
    h.set_total_bytes(2 * kMinChunkBytes);
    h.set_num_chunks(2);
    frames.push_back(EncodeFrame(h, View(big), 0, kMinChunkBytes));
  }
  auto acks = SendRaw(address_, std::move(frames));
  // The liar and the tensors beyond the bound are refused (acked at once);
  // the half-received ones within it wait for their second chunk.
  ASSERT_EQ(acks.size(), 1u + (300 - 256));
  EXPECT_THAT(acks[0].error(), HasSubstr("4294967295 chunks for 32 bytes (at most 1"));
  EXPECT_THAT(acks[1].error(), HasSubstr("more than 256 tensors half-received on this stream"));
  EXPECT_EQ(server_->stats().malformed, 1u);
}

TEST_F(TransportTest, EmulatedLinkDelaysAndRateLimits) {
  PeerSenderOptions options;
  options.chunk_bytes = 256 << 10;
  options.emulation.latency = absl::Milliseconds(150);
  options.emulation.bandwidth_bytes_per_s = 10e6;  // 10 MB/s
  PeerSender sender(address_, options);
  double seconds = 0;
  const absl::Time start = absl::Now();
  // 2 MB at 10 MB/s = 0.2 s, plus 0.15 s latency.
  ASSERT_TRUE(SendAndWait(sender, Header(0, {500000}), View(Pattern(2000000, 3)), &seconds).ok());
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_GE(elapsed, 0.33);
  EXPECT_LT(elapsed, 2.0);
  // A small frame pays the latency but not much transmission.
  const absl::Time small_start = absl::Now();
  ASSERT_TRUE(SendAndWait(sender, Header(1, {4}), View(Pattern(16, 4))).ok());
  const double small = absl::ToDoubleSeconds(absl::Now() - small_start);
  EXPECT_GE(small, 0.14);
  EXPECT_LT(small, 1.0);
}

TEST_F(TransportTest, UnreachablePeerFailsTransfers) {
  PeerSenderOptions options;
  options.ack_timeout = absl::Seconds(3);
  PeerSender sender("127.0.0.1:1", options);
  absl::Status s = SendAndWait(sender, Header(0, {4}), View(Pattern(16, 0)));
  EXPECT_FALSE(s.ok());
}

TEST_F(TransportTest, CloseFailsPendingAndIsIdempotent) {
  PeerSenderOptions options;
  options.emulation.latency = absl::Seconds(5);  // keeps the transfer pending
  auto sender = std::make_unique<PeerSender>(address_, options);
  absl::Notification done;
  absl::Status result;
  sender->Send(Header(0, {4}), View(Pattern(16, 0)), [&](absl::Status s, double) {
    result = s;
    done.Notify();
  });
  sender->Close();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(result.code(), absl::StatusCode::kCancelled);
  sender->Close();
  sender.reset();
}

// Regression (issue 12): a sender's stream reactor told the sender it was
// done before it released its ClientContext, so Close() could return (and the
// sender, the test, even the process end) while a gRPC thread still held the
// call and the last reference to the channel: a use after release that once
// aborted with ref_counted.h "prior > 0" after this suite passed. Once a
// sender is closed and destroyed nothing of it may remain inside gRPC: the
// channel it was given must be gone. Alternates waiting for the failure
// (stream broken, then closed) with closing while the connection attempt is
// still under way (stream cancelled on close).
TEST_F(TransportTest, ClosedSenderReleasesEverythingItHandedToGrpc) {
  constexpr int kCycles = 200;
  int still_held = 0;
  for (int i = 0; i < kCycles; ++i) {
    const std::string peer = "127.0.0.1:1";  // nothing listens: connection refused
    std::shared_ptr<grpc::Channel> channel = MakeChannel(peer);
    std::weak_ptr<grpc::Channel> watch = channel;
    PeerSenderOptions options;
    options.ack_timeout = absl::Seconds(3);
    auto sender = std::make_unique<PeerSender>(peer, std::move(channel), options);
    if (i % 2 == 0) {
      absl::Status s = SendAndWait(*sender, Header(0, {4}), View(Pattern(16, i)));
      EXPECT_FALSE(s.ok());
    } else {
      sender->Send(Header(0, {4}), View(Pattern(16, i)), [](absl::Status, double) {});
    }
    sender->Close();
    sender.reset();
    if (!watch.expired()) ++still_held;
  }
  EXPECT_EQ(still_held, 0) << "of " << kCycles << " closed senders, " << still_held
                           << " left their channel inside a gRPC call";
}

}  // namespace
}  // namespace detour
