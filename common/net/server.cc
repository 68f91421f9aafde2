#include "common/net/server.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/resource_quota.h"

namespace detour {

absl::StatusOr<RunningServer> StartGrpcServer(GrpcServerOptions options, absl::string_view what) {
  // gRPC would otherwise log its own bind failure and return null.
  absl::Status free = CheckPortFree(options.listen, what);
  if (!free.ok()) return free;

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  std::shared_ptr<RelayAuthSink> sink;
  if (options.admission) {
    sink = std::make_shared<RelayAuthSink>();
    options.interceptors.push_back(RelayAuthInterceptorFactory(sink));
    // Only the relay reaches it (and whoever else can open loopback
    // connections on this host: TLS still holds for them).
    builder.AddListeningPort("127.0.0.1:0", options.security.ServerCredentials(), &port);
  } else {
    builder.AddListeningPort(options.listen.ToString(), options.security.ServerCredentials(),
                             &port);
  }
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Tensor streams: let a whole chunk be in flight before the reader drains
  // it, and frame it in large HTTP/2 frames.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 128 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 5000);
  // Bounds on what clients can make the server hold: streams per connection
  // and, when asked, buffer memory over all connections.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  builder.AddChannelArgument(
      GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
      static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(options.handshake_timeout), 1,
                                           std::numeric_limits<int>::max())));
  if (options.memory_quota_bytes > 0) {
    grpc::ResourceQuota quota("detour-server");
    quota.Resize(options.memory_quota_bytes);
    builder.SetResourceQuota(quota);
  }
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  if (options.generic_service != nullptr) {
    builder.RegisterCallbackGenericService(options.generic_service);
  }
  if (!options.interceptors.empty()) {
    builder.experimental().SetInterceptorCreators(std::move(options.interceptors));
  }
  RunningServer running;
  running.server = builder.BuildAndStart();
  if (running.server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        what, ": cannot listen on ", options.listen.ToString(), " (address in use or not local)"));
  }
  running.port = port;
  if (options.admission) {
    absl::StatusOr<std::unique_ptr<AdmissionRelay>> relay =
        AdmissionRelay::Start(options.listen, what, port, std::move(options.relay));
    if (!relay.ok()) {
      running.server->Shutdown();
      return relay.status();
    }
    running.relay = *std::move(relay);
    running.relay->AttachSink(std::move(sink));
    running.port = running.relay->port();
  }
  SetServing(running.server.get(), true);
  return running;
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target,
                                           const TransportSecurity& security,
                                           const std::string& server_name, int max_message_bytes) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(max_message_bytes);
  args.SetMaxSendMessageSize(max_message_bytes);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Reconnect quickly after a peer restarts (default backoff grows to 2 min).
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  // Despite its name, gRPC uses this as the least time one connection
  // attempt (TCP, TLS handshake, HTTP/2 settings) is given
  // (doc/connection-backoff.md's MIN_CONNECT_TIMEOUT). At 200 ms, as it was,
  // every handshake slower than that — a loaded or sanitized peer, or a few
  // round trips on an intercontinental link — failed, and calls without
  // wait_for_ready failed with it (UNAVAILABLE "timed out before receiving
  // SETTINGS frame"). A refused connection still fails at once, so restarts
  // are found as quickly as before.
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kMinConnectTimeoutMs);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 128 << 20);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  if (security.tls() && !server_name.empty()) {
    args.SetSslTargetNameOverride(server_name);
  }
  return grpc::CreateCustomChannel(target, security.ChannelCredentials(), args);
}

void SetServing(grpc::Server* server, bool serving) {
  if (server == nullptr || server->GetHealthCheckService() == nullptr) return;
  server->GetHealthCheckService()->SetServingStatus(serving);
}

}  // namespace detour
