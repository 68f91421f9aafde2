#include "common/net/grpc_status.h"

#include "gtest/gtest.h"

namespace detour {
namespace {

TEST(GrpcStatus, EveryCodeRoundTrips) {
  for (int code = 0; code <= 16; ++code) {
    const absl::Status s(static_cast<absl::StatusCode>(code), code == 0 ? "" : "msg");
    const grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), code);
    if (code != 0) {
      EXPECT_EQ(g.error_message(), "msg");
    }
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
}

TEST(GrpcStatus, NamedCodesMatch) {
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down")).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(GrpcStatus, UnknownCodeFromPeerBecomesUnknown) {
  // 20: unassigned, but within grpc::StatusCode's range (a value beyond it is
  // undefined behaviour for the enum).
  const absl::Status s = FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(20), "odd"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnknown);
  EXPECT_EQ(s.message(), "odd");
}

}  // namespace
}  // namespace detour
