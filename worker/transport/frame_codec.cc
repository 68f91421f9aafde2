#include "worker/transport/frame_codec.h"

#include <algorithm>

#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/tsan.h"

namespace detour {
namespace {

constexpr uint8_t kHeaderTag = (1 << 3) | 2;  // field 1, length-delimited
constexpr uint8_t kDataTag = (2 << 3) | 2;    // field 2, length-delimited

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Sequential reader over a list of slices.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  bool AtEnd() {
    Skip();
    return index_ >= slices_.size();
  }

  bool ReadByte(uint8_t* b) {
    Skip();
    if (index_ >= slices_.size()) return false;
    *b = slices_[index_].begin()[pos_++];
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // Copies n bytes into out.
  bool ReadBytes(size_t n, std::string* out) {
    out->clear();
    while (n > 0) {
      Skip();
      if (index_ >= slices_.size()) return false;
      const size_t take = std::min(n, slices_[index_].size() - pos_);
      out->append(reinterpret_cast<const char*>(slices_[index_].begin() + pos_), take);
      pos_ += take;
      n -= take;
    }
    return true;
  }

  // Takes n bytes as sub-slices (no copy).
  bool TakeSlices(size_t n, std::vector<grpc::Slice>* out) {
    while (n > 0) {
      Skip();
      if (index_ >= slices_.size()) return false;
      const size_t take = std::min(n, slices_[index_].size() - pos_);
      out->push_back(slices_[index_].sub(pos_, pos_ + take));
      pos_ += take;
      n -= take;
    }
    return true;
  }

 private:
  void Skip() {
    while (index_ < slices_.size() && pos_ >= slices_[index_].size()) {
      ++index_;
      pos_ = 0;
    }
  }
  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t pos_ = 0;
};

// gRPC calls this on one of its threads when it drops the slice; the slice
// (and this pointer) was handed over through gRPC's refcounts.
void ReleaseKeepalive(void* user_data) {
  DETOUR_HAPPENS_AFTER(user_data);
  delete static_cast<std::shared_ptr<const void>*>(user_data);
}

void* NewKeepalive(const std::shared_ptr<const void>& keepalive) {
  auto* held = new std::shared_ptr<const void>(keepalive);
  DETOUR_HAPPENS_BEFORE(held);
  return held;
}

}  // namespace

size_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32: return 4;
    case v1::DTYPE_FP16: return 2;
    case v1::DTYPE_BF16: return 2;
    case v1::DTYPE_INT64: return 8;
    case v1::DTYPE_BYTES: return 1;
    default: return 0;
  }
}

grpc::ByteBuffer EncodeFrame(const v1::FrameHeader& header, const TensorView& view, size_t offset,
                             size_t bytes) {
  std::string prefix;
  const std::string serialized = header.SerializeAsString();
  prefix.push_back(static_cast<char>(kHeaderTag));
  AppendVarint(serialized.size(), &prefix);
  prefix += serialized;
  prefix.push_back(static_cast<char>(kDataTag));
  AppendVarint(bytes, &prefix);
  if (bytes == 0) {
    grpc::Slice only(prefix.data(), prefix.size());
    return grpc::ByteBuffer(&only, 1);
  }
  grpc::Slice slices[2] = {
      grpc::Slice(prefix.data(), prefix.size()),
      grpc::Slice(const_cast<char*>(static_cast<const char*>(view.data)) + offset, bytes,
                  &ReleaseKeepalive, NewKeepalive(view.keepalive))};
  return grpc::ByteBuffer(slices, 2);
}

void DecodedFrame::CopyTo(void* out) const {
  char* dst = static_cast<char*>(out);
  for (const grpc::Slice& s : data) {
    std::memcpy(dst, s.begin(), s.size());
    dst += s.size();
  }
}

absl::StatusOr<DecodedFrame> DecodeFrame(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) return absl::InvalidArgumentError("unreadable frame buffer");
  SliceReader reader(slices);
  DecodedFrame frame;
  bool have_header = false;
  bool have_data = false;
  while (!reader.AtEnd()) {
    uint8_t tag;
    uint64_t length;
    if (!reader.ReadByte(&tag) || !reader.ReadVarint(&length)) {
      return absl::InvalidArgumentError("truncated frame");
    }
    if (tag == kHeaderTag && !have_header) {
      std::string bytes;
      if (length > (1u << 20) || !reader.ReadBytes(length, &bytes)) {
        return absl::InvalidArgumentError("truncated or oversized frame header");
      }
      if (!frame.header.ParseFromString(bytes)) {
        return absl::InvalidArgumentError("unparseable frame header");
      }
      have_header = true;
    } else if (tag == kDataTag && !have_data) {
      if (!reader.TakeSlices(length, &frame.data)) {
        return absl::InvalidArgumentError(
            absl::StrCat("frame data truncated: header says ", length, " bytes"));
      }
      frame.data_bytes = length;
      have_data = true;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected field tag ", static_cast<int>(tag), " in frame"));
    }
  }
  if (!have_header) return absl::InvalidArgumentError("frame has no header");
  return frame;
}

absl::Status ValidateFrameHeader(const v1::FrameHeader& h, size_t data_bytes,
                                 uint64_t max_tensor_bytes) {
  if (h.job_id().empty()) return absl::InvalidArgumentError("frame header: job_id is empty");
  // The header is kept while a tensor is half received: its strings and
  // rank are bounded like a spec's ids (the decoder allows 1 MiB headers).
  if (h.job_id().size() > kMaxFrameIdBytes || h.sender().size() > kMaxFrameIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame header: job_id or sender longer than ", kMaxFrameIdBytes, " bytes"));
  }
  if (h.shape_size() > static_cast<int>(kMaxFrameDims)) {
    return absl::InvalidArgumentError(absl::StrCat("frame header: ", h.shape_size(),
                                                   " dimensions (at most ", kMaxFrameDims, ")"));
  }
  if (h.direction() != v1::DIRECTION_FORWARD && h.direction() != v1::DIRECTION_BACKWARD &&
      h.direction() != v1::DIRECTION_ALLREDUCE && h.direction() != v1::DIRECTION_STATE &&
      h.direction() != v1::DIRECTION_PROBE) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame header: direction ", h.direction(),
                     " is not FORWARD, BACKWARD, ALLREDUCE, STATE or PROBE"));
  }
  const size_t element = DTypeSize(h.dtype());
  if (element == 0) {
    return absl::InvalidArgumentError(absl::StrCat("frame header: unknown dtype ", h.dtype()));
  }
  uint64_t elements = 1;
  for (int64_t d : h.shape()) {
    if (d < 0 || (d > 0 && elements > std::numeric_limits<uint64_t>::max() / d)) {
      return absl::InvalidArgumentError(
          absl::StrCat("frame header: bad shape [", absl::StrJoin(h.shape(), ","), "]"));
    }
    elements *= static_cast<uint64_t>(d);
  }
  if (elements > std::numeric_limits<uint64_t>::max() / element ||
      elements * element != h.total_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frame header: shape [", absl::StrJoin(h.shape(), ","), "] of ", v1::DType_Name(h.dtype()),
        " needs ", elements * element, " bytes, total_bytes says ", h.total_bytes()));
  }
  if (h.total_bytes() > max_tensor_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("frame header: tensor of ", h.total_bytes(),
                                                     " bytes exceeds the limit of ",
                                                     max_tensor_bytes));
  }
  if (h.num_chunks() == 0 || h.chunk_index() >= h.num_chunks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame header: chunk ", h.chunk_index(), " of ", h.num_chunks()));
  }
  // Every chunk but the last carries at least kMinChunkBytes, so a tensor
  // has at most this many: a header cannot make the receiver book-keep more
  // chunks than its bytes justify.
  const uint64_t most_chunks =
      std::max<uint64_t>(1, (h.total_bytes() + kMinChunkBytes - 1) / kMinChunkBytes);
  if (h.num_chunks() > most_chunks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frame header: ", h.num_chunks(), " chunks for ", h.total_bytes(), " bytes (at most ",
        most_chunks, " of at least ", kMinChunkBytes, " bytes each)"));
  }
  if (h.offset() > h.total_bytes() || data_bytes > h.total_bytes() - h.offset()) {
    return absl::InvalidArgumentError(absl::StrCat("frame header: ", data_bytes,
                                                   " bytes at offset ", h.offset(),
                                                   " overrun total_bytes ", h.total_bytes()));
  }
  return absl::OkStatus();
}

}  // namespace detour
