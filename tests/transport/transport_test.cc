// ActivationService transport on loopback: chunked tensors arrive intact,
// bad frames are rejected and counted, emulation delays and rate-limits.
#include <algorithm>
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
#include "tests/transport/recording_sink.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/frame_codec.h"
#include "worker/transport/peer_sender.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

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
    ASSERT_TRUE(
        SendAndWait(sender, Header(mb, {static_cast<int64_t>(sizes[mb] / 4)}), View(bytes)).ok());
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
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(
                                      +[](int* d) { return *d == 16; }, &done),
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
  auto channel = MakeChannel(address, TransportSecurity::Insecure());
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
  while (cq.Next(&tag, &ok)) {}
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

// Regression: a 50-byte frame announcing 2^32-1 chunks made the receiver
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

// Regression: a sender's stream reactor told the sender it was
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
    std::shared_ptr<grpc::Channel> channel = MakeChannel(peer, TransportSecurity::Insecure());
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

// Accepts job "job-1" into real allocations and counts the sink memory that
// half- and fully-received tensors hold (released when the transport drops
// its reference), with the peak.
class CountingSink : public TensorSink {
 public:
  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) override {
    if (h.job_id() != "job-1") {
      return absl::FailedPreconditionError(absl::StrCat("unknown job ", h.job_id()));
    }
    const size_t bytes = h.total_bytes();
    char* data = new char[bytes];
    std::memset(data, 0, bytes);  // touched: real memory, as the runtime's tensors
    Add(static_cast<int64_t>(bytes));
    MutableBuffer b;
    b.data = data;
    b.bytes = bytes;
    b.keepalive = std::shared_ptr<void>(data, [this, bytes](void* p) {
      delete[] static_cast<char*>(p);
      Add(-static_cast<int64_t>(bytes));
    });
    return b;
  }
  void Deliver(const v1::FrameHeader&, MutableBuffer) override {}
  int64_t held() {
    absl::MutexLock lock(&mu_);
    return held_;
  }
  int64_t peak() {
    absl::MutexLock lock(&mu_);
    return peak_;
  }

 private:
  void Add(int64_t bytes) {
    absl::MutexLock lock(&mu_);
    held_ += bytes;
    peak_ = std::max(peak_, held_);
  }
  absl::Mutex mu_;
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t peak_ ABSL_GUARDED_BY(mu_) = 0;
};

// A raw ActivationService stream that writes frames, reads every ack (so
// the receiver keeps reading) and stays open until Close().
class FloodStream {
 public:
  explicit FloodStream(const std::string& address)
      : channel_(MakeChannel(address, TransportSecurity::Insecure())), stub_(channel_) {
    call_ = stub_.PrepareCall(&context_, "/detour.v1.ActivationService/Stream", &cq_);
    call_->StartCall(Tag(kStart));
    WaitFor(kStart);
    call_->Read(&incoming_, Tag(kRead));
  }
  ~FloodStream() { Close(); }

  void Write(const grpc::ByteBuffer& frame) {
    call_->Write(frame, Tag(kWrite));
    WaitFor(kWrite);
  }
  int acks() const { return acks_; }

  void Close() {
    if (closed_) return;
    closed_ = true;
    context_.TryCancel();
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {}
  }

 private:
  enum : intptr_t { kStart = 1, kWrite, kRead };
  static void* Tag(intptr_t t) { return reinterpret_cast<void*>(t); }
  // Runs the queue until `want` completes, reading acks on the way.
  void WaitFor(intptr_t want) {
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
      const intptr_t t = reinterpret_cast<intptr_t>(tag);
      if (t == kRead && ok) {
        ++acks_;
        incoming_.Clear();
        call_->Read(&incoming_, Tag(kRead));
      }
      if (t == want) return;
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  grpc::ByteBuffer incoming_;
  int acks_ = 0;
  bool closed_ = false;
};

// Regression: a worker under a flood of frames keeps its transport's
// memory under the documented bound. Two streams send 150 first chunks each
// of 1 MiB tensors of its own job announcing the most chunks allowed (256),
// four more 150 first chunks each of tensors for a job it does not hold, and
// none finishes one. Per stream 256 half-received tensors were allowed, so
// the two held 300 MiB of sink memory and the six 900 tensors; now the limits
// (here 512 tensors, 8 MiB) hold over all streams together, the rest is
// refused by ack, and everything is given back when the streams end.
// Nothing is timed: waits only bound how long a broken build may hang.
TEST(ActivationFloodTest, HalfSentTensorsStayWithinTheServersLimits) {
  CountingSink sink;
  ActivationServerOptions options;
  options.max_tensor_bytes = 1 << 20;
  options.max_partial_tensors = 512;
  options.max_partial_bytes = 8 << 20;
  ActivationServer server(&sink, options);
  GrpcServerOptions grpc_options;
  grpc_options.listen = HostPort{"127.0.0.1", 0};
  grpc_options.generic_service = &server;
  auto running = StartGrpcServer(std::move(grpc_options), "test");
  ASSERT_TRUE(running.ok()) << running.status();
  const std::string address = absl::StrCat("127.0.0.1:", running->port);

  auto chunk = std::make_shared<std::vector<char>>(kMinChunkBytes, 'x');
  TensorView view;
  view.data = chunk->data();
  view.bytes = chunk->size();
  view.keepalive = chunk;
  // Sends 150 first chunks on each of `n` new streams: of 1 MiB own-job
  // tensors announcing the most chunks allowed (256), or of small tensors
  // of a job this worker does not hold. Waits until the server read them.
  std::vector<std::unique_ptr<FloodStream>> streams;
  uint64_t sent = 0;
  auto flood = [&](int n, bool own) {
    for (int st = 0; st < n; ++st) {
      streams.push_back(std::make_unique<FloodStream>(address));
      for (int i = 0; i < 150; ++i) {
        v1::FrameHeader h;
        h.set_job_id(own ? "job-1" : absl::StrCat("job-not-here-", st));
        h.set_iteration(7);
        h.set_microbatch(static_cast<uint32_t>(st * 1000 + i));
        h.set_direction(v1::DIRECTION_FORWARD);
        h.set_sender(absl::StrCat("flooder-", st));
        h.set_dtype(v1::DTYPE_FP32);
        const uint64_t total = own ? (1u << 20) : 2 * kMinChunkBytes;
        h.add_shape(static_cast<int64_t>(total / 4));
        h.set_total_bytes(total);
        h.set_num_chunks(static_cast<uint32_t>(total / kMinChunkBytes));
        streams.back()->Write(EncodeFrame(h, view, 0, kMinChunkBytes));
        ++sent;
      }
    }
    for (int i = 0; i < 6000 && server.stats().frames < sent; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(server.stats().frames, sent);
  };
  auto close_all = [&] {
    for (auto& s : streams) s->Close();
    streams.clear();
    for (int i = 0; i < 6000 && (server.stats().partial_tensors > 0 || sink.held() > 0); ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    const auto after = server.stats();
    EXPECT_EQ(after.partial_tensors, 0u);
    EXPECT_EQ(after.partial_bytes, 0u);
    EXPECT_EQ(after.bookkeeping_bytes, 0u);
    EXPECT_EQ(sink.held(), 0);
  };

  // Six streams of a foreign job's tensors: 900 half-received, 512 kept.
  flood(6, /*own=*/false);
  auto stats = server.stats();
  EXPECT_EQ(stats.malformed, 0u);
  EXPECT_EQ(stats.partial_tensors, 512u);
  EXPECT_LE(stats.peak_partial_tensors, 512u);
  EXPECT_EQ(stats.partial_bytes, 0u);
  EXPECT_EQ(sink.peak(), 0);
  // Book-keeping: a header of bounded ids, its key twice, no chunk map.
  EXPECT_GT(stats.bookkeeping_bytes, 0u);
  EXPECT_LE(stats.peak_bookkeeping_bytes, 512u * 2048u) << stats.peak_bookkeeping_bytes;
  close_all();

  // Two streams of its own job's 1 MiB tensors: 300 MiB were held, now 8.
  flood(2, /*own=*/true);
  stats = server.stats();
  EXPECT_LE(stats.peak_partial_bytes, 8u << 20);
  EXPECT_LE(sink.peak(), int64_t{8} << 20) << "sink memory held by half-sent tensors";
  EXPECT_EQ(stats.partial_tensors, 8u);  // the byte limit is full
  EXPECT_GE(stats.rejected, 300u - 8u);
  // Per accepted tensor also one bit per announced chunk (256).
  EXPECT_LE(stats.peak_bookkeeping_bytes, 512u * 2048u);
  close_all();
  running->server->Shutdown();
}

// A header's strings and rank are bounded (it is kept while its tensor is
// half received).
TEST(FrameCodecTest, HeaderIdsAndRankAreBounded) {
  v1::FrameHeader h;
  h.set_job_id(std::string(257, 'j'));
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_dtype(v1::DTYPE_FP32);
  h.add_shape(1);
  h.set_total_bytes(4);
  h.set_num_chunks(1);
  EXPECT_THAT(ValidateFrameHeader(h, 4, 1 << 20).message(), HasSubstr("longer than 256"));
  h.set_job_id("job-1");
  h.set_sender(std::string(300, 's'));
  EXPECT_THAT(ValidateFrameHeader(h, 4, 1 << 20).message(), HasSubstr("longer than 256"));
  h.set_sender("w1");
  EXPECT_TRUE(ValidateFrameHeader(h, 4, 1 << 20).ok());
  h.clear_shape();
  for (int i = 0; i < 9; ++i) h.add_shape(1);
  EXPECT_THAT(ValidateFrameHeader(h, 4, 1 << 20).message(), HasSubstr("9 dimensions"));
}

}  // namespace
}  // namespace detour
