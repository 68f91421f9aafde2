// The worker registry's records in etcd, for the coordinator that leads
// next: <prefix>workers/<worker id> holds a worker's record (JSON of its
// v1::WorkerInfo as WorkerRegistry::Records() gives it: no session token, no
// heartbeat counts), next to the jobs' <prefix>jobs/. Every key is bound to
// one lease of the leader's, with the registry's silence as its time to
// live, kept alive from this directory's thread while leading: when no
// leader keeps it alive, the records expire by themselves. Writes happen on
// that thread when the records change (never per heartbeat), in
// transactions fenced like the job store's: <prefix>leader must still have
// been created at the writer's term. Thread-safe.
#ifndef DETOUR_COORDINATOR_ETCD_ETCD_WORKER_DIRECTORY_H_
#define DETOUR_COORDINATOR_ETCD_ETCD_WORKER_DIRECTORY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/etcd/etcd_client.h"
#include "coordinator/worker_directory.h"

namespace detour {

class EtcdWorkerDirectory : public WorkerDirectory {
 public:
  // The most records Load takes (the registry's kMaxWorkers), and the
  // largest one (a record's fields are bounded at registration).
  static constexpr size_t kMaxRecords = 10000;
  static constexpr size_t kMaxRecordBytes = 16384;
  // Puts and deletes per transaction (etcd allows 128 by default).
  static constexpr int kOpsPerTxn = 64;

  // `records` gives what to mirror (WorkerRegistry::Records); it is called
  // on the directory's thread. `ttl` is the lease's time to live (at least
  // 1 s). `prefix` as EtcdJobBackend::CheckPrefix wants it.
  // `meter` (optional) is told of every request to etcd, when it started
  // and how it ended: the store's metrics (MeteredJobBackend).
  using Meter = std::function<void(absl::Time started, const absl::Status& status)>;
  static absl::StatusOr<std::unique_ptr<EtcdWorkerDirectory>> Create(
      std::unique_ptr<EtcdClient> client, std::string prefix, absl::Duration ttl,
      std::function<std::vector<v1::WorkerInfo>()> records, Meter meter = nullptr);
  // Stops the thread. The lease is left to expire: the next leader may
  // still take the records.
  ~EtcdWorkerDirectory() override;

  std::string Describe() const override;
  // Reads <prefix>workers/ (at most kMaxRecords keys). Skips, with a
  // warning naming the key and the problem, records over kMaxRecordBytes,
  // ones that do not parse, and ones whose id is not their key's (they are
  // left where they are; the registry checks the rest, Restore).
  absl::StatusOr<std::vector<v1::WorkerInfo>> Load() override;
  void Lead(int64_t term) override;
  void Changed() override;
  void StopLeading() override;

  std::string WorkerKey(const std::string& id) const;
  // The lease the records are bound to now; 0 when none (tests).
  int64_t lease() const;
  // Waits until the changes announced before the call are written; false
  // after `timeout`, or when not leading (tests).
  bool Flush(absl::Duration timeout);

 private:
  EtcdWorkerDirectory(std::unique_ptr<EtcdClient> client, std::string prefix, absl::Duration ttl,
                      std::function<std::vector<v1::WorkerInfo>()> records, Meter meter);
  void Metered(absl::Time started, const absl::Status& status) const {
    if (meter_) meter_(started, status);
  }
  void Loop();
  // One pass of the thread while leading: a lease, its keep-alive, and the
  // changed records written (`generation`: changes_ when they were read).
  // Returns when to run again at the latest.
  absl::Duration Work(int64_t term, uint64_t generation);
  // Writes the difference between `records_` and `written_`.
  absl::Status WriteChanges(int64_t term, int64_t lease);

  const std::unique_ptr<EtcdClient> client_;
  const std::string prefix_;
  const absl::Duration ttl_;
  const std::function<std::vector<v1::WorkerInfo>()> records_;
  const Meter meter_;

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t term_ ABSL_GUARDED_BY(mu_) = 0;  // 0 = not leading
  bool leading_changed_ ABSL_GUARDED_BY(mu_) = false;
  // Changed() and Lead() calls so far, and the count the last successful
  // write saw.
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t written_changes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t lease_ ABSL_GUARDED_BY(mu_) = 0;

  // The thread's own: key -> value as written under the current lease.
  std::map<std::string, std::string> written_;
  // A write is due: a change, a new lease, or a write that failed.
  bool dirty_ = false;
  absl::Time next_keep_alive_ = absl::InfinitePast();
  absl::Time last_error_log_ = absl::InfinitePast();
  std::thread thread_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_ETCD_ETCD_WORKER_DIRECTORY_H_
