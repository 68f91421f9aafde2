// Fuzzes what a worker does with bytes a peer sends on ActivationService: the
// TensorFrame decoder, the header validation and, for a valid frame, the copy
// into a receiver buffer of the announced size.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "worker/transport/frame_codec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  grpc::Slice slice(data, size);
  grpc::ByteBuffer buffer(&slice, 1);
  auto frame = detour::DecodeFrame(buffer);
  if (!frame.ok()) return 0;
  // The limit a worker runs with is 1 GiB; 1 MiB keeps the fuzzer fast.
  if (!detour::ValidateFrameHeader(frame->header, frame->data_bytes, 1 << 20).ok()) return 0;
  std::vector<char> target(frame->header.total_bytes());
  frame->CopyTo(target.data() + frame->header.offset());
  return 0;
}
