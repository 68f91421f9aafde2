#include "common/net/port_probe.h"

#include <fcntl.h>
#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net/address.h"

namespace detour {
namespace {

// Waits for `events` on `fd` until `deadline`.
bool WaitFor(int fd, short events, absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  if (ms <= 0) return false;
  pollfd p{fd, events, 0};
  return ::poll(&p, 1, static_cast<int>(ms)) == 1 && (p.revents & events) != 0;
}

PortAnswer Classify(const unsigned char* b, size_t n) {
  if (n >= 7 && std::memcmp(b, "HTTP/1.", 7) == 0) return PortAnswer::kHttp1;
  // A TLS record: content type alert (21) or handshake (22), version 3.x.
  if (n >= 3 && (b[0] == 21 || b[0] == 22) && b[1] == 3) return PortAnswer::kTls;
  // An HTTP/2 frame header: 24-bit length, type SETTINGS (4) or GOAWAY (7).
  if (n >= 9 && (b[3] == 4 || b[3] == 7)) return PortAnswer::kHttp2Plain;
  return PortAnswer::kNothing;
}

// A TLS ClientHello, as OpenSSL writes it for a client that verifies
// nothing (the probe only tells protocols apart); empty on failure.
std::string ClientHello() {
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_client_method()),
                                                        &SSL_CTX_free);
  if (ctx == nullptr) return "";
  std::unique_ptr<SSL, decltype(&SSL_free)> ssl(SSL_new(ctx.get()), &SSL_free);
  if (ssl == nullptr) return "";
  BIO* in = BIO_new(BIO_s_mem());
  BIO* out = BIO_new(BIO_s_mem());
  if (in == nullptr || out == nullptr) {
    BIO_free(in);
    BIO_free(out);
    return "";
  }
  SSL_set_bio(ssl.get(), in, out);  // ssl owns both from here
  SSL_set_connect_state(ssl.get());
  (void)SSL_do_handshake(ssl.get());  // wants to read the answer: expected
  char* data = nullptr;
  const long n = BIO_get_mem_data(out, &data);
  return n > 0 && data != nullptr ? std::string(data, static_cast<size_t>(n)) : "";
}

// Sends `request` on a new connection to `a` and classifies the first bytes
// of the answer before `deadline`.
PortAnswer Ask(const addrinfo& a, const std::string& request, absl::Time deadline) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return PortAnswer::kNothing;
  if (::connect(fd, a.ai_addr, a.ai_addrlen) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return PortAnswer::kNothing;
  }
  int error = 0;
  socklen_t len = sizeof(error);
  unsigned char buffer[16];
  size_t got = 0;
  if (WaitFor(fd, POLLOUT, deadline) && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 &&
      error == 0 && ::send(fd, request.data(), request.size(), MSG_NOSIGNAL) > 0) {
    while (got < sizeof(buffer) && WaitFor(fd, POLLIN, deadline)) {
      const ssize_t n = ::recv(fd, buffer + got, sizeof(buffer) - got, 0);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
      if (Classify(buffer, got) != PortAnswer::kNothing) break;
    }
  }
  ::close(fd);
  return Classify(buffer, got);
}

}  // namespace

PortAnswer ProbePort(absl::string_view address, absl::Duration timeout) {
  auto hp = ParseHostPort(address, "address", /*allow_port_zero=*/false);
  if (!hp.ok()) return PortAnswer::kNothing;
  const absl::Time deadline = absl::Now() + timeout;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(hp->host.c_str(), std::to_string(hp->port).c_str(), &hints, &found) != 0) {
    return PortAnswer::kNothing;
  }
  PortAnswer answer = PortAnswer::kNothing;
  for (addrinfo* a = found; a != nullptr && answer == PortAnswer::kNothing; a = a->ai_next) {
    answer = Ask(*a, "GET / HTTP/1.0\r\n\r\n", deadline);
    // gRPC's TLS server hangs up on a plain request without a word: offer
    // it a TLS handshake instead.
    if (answer == PortAnswer::kNothing && absl::Now() < deadline) {
      const std::string hello = ClientHello();
      if (!hello.empty()) answer = Ask(*a, hello, deadline);
    }
  }
  ::freeaddrinfo(found);
  return answer;
}

std::string PortHint(absl::string_view address, bool client_tls, PortAnswer answer) {
  switch (answer) {
    case PortAnswer::kHttp1:
      return absl::StrCat(address,
                          " answers plain HTTP/1, not gRPC: is it a metrics port? Give the "
                          "coordinator's gRPC address (its --listen)");
    case PortAnswer::kTls:
      return client_tls ? ""
                        : absl::StrCat(address, " speaks TLS: drop --insecure and give --tls_ca");
    case PortAnswer::kHttp2Plain:
      return client_tls ? absl::StrCat(address,
                                       " speaks plaintext HTTP/2 (a server started with "
                                       "--insecure): use --insecure, or start it with TLS")
                        : "";
    case PortAnswer::kNothing: break;
  }
  return "";
}

}  // namespace detour
