// Per-method metrics for gRPC servers, recorded by a server interceptor:
//
//   detour_rpc_server_handled_total{method,code}  RPCs completed, by status
//   detour_rpc_server_handling_seconds{method}    time from the call being
//                                                 matched to its status
//
// `method` is the full method name as gRPC gives it
// ("/grpc.health.v1.Health/Check"), `code` the canonical status name ("OK",
// "NOT_FOUND"). Streaming RPCs are recorded once, when the server sends the
// final status, so the histogram holds whole-stream durations (long-lived
// streams fall in the top buckets or +Inf). A call the client cancelled (or
// whose deadline passed) is counted as CANCELLED whatever status the handler
// then sends, and so is a call that ends without the server sending one.
//
//   ASSIGN_OR_RETURN(auto factory,
//                    metrics::ServerMetricsInterceptorFactory::Create(&registry));
//   std::vector<std::unique_ptr<
//       grpc::experimental::ServerInterceptorFactoryInterface>> creators;
//   creators.push_back(std::move(factory));
//   builder.experimental().SetInterceptorCreators(std::move(creators));
#ifndef DETOUR_COMMON_METRICS_GRPC_METRICS_H_
#define DETOUR_COMMON_METRICS_GRPC_METRICS_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/support/server_interceptor.h>
#include <grpcpp/support/status.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"

namespace detour::metrics {

// Method label used for calls outside the allowed set, keeping labels bounded.
inline constexpr absl::string_view kOtherMethod = "other";

// Creates one recording interceptor per RPC. Thread-safe (gRPC calls it from
// its threads). Does not own `registry`, which must outlive the factory and
// every server using it; gRPC's ServerBuilder owns the factory itself.
class ServerMetricsInterceptorFactory
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  struct Options {
    // Full method names to label individually; calls to any other method are
    // labelled kOtherMethod. Empty: every method gets its own label until
    // max_methods distinct names have been seen, then kOtherMethod (a generic
    // service accepts any name a client sends, so this keeps a bound).
    std::vector<std::string> methods;
    size_t max_methods = 200;
    // Latency histogram bounds in seconds.
    std::vector<double> latency_buckets = DefaultLatencyBuckets();
  };

  // Registers the two families in `registry`; their errors are returned (e.g.
  // ALREADY_EXISTS with other buckets).
  static absl::StatusOr<std::unique_ptr<ServerMetricsInterceptorFactory>> Create(Registry* registry,
                                                                                 Options options);
  static absl::StatusOr<std::unique_ptr<ServerMetricsInterceptorFactory>> Create(
      Registry* registry) {
    return Create(registry, Options());
  }

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override;

  // Records one finished call. Public for the interceptor; not for general use.
  void Record(const std::string& method, grpc::StatusCode code, double seconds);

 private:
  ServerMetricsInterceptorFactory(CounterFamily* handled, HistogramFamily* latency,
                                  Options options);
  // The label for `method` under the bounding rules in Options.
  std::string MethodLabel(absl::string_view method);

  CounterFamily* const handled_;    // owned by the registry
  HistogramFamily* const latency_;  // owned by the registry
  const absl::flat_hash_set<std::string> allowed_;
  const size_t max_methods_;
  absl::Mutex mu_;
  absl::flat_hash_set<std::string> seen_ ABSL_GUARDED_BY(mu_);
};

// "OK", "CANCELLED", ... "UNAUTHENTICATED"; "UNKNOWN_CODE_<n>" otherwise.
std::string StatusCodeName(grpc::StatusCode code);

// Full method names ("/pkg.Service/Method") of the services named
// ("grpc.health.v1.Health"), read from the protobuf descriptors linked into
// the binary: a ready Options::methods for the services a server registers.
// NOT_FOUND names a service whose descriptor is not linked in.
absl::StatusOr<std::vector<std::string>> MethodsOfServices(
    const std::vector<std::string>& service_names);

}  // namespace detour::metrics

#endif  // DETOUR_COMMON_METRICS_GRPC_METRICS_H_
