// The sending side of the activation transport towards one peer: a
// long-lived ActivationService stream, or — when the peer has a direct
// address — direct connections (direct_link.h), several at once over a long
// fast link (striping); tensors cut into chunks (a few MiB per frame, sent
// from the tensor's memory), one write in flight per stream or connection,
// completion when the peer acknowledges the whole tensor. Optional network
// emulation delays and rate-limits frames as a geo-distributed link would
// (tests and benchmarks only). Thread-safe; owns one thread that paces and
// issues the writes (and, for a direct connection, one that reads its acks),
// so gRPC reactions never wait; direct connections each have a writer and
// an ack reader thread.
#ifndef DETOUR_WORKER_TRANSPORT_PEER_SENDER_H_
#define DETOUR_WORKER_TRANSPORT_PEER_SENDER_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "detour/v1/activation_service.pb.h"
#include "common/net/tls.h"
#include "grpcpp/grpcpp.h"
#include "worker/transport/direct_link.h"
#include "worker/transport/frame_codec.h"
#include "worker/transport/tcp_tuning.h"

namespace detour {

// Link emulation for one peer. Zero bandwidth = unlimited.
struct LinkEmulation {
  absl::Duration latency = absl::ZeroDuration();
  double bandwidth_bytes_per_s = 0;
  bool enabled() const { return latency > absl::ZeroDuration() || bandwidth_bytes_per_s > 0; }
};

struct PeerSenderOptions {
  size_t chunk_bytes = 4 << 20;
  LinkEmulation emulation;
  // A tensor not acknowledged within this time fails with DEADLINE_EXCEEDED.
  absl::Duration ack_timeout = absl::Seconds(60);
  // For the channel PeerSender makes itself: TLS or plaintext, and with TLS
  // the name the peer's certificate must carry (its worker id; "" = the
  // host of the address).
  TransportSecurity security;
  std::string peer_name;
  // host:port of the peer's direct transport; empty = its ActivationService
  // stream. A direct connection uses `security` the same way (TLS with the
  // peer's certificate naming `peer_name`, or plaintext).
  std::string direct_address;
  // Connecting (and the TLS handshake) of a direct connection. A receiver
  // that accepts and then closes a connection without a word (it sheds load
  // under a connection flood, or is shutting down: ClosedByReceiver) is
  // tried again, after 50 ms doubling to 1 s, until this much has passed
  // since the first try.
  absl::Duration connect_timeout = absl::Seconds(10);
  // Striping (direct transport): how many connections carry tensors to this
  // peer. 0 = as many as the link needs (tcp_tuning.h's PlanStripes: the
  // link's rate × RTT against the socket-buffer limits), else this many
  // (at most kMaxDirectStripes). The connections take chunks from one
  // queue, each when its socket has room (kStripeNotsentLowat), so one that
  // a loss holds up takes fewer. A tensor of at least stripe_threshold_bytes
  // is cut into chunks of chunk_bytes (once the connections are open, of
  // StripeChunkBytes: as many per connection for a large one, 1 MiB for a
  // smaller one); a smaller tensor, into chunks of chunk_bytes.
  int direct_connections = 0;
  size_t stripe_threshold_bytes = 8 << 20;
  // What the link to this peer is expected to carry (the cluster's link
  // table has it: rate between the two regions, their round trip). An
  // unknown rate is taken as kDefaultLinkRateBytesPerS, an unknown RTT as
  // the kernel's estimate from the first connection's handshake.
  LinkHint link;
  // TCP_CONGESTION "bbr" on direct connections where the system has it.
  bool bbr = true;
};

// What the direct transport to a peer uses (for logs and tests).
struct DirectConnectionInfo {
  int connections = 0;  // 0 = not connected
  std::string congestion_control;
  absl::Duration rtt;  // the kernel's estimate at connect
  int64_t sndbuf_request = 0;
  // Tries the last connect took: more than 1 when the receiver closed the
  // connections of the earlier ones (PeerSenderOptions::connect_timeout).
  int connect_attempts = 0;
  // Tensor bytes written on each connection of the session (chunks only).
  std::vector<uint64_t> written;
};

class PeerSender {
 public:
  // Status of the whole transfer and its duration in seconds (first chunk
  // handed to gRPC to the peer's acknowledgement). Called on an internal or
  // gRPC thread; must not block.
  using Done = std::function<void(absl::Status, double seconds)>;

  PeerSender(std::string peer_address, PeerSenderOptions options);
  // Sends over `channel` (to `peer_address`) instead of a channel of its own
  // (ignored with a direct address).
  PeerSender(std::string peer_address, std::shared_ptr<grpc::Channel> channel,
             PeerSenderOptions options);
  ~PeerSender();
  PeerSender(const PeerSender&) = delete;
  PeerSender& operator=(const PeerSender&) = delete;

  // Queues a tensor. `header` names job, iteration, microbatch, direction,
  // sender, hop, shape and dtype; chunk fields and total_bytes are filled
  // here. `data` must stay unmodified until `done` runs.
  void Send(v1::FrameHeader header, TensorView data, Done done);

  // Connects now, before the first tensor needs it: the direct transport's
  // connections (every stripe, TLS handshakes and hello included) are opened
  // on the writer thread, or the gRPC channel starts connecting, so that
  // their round trips overlap whatever comes before the first tensor. A
  // no-op while connected; a failure is not reported here (the next tensor
  // tries again and reports it). Never blocks.
  void Connect();

  // Fails what is pending with CANCELLED, closes the stream (cancels it when
  // the peer does not end it within 2 s), joins the thread and waits until
  // gRPC has released every stream this sender opened: afterwards nothing of
  // it (call, context, channel reference) is left inside gRPC. Idempotent.
  void Close();

  const std::string& peer() const { return peer_; }
  // "grpc" or "direct": how tensors travel to this peer.
  const char* transport() const { return direct() ? "direct" : "grpc"; }
  // The current (or last) direct connection set.
  DirectConnectionInfo direct_info() const;

 private:
  class Stream;
  class GrpcStream;
  class DirectStream;
  bool direct() const { return !options_.direct_address.empty(); }
  struct Pending {
    v1::FrameHeader header;
    TensorView data;
    Done done;
    absl::Time first_write;
    absl::Time deadline;
  };
  struct Chunk {
    v1::FrameHeader header;  // with its chunk fields
    TensorView data;         // the whole tensor
    size_t offset = 0;       // of this chunk in it
    std::string key;
    size_t bytes = 0;
    absl::Time release;  // emulated: not written before this time
  };

  void WriterLoop();
  void OnAck(const v1::FrameAck& ack);
  void OnWriteDone(bool ok);
  void OnReadEnded();
  void OnStreamDone();
  // A direct stripe wrote a chunk of `bytes` (DirectConnectionInfo::written).
  void CountWritten(size_t connection, uint64_t bytes);
  // A direct stripe failed: the whole stream is given up (its tensors fail).
  void OnStreamBroken();
  // Opens the stripes of a new direct session (blocking; without mu_),
  // trying again while the receiver closes them without a word.
  absl::StatusOr<std::vector<std::unique_ptr<DirectLink>>> ConnectDirect();
  // One try: every stripe of a new session, opened by `deadline`.
  absl::StatusOr<std::vector<std::unique_ptr<DirectLink>>> ConnectDirectOnce(absl::Time deadline);
  // Waits `pause`, or less when Close() wakes it (false then).
  bool PauseUnlessClosed(absl::Duration pause);
  // PERMISSION_DENIED unless a TLS link's receiver presented a worker's
  // certificate (common/net/identity.h; unmarked ones when the security
  // allows them).
  absl::Status ReceiverIsWorker(const DirectLink& link) const;
  // A stream could not be opened or broke: its reason, for the failures.
  void OnStreamError(const absl::Status& status);
  void FailAll(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string peer_;
  const PeerSenderOptions options_;
  std::shared_ptr<grpc::Channel> channel_;

  mutable absl::Mutex mu_;
  std::deque<Chunk> queue_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  // The current stream; only the writer thread starts operations on it.
  Stream* stream_ ABSL_GUARDED_BY(mu_) = nullptr;
  int live_streams_ ABSL_GUARDED_BY(mu_) = 0;
  bool stream_broken_ ABSL_GUARDED_BY(mu_) = false;
  std::string broken_reason_ ABSL_GUARDED_BY(mu_);
  bool read_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool connect_wanted_ ABSL_GUARDED_BY(mu_) = false;  // Connect() before a tensor
  Chunk current_;  // the chunk being written; writer thread and OnWriteDone
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time link_free_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::shared_ptr<ssl_ctx_st> ssl_ctx_;  // direct TLS connections
  absl::Status ssl_ctx_status_;
  TcpLimits tcp_limits_;  // read once, at construction
  DirectConnectionInfo direct_info_ ABSL_GUARDED_BY(mu_);
  int wake_pipe_[2] = {-1, -1};  // Close() wakes a direct connect
  std::thread writer_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_PEER_SENDER_H_
