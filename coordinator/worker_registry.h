// The coordinator's view of its workers: registration, heartbeats, and losing
// workers that fall silent. Thread-safe. Times are passed in so tests can
// drive the clock.
#ifndef DETOUR_COORDINATOR_WORKER_REGISTRY_H_
#define DETOUR_COORDINATOR_WORKER_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/spec.h"
#include "detour/v1/control_service.pb.h"

namespace detour {

class WorkerRegistry {
 public:
  // A worker is lost when no heartbeat arrived for `silence`.
  WorkerRegistry(absl::Duration silence, absl::Duration heartbeat_interval);

  // Validates and records a worker. An empty id gets one assigned ("w1",
  // "w2", ...). ALREADY_EXISTS when the id belongs to a worker whose session
  // is open; a lost worker's id, or one whose session ended (a worker that
  // restarted within the silence window, even after a clean stop), may be
  // taken again: the new registration replaces the stale one and its token.
  // RESOURCE_EXHAUSTED when kMaxWorkers are registered. INVALID_ARGUMENT
  // names a bad field.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request, absl::Time now);

  // Records a heartbeat. UNAUTHENTICATED for an unknown or replaced token.
  // A lost worker that heartbeats again is alive again.
  absl::StatusOr<std::string> Heartbeat(const std::string& token, const v1::Heartbeat& beat,
                                        absl::Time now);

  // Worker id for a live session token; UNAUTHENTICATED otherwise.
  absl::StatusOr<std::string> WorkerForToken(const std::string& token) const;

  // The control stream of `token`'s session opened / ended.
  void SessionOpened(const std::string& token, absl::Time now = absl::Now());
  void SessionEnded(const std::string& token, absl::Time now = absl::Now());

  // Called (outside the registry's lock, on the calling thread) after every
  // change a job may care about: a registration, a session opening or
  // ending, a worker lost, a heartbeat that changes a worker's job. Set once,
  // before use; must not block.
  void SetListener(std::function<void()> on_change);

  // Called (outside the lock, on the calling thread) after a change of what
  // Records() returns: a registration, a worker lost or heard from again,
  // one forgotten, records restored. Never for a mere heartbeat. Set once,
  // before use; must not block.
  void SetRecordListener(std::function<void()> on_change);

  // Every worker's record for a WorkerDirectory, sorted by id: its
  // registration (what Register recorded) and whether it is lost, without
  // what every heartbeat changes (heartbeat count and time, job, session).
  std::vector<v1::WorkerInfo> Records() const;

  // OK when `record` is fit to restore: a valid id and the fields Register
  // checks within its limits; INVALID_ARGUMENT naming the field otherwise.
  static absl::Status CheckRecord(const v1::WorkerInfo& record);

  // Takes the records a previous leader left (WorkerDirectory::Load) as
  // workers awaiting their reconnection: WORKER_STATE_LOST, session closed,
  // silent since `now` (so forgotten 10 x the silence later unless they
  // register again), with no session token. Their ids stay theirs: an id is
  // never assigned to another worker while its record is here, and the
  // worker registering with its id takes it back. Ids already registered
  // are kept as they are; records that fail CheckRecord, or beyond
  // kMaxWorkers, are logged and skipped. Returns how many were taken.
  int Restore(const std::vector<v1::WorkerInfo>& records, absl::Time now);

  // The coordinator itself did not run for a while (it was paused, or the
  // machine stalled): nobody's silence since `since` counts against them.
  void ForgiveSilence(absl::Time now);

  // Marks workers silent for longer than the limit as lost and forgets
  // workers lost for longer than 10 × the limit (they would re-register);
  // returns the ids newly lost by this call.
  std::vector<std::string> MarkSilentWorkersLost(absl::Time now);

  // Most workers registered at once (lost ones included until forgotten):
  // the spec's limit, so every job that validates can be run.
  static constexpr size_t kMaxWorkers = SpecLimits::kMaxWorkers;
  // Longest region, device, version and address accepted.
  static constexpr size_t kMaxFieldBytes = 256;

  // Snapshot, sorted by worker id.
  std::vector<v1::WorkerInfo> List(bool include_lost) const;

  // Number of workers in `state`.
  int Count(v1::WorkerState state) const;
  uint64_t total_heartbeats() const;

  absl::Duration silence() const { return silence_; }

 private:
  struct Entry {
    v1::WorkerInfo info;
    std::string token;
    absl::Time last_heartbeat;
    // Its session stream is open (set when it opens, cleared when it ends).
    bool connected = false;
    // Taken from a previous leader's records, not registered here yet.
    bool restored = false;
  };

  void Notify() const;
  void NotifyRecords() const;
  absl::StatusOr<v1::RegisterResponse> RegisterLocked(const v1::RegisterRequest& request,
                                                      absl::Time now);
  // Sets `*forgot` when a lost worker was forgotten.
  std::vector<std::string> MarkSilentLocked(absl::Time now, bool* forgot);
  void SetSession(const std::string& token, bool open, absl::Time now);

  const absl::Duration silence_;
  const absl::Duration heartbeat_interval_;
  std::function<void()> listener_;
  std::function<void()> record_listener_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> token_to_worker_ ABSL_GUARDED_BY(mu_);
  uint64_t next_worker_number_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t total_heartbeats_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_WORKER_REGISTRY_H_
