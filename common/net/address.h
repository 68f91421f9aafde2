// Parsing and checking "host:port" addresses given on command lines.
#ifndef DETOUR_COMMON_NET_ADDRESS_H_
#define DETOUR_COMMON_NET_ADDRESS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace detour {

struct HostPort {
  std::string host;  // name, IPv4 literal, or IPv6 literal without brackets
  int port = 0;      // 0..65535; 0 = pick a free port (listen addresses only)

  // "host:port", with brackets around IPv6 literals.
  std::string ToString() const;
};

// Parses "host:port", "[v6]:port" or ":port" (host defaults to 0.0.0.0).
// `flag` names the source in errors: `--listen: "abc" is not host:port`.
absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view flag,
                                       bool allow_port_zero);

// A TCP socket (close-on-exec) bound to `address` — SO_REUSEADDR, never
// SO_REUSEPORT, so two processes cannot share a port — and listening (backlog
// 128) when `listen` is set. The port it got (for port 0) goes to
// *bound_port. Errors name `what` and the address: cannot resolve, already
// in use by another process, cannot bind.
absl::StatusOr<int> BindTcp(const HostPort& address, absl::string_view what, bool listen,
                            int* bound_port = nullptr);

// The local port of a socket, bound or connected (getsockname); 0 if unknown.
int LocalPort(int fd);

// True when nothing listens on host:port right now (a TCP bind succeeds
// without SO_REUSEPORT). Used to give a clear "already in use" error before
// gRPC or civetweb print their own.
absl::Status CheckPortFree(const HostPort& address, absl::string_view what);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_ADDRESS_H_
