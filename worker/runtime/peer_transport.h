// How the job runtime reaches its peers: tensors to another worker of the
// job, with completion when the peer acknowledged them. The runtime gets a
// factory and makes one transport per job, so tests can run the runtime's
// logic over in-memory fakes instead of gRPC streams.
//
// GrpcPeerTransport (the daemon's) keeps one PeerSender per peer — a direct
// connection when the peer has a direct address, else a long-lived
// ActivationService stream — created when the peer is first used, with the
// job's network emulation if it asks for one.
#ifndef DETOUR_WORKER_RUNTIME_PEER_TRANSPORT_H_
#define DETOUR_WORKER_RUNTIME_PEER_TRANSPORT_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/spec.pb.h"
#include "worker/transport/frame_codec.h"
#include "worker/transport/peer_sender.h"

namespace detour {

struct PeerEndpoint {
  std::string worker_id;
  std::string address;  // host:port of its ActivationService
  std::string region;
  // host:port of its direct transport; empty = tensors go over `address`.
  std::string data_address;
  // What the link there carries (this worker's link probes measured it;
  // zero parts unknown): the direct transport's connections are planned
  // from it when the first tensor opens them.
  LinkHint link;
};

class PeerTransport {
 public:
  // The transfer's status and its duration in seconds. May run on any
  // thread, must not block.
  using Done = std::function<void(absl::Status, double seconds)>;

  virtual ~PeerTransport() = default;
  // The peers of the job (replaces the previous set; senders to peers no
  // longer in it are closed).
  virtual void SetPeers(const std::vector<PeerEndpoint>& peers) = 0;
  // Sends a tensor; NOT_FOUND through `done` for a peer not in the set.
  // `data` must stay unmodified until `done` runs.
  virtual void Send(const std::string& to, v1::FrameHeader header, TensorView data, Done done) = 0;
  // The peers (of the set) that tensors will go to soon: their connections
  // may be opened now, so that the first tensor does not pay for them.
  // Never blocks; peers not in the set are ignored.
  virtual void Prepare(const std::vector<std::string>& peers) { (void)peers; }
  // Fails what is pending (CANCELLED) and closes every stream. Idempotent.
  virtual void Close() = 0;
};

struct PeerTransportConfig {
  std::string region;  // this worker's
  // Region network to emulate on outgoing frames; empty = none.
  v1::ClusterSpec emulate_network;
  // TLS to peers (each peer's certificate must name its worker id) or plaintext.
  TransportSecurity security;
  // A tensor not acknowledged within `ack_timeout` fails (the peer is then
  // reported unreachable); opening a connection to a peer, its TLS handshake
  // included, gives up after `connect_timeout`. Long, lossy links need more
  // than a LAN (worker flags --peer_ack_timeout, --peer_connect_timeout).
  absl::Duration ack_timeout = absl::Seconds(60);
  absl::Duration connect_timeout = absl::Seconds(10);
  // Direct connections per peer: 0 = as many as each link needs
  // (PeerSenderOptions::direct_connections). The link prober's latency
  // rounds take 1: their pings are 64 bytes, and stripes would cost every
  // worker a TLS handshake per stripe and peer at once.
  int direct_connections = 0;
};

using PeerTransportFactory =
    std::function<std::unique_ptr<PeerTransport>(const PeerTransportConfig&)>;

// Link emulation between two regions of `network` (zero when it is empty).
LinkEmulation EmulationBetween(const v1::ClusterSpec& network, const std::string& from_region,
                               const std::string& to_region);

class GrpcPeerTransport final : public PeerTransport {
 public:
  explicit GrpcPeerTransport(PeerTransportConfig config);
  ~GrpcPeerTransport() override;

  void SetPeers(const std::vector<PeerEndpoint>& peers) override;
  void Send(const std::string& to, v1::FrameHeader header, TensorView data, Done done) override;
  // Opens the connections to `peers` (PeerSender::Connect).
  void Prepare(const std::vector<std::string>& peers) override;
  void Close() override;

  static PeerTransportFactory Factory();

 private:
  // The sender to `to` (made on first use); null when `to` is not a peer.
  PeerSender* SenderLocked(const std::string& to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PeerTransportConfig config_;
  absl::Mutex mu_;
  std::map<std::string, PeerEndpoint> peers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<PeerSender>> senders_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_PEER_TRANSPORT_H_
