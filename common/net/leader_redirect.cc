#include "common/net/leader_redirect.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/net/address.h"

namespace detour {

absl::StatusOr<std::vector<std::string>> ParseCoordinatorList(const std::string& list,
                                                              const std::string& flag) {
  std::vector<std::string> addresses;
  for (absl::string_view part : absl::StrSplit(list, ',')) {
    part = absl::StripAsciiWhitespace(part);
    if (part.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": an empty address in \"", list.substr(0, 256), "\""));
    }
    auto parsed = ParseHostPort(std::string(part), flag, /*allow_port_zero=*/false);
    if (!parsed.ok()) return parsed.status();
    if (std::find(addresses.begin(), addresses.end(), part) != addresses.end()) continue;
    if (addresses.size() == kMaxCoordinatorAddresses) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": more than ", kMaxCoordinatorAddresses, " addresses"));
    }
    addresses.emplace_back(part);
  }
  return addresses;
}

std::optional<std::string> LeaderFromTrailers(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  auto it = trailers.find(kLeaderRedirectKey);
  if (it == trailers.end() || it->second.size() > 256) return std::nullopt;
  std::string leader(it->second.data(), it->second.size());
  if (!ParseHostPort(leader, "leader", /*allow_port_zero=*/false).ok()) return std::nullopt;
  return leader;
}

}  // namespace detour
