#include "common/metrics/http_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/exposition.h"

namespace detour::metrics {
namespace {

// civetweb reports startup failures (such as a busy port) only through its
// log callback, which runs on the thread calling mg_start2. Start() points
// this at a local vector for the duration of that call.
thread_local std::vector<std::string>* startup_log = nullptr;

int LogMessage(const mg_connection* /*connection*/, const char* message) {
  if (startup_log != nullptr && message != nullptr) {
    startup_log->emplace_back(message);
  }
  return 1;  // handled: civetweb must not print anything itself
}

// civetweb's response headers take their Date from gmtime(), whose result
// lives in one buffer per process (the one localtime() uses too): two
// threads answering at once race on it (ThreadSanitizer found it, a
// scrape's headers against another's). Our handlers send their headers
// under this lock; civetweb itself calls localtime() for an access log
// only, and the server has none (no access_log_file, no log_access
// callback).
ABSL_CONST_INIT absl::Mutex header_mu(absl::kConstInit);

void InitCivetwebOnce() {
  // mg_init_library is not thread-safe and should run once per process.
  static const bool initialized = [] {
    mg_init_library(0);
    return true;
  }();
  (void)initialized;
}

void SendText(mg_connection* connection, bool head_only, absl::string_view content_type,
              absl::string_view body) {
  {
    absl::MutexLock lock(&header_mu);
    mg_send_http_ok(connection, std::string(content_type).c_str(),
                    static_cast<long long>(body.size()));
  }
  if (!head_only) mg_write(connection, body.data(), body.size());
}

// Opens and closes one TCP connection to the listener at `bind_address`
// (loopback for wildcard addresses); errors are irrelevant to the caller.
void PokeListener(const std::string& bind_address, int port) {
  sockaddr_storage storage = {};
  socklen_t length = 0;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, bind_address.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    if (v4->sin_addr.s_addr == htonl(INADDR_ANY)) {
      v4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    length = sizeof(sockaddr_in);
  } else if (inet_pton(AF_INET6, bind_address.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    if (IN6_IS_ADDR_UNSPECIFIED(&v6->sin6_addr)) v6->sin6_addr = in6addr_loopback;
    length = sizeof(sockaddr_in6);
  } else {
    return;
  }
  const int fd = socket(storage.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  connect(fd, reinterpret_cast<sockaddr*>(&storage), length);
  close(fd);
}

}  // namespace

MetricsHttpServer::MetricsHttpServer(Registry* registry) : registry_(registry) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

absl::Status MetricsHttpServer::Start(const std::string& bind_address, int port) {
  if (context_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("metrics server already listening on port ", port_.load()));
  }
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", port, " is outside 0..65535"));
  }
  unsigned char address_bytes[sizeof(in6_addr)];
  std::string listening_port;
  if (inet_pton(AF_INET, bind_address.c_str(), address_bytes) == 1) {
    listening_port = absl::StrCat(bind_address, ":", port);
  } else if (inet_pton(AF_INET6, bind_address.c_str(), address_bytes) == 1) {
    if (!mg_check_feature(MG_FEATURES_IPV6)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics bind address ", bind_address,
                       " is IPv6, which this build of civetweb does not support"));
    }
    listening_port = absl::StrCat("[", bind_address, "]:", port);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("metrics bind address \"", bind_address,
                                                   "\" is not an IPv4 or IPv6 address literal"));
  }

  absl::StatusOr<CounterFamily*> scrapes = registry_->AddCounter(
      "detour_metrics_scrapes", "Scrapes of the /metrics endpoint served by this process.");
  if (!scrapes.ok()) return scrapes.status();
  absl::StatusOr<Counter*> scrapes_counter = (*scrapes)->WithLabels({});
  if (!scrapes_counter.ok()) return scrapes_counter.status();
  scrapes_ = *scrapes_counter;

  InitCivetwebOnce();
  mg_callbacks callbacks = {};
  callbacks.log_message = &LogMessage;
  // No document_root: civetweb serves no files, only our handler.
  // Each civetweb thread serves one connection until it ends, so a few slow
  // or idle clients used to block every scrape (2 threads, 10 s timeout: 30
  // idle connections made /metrics and /healthz time out). More threads and
  // a short read timeout bound how long slow clients can hold them.
  const char* options[] = {"listening_ports",
                           listening_port.c_str(),
                           "num_threads",
                           "32",
                           "request_timeout_ms",
                           "2000",
                           nullptr};
  mg_init_data init = {};
  init.callbacks = &callbacks;
  init.configuration_options = options;
  char error_text[256] = {};
  unsigned error_code = 0;
  mg_error_data error = {};
  error.code = &error_code;
  error.text = error_text;
  error.text_buffer_size = sizeof(error_text);

  std::vector<std::string> log;
  startup_log = &log;
  mg_context* context = mg_start2(&init, &error);
  startup_log = nullptr;

  if (context == nullptr) {
    const std::string details = absl::StrJoin(log, "; ");
    if (absl::StrContains(details, "Address already in use") ||
        absl::StrContains(details, "in use")) {
      return absl::UnavailableError(
          absl::StrCat("metrics port ", port, " on ", bind_address, " is already in use"));
    }
    return absl::UnavailableError(absl::StrCat(
        "metrics server on ", listening_port,
        " failed to start: ", error_text[0] != '\0' ? error_text : "unknown civetweb error",
        details.empty() ? "" : " (", details, details.empty() ? "" : ")"));
  }

  mg_server_port bound = {};
  if (mg_get_server_ports(context, 1, &bound) != 1 || bound.port <= 0) {
    mg_stop(context);
    return absl::InternalError(
        absl::StrCat("metrics server on ", listening_port, " started but did not report its port"));
  }
  // What handlers may read is set before they can run: a handler that named
  // the port (service discovery) read it unordered with this write, and saw 0
  // in the instant after registration (TSan found it).
  context_ = context;
  bind_address_ = bind_address;
  port_ = bound.port;
  // "**" matches every URI; HandleRequest routes by path itself so that
  // anything unknown gets a 404 from us rather than from civetweb. (civetweb
  // only takes handlers once started; a request in the instant before this
  // call gets civetweb's own 404, as there is no document root.)
  mg_set_request_handler(context, "**", &MetricsHttpServer::HandleRequest, this);
  return absl::OkStatus();
}

absl::Status MetricsHttpServer::AddHandler(const std::string& path,
                                           std::function<Response()> handler) {
  if (context_ != nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("metrics server: cannot add ", path, " after it started"));
  }
  if (path.empty() || path[0] != '/' || path == "/metrics" || path == "/healthz") {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics server: handler path \"", path,
                     "\" must start with / and not be /metrics or /healthz"));
  }
  if (handler == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("metrics server: no handler for ", path));
  }
  if (!handlers_.emplace(path, std::move(handler)).second) {
    return absl::AlreadyExistsError(absl::StrCat("metrics server: ", path, " is already served"));
  }
  return absl::OkStatus();
}

void MetricsHttpServer::Stop() {
  if (context_ == nullptr) return;
  // civetweb's listener thread notices the stop request only when its poll()
  // returns, which without traffic takes up to 2 s. Connecting to it wakes it
  // at once; a connection that slips in before the stop request is just an
  // empty one that the server closes.
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      PokeListener(bind_address_, port_.load());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  mg_stop(context_);  // joins civetweb's threads
  stopped.store(true);
  waker.join();
  context_ = nullptr;
  port_ = 0;
}

int MetricsHttpServer::HandleRequest(mg_connection* connection, void* server) {
  return static_cast<MetricsHttpServer*>(server)->HandleRequest(connection);
}

int MetricsHttpServer::HandleRequest(mg_connection* connection) {
  const mg_request_info* info = mg_get_request_info(connection);
  const absl::string_view path =
      info != nullptr && info->local_uri != nullptr ? info->local_uri : "";
  const absl::string_view method =
      info != nullptr && info->request_method != nullptr ? info->request_method : "";
  const auto handler = handlers_.find(path);
  if (path != "/metrics" && path != "/healthz" && handler == handlers_.end()) {
    absl::MutexLock lock(&header_mu);
    mg_send_http_error(connection, 404, "%s", "not found\n");
    return 404;
  }
  const bool head_only = method == "HEAD";
  if (method != "GET" && !head_only) {
    static constexpr absl::string_view kBody = "method not allowed\n";
    mg_printf(connection,
              "HTTP/1.1 405 Method Not Allowed\r\n"
              "Allow: GET, HEAD\r\n"
              "Content-Type: text/plain; charset=utf-8\r\n"
              "Content-Length: %zu\r\n"
              "Connection: close\r\n\r\n",
              kBody.size());
    mg_write(connection, kBody.data(), kBody.size());
    return 405;
  }
  if (path == "/healthz") {
    SendText(connection, head_only, "text/plain; charset=utf-8", "ok");
    return 200;
  }
  if (handler != handlers_.end()) {
    const Response response = handler->second();
    SendText(connection, head_only, response.content_type, response.body);
    return 200;
  }
  scrapes_->Increment();
  SendText(connection, head_only, kExpositionContentType, registry_->Serialize());
  return 200;
}

}  // namespace detour::metrics
