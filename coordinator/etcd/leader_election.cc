#include "coordinator/etcd/leader_election.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"

namespace detour {

absl::StatusOr<LeaderInfo> ObserveLeader(EtcdClient* client, const std::string& key) {
  ASSIGN_OR_RETURN(std::optional<EtcdKeyValue> kv, client->Get(key));
  if (!kv.has_value()) {
    return absl::NotFoundError(absl::StrCat("no leader: ", key, " is not in ", client->Describe()));
  }
  return LeaderInfo{kv->value, kv->create_revision};
}

LeaderElection::LeaderElection(EtcdClient* client, ElectionOptions options)
    : client_(client), options_(std::move(options)) {}

LeaderElection::~LeaderElection() {
  if (absl::Status resigned = Resign(); !resigned.ok()) {
    LogWarning("leader election ", options_.key, ": ", resigned.message());
  }
}

absl::StatusOr<bool> LeaderElection::TryCampaign() {
  if (IsLeader()) return true;
  StopKeepAlive();  // of an earlier term that ended
  const absl::Time sent = absl::Now();
  ASSIGN_OR_RETURN(EtcdClient::Lease lease, client_->LeaseGrant(options_.ttl));
  etcdserverpb::TxnRequest txn;
  *txn.add_compare() = EtcdCreateRevisionIs(options_.key, 0);
  *txn.add_success() = EtcdPutOp(options_.key, options_.address, lease.id);
  *txn.add_failure() = EtcdGetOp(options_.key);
  auto response = client_->Txn(txn);
  if (!response.ok() || !response->succeeded()) {
    // Best effort: an unused lease also ends by itself after its TTL.
    if (absl::Status revoked = client_->LeaseRevoke(lease.id); !revoked.ok()) {
      LogWarning("leader election ", options_.key, ": ", revoked.message());
    }
    if (!response.ok()) return Annotate(response.status(), "campaigning");
    return false;
  }
  const int64_t term = response->header().revision();
  absl::MutexLock lock(&mu_);
  leading_ = true;
  lease_ = lease.id;
  term_ = term;
  valid_until_ = sent + lease.ttl;
  stop_ = std::make_unique<absl::Notification>();
  keep_alive_ = std::thread([this, id = lease.id, term] { KeepAliveLoop(id, term); });
  LogInfo("leader election ", options_.key, ": leading as ", options_.address, ", term ", term);
  return true;
}

absl::Status LeaderElection::Campaign(absl::Duration timeout, absl::Duration retry) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::OkStatus();
  {
    absl::MutexLock lock(&mu_);
    resigned_ = false;
  }
  while (true) {
    auto won = TryCampaign();
    if (won.ok() && *won) return absl::OkStatus();
    if (!won.ok()) last = won.status();
    absl::MutexLock lock(&mu_);
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "not elected leader of ", options_.key, " within ", absl::FormatDuration(timeout),
          last.ok() ? "" : "; last error: ", last.message()));
    }
    auto resigned = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return resigned_; };
    if (mu_.AwaitWithTimeout(absl::Condition(&resigned), std::min(retry, left))) {
      return absl::CancelledError(absl::StrCat("campaign for ", options_.key, " given up"));
    }
  }
}

bool LeaderElection::IsLeader() const {
  absl::MutexLock lock(&mu_);
  return leading_ && absl::Now() < valid_until_;
}

int64_t LeaderElection::term() const {
  absl::MutexLock lock(&mu_);
  return leading_ ? term_ : 0;
}

void LeaderElection::KeepAliveLoop(int64_t lease, int64_t term) {
  absl::Notification* stop = nullptr;
  {
    absl::MutexLock lock(&mu_);
    stop = stop_.get();
  }
  while (!stop->WaitForNotificationWithTimeout(options_.ttl / 3)) {
    const absl::Time sent = absl::Now();
    auto left = client_->LeaseKeepAliveOnce(lease);
    if (!left.ok()) return StepDown(Annotate(left.status(), "keeping the lease alive"));
    auto kv = client_->Get(options_.key);
    if (!kv.ok()) return StepDown(Annotate(kv.status(), "reading the leader key"));
    if (!kv->has_value() || (*kv)->create_revision != term || (*kv)->lease != lease) {
      return StepDown(absl::FailedPreconditionError(
          absl::StrCat(options_.key, " is no longer this leader's (term ", term, ")")));
    }
    absl::MutexLock lock(&mu_);
    if (!leading_) return;
    valid_until_ = sent + *left;
  }
}

void LeaderElection::StepDown(const absl::Status& why) {
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!leading_) return;
    leading_ = false;
    lease = lease_;
  }
  LogWarning("leader election ", options_.key, ": stepping down (", why.message(), ")");
  // Lets a new leader take over at once when etcd can still be reached.
  if (absl::Status revoked = client_->LeaseRevoke(lease); !revoked.ok()) {
    LogWarning("leader election ", options_.key, ": ", revoked.message());
  }
  if (options_.on_lost) options_.on_lost(why);
}

void LeaderElection::StopKeepAlive() {
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    if (stop_ != nullptr && !stop_->HasBeenNotified()) stop_->Notify();
    thread = std::move(keep_alive_);
  }
  if (thread.joinable()) thread.join();
}

absl::Status LeaderElection::Resign() {
  {
    absl::MutexLock lock(&mu_);
    resigned_ = true;
  }
  StopKeepAlive();
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!leading_) return absl::OkStatus();
    leading_ = false;
    lease = lease_;
  }
  return client_->LeaseRevoke(lease);
}

}  // namespace detour
