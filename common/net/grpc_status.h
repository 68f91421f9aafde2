// The one place absl::Status and grpc::Status are converted. The numeric codes
// of the two match one to one (both follow google.rpc.Code).
#ifndef DETOUR_COMMON_NET_GRPC_STATUS_H_
#define DETOUR_COMMON_NET_GRPC_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace detour {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_GRPC_STATUS_H_
