// Leader election among coordinators over etcd. A candidate takes a lease and
// creates <prefix>leader holding its address, bound to the lease, in a
// transaction that succeeds only while the key does not exist
// (create_revision == 0). The winner's term is the revision that created the
// key: it grows with every election, so it can fence a deposed leader. The
// leader keeps the lease alive from a thread of its own and steps down when a
// keep-alive fails, when the lease would have expired since the last one that
// succeeded, or when the key is no longer its own. Thread-safe, but one
// caller campaigns at a time.
#ifndef DETOUR_COORDINATOR_ETCD_LEADER_ELECTION_H_
#define DETOUR_COORDINATOR_ETCD_LEADER_ELECTION_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "coordinator/etcd/etcd_client.h"

namespace detour {

struct ElectionOptions {
  // The election's key, e.g. "/detour/leader".
  std::string key;
  // What followers learn about the leader (its gRPC address).
  std::string address;
  // The lease's time to live; keep-alives go every third of it.
  absl::Duration ttl = absl::Seconds(5);
  // Called once, on the keep-alive thread, when this leader steps down
  // (not when it resigns). It must not call back into the election.
  std::function<void(const absl::Status& why)> on_lost;
};

// The leader as any coordinator sees it.
struct LeaderInfo {
  std::string address;
  int64_t term = 0;
};

// The current leader; NOT_FOUND when there is none.
absl::StatusOr<LeaderInfo> ObserveLeader(EtcdClient* client, const std::string& key);

class LeaderElection {
 public:
  // Does not own `client`, which must outlive it.
  LeaderElection(EtcdClient* client, ElectionOptions options);
  // Resigns when leading.
  ~LeaderElection();

  // One campaign: true when this candidate won (or already leads), false
  // when another leads. Errors when etcd cannot be asked.
  absl::StatusOr<bool> TryCampaign();
  // Campaigns every `retry` until won, `timeout` passes (DEADLINE_EXCEEDED),
  // or Resign is called (CANCELLED).
  absl::Status Campaign(absl::Duration timeout, absl::Duration retry = absl::Milliseconds(500));

  // True only while leading and the lease is surely alive on etcd's side:
  // the last successful keep-alive was sent less than its TTL ago.
  bool IsLeader() const;
  // The term won; 0 when not leading.
  int64_t term() const;

  // Stops leading: ends the keep-alives and revokes the lease, which deletes
  // the key (a new leader can be elected at once). Idempotent.
  absl::Status Resign();

 private:
  void KeepAliveLoop(int64_t lease, int64_t term);
  // Ends leadership from the keep-alive thread and tells on_lost.
  void StepDown(const absl::Status& why);
  void StopKeepAlive();

  EtcdClient* const client_;
  const ElectionOptions options_;
  mutable absl::Mutex mu_;
  bool leading_ ABSL_GUARDED_BY(mu_) = false;
  bool resigned_ ABSL_GUARDED_BY(mu_) = false;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t term_ ABSL_GUARDED_BY(mu_) = 0;
  // The lease is alive on etcd until at least this time.
  absl::Time valid_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::unique_ptr<absl::Notification> stop_ ABSL_GUARDED_BY(mu_);
  std::thread keep_alive_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_ETCD_LEADER_ELECTION_H_
