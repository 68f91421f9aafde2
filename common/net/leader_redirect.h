// Clients of a coordinator that may be one of several (one leader, the
// others followers over etcd): the list of addresses they are given, and the
// leader a follower names when it refuses a call (UNAVAILABLE with trailing
// metadata "detour-leader: host:port"). Stateless functions.
#ifndef DETOUR_COMMON_NET_LEADER_REDIRECT_H_
#define DETOUR_COMMON_NET_LEADER_REDIRECT_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"

namespace detour {

// The trailing metadata key a follower names the leader under.
inline constexpr char kLeaderRedirectKey[] = "detour-leader";
// Coordinators one flag may list, at most.
inline constexpr size_t kMaxCoordinatorAddresses = 16;

// "host:port[,host:port...]": each checked (ParseHostPort, no port 0),
// duplicates dropped, at most kMaxCoordinatorAddresses; `flag` names the
// source in errors.
absl::StatusOr<std::vector<std::string>> ParseCoordinatorList(const std::string& list,
                                                              const std::string& flag);

// The leader a refused call's trailers name, when it is a well-formed
// host:port (at most 256 bytes); nullopt otherwise. Call after the RPC ended.
std::optional<std::string> LeaderFromTrailers(const grpc::ClientContext& context);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_LEADER_REDIRECT_H_
