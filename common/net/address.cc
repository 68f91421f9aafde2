#include "common/net/address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace detour {

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view flag,
                                       bool allow_port_zero) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", text, "\" is not host:port (", why, ")"));
  };
  const size_t colon = text.rfind(':');
  if (colon == absl::string_view::npos) return bad("missing ':port'");
  absl::string_view host = text.substr(0, colon);
  absl::string_view port_text = text.substr(colon + 1);
  if (!host.empty() && host.front() == '[') {
    if (host.size() < 2 || host.back() != ']') return bad("unbalanced '['");
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != absl::string_view::npos) {
    return bad("IPv6 addresses need brackets, e.g. [::1]:7070");
  }
  int port = 0;
  if (!absl::SimpleAtoi(port_text, &port) || port < 0 || port > 65535) {
    return bad("port must be a number in 0..65535");
  }
  if (port == 0 && !allow_port_zero) return bad("port 0 is only allowed for listening");
  HostPort out;
  out.host = host.empty() ? "0.0.0.0" : std::string(host);
  out.port = port;
  return out;
}

absl::StatusOr<int> BindTcp(const HostPort& address, absl::string_view what, bool listen,
                            int* bound_port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* result = nullptr;
  const std::string port = std::to_string(address.port);
  const char* host = address.host.empty() ? nullptr : address.host.c_str();
  const int rc = ::getaddrinfo(host, port.c_str(), &hints, &result);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": cannot resolve host \"", address.host, "\": ", gai_strerror(rc)));
  }
  absl::Status status =
      absl::UnavailableError(absl::StrCat(what, ": no address to bind for ", address.ToString()));
  int bound = -1;
  for (addrinfo* ai = result; ai != nullptr && bound < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || (listen && ::listen(fd, 128) != 0)) {
      const int err = errno;
      status = err == EADDRINUSE
                   ? absl::UnavailableError(absl::StrCat(what, ": ", address.ToString(),
                                                         " is already in use by another process"))
                   : absl::UnavailableError(absl::StrCat(what, ": cannot bind ", address.ToString(),
                                                         ": ", std::strerror(err)));
      ::close(fd);
      continue;
    }
    bound = fd;
  }
  ::freeaddrinfo(result);
  if (bound < 0) return status;
  if (bound_port != nullptr) *bound_port = LocalPort(bound);
  return bound;
}

int LocalPort(int fd) {
  sockaddr_storage name{};
  socklen_t len = sizeof(name);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&name), &len) != 0) return 0;
  return name.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&name)->sin6_port)
                                    : ntohs(reinterpret_cast<sockaddr_in*>(&name)->sin_port);
}

absl::Status CheckPortFree(const HostPort& address, absl::string_view what) {
  if (address.port == 0) return absl::OkStatus();
  absl::StatusOr<int> fd = BindTcp(address, what, /*listen=*/false);
  if (!fd.ok()) return fd.status();
  ::close(*fd);
  return absl::OkStatus();
}

}  // namespace detour
