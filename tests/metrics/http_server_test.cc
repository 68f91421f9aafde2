#include "common/metrics/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/metrics/exposition.h"
#include "common/metrics/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour::metrics {
namespace {

using ::testing::HasSubstr;

struct HttpResponse {
  int status = 0;  // 0: no response (connection failed)
  std::string content_type;
  std::string body;
};

// A minimal HTTP/1.0 client: one request per connection, read to EOF.
HttpResponse HttpRequest(int port, const std::string& method, const std::string& path) {
  HttpResponse response;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return response;
  timeval timeout = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return response;
  }
  const std::string request =
      absl::StrCat(method, " ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (send(fd, request.data(), request.size(), 0) != static_cast<ssize_t>(request.size())) {
    close(fd);
    return response;
  }
  std::string raw;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0) raw.append(buffer, n);
  close(fd);

  const size_t header_end = raw.find("\r\n\r\n");
  if (header_end == std::string::npos) return response;
  response.body = raw.substr(header_end + 4);
  std::vector<std::string> lines = absl::StrSplit(raw.substr(0, header_end), "\r\n");
  // "HTTP/1.1 200 OK"
  std::vector<std::string> status_line = absl::StrSplit(lines[0], ' ');
  if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], &response.status)) {
    response.status = -1;
  }
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == std::string::npos) continue;
    if (absl::AsciiStrToLower(lines[i].substr(0, colon)) == "content-type") {
      response.content_type = std::string(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)));
    }
  }
  return response;
}

HttpResponse HttpGet(int port, const std::string& path) { return HttpRequest(port, "GET", path); }

TEST(MetricsHttpServerTest, ServesMetricsOnEphemeralPort) {
  Registry registry;
  registry.AddCounter("detour_demo", "Demo.", {"kind"})
      .value()
      ->WithLabels({"a\"b"})
      .value()
      ->Increment();
  MetricsHttpServer server(&registry);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  ASSERT_GT(server.port(), 0);

  const HttpResponse response = HttpGet(server.port(), "/metrics");
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.content_type, "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(response.content_type, kExpositionContentType);
  // The scrape counts itself before rendering, and nothing has changed since.
  EXPECT_EQ(response.body, registry.Serialize());
  EXPECT_THAT(response.body, HasSubstr("detour_demo_total{kind=\"a\\\"b\"} 1\n"));
  EXPECT_THAT(response.body, HasSubstr("detour_metrics_scrapes_total 1\n"));

  const HttpResponse second = HttpGet(server.port(), "/metrics?x=1");
  EXPECT_EQ(second.status, 200);
  EXPECT_THAT(second.body, HasSubstr("detour_metrics_scrapes_total 2\n"));
}

TEST(MetricsHttpServerTest, HealthzAndUnknownPaths) {
  Registry registry;
  MetricsHttpServer server(&registry);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());

  const HttpResponse health = HttpGet(server.port(), "/healthz");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body, "ok");

  for (const char* path : {"/", "/metricsx", "/metrics/extra", "/index.html", "/../etc/passwd"}) {
    EXPECT_EQ(HttpGet(server.port(), path).status, 404) << path;
  }
  EXPECT_EQ(HttpRequest(server.port(), "POST", "/metrics").status, 405);
  const HttpResponse head = HttpRequest(server.port(), "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "");
  // HEAD renders the registry (for Content-Length), so it counts as a
  // scrape; the 404s and the 405 do not.
  EXPECT_THAT(registry.Serialize(), HasSubstr("detour_metrics_scrapes_total 1\n"));
}

TEST(MetricsHttpServerTest, ServesAddedHandlersOnly) {
  Registry registry;
  MetricsHttpServer server(&registry);
  int calls = 0;
  ASSERT_TRUE(server
                  .AddHandler("/sd",
                              [&calls] {
                                ++calls;
                                return MetricsHttpServer::Response{"application/json", "[]"};
                              })
                  .ok());
  EXPECT_EQ(server.AddHandler("/sd", [] { return MetricsHttpServer::Response{}; }).code(),
            absl::StatusCode::kAlreadyExists);
  for (const char* bad : {"", "sd", "/metrics", "/healthz"}) {
    EXPECT_EQ(server.AddHandler(bad, [] { return MetricsHttpServer::Response{}; }).code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  EXPECT_EQ(server.AddHandler("/late", [] { return MetricsHttpServer::Response{}; }).code(),
            absl::StatusCode::kFailedPrecondition);

  const HttpResponse sd = HttpGet(server.port(), "/sd");
  EXPECT_EQ(sd.status, 200);
  EXPECT_EQ(sd.content_type, "application/json");
  EXPECT_EQ(sd.body, "[]");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(HttpRequest(server.port(), "POST", "/sd").status, 405);
  EXPECT_EQ(HttpGet(server.port(), "/sd/x").status, 404);
  EXPECT_EQ(calls, 1);
  // Not a scrape.
  EXPECT_THAT(registry.Serialize(), HasSubstr("detour_metrics_scrapes_total 0\n"));
}

// A handler may name the server's own port (service discovery does). The
// port was written after the handler was registered, unordered with the
// handler's read on civetweb's thread: ThreadSanitizer reports that on every
// such request (tools/checks.sh runs this test under TSan).
TEST(MetricsHttpServerTest, AHandlerSeesTheBoundPort) {
  Registry registry;
  MetricsHttpServer server(&registry);
  ASSERT_TRUE(
      server
          .AddHandler(
              "/port",
              [&server] {
                return MetricsHttpServer::Response{"text/plain", std::to_string(server.port())};
              })
          .ok());
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  for (int i = 0; i < 3; ++i) {
    const HttpResponse r = HttpGet(server.port(), "/port");
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, std::to_string(server.port()));
  }
  server.Stop();
  EXPECT_EQ(server.port(), 0);
}

// Regression: 30 slow connections made /metrics and /healthz time out. With 40
// connections that send nothing, a scrape is still answered within seconds.
TEST(MetricsHttpServerTest, IdleConnectionsDoNotBlockScrapes) {
  Registry registry;
  MetricsHttpServer server(&registry);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  std::vector<int> idle;
  for (int i = 0; i < 40; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = {};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const char partial[] = "GET /metr";  // and then nothing
    ASSERT_GT(::send(fd, partial, sizeof(partial) - 1, 0), 0);
    idle.push_back(fd);
  }
  const absl::Time start = absl::Now();
  const HttpResponse health = HttpGet(server.port(), "/healthz");
  EXPECT_EQ(health.status, 200);
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  for (int fd : idle) ::close(fd);
}

TEST(MetricsHttpServerTest, BusyPortGivesClearErrorAndNoNoise) {
  const int holder = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(holder, 0);
  sockaddr_in address = {};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  ASSERT_EQ(bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(holder, 1), 0);
  socklen_t length = sizeof(address);
  ASSERT_EQ(getsockname(holder, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int busy_port = ntohs(address.sin_port);

  Registry registry;
  MetricsHttpServer server(&registry);
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const absl::Status status = server.Start("127.0.0.1", busy_port);
  const std::string out = testing::internal::GetCapturedStdout();
  const std::string err = testing::internal::GetCapturedStderr();
  close(holder);

  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(status.message(),
            absl::StrCat("metrics port ", busy_port, " on 127.0.0.1 is already in use"));
  EXPECT_EQ(out, "");
  EXPECT_EQ(err, "");
  EXPECT_EQ(server.port(), 0);
  // The failed server can still start elsewhere.
  EXPECT_TRUE(server.Start("127.0.0.1", 0).ok());
}

TEST(MetricsHttpServerTest, RejectsBadArgumentsAndDoubleStart) {
  Registry registry;
  MetricsHttpServer server(&registry);
  EXPECT_EQ(server.Start("localhost:80", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.Start("not an address", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.Start("127.0.0.1", 70000).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(server.Start("127.0.0.1", -1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  EXPECT_EQ(server.Start("127.0.0.1", 0).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MetricsHttpServerTest, Ipv6IsServedOrClearlyRefused) {
  Registry registry;
  MetricsHttpServer server(&registry);
  const absl::Status status = server.Start("::1", 0);
  if (status.ok()) {
    EXPECT_GT(server.port(), 0);
  } else {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("IPv6"));
  }
}

TEST(MetricsHttpServerTest, StopClosesThePortAndAllowsRestart) {
  Registry registry;
  MetricsHttpServer server(&registry);
  ASSERT_TRUE(server.Start("127.0.0.1", 0).ok());
  const int port = server.port();
  EXPECT_EQ(HttpGet(port, "/healthz").status, 200);
  server.Stop();
  EXPECT_EQ(server.port(), 0);
  EXPECT_EQ(HttpGet(port, "/healthz").status, 0);  // connection refused
  server.Stop();                                   // idempotent
  ASSERT_TRUE(server.Start("127.0.0.1", port).ok());
  EXPECT_EQ(server.port(), port);
  EXPECT_EQ(HttpGet(port, "/healthz").status, 200);
}

TEST(MetricsHttpServerTest, TwoServersShareOneRegistry) {
  Registry registry;
  MetricsHttpServer first(&registry);
  MetricsHttpServer second(&registry);
  ASSERT_TRUE(first.Start("127.0.0.1", 0).ok());
  ASSERT_TRUE(second.Start("127.0.0.1", 0).ok());
  EXPECT_NE(first.port(), second.port());
  EXPECT_EQ(HttpGet(first.port(), "/metrics").status, 200);
  EXPECT_THAT(HttpGet(second.port(), "/metrics").body,
              HasSubstr("detour_metrics_scrapes_total 2\n"));
}

}  // namespace
}  // namespace detour::metrics
