#include "coordinator/leader_gate.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace detour {

LeaderGate::LeaderGate(std::function<bool()> lease_alive) : lease_alive_(std::move(lease_alive)) {}

void LeaderGate::Lead(int64_t term) {
  absl::MutexLock lock(&mu_);
  term_ = term;
  leader_.clear();
}

void LeaderGate::Follow(const std::string& leader) {
  absl::MutexLock lock(&mu_);
  term_ = 0;
  leader_ = leader;
}

int64_t LeaderGate::OpenTerm() const {
  if (!lease_alive_) return 0;
  int64_t term = 0;
  {
    absl::MutexLock lock(&mu_);
    term = term_;
  }
  if (term <= 0 || !lease_alive_()) return -1;
  return term;
}

std::string LeaderGate::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

absl::Status LeaderGate::Check(grpc::ServerContextBase* context, const char* call) const {
  if (IsOpen()) return absl::OkStatus();
  const std::string leader = this->leader();
  if (leader.empty()) {
    return absl::UnavailableError(
        absl::StrCat(call,
                     ": this coordinator is not the leader and no leader is elected yet; "
                     "retry shortly"));
  }
  if (context != nullptr) context->AddTrailingMetadata(kLeaderRedirectKey, leader);
  return absl::UnavailableError(
      absl::StrCat(call, ": this coordinator is not the leader; the leader is at ", leader));
}

}  // namespace detour
