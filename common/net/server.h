// Building a gRPC server the way every detour daemon wants it: health service,
// server reflection, no SO_REUSEPORT (a busy port is an error, not a silently
// shared listener), raised message limits, and a clear error when the listen
// address cannot be bound.
#ifndef DETOUR_COMMON_NET_SERVER_H_
#define DETOUR_COMMON_NET_SERVER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/net/address.h"
#include "common/net/admission_relay.h"
#include "common/net/tls.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"

namespace detour {

struct GrpcServerOptions {
  HostPort listen;
  // TLS (and which client certificates verify) or plaintext.
  TransportSecurity security;
  // Services to register; not owned, must outlive the server.
  std::vector<grpc::Service*> services;
  // Optional generic service for raw-buffer methods (the ActivationService);
  // not owned.
  grpc::CallbackGenericService* generic_service = nullptr;
  // Largest message accepted or sent, in bytes.
  int max_message_bytes = 64 << 20;
  // Streams one client connection may have open at once (HTTP/2
  // SETTINGS_MAX_CONCURRENT_STREAMS): more wait until one ends.
  int max_concurrent_streams = 1024;
  // Memory gRPC may use for all connections' buffers together (a
  // grpc::ResourceQuota); reads slow down at the limit. 0 = gRPC's default.
  size_t memory_quota_bytes = 0;
  // A connection's TLS handshake must be done within this, or it is closed
  // (gRPC's default is 120 s: a silent connection held a slot that long).
  // Generous against long round trips: a handshake takes a few.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Optional interceptor factories (e.g. RPC metrics); ownership moves in.
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // Connection admission on `listen` (admission_relay.h): gRPC listens on
  // the loopback, behind an AdmissionRelay that bounds unauthenticated
  // connections per source and in total. Off: gRPC listens on `listen`
  // itself, with no such bounds.
  bool admission = true;
  AdmissionRelayOptions relay;
};

struct RunningServer {
  // Before `server`, so that it goes after it: the server's calls report
  // proven callers to it until the server is gone.
  std::unique_ptr<AdmissionRelay> relay;
  std::unique_ptr<grpc::Server> server;
  // The bound port (the chosen one when options.listen.port was 0): the
  // relay's when there is one.
  int port = 0;
};

// Starts the server. UNAVAILABLE naming the address when it is in use or
// cannot be bound. `what` names the listener in errors ("--listen").
absl::StatusOr<RunningServer> StartGrpcServer(GrpcServerOptions options, absl::string_view what);

// The least time MakeChannel's channels give one connection attempt (TCP,
// TLS and HTTP/2 handshakes) before it counts as failed.
inline constexpr int kMinConnectTimeoutMs = 5000;

// Channel to a peer with the limits above and keep-alive pings so a dead peer
// is noticed on long-lived streams, secured by `security`. Reconnects after
// 0.2 s growing to 2 s; one attempt may take kMinConnectTimeoutMs. With TLS, the
// server's certificate must name `server_name` (a worker's id) when given,
// else the host of `target`.
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const TransportSecurity& security,
                                           const std::string& server_name = "",
                                           int max_message_bytes = 64 << 20);

// Sets the overall and per-service health status of a running server.
void SetServing(grpc::Server* server, bool serving);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_SERVER_H_
