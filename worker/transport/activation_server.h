// The receiving side of ActivationService: a callback generic service that
// reads raw TensorFrame buffers, validates them, reassembles chunked tensors
// straight into memory the TensorSink provides (one copy), and acknowledges
// every complete or rejected tensor with a FrameAck. Malformed, oversized,
// duplicate and unwanted frames are dropped and counted, never applied.
// Thread-safe; reactions never block (the only work in them is one memcpy
// of a chunk). The same reassembly, limits and counters serve the direct
// transport (direct_server.h), through TensorAssembler.
#ifndef DETOUR_WORKER_TRANSPORT_ACTIVATION_SERVER_H_
#define DETOUR_WORKER_TRANSPORT_ACTIVATION_SERVER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "detour/v1/activation_service.pb.h"
#include "grpcpp/generic/async_generic_service.h"
#include "common/net/connection_admission.h"

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

// What a worker's transport may hold at once, over all its streams (see
// docs/OPERATIONS.md for the whole bound). A tensor beyond either limit is
// refused with an ack naming it, before the sink is asked for memory.
struct ActivationServerOptions {
  // Largest tensor accepted, in bytes.
  uint64_t max_tensor_bytes = uint64_t{1} << 30;
  // Half-received tensors (accepted or being dropped), over all streams.
  uint64_t max_partial_tensors = 4096;
  // Bytes of sink memory held by half-received tensors, over all streams.
  uint64_t max_partial_bytes = uint64_t{4} << 30;
  // Optional; counters are registered here when set.
  metrics::Registry* metrics = nullptr;
  // TLS: a stream is read only from a peer with a verified certificate, and
  // every frame's `sender` must be that certificate's name; others end with
  // UNAUTHENTICATED / PERMISSION_DENIED. The certificate must be a worker's
  // (common/net/identity.h); one without an identity kind only with
  // `allow_unmarked_worker_certs`.
  bool require_peer_certificates = false;
  bool allow_unmarked_worker_certs = false;
};

class ActivationServer;

// Reassembles the tensors arriving on one stream (an ActivationService
// stream or a direct connection) into sink memory, within the server's
// limits, and says what to acknowledge. Not thread-safe: one per stream,
// used by that stream's reader only. Gives back what half-received tensors
// hold when destroyed. Does not own `server`.
class TensorAssembler {
 public:
  // `peer_name`: the verified certificate name of the sender, if any; with
  // ActivationServerOptions::require_peer_certificates every frame must name
  // it as its sender.
  TensorAssembler(ActivationServer* server, std::optional<std::string> peer_name);
  ~TensorAssembler();
  TensorAssembler(const TensorAssembler&) = delete;
  TensorAssembler& operator=(const TensorAssembler&) = delete;

  enum class Verdict {
    kAccept,     // write the frame's data to *dest, then call Finish()
    kDrop,       // read and discard the frame's data
    kEndStream,  // the sender is not who its certificate says: end the stream
  };
  // A decoded frame's header and the length of its data: counts the frame,
  // validates it, and starts or continues its tensor (asking the sink for
  // memory at its first chunk). Acknowledgements to send go to `acks`; with
  // kEndStream, `end` says why.
  Verdict Begin(const v1::FrameHeader& header, size_t data_bytes, void** dest,
                std::vector<v1::FrameAck>* acks, absl::Status* end);
  // The data of the frame Begin accepted is in place: completes the chunk
  // and, with its tensor's last chunk, delivers the tensor and acks it.
  void Finish(std::vector<v1::FrameAck>* acks);

  // The same for several chunks in flight at once (a striped direct
  // session, whose connections share one assembler under their lock): Begin
  // claims the chunk (a second claim of it is a duplicate) and says where
  // its data goes; the data is read without the lock; Finish(claim)
  // completes it. An assembly is never erased while a claim on it is open
  // (only its last Finish or the assembler's destruction erases it), so
  // `dest` stays valid until then.
  struct Claim {
    std::string key;
    uint32_t chunk = 0;
    size_t bytes = 0;
    void* dest = nullptr;
  };
  Verdict Begin(const v1::FrameHeader& header, size_t data_bytes, Claim* claim,
                std::vector<v1::FrameAck>* acks, absl::Status* end);
  void Finish(const Claim& claim, std::vector<v1::FrameAck>* acks);
  // A frame that could not be decoded: counted, its error acknowledged.
  void Malformed(absl::string_view why, std::vector<v1::FrameAck>* acks);

  // Half-received tensors one stream may hold (a sender has a few in flight).
  static constexpr size_t kMaxPartialTensors = 256;

 private:
  static constexpr uint64_t kNoOffset = ~uint64_t{0};
  struct Assembly {
    v1::FrameHeader first;
    MutableBuffer buffer;
    std::vector<bool> seen;
    uint32_t received = 0;
    bool rejected = false;
    uint64_t reserved = 0;    // sink bytes counted against the server's limit
    int64_t bookkeeping = 0;  // what this entry costs the transport
    // The chunk length all but the last chunk share and the last chunk's
    // offset, once a chunk showed them.
    uint64_t chunk_bytes = 0;
    uint64_t last_offset = kNoOffset;
  };
  using Assemblies = std::map<std::string, Assembly>;

  // Whether a chunk sits where the chunks seen so far say its tensor's
  // chunks go (records what it shows).
  static bool FitsGeometry(Assembly* a, const v1::FrameHeader& h, uint64_t bytes);

  // Releases what an assembly holds against the server's limits.
  void Forget(const Assembly& a);
  void Erase(Assemblies::iterator it);

  ActivationServer* const server_;
  const std::optional<std::string> peer_name_;
  Assemblies assemblies_;
  // The chunk the single-stream Begin accepted, until Finish.
  Claim current_;
  bool have_current_ = false;
};

class ActivationServer final : public grpc::CallbackGenericService {
 public:
  static constexpr char kMethod[] = "/detour.v1.ActivationService/Stream";

  // Does not own `sink` (must outlive the server).
  ActivationServer(TensorSink* sink, ActivationServerOptions options);

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

  struct Stats {
    uint64_t frames = 0;      // frames read
    uint64_t tensors = 0;     // tensors delivered
    uint64_t bytes = 0;       // data bytes accepted
    uint64_t malformed = 0;   // undecodable or invalid frames
    uint64_t rejected = 0;    // tensors the sink refused
    uint64_t duplicates = 0;  // chunks received twice
    uint64_t dropped = 0;     // chunks of rejected tensors
    // Streams and frames refused for who sent them: no certificate, a sender
    // the certificate does not name, or not a member of the job.
    uint64_t unauthorized = 0;
    // Now and at most so far: half-received tensors, the sink memory they
    // hold, and the transport's own book-keeping for them (headers, keys,
    // chunk maps).
    uint64_t partial_tensors = 0, peak_partial_tensors = 0;
    uint64_t partial_bytes = 0, peak_partial_bytes = 0;
    uint64_t bookkeeping_bytes = 0, peak_bookkeeping_bytes = 0;
  };
  Stats stats() const;
  const ActivationServerOptions& options() const { return options_; }
  // A stream or connection refused for who opened it (no certificate, or
  // not a worker's): counted. (Its caller logs it, in rate-limited
  // summaries.)
  void CountUnauthorizedStream();

 private:
  friend class ActivationStreamReactor;
  friend class TensorAssembler;
  void Count(std::atomic<uint64_t>* counter, metrics::Counter* metric, uint64_t n = 1);
  // Takes one half-received tensor holding `bytes` of sink memory within
  // the limits; false (nothing taken) when it does not fit.
  bool Reserve(uint64_t bytes, std::string* why);
  // Gives back one tensor and `bytes`; ReleaseBytes only the bytes.
  void Release(uint64_t bytes);
  void ReleaseBytes(uint64_t bytes);
  void AddBookkeeping(int64_t bytes);

  TensorSink* const sink_;
  const ActivationServerOptions options_;
  std::atomic<uint64_t> frames_{0}, tensors_{0}, bytes_{0}, malformed_{0}, rejected_{0},
      duplicates_{0}, dropped_{0}, unauthorized_{0};
  std::atomic<uint64_t> partial_tensors_{0}, peak_partial_tensors_{0}, partial_bytes_{0},
      peak_partial_bytes_{0};
  std::atomic<int64_t> bookkeeping_bytes_{0}, peak_bookkeeping_bytes_{0};
  metrics::Counter* frames_metric_ = nullptr;
  metrics::Counter* tensors_metric_ = nullptr;
  metrics::Counter* bytes_metric_ = nullptr;
  metrics::Counter* malformed_metric_ = nullptr;
  metrics::Counter* rejected_metric_ = nullptr;
  metrics::Counter* duplicates_metric_ = nullptr;
  metrics::Counter* dropped_metric_ = nullptr;
  metrics::Counter* unauthorized_metric_ = nullptr;
  // Streams refused for who opened them, logged as summaries.
  absl::Mutex refusal_mu_;
  RefusalLog refusal_log_ ABSL_GUARDED_BY(refusal_mu_){absl::Seconds(10), "activation stream",
                                                       "stream"};
};

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_ACTIVATION_SERVER_H_
