// The receiving side of the direct transport (direct_link.h): a listening
// socket whose connections each get a reader thread that reads frames
// straight into the memory the ActivationServer's sink provides, and
// acknowledges tensors as ActivationService does. Reassembly, limits, the
// sink's checks and the counters are the ActivationServer's (one
// TensorAssembler per sender session, shared by its stripe connections), so
// both paths obey the same bounds.
//
// A connection must complete its TLS handshake (a worker certificate from the
// cluster CA when the server has TLS) and send the preface within
// `handshake_timeout`; until then it counts against the limits on
// unauthenticated connections (connection_admission.h), which keep room for
// authenticated peers whatever a flood of unauthenticated ones does. A
// frame's bytes must keep coming (no `io_timeout` without progress);
// malformed framing, a sender its certificate does not name, or too many
// connections end the connection. Refusals are counted by reason and logged
// as rate-limited summaries. Thread-safe.
#ifndef DETOUR_WORKER_TRANSPORT_DIRECT_SERVER_H_
#define DETOUR_WORKER_TRANSPORT_DIRECT_SERVER_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "common/net/address.h"
#include "common/net/tls.h"
#include "worker/transport/activation_server.h"
#include "common/net/connection_admission.h"
#include "worker/transport/direct_link.h"

namespace detour {

// Reads frames from an accepted connection until it ends, an error, or
// `stopping` says so (checked while the connection idles): each frame goes
// through `assembler`, acknowledgements back on `link`. Frame data beyond
// `max_tensor_bytes` ends the connection. Exposed for the fuzz target.
absl::Status ReadDirectFrames(DirectLink* link, TensorAssembler* assembler,
                              uint64_t max_tensor_bytes, const std::function<bool()>& stopping);

// The assembler the connections (stripes) of one session share: a frame's
// header is checked and its chunk claimed under `mu`, its data read into
// the tensor without it. Thread-safe.
struct SharedTensorAssembler {
  SharedTensorAssembler(ActivationServer* server, std::optional<std::string> peer_name)
      : assembler(server, std::move(peer_name)) {}
  absl::Mutex mu;
  TensorAssembler assembler ABSL_GUARDED_BY(mu);
};
// ReadDirectFrames for one connection of a session: what a DirectServer runs
// per connection.
absl::Status ReadDirectFrames(DirectLink* link, SharedTensorAssembler* shared,
                              uint64_t max_tensor_bytes, const std::function<bool()>& stopping);

struct DirectServerOptions {
  HostPort listen;  // port 0 picks a free one
  TransportSecurity security;
  // Connections open at once (each holds a thread), and how many of them may
  // be unauthenticated, in all and per source address; beyond them the
  // oldest unauthenticated connection of the busiest source is closed, or
  // the new one is refused (ConnectionAdmission).
  AdmissionLimits admission;
  // TLS handshake, preface and hello within this.
  absl::Duration handshake_timeout = absl::Seconds(5);
  // Refusals beyond the first are logged as one summary per interval.
  absl::Duration refusal_log_interval = absl::Seconds(10);
  absl::Duration io_timeout = absl::Seconds(60);
  // Optional; connection counters and the open-connection gauge go here.
  metrics::Registry* metrics = nullptr;
  // TCP_CONGESTION "bbr" on accepted connections where the system has it.
  bool bbr = true;
  // The links this worker expects to receive over (rate, RTT; unknown parts
  // take tcp_tuning.h's defaults): sizes the receive buffer when autotuning
  // cannot reach it, and the start-up report (LogDirectTransportTuning,
  // logged once by Start) warns when the system's limits cap it.
  LinkHint expected_link;
};

class DirectServer {
 public:
  // Listens and starts accepting. Does not own `activations` (must outlive
  // the server). Errors: the port is taken, TLS without a certificate.
  static absl::StatusOr<std::unique_ptr<DirectServer>> Start(ActivationServer* activations,
                                                             DirectServerOptions options);
  ~DirectServer();
  DirectServer(const DirectServer&) = delete;
  DirectServer& operator=(const DirectServer&) = delete;

  int port() const { return port_; }
  // The addresses ("host:port") of the job's peers, as the coordinator
  // sent them, replacing the last set: connections from their hosts are
  // known (ConnectionAdmission: trusted, with a reserve of handshakes no
  // stranger can take). A host given by name is left out (resolving it
  // here could block): such a peer connects as a stranger, and is trusted
  // once one of its connections authenticated. Returns how many sources
  // are known now.
  size_t SetKnownPeers(const std::vector<std::string>& addresses);
  // Stops accepting, ends every connection and joins their threads.
  // Idempotent.
  void Shutdown();

  struct Stats {
    uint64_t accepted = 0;  // connections that completed the handshake
    uint64_t refused = 0;   // failed handshakes, over the limits, bad preface
    uint64_t refused_by_reason[kRefusalReasons] = {};  // by RefusalReason
    int open = 0;                                      // connections now
    int unauthenticated = 0;  // of them, not yet through handshake and hello
    int sessions = 0;         // senders' sessions now (one or more stripes each)
  };
  Stats stats() const;

 private:
  DirectServer(ActivationServer* activations, DirectServerOptions options, int listen_fd, int port,
               std::shared_ptr<ssl_ctx_st> ctx);
  // The connections of one sender's session and the assembler they share.
  // Any connection that ends ends the session (its other connections are
  // shut down): a tensor striped over a lost connection cannot complete, and
  // the last connection out frees what the session held half-received.
  struct Session {
    Session(ActivationServer* server, std::optional<std::string> peer_name, uint32_t stripes)
        : shared(server, std::move(peer_name)), stripes(stripes) {}
    SharedTensorAssembler shared;
    const uint32_t stripes;
    // Guarded by the server's mu_.
    uint32_t joined = 0;  // bit per stripe that has connected
    std::map<uint64_t, DirectLink*> links;
    bool ended = false;
  };
  using SessionKey = std::pair<std::string, uint64_t>;  // peer identity, session id

  void AcceptLoop();
  // Accepts one connection from the listening socket, or refuses it.
  void AcceptOne();
  void Serve(uint64_t id, int fd, const std::string& source);
  // The handshake, preface and hello of connection `id`; the link when it
  // is admitted as authenticated, null when refused (counted and logged).
  std::unique_ptr<DirectLink> Handshake(uint64_t id, int fd, const std::string& source);
  // Counts a refusal; the line to log (after the lock), if any.
  std::optional<std::string> RefusedLocked(RefusalReason reason, absl::string_view source,
                                           absl::string_view detail)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds an accepted connection to its session (by its certificate name and
  // hello); null and why when refused (a stripe twice, a stripe count that
  // disagrees, a session that already ended).
  std::shared_ptr<Session> Join(uint64_t id, DirectLink* link, std::string* why);
  void Leave(uint64_t id, DirectLink* link, const std::shared_ptr<Session>& session);

  ActivationServer* const activations_;
  const DirectServerOptions options_;
  int listen_fd_;  // closed by Shutdown (new connections are refused)
  const int port_;
  const std::shared_ptr<ssl_ctx_st> ctx_;
  int wake_pipe_[2] = {-1, -1};

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  // Open connections' links (for Shutdown) and every connection thread not
  // yet joined (a finished one is joined by the next accept or Shutdown).
  std::map<uint64_t, DirectLink*> links_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> finished_ ABSL_GUARDED_BY(mu_);
  std::map<SessionKey, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  int open_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  ConnectionAdmission admission_ ABSL_GUARDED_BY(mu_);
  RefusalCounter refusals_ ABSL_GUARDED_BY(mu_);
  // A duplicate of each unauthenticated connection's socket, open until its
  // thread is done with the handshake: shutting it down closes the
  // connection (eviction) without racing the thread's close of its own.
  std::map<uint64_t, int> unauthenticated_fds_ ABSL_GUARDED_BY(mu_);
  std::thread acceptor_;
  metrics::Counter* accepted_metric_ = nullptr;
  metrics::Gauge* open_metric_ = nullptr;
};

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_DIRECT_SERVER_H_
