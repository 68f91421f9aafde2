// What answers at a TCP address that a gRPC call could not reach, for a
// hint in the caller's error: a plain HTTP/1 server (a metrics port), a TLS
// server (the client spoke plaintext), or an HTTP/2 server without TLS (the
// client spoke TLS to an --insecure server). One short request, and a TLS
// ClientHello on a second connection when the first got nothing; at most
// `timeout` in all; thread-safe.
#ifndef DETOUR_COMMON_NET_PORT_PROBE_H_
#define DETOUR_COMMON_NET_PORT_PROBE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace detour {

enum class PortAnswer {
  kNothing,    // no connection, no answer, or nothing recognised
  kHttp1,      // "HTTP/1.x ...": a web server, e.g. a metrics port
  kTls,        // a TLS record: a TLS server
  kHttp2Plain  // an HTTP/2 frame without TLS: gRPC with --insecure
};

// Connects to `address` ("host:port") and sends an HTTP/1.0 request for "/"
// (some TLS servers answer it with an alert, an HTTP/2 server with a
// SETTINGS frame); when the server closes without a byte (gRPC's TLS server
// does), sends a TLS ClientHello instead (made by OpenSSL into memory; the
// answer is only classified, no handshake is finished). Classifies the
// first bytes of the answer.
PortAnswer ProbePort(absl::string_view address, absl::Duration timeout);

// A sentence for an unreachable `address`, given whether the client used
// TLS; "" when the probe recognised nothing.
std::string PortHint(absl::string_view address, bool client_tls, PortAnswer answer);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_PORT_PROBE_H_
