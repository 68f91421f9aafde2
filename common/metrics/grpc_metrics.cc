#include "common/metrics/grpc_metrics.h"

#include <atomic>
#include <chrono>
#include <utility>

#include <google/protobuf/descriptor.h>
#include <grpcpp/server_context.h>
#include <grpcpp/support/interceptor.h>

#include "absl/strings/str_cat.h"

namespace detour::metrics {
namespace {

using grpc::experimental::InterceptionHookPoints;

// Lives for one RPC; gRPC deletes it when the call is over.
class ServerMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  ServerMetricsInterceptor(ServerMetricsInterceptorFactory* factory,
                           grpc::experimental::ServerRpcInfo* info)
      : factory_(factory),
        context_(info->server_context()),
        method_(info->method() != nullptr ? info->method() : ""),
        start_(std::chrono::steady_clock::now()) {}

  ~ServerMetricsInterceptor() override {
    // No status was sent: the call was cancelled or the server shut down.
    Finish(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      // Handlers often answer a cancelled call with some other code (the
      // default health service sends UNKNOWN); what happened is a cancel.
      const bool cancelled = context_ != nullptr && context_->IsCancelled();
      Finish(cancelled ? grpc::StatusCode::CANCELLED : methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Finish(grpc::StatusCode code) {
    // Send and receive batches of a stream may be intercepted concurrently.
    if (recorded_.exchange(true)) return;
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start_;
    factory_->Record(method_, code, elapsed.count());
  }

  ServerMetricsInterceptorFactory* const factory_;
  grpc::ServerContextBase* const context_;  // owned by gRPC, outlives us
  const std::string method_;
  const std::chrono::steady_clock::time_point start_;
  std::atomic<bool> recorded_{false};
};

}  // namespace

std::string StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: break;
  }
  return absl::StrCat("UNKNOWN_CODE_", static_cast<int>(code));
}

absl::StatusOr<std::unique_ptr<ServerMetricsInterceptorFactory>>
ServerMetricsInterceptorFactory::Create(Registry* registry, Options options) {
  absl::StatusOr<CounterFamily*> handled = registry->AddCounter(
      "detour_rpc_server_handled_total",
      "RPCs completed on the server, by full method name and status code.", {"method", "code"});
  if (!handled.ok()) return handled.status();
  absl::StatusOr<HistogramFamily*> latency = registry->AddHistogram(
      "detour_rpc_server_handling_seconds",
      "Time from an RPC being matched on the server to its status being sent "
      "(whole-stream duration for streaming RPCs).",
      options.latency_buckets, {"method"});
  if (!latency.ok()) return latency.status();
  return std::unique_ptr<ServerMetricsInterceptorFactory>(
      new ServerMetricsInterceptorFactory(*handled, *latency, std::move(options)));
}

ServerMetricsInterceptorFactory::ServerMetricsInterceptorFactory(CounterFamily* handled,
                                                                 HistogramFamily* latency,
                                                                 Options options)
    : handled_(handled),
      latency_(latency),
      allowed_(options.methods.begin(), options.methods.end()),
      max_methods_(options.max_methods) {}

grpc::experimental::Interceptor* ServerMetricsInterceptorFactory::CreateServerInterceptor(
    grpc::experimental::ServerRpcInfo* info) {
  return new ServerMetricsInterceptor(this, info);
}

std::string ServerMetricsInterceptorFactory::MethodLabel(absl::string_view method) {
  if (!allowed_.empty()) {
    return allowed_.contains(method) ? std::string(method) : std::string(kOtherMethod);
  }
  absl::MutexLock lock(&mu_);
  if (seen_.contains(method)) return std::string(method);
  if (seen_.size() >= max_methods_) return std::string(kOtherMethod);
  seen_.emplace(method);
  return std::string(method);
}

void ServerMetricsInterceptorFactory::Record(const std::string& method, grpc::StatusCode code,
                                             double seconds) {
  const std::string label = MethodLabel(method);
  // Both families have a bounded number of series by construction, so the
  // only possible error (RESOURCE_EXHAUSTED) means metrics are dropped, which
  // must not affect the RPC.
  if (absl::StatusOr<Counter*> counter = handled_->WithLabels({label, StatusCodeName(code)});
      counter.ok()) {
    (*counter)->Increment();
  }
  if (absl::StatusOr<Histogram*> histogram = latency_->WithLabels({label}); histogram.ok()) {
    (*histogram)->Observe(seconds);
  }
}

absl::StatusOr<std::vector<std::string>> MethodsOfServices(
    const std::vector<std::string>& service_names) {
  std::vector<std::string> methods;
  const google::protobuf::DescriptorPool* pool = google::protobuf::DescriptorPool::generated_pool();
  for (const std::string& service_name : service_names) {
    const google::protobuf::ServiceDescriptor* service = pool->FindServiceByName(service_name);
    if (service == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          "service ", service_name, " is not linked into this binary (no protobuf descriptor)"));
    }
    for (int i = 0; i < service->method_count(); ++i) {
      methods.push_back(absl::StrCat("/", service->full_name(), "/", service->method(i)->name()));
    }
  }
  return methods;
}

}  // namespace detour::metrics
