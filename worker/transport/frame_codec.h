// Encoding and decoding of detour.v1.TensorFrame without copying tensors into
// protobuf fields. A frame on the wire is exactly the protobuf encoding of
// TensorFrame { FrameHeader header = 1; bytes data = 2; }, so any protobuf
// client can read it, but we build it as [tag, length, header bytes, tag,
// length] in one small slice followed by one slice that points straight at
// the tensor's memory. Thread-safe (no state).
#ifndef DETOUR_WORKER_TRANSPORT_FRAME_CODEC_H_
#define DETOUR_WORKER_TRANSPORT_FRAME_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "detour/v1/activation_service.pb.h"
#include "grpcpp/support/byte_buffer.h"

namespace detour {

// The smallest chunk a sender may cut a tensor into (all but the last
// chunk): receivers refuse headers announcing more chunks than that allows.
inline constexpr uint64_t kMinChunkBytes = 4096;
// Longest job id / sender id and highest rank a frame header may carry.
inline constexpr size_t kMaxFrameIdBytes = 256;
inline constexpr size_t kMaxFrameDims = 8;

// Bytes per element; 0 for DTYPE_UNSPECIFIED or unknown values.
size_t DTypeSize(v1::DType dtype);

// Read-only tensor memory and what keeps it alive until gRPC releases it.
struct TensorView {
  const void* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<const void> keepalive;
};

// Builds one frame: `header` (chunk fields already set) plus `bytes` bytes of
// `view` starting at `offset`. The data slice references view.data; the
// returned buffer holds a reference to view.keepalive until gRPC is done.
grpc::ByteBuffer EncodeFrame(const v1::FrameHeader& header, const TensorView& view, size_t offset,
                             size_t bytes);

// A received frame: the parsed header and the data bytes as slices of the
// received buffer (no copy yet).
struct DecodedFrame {
  v1::FrameHeader header;
  std::vector<grpc::Slice> data;  // in order; sizes sum to data_bytes
  size_t data_bytes = 0;
  // Copies the data into `out` (which must hold data_bytes).
  void CopyTo(void* out) const;
};

// Parses a frame. INVALID_ARGUMENT for anything that is not a well-formed
// TensorFrame (bad tags, truncated lengths, unparseable header, extra fields).
absl::StatusOr<DecodedFrame> DecodeFrame(const grpc::ByteBuffer& buffer);

// Checks a header against itself: ids of at most kMaxFrameIdBytes, at most
// kMaxFrameDims dimensions, known dtype, shape matches total_bytes,
// chunk index/count/offset consistent with the data length, size within
// `max_tensor_bytes`. INVALID_ARGUMENT or RESOURCE_EXHAUSTED naming the field.
absl::Status ValidateFrameHeader(const v1::FrameHeader& header, size_t data_bytes,
                                 uint64_t max_tensor_bytes);

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_FRAME_CODEC_H_
