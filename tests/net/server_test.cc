// The shared gRPC server set-up bounds what one client can make it hold:
// streams per connection wait beyond max_concurrent_streams.
#include "common/net/server.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

struct Watch {
  grpc::ClientContext context;
  std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
};

std::unique_ptr<Watch> StartWatch(Health::Stub* stub, absl::Duration deadline) {
  auto w = std::make_unique<Watch>();
  w->context.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  w->reader = stub->Watch(&w->context, HealthCheckRequest());
  return w;
}

TEST(GrpcServer, StreamsBeyondTheConnectionLimitWait) {
  GrpcServerOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.max_concurrent_streams = 2;
  options.memory_quota_bytes = 64 << 20;
  auto server = StartGrpcServer(std::move(options), "test");
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = Health::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", server->port), TransportSecurity::Insecure()));
  HealthCheckResponse response;
  auto first = StartWatch(stub.get(), absl::Seconds(30));
  auto second = StartWatch(stub.get(), absl::Seconds(30));
  ASSERT_TRUE(first->reader->Read(&response));
  ASSERT_TRUE(second->reader->Read(&response));
  // A third stream on the same connection is not served while two are open.
  auto third = StartWatch(stub.get(), absl::Seconds(1));
  EXPECT_FALSE(third->reader->Read(&response));
  EXPECT_EQ(third->reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // Once one ends, a new one is.
  first->context.TryCancel();
  first->reader->Finish();
  auto fourth = StartWatch(stub.get(), absl::Seconds(10));
  EXPECT_TRUE(fourth->reader->Read(&response));
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
  second->context.TryCancel();
  second->reader->Finish();
  fourth->context.TryCancel();
  fourth->reader->Finish();
  server->server->Shutdown(absl::ToChronoTime(absl::Now()));
}

}  // namespace
}  // namespace detour
