// Connection admission in front of a gRPC server. gRPC (Debian's 1.51) has
// no per-source or total connection limit, and its C++ API adopts an
// accepted socket only without TLS, so the daemons' gRPC servers listen on
// the loopback and an AdmissionRelay owns the public port: it accepts, lets
// a connection in or refuses it by the direct transport's rules
// (connection_admission.h: unauthenticated connections bounded in total and
// per source, the job's known peers' reserve, the oldest of the busiest
// source closed to make room), and relays the admitted connection's bytes,
// TLS and all, to the server untouched. One thread, epoll.
//
// The relay cannot read TLS, so the server tells it who proved themselves:
// RelayAuthInterceptorFactory marks a connection authenticated when a call
// on it comes with a verified client certificate, or when a call other than
// the health and reflection services is answered with a message or OK
// (tokens are checked before any service answers). A connection that has
// not proven its caller within `prove_within` of its accept is closed.
//
// What the server sees as a call's peer is then the relay's loopback
// connection ("ipv4:127.0.0.1:PORT"); the relay logs the real source of the
// connections it refuses or closes.
#ifndef DETOUR_COMMON_NET_ADMISSION_RELAY_H_
#define DETOUR_COMMON_NET_ADMISSION_RELAY_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "common/net/address.h"
#include "common/net/connection_admission.h"
#include "grpcpp/support/server_interceptor.h"

namespace detour {

class RelayAuthSink;

struct AdmissionRelayOptions {
  // Each admitted connection holds two descriptors and, while bytes are in
  // flight, two buffers of buffer_bytes. Start raises the process's soft
  // limit on open files (RLIMIT_NOFILE) towards what max_connections needs,
  // and warns, naming LimitNOFILE, when the hard limit is lower.
  AdmissionLimits limits{/*max_connections=*/512, /*max_unauthenticated=*/64,
                         /*max_unauthenticated_per_source=*/8,
                         /*max_unauthenticated_known=*/32};
  // A connection must prove its caller within this (TLS handshake and a
  // first call answered), or it is closed (reason `deadline`).
  absl::Duration prove_within = absl::Seconds(30);
  absl::Duration refusal_log_interval = absl::Seconds(10);
  // 256 KiB: a quarter fewer system calls per byte than 64 KiB, and the
  // gRPC stream's loopback rate about 1.2–1.8× (docs/BENCHMARKS.md).
  size_t buffer_bytes = 256 << 10;
  // "coordinator gRPC", in log lines.
  std::string what = "gRPC";
  // With a registry: <metric_prefix>_connections_refused_total{reason} and
  // <metric_prefix>_connections{state="unauthenticated"|"authenticated"}.
  metrics::Registry* metrics = nullptr;
  std::string metric_prefix = "detour_grpc";
};

class AdmissionRelay {
 public:
  // Listens on `listen` (errors name `flag` and the address, as BindTcp's)
  // and relays admitted connections to 127.0.0.1:backend_port.
  static absl::StatusOr<std::unique_ptr<AdmissionRelay>> Start(const HostPort& listen,
                                                               absl::string_view flag,
                                                               int backend_port,
                                                               AdmissionRelayOptions options);
  ~AdmissionRelay();
  AdmissionRelay(const AdmissionRelay&) = delete;
  AdmissionRelay& operator=(const AdmissionRelay&) = delete;

  // Stops accepting and closes every connection. Idempotent.
  void Stop();
  // Reports from `sink` (the server's interceptors) reach this relay until
  // it is destroyed.
  void AttachSink(std::shared_ptr<RelayAuthSink> sink);
  // The public port (the chosen one for port 0).
  int port() const { return port_; }

  // A call on the loopback connection whose client end is 127.0.0.1:`port`
  // (the relay's side) proved its caller. Thread-safe; unknown ports are
  // ignored.
  void Authenticated(int backend_client_port);
  // The sources (host literals of "host:port" addresses; names are
  // skipped) whose handshakes get the known peers' reserve; replaces the
  // last set. Returns how many sources are known.
  size_t SetKnownPeers(const std::vector<std::string>& addresses);

  struct Stats {
    uint64_t accepted = 0;
    uint64_t refused = 0;
    uint64_t refused_by_reason[kRefusalReasons] = {};
    int open = 0;
    int unauthenticated = 0;
    int authenticated = 0;
  };
  Stats stats() const;

 private:
  struct Conn;
  AdmissionRelay(int listen_fd, int port, int epoll_fd, int wake_fd, int backend_port,
                 AdmissionRelayOptions options);
  void Loop();
  void AcceptAll(absl::Time now);
  // Moves bytes both ways until the sockets would block; false when the
  // connection is done (both directions ended, or an error).
  bool Pump(Conn& c);
  void Watch(Conn& c);
  void CloseConn(uint64_t id);
  void CloseOverdue(absl::Time now);
  // Counts a refusal; the line to log (after the lock), if any.
  std::optional<std::string> RefusedLocked(RefusalReason reason, absl::string_view source,
                                           absl::string_view detail)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AdmissionRelayOptions options_;
  int listen_fd_;  // -1 once stopped
  const int port_, epoll_fd_, wake_fd_, backend_port_;
  std::thread thread_;
  std::shared_ptr<RelayAuthSink> sink_;
  absl::Time accept_paused_until_ = absl::InfinitePast();  // the loop's thread only
  // The loop's thread only: the connections and their descriptors.
  std::map<uint64_t, std::unique_ptr<Conn>> conns_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  ConnectionAdmission admission_ ABSL_GUARDED_BY(mu_);
  RefusalCounter refusals_ ABSL_GUARDED_BY(mu_);
  std::map<int, uint64_t> by_backend_port_ ABSL_GUARDED_BY(mu_);
  // Admitted connections whose caller has not proven itself yet.
  std::set<uint64_t> unproven_ ABSL_GUARDED_BY(mu_);
  uint64_t accepted_ ABSL_GUARDED_BY(mu_) = 0;
  metrics::Gauge* unauthenticated_metric_ = nullptr;
  metrics::Gauge* authenticated_metric_ = nullptr;
};

// Where the interceptors report proven callers: the relay, once it runs
// (the server starts first, on the loopback). Thread-safe.
class RelayAuthSink {
 public:
  void Attach(AdmissionRelay* relay) {
    absl::MutexLock lock(&mu_);
    relay_ = relay;
  }
  // `peer` is a server call's peer ("ipv4:127.0.0.1:PORT").
  void Authenticated(absl::string_view peer);

 private:
  absl::Mutex mu_;
  AdmissionRelay* relay_ ABSL_GUARDED_BY(mu_) = nullptr;
};

// The client port of a loopback call's peer ("ipv4:127.0.0.1:PORT" or
// "ipv6:[::1]:PORT"); nullopt for anything else.
std::optional<int> LoopbackPeerPort(absl::string_view peer);

// Server interceptors that tell `sink` which connections proved their
// callers (above).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RelayAuthInterceptorFactory(
    std::shared_ptr<RelayAuthSink> sink);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_ADMISSION_RELAY_H_
