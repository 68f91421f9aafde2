// Reassembly of a tensor whose chunks arrive over several connections of one
// striped session (TensorAssembler's claims, direct_server.h's shared
// assembler) and the session hello's bounds: in order, out of order with
// several chunks in flight, duplicates, overlaps, ranges beyond the tensor,
// chunks that disagree with the tensor, and partial tensors given back.
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/transport/recording_sink.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/direct_link.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kChunk = 4096;               // kMinChunkBytes
constexpr uint64_t kTotal = 4 * kChunk - 1000;  // the last chunk is shorter

v1::FrameHeader Chunk(uint32_t index, uint64_t offset, uint64_t total = kTotal,
                      uint32_t chunks = 4) {
  v1::FrameHeader h;
  h.set_job_id("job-1");
  h.set_iteration(1);
  h.set_microbatch(0);
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_sender("w1");
  h.set_hop(1);
  h.add_shape(static_cast<int64_t>(total));
  h.set_dtype(v1::DTYPE_BYTES);
  h.set_total_bytes(total);
  h.set_num_chunks(chunks);
  h.set_chunk_index(index);
  h.set_offset(offset);
  return h;
}

uint64_t Len(uint32_t index) { return index == 3 ? kTotal - 3 * kChunk : kChunk; }

std::vector<char> Pattern() {
  std::vector<char> v(kTotal);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>((i * 7 + 3) & 0xff);
  return v;
}

class StripeAssemblyTest : public ::testing::Test {
 protected:
  StripeAssemblyTest() : server_(&sink_, ActivationServerOptions{}) {}

  // Begins chunk `index` at its canonical place; the verdict.
  TensorAssembler::Verdict Begin(TensorAssembler& a, const v1::FrameHeader& h, uint64_t bytes,
                                 TensorAssembler::Claim* claim) {
    absl::Status end;
    return a.Begin(h, bytes, claim, &acks_, &end);
  }
  void Fill(const TensorAssembler::Claim& c, uint64_t offset) {
    std::memcpy(c.dest, data_.data() + offset, c.bytes);
  }

  RecordingSink sink_;
  ActivationServer server_;
  std::vector<v1::FrameAck> acks_;
  const std::vector<char> data_ = Pattern();
};

TEST_F(StripeAssemblyTest, InOrder) {
  TensorAssembler a(&server_, std::nullopt);
  for (uint32_t i = 0; i < 4; ++i) {
    TensorAssembler::Claim c;
    ASSERT_EQ(Begin(a, Chunk(i, i * kChunk), Len(i), &c), TensorAssembler::Verdict::kAccept);
    Fill(c, i * kChunk);
    a.Finish(c, &acks_);
  }
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(sink_.received()[0].second, data_);
  ASSERT_EQ(acks_.size(), 1u);
  EXPECT_TRUE(acks_[0].ok());
  EXPECT_EQ(server_.stats().partial_tensors, 0u);
}

TEST_F(StripeAssemblyTest, OutOfOrderWithEveryChunkInFlightAtOnce) {
  // Four stripes each begin their chunk (the last one first) before any
  // data is in; the data lands and the chunks finish in yet another order.
  TensorAssembler a(&server_, std::nullopt);
  const uint32_t begin_order[] = {3, 1, 0, 2};
  TensorAssembler::Claim claims[4];
  for (uint32_t i : begin_order) {
    ASSERT_EQ(Begin(a, Chunk(i, i * kChunk), Len(i), &claims[i]), TensorAssembler::Verdict::kAccept)
        << i;
  }
  EXPECT_EQ(server_.stats().partial_tensors, 1u);
  const uint32_t finish_order[] = {2, 0, 3, 1};
  for (uint32_t i : finish_order) {
    EXPECT_TRUE(sink_.received().empty());
    Fill(claims[i], i * kChunk);
    a.Finish(claims[i], &acks_);
  }
  ASSERT_EQ(sink_.received().size(), 1u);
  EXPECT_EQ(sink_.received()[0].second, data_);
  EXPECT_EQ(server_.stats().partial_tensors, 0u);
  EXPECT_EQ(server_.stats().partial_bytes, 0u);
}

TEST_F(StripeAssemblyTest, ADuplicateWhileTheFirstIsInFlightIsDropped) {
  TensorAssembler a(&server_, std::nullopt);
  TensorAssembler::Claim first, again;
  ASSERT_EQ(Begin(a, Chunk(1, kChunk), kChunk, &first), TensorAssembler::Verdict::kAccept);
  EXPECT_EQ(Begin(a, Chunk(1, kChunk), kChunk, &again), TensorAssembler::Verdict::kDrop);
  EXPECT_EQ(server_.stats().duplicates, 1u);
  Fill(first, kChunk);
  a.Finish(first, &acks_);
  // And after it finished, still a duplicate.
  EXPECT_EQ(Begin(a, Chunk(1, kChunk), kChunk, &again), TensorAssembler::Verdict::kDrop);
  EXPECT_EQ(server_.stats().duplicates, 2u);
  EXPECT_TRUE(acks_.empty());
}

TEST_F(StripeAssemblyTest, OverlappingChunksAreRefused) {
  TensorAssembler a(&server_, std::nullopt);
  TensorAssembler::Claim c;
  ASSERT_EQ(Begin(a, Chunk(0, 0), kChunk, &c), TensorAssembler::Verdict::kAccept);
  // Chunk 1 half over chunk 0 (a distinct index, so not a duplicate).
  EXPECT_EQ(Begin(a, Chunk(1, kChunk / 2), kChunk, &c), TensorAssembler::Verdict::kDrop);
  // A chunk of another length than chunk 0's.
  EXPECT_EQ(Begin(a, Chunk(1, kChunk), kChunk / 2, &c), TensorAssembler::Verdict::kDrop);
  // The last chunk starting inside chunk 2's range.
  EXPECT_EQ(Begin(a, Chunk(3, kTotal - kChunk), kChunk, &c), TensorAssembler::Verdict::kDrop);
  EXPECT_EQ(server_.stats().malformed, 3u);
  ASSERT_EQ(acks_.size(), 3u);
  EXPECT_THAT(acks_[0].error(), HasSubstr("does not tile"));
  EXPECT_TRUE(sink_.received().empty());
}

TEST_F(StripeAssemblyTest, TheLastChunkFirstFixesWhereTheOthersMayGo) {
  TensorAssembler a(&server_, std::nullopt);
  TensorAssembler::Claim c;
  ASSERT_EQ(Begin(a, Chunk(3, 3 * kChunk), Len(3), &c), TensorAssembler::Verdict::kAccept);
  // A chunk length that would put the last chunk elsewhere.
  TensorAssembler::Claim d;
  EXPECT_EQ(Begin(a, Chunk(1, 2 * kChunk), 2 * kChunk, &d), TensorAssembler::Verdict::kDrop);
  ASSERT_EQ(Begin(a, Chunk(1, kChunk), kChunk, &d), TensorAssembler::Verdict::kAccept);
}

TEST_F(StripeAssemblyTest, RangesBeyondTheTensorAndDisagreeingTotalsAreRefused) {
  TensorAssembler a(&server_, std::nullopt);
  TensorAssembler::Claim c;
  // offset + length beyond total_bytes.
  EXPECT_EQ(Begin(a, Chunk(3, 3 * kChunk), kChunk, &c), TensorAssembler::Verdict::kDrop);
  // An index beyond the chunk count.
  EXPECT_EQ(Begin(a, Chunk(4, 4 * kChunk), 0, &c), TensorAssembler::Verdict::kDrop);
  // An offset beyond the tensor.
  EXPECT_EQ(Begin(a, Chunk(1, uint64_t{1} << 62), kChunk, &c), TensorAssembler::Verdict::kDrop);
  EXPECT_EQ(server_.stats().malformed, 3u);
  // A chunk whose total or count disagrees with the tensor's first chunk.
  ASSERT_EQ(Begin(a, Chunk(0, 0), kChunk, &c), TensorAssembler::Verdict::kAccept);
  v1::FrameHeader other = Chunk(1, kChunk, kTotal + 8, 4);
  other.set_shape(0, static_cast<int64_t>(kTotal + 8));
  EXPECT_EQ(Begin(a, other, kChunk, &c), TensorAssembler::Verdict::kDrop);
  EXPECT_EQ(Begin(a, Chunk(1, kChunk, kTotal, 5), kChunk, &c), TensorAssembler::Verdict::kDrop);
  EXPECT_TRUE(sink_.received().empty());
}

TEST_F(StripeAssemblyTest, APartialTensorIsGivenBackWhenTheSessionEnds) {
  {
    TensorAssembler a(&server_, std::nullopt);
    TensorAssembler::Claim c;
    ASSERT_EQ(Begin(a, Chunk(0, 0), kChunk, &c), TensorAssembler::Verdict::kAccept);
    Fill(c, 0);
    a.Finish(c, &acks_);
    TensorAssembler::Claim open;  // a stripe died with this one in flight
    ASSERT_EQ(Begin(a, Chunk(2, 2 * kChunk), kChunk, &open), TensorAssembler::Verdict::kAccept);
    EXPECT_EQ(server_.stats().partial_tensors, 1u);
    EXPECT_EQ(server_.stats().partial_bytes, kTotal);
  }
  EXPECT_EQ(server_.stats().partial_tensors, 0u);
  EXPECT_EQ(server_.stats().partial_bytes, 0u);
  EXPECT_TRUE(sink_.received().empty());
}

TEST(DirectHelloTest, BoundsAreCheckedBeforeUse) {
  char bytes[kDirectHelloBytes];
  EncodeDirectHello(DirectHello{0x0123456789abcdefULL, 3, 4}, bytes);
  auto hello = DecodeDirectHello(bytes);
  ASSERT_TRUE(hello.ok()) << hello.status();
  EXPECT_EQ(hello->session, 0x0123456789abcdefULL);
  EXPECT_EQ(hello->stripe, 3u);
  EXPECT_EQ(hello->stripes, 4u);
  const DirectHello bad[] = {{1, 0, 0},
                             {1, 4, 4},
                             {1, 0, static_cast<uint32_t>(kMaxDirectStripes) + 1},
                             {1, 0xffffffffu, 0xffffffffu}};
  for (const DirectHello& h : bad) {
    EncodeDirectHello(h, bytes);
    EXPECT_EQ(DecodeDirectHello(bytes).status().code(), absl::StatusCode::kInvalidArgument)
        << h.stripe << " of " << h.stripes;
  }
  // The version is in the preface: v1 and v2 differ, v2 is what we send.
  EXPECT_NE(std::memcmp(kDirectPreface, kDirectPrefaceV1, sizeof(kDirectPreface)), 0);
  EXPECT_EQ(std::string(kDirectPreface, 8), "DTRDIRv2");
}

}  // namespace
}  // namespace detour
