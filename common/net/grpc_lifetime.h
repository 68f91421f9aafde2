// Keeps gRPC initialised for the scope of a daemon's main and shuts it down
// synchronously at the end of that scope. When the last gRPC object goes,
// gRPC shuts down on a thread of its own, which exit() can overtake: what
// that thread was still freeing (a refused TLS handshake's OpenSSL objects)
// is then reported by LeakSanitizer as leaked. Holding a reference of our own
// and dropping it with grpc_shutdown_blocking() makes the last shutdown run
// here, before exit; it is bounded (gRPC waits at most seconds for its own
// objects). Declare it before every gRPC object of the scope, so that it
// goes last.
#ifndef DETOUR_COMMON_NET_GRPC_LIFETIME_H_
#define DETOUR_COMMON_NET_GRPC_LIFETIME_H_

#include <grpc/grpc.h>

namespace detour {

class GrpcLifetime {
 public:
  GrpcLifetime() { grpc_init(); }
  ~GrpcLifetime() { grpc_shutdown_blocking(); }
  GrpcLifetime(const GrpcLifetime&) = delete;
  GrpcLifetime& operator=(const GrpcLifetime&) = delete;
};

}  // namespace detour

#endif  // DETOUR_COMMON_NET_GRPC_LIFETIME_H_
