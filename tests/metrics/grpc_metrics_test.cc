#include "common/metrics/grpc_metrics.h"

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"

namespace detour::metrics {
namespace {

using ::grpc::health::v1::Health;
using ::grpc::health::v1::HealthCheckRequest;
using ::grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kCheck[] = "/grpc.health.v1.Health/Check";

// An in-process gRPC server with the default health service and the metrics
// interceptor.
class MetricsGrpcTest : public ::testing::Test {
 protected:
  void StartServer(ServerMetricsInterceptorFactory::Options options) {
    grpc::EnableDefaultHealthCheckService(true);
    absl::StatusOr<std::unique_ptr<ServerMetricsInterceptorFactory>> factory =
        ServerMetricsInterceptorFactory::Create(&registry_, std::move(options));
    ASSERT_TRUE(factory.ok()) << factory.status();
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(*std::move(factory));
    grpc::ServerBuilder builder;
    // Answers every unknown method with UNIMPLEMENTED, as a generic service
    // in the daemons would; gRPC also refuses to build a server that has no
    // service of its own besides the default health service.
    builder.RegisterCallbackGenericService(&generic_service_);
    builder.experimental().SetInterceptorCreators(std::move(creators));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ = server_->InProcessChannel(grpc::ChannelArguments());
    stub_ = Health::NewStub(channel_);
  }

  void TearDown() override {
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    }
  }

  grpc::Status Check(const std::string& service) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    HealthCheckRequest request;
    request.set_service(service);
    HealthCheckResponse response;
    return stub_->Check(&context, request, &response);
  }

  // Calls `method` through a generic stub with an empty request.
  grpc::Status CallGeneric(const std::string& method) {
    grpc::GenericStub stub(channel_);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status status) { done.set_value(status); });
    return done.get_future().get();
  }

  // Waits until the exposition contains `text` (records of cancelled streams
  // land asynchronously).
  bool WaitForText(const std::string& text) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      if (absl::StrContains(registry_.Serialize(), text)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  Registry registry_;
  grpc::CallbackGenericService generic_service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Health::Stub> stub_;
};

TEST_F(MetricsGrpcTest, CountsUnaryCallsByMethodAndCode) {
  StartServer({});
  ASSERT_TRUE(Check("").ok());
  ASSERT_TRUE(Check("").ok());
  ASSERT_EQ(Check("no.such.Service").error_code(), grpc::StatusCode::NOT_FOUND);

  // The interceptor records before the status is sent, so the client has
  // seen its reply only after the metrics were updated.
  const std::string text = registry_.Serialize();
  EXPECT_THAT(text, HasSubstr("# TYPE detour_rpc_server_handled_total counter\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("detour_rpc_server_handled_total{method=\"", kCheck,
                                           "\",code=\"NOT_FOUND\"} 1\n"
                                           "detour_rpc_server_handled_total{method=\"",
                                           kCheck, "\",code=\"OK\"} 2\n")));
  EXPECT_THAT(text, HasSubstr("# TYPE detour_rpc_server_handling_seconds histogram\n"));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("detour_rpc_server_handling_seconds_bucket{method=\"",
                                           kCheck, "\",le=\"+Inf\"} 3\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("detour_rpc_server_handling_seconds_count{method=\"",
                                           kCheck, "\"} 3\n")));
  EXPECT_THAT(text, HasSubstr(absl::StrCat("detour_rpc_server_handling_seconds_bucket{method=\"",
                                           kCheck, "\",le=\"60\"} 3\n")));
}

TEST_F(MetricsGrpcTest, CancelledStreamIsCountedOnceAtItsEnd) {
  StartServer({});
  grpc::ClientContext context;
  HealthCheckRequest request;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader = stub_->Watch(&context, request);
  HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  // Nothing is recorded while the stream is open.
  EXPECT_THAT(registry_.Serialize(), Not(HasSubstr("Health/Watch")));
  context.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(
      WaitForText("detour_rpc_server_handled_total{method=\"/grpc.health.v1.Health/"
                  "Watch\",code=\"CANCELLED\"} 1\n"))
      << registry_.Serialize();
  EXPECT_THAT(registry_.Serialize(), HasSubstr("detour_rpc_server_handling_seconds_count{method=\"/"
                                               "grpc.health.v1.Health/Watch\"} 1\n"));
}

TEST_F(MetricsGrpcTest, MethodsOutsideTheAllowListAreLabelledOther) {
  absl::StatusOr<std::vector<std::string>> methods = MethodsOfServices({"grpc.health.v1.Health"});
  ASSERT_TRUE(methods.ok()) << methods.status();
  EXPECT_EQ(*methods, (std::vector<std::string>{"/grpc.health.v1.Health/Check",
                                                "/grpc.health.v1.Health/Watch"}));
  ServerMetricsInterceptorFactory::Options options;
  options.methods = {"/grpc.health.v1.Health/Watch"};  // Check not allowed
  StartServer(options);
  ASSERT_TRUE(Check("").ok());
  ASSERT_EQ(CallGeneric("/made.up.Service/Anything").error_code(), grpc::StatusCode::UNIMPLEMENTED);
  const std::string text = registry_.Serialize();
  EXPECT_THAT(text, HasSubstr("detour_rpc_server_handled_total{method=\"other\","
                              "code=\"OK\"} 1\n"));
  EXPECT_TRUE(
      WaitForText("detour_rpc_server_handled_total{method=\"other\","
                  "code=\"UNIMPLEMENTED\"} 1\n"))
      << registry_.Serialize();
  EXPECT_THAT(registry_.Serialize(), Not(HasSubstr(kCheck)));
  EXPECT_THAT(registry_.Serialize(), Not(HasSubstr("made.up")));
}

TEST_F(MetricsGrpcTest, DistinctMethodLabelsAreCapped) {
  ServerMetricsInterceptorFactory::Options options;
  options.max_methods = 1;
  absl::StatusOr<std::unique_ptr<ServerMetricsInterceptorFactory>> factory =
      ServerMetricsInterceptorFactory::Create(&registry_, options);
  ASSERT_TRUE(factory.ok());
  (*factory)->Record("/a.S/M", grpc::StatusCode::OK, 0.001);
  (*factory)->Record("/b.S/M", grpc::StatusCode::INTERNAL, 0.001);
  (*factory)->Record("/a.S/M", grpc::StatusCode::OK, 0.001);
  const std::string text = registry_.Serialize();
  EXPECT_THAT(text, HasSubstr("detour_rpc_server_handled_total{method=\"/a.S/"
                              "M\",code=\"OK\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("detour_rpc_server_handled_total{method=\"other\","
                              "code=\"INTERNAL\"} 1\n"));
}

TEST(MetricsGrpcHelpersTest, StatusCodeNames) {
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::OK), "OK");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
  EXPECT_EQ(StatusCodeName(grpc::StatusCode::UNAUTHENTICATED), "UNAUTHENTICATED");
  // An unassigned code within the enum's range (values beyond it, like 99,
  // are undefined behaviour for grpc::StatusCode; UBSan catches them).
  EXPECT_EQ(StatusCodeName(static_cast<grpc::StatusCode>(20)), "UNKNOWN_CODE_20");
}

TEST(MetricsGrpcHelpersTest, UnknownServiceIsNotFound) {
  EXPECT_EQ(MethodsOfServices({"no.such.Service"}).status().code(), absl::StatusCode::kNotFound);
}

TEST(MetricsGrpcHelpersTest, ConflictingFamilyIsReported) {
  Registry registry;
  ASSERT_TRUE(registry.AddGauge("detour_rpc_server_handled_total", "x").ok());
  EXPECT_EQ(ServerMetricsInterceptorFactory::Create(&registry).status().code(),
            absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace detour::metrics
