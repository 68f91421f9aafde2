// The receiving side of ActivationService: a callback generic service that
// reads raw TensorFrame buffers, validates them, reassembles chunked tensors
// straight into memory the TensorSink provides (one copy), and acknowledges
// every complete or rejected tensor with a FrameAck. Malformed, oversized,
// duplicate and unwanted frames are dropped and counted, never applied.
// Thread-safe; reactions never block (the only work in them is one memcpy
// of a chunk).
#ifndef DETOUR_WORKER_TRANSPORT_ACTIVATION_SERVER_H_
#define DETOUR_WORKER_TRANSPORT_ACTIVATION_SERVER_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics/metrics.h"
#include "detour/v1/activation_service.pb.h"
#include "grpcpp/generic/async_generic_service.h"

namespace detour {

// Writable destination for one tensor, and what keeps it alive.
struct MutableBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  std::shared_ptr<void> keepalive;
};

// Where received tensors go. Implemented by the worker runtime. Called on
// gRPC threads: must be quick and must not block.
class TensorSink {
 public:
  virtual ~TensorSink() = default;
  // Called for the first chunk of each tensor. Validates the header against
  // what the runtime expects (job, iteration, microbatch, shape, dtype) and
  // returns memory of header.total_bytes() bytes. An error rejects the
  // tensor: its chunks are dropped and the sender gets the message.
  virtual absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& header) = 0;
  // The whole tensor arrived in `buffer`.
  virtual void Deliver(const v1::FrameHeader& header, MutableBuffer buffer) = 0;
};

struct ActivationServerOptions {
  // Largest tensor accepted, in bytes.
  uint64_t max_tensor_bytes = uint64_t{1} << 30;
  // Optional; counters are registered here when set.
  metrics::Registry* metrics = nullptr;
};

class ActivationServer final : public grpc::CallbackGenericService {
 public:
  static constexpr char kMethod[] = "/detour.v1.ActivationService/Stream";

  // Does not own `sink` (must outlive the server).
  ActivationServer(TensorSink* sink, ActivationServerOptions options);

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

  struct Stats {
    uint64_t frames = 0;           // frames read
    uint64_t tensors = 0;          // tensors delivered
    uint64_t bytes = 0;            // data bytes accepted
    uint64_t malformed = 0;        // undecodable or invalid frames
    uint64_t rejected = 0;         // tensors the sink refused
    uint64_t duplicates = 0;       // chunks received twice
    uint64_t dropped = 0;          // chunks of rejected tensors
  };
  Stats stats() const;

 private:
  friend class ActivationStreamReactor;
  void Count(std::atomic<uint64_t>* counter, metrics::Counter* metric, uint64_t n = 1);

  TensorSink* const sink_;
  const ActivationServerOptions options_;
  std::atomic<uint64_t> frames_{0}, tensors_{0}, bytes_{0}, malformed_{0}, rejected_{0},
      duplicates_{0}, dropped_{0};
  metrics::Counter* frames_metric_ = nullptr;
  metrics::Counter* tensors_metric_ = nullptr;
  metrics::Counter* bytes_metric_ = nullptr;
  metrics::Counter* malformed_metric_ = nullptr;
  metrics::Counter* rejected_metric_ = nullptr;
  metrics::Counter* duplicates_metric_ = nullptr;
  metrics::Counter* dropped_metric_ = nullptr;
};

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_ACTIVATION_SERVER_H_
