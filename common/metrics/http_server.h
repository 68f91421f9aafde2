// Serves a Registry over HTTP for Prometheus to scrape, on civetweb.
//
//   GET /metrics  200, the registry in text format 0.0.4
//                 (Content-Type: text/plain; version=0.0.4; charset=utf-8)
//   GET /healthz  200, "ok"
//   anything else 404 (other methods on those paths: 405)
//
//   metrics::MetricsHttpServer server(&registry);
//   RETURN_IF_ERROR(server.Start("0.0.0.0", 9100));
//
// Each scrape of /metrics increments detour_metrics_scrapes_total in the same
// registry before rendering it. civetweb's own log output is swallowed: the
// server never writes to stdout or stderr.
#ifndef DETOUR_COMMON_METRICS_HTTP_SERVER_H_
#define DETOUR_COMMON_METRICS_HTTP_SERVER_H_

#include <string>

#include "absl/status/status.h"
#include "common/metrics/metrics.h"

struct mg_connection;
struct mg_context;

namespace detour::metrics {

// An HTTP endpoint for one Registry. Start and Stop are thread-compatible
// (call them from one thread, or synchronise); requests are served on
// civetweb's own threads, which only read the registry. Does not own
// `registry`, which must outlive the server.
class MetricsHttpServer {
 public:
  explicit MetricsHttpServer(Registry* registry);
  // Stops the server if it is running.
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  // Listens on `bind_address` (an IPv4 literal such as "127.0.0.1" or
  // "0.0.0.0"; IPv6 literals only where civetweb was built with IPv6, which
  // Debian's 1.15 is not) and `port`; port 0 picks a free ephemeral port, see
  // port(). Returns when the socket is listening. Errors:
  //   INVALID_ARGUMENT     bad address or port, or IPv6 without support
  //   FAILED_PRECONDITION  already started
  //   UNAVAILABLE          the port is in use ("metrics port 9100 on
  //                        127.0.0.1 is already in use") or civetweb failed
  absl::Status Start(const std::string& bind_address, int port);

  // The port actually bound (the ephemeral one after Start(addr, 0)); 0 when
  // not started.
  int port() const { return port_; }

  // Closes the socket and waits for in-flight requests. Idempotent.
  void Stop();

 private:
  static int HandleRequest(mg_connection* connection, void* server);
  int HandleRequest(mg_connection* connection);

  Registry* const registry_;
  Counter* scrapes_ = nullptr;  // owned by registry_
  mg_context* context_ = nullptr;
  std::string bind_address_;
  int port_ = 0;
};

}  // namespace detour::metrics

#endif  // DETOUR_COMMON_METRICS_HTTP_SERVER_H_
