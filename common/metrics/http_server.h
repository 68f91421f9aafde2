// Serves a Registry over HTTP for Prometheus to scrape, on civetweb.
//
//   GET /metrics  200, the registry in text format 0.0.4
//                 (Content-Type: text/plain; version=0.0.4; charset=utf-8)
//   GET /healthz  200, "ok"
//   GET <path>    what a handler added with AddHandler answers
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

#include <atomic>
#include <functional>
#include <map>
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

  // What a handler answers: 200 with this body and Content-Type.
  struct Response {
    std::string content_type;
    std::string body;
  };
  // Serves GET (and HEAD) `path` with `handler` besides /metrics and
  // /healthz, e.g. Prometheus service discovery. The handler runs on
  // civetweb's threads, possibly several at once: it must be thread-safe and
  // quick, and stay callable until Stop(). Call before Start().
  // INVALID_ARGUMENT for a path that does not start with "/" or is /metrics
  // or /healthz; ALREADY_EXISTS for a path added before; FAILED_PRECONDITION
  // once started.
  absl::Status AddHandler(const std::string& path, std::function<Response()> handler);

  // The port actually bound (the ephemeral one after Start(addr, 0)); 0 when
  // not started.
  int port() const { return port_.load(); }

  // Closes the socket and waits for in-flight requests. Idempotent.
  void Stop();

 private:
  static int HandleRequest(mg_connection* connection, void* server);
  int HandleRequest(mg_connection* connection);

  Registry* const registry_;
  Counter* scrapes_ = nullptr;  // owned by registry_
  // Fixed once started (read without a lock by civetweb's threads).
  std::map<std::string, std::function<Response()>, std::less<>> handlers_;
  mg_context* context_ = nullptr;
  std::string bind_address_;  // set before the handler is registered
  // Read by handlers on civetweb's threads (service discovery names it) and
  // by any thread through port().
  std::atomic<int> port_{0};
};

}  // namespace detour::metrics

#endif  // DETOUR_COMMON_METRICS_HTTP_SERVER_H_
