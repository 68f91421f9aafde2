// Whether this coordinator may serve JobService and the workers' control
// calls, and where callers go when it may not. A coordinator without an
// election (one coordinator, files or etcd without peers) is always open;
// with one it is open only while it leads and its lease is surely alive
// (`lease_alive`, checked on every call so a deposed or paused leader stops
// at once, before its keep-alive thread notices). A closed gate answers
// UNAVAILABLE naming the leader in the message and in the trailing metadata
// `detour-leader` (host:port), which clients follow. Thread-safe.
#ifndef DETOUR_COORDINATOR_LEADER_GATE_H_
#define DETOUR_COORDINATOR_LEADER_GATE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/net/leader_redirect.h"
#include "grpcpp/server_context.h"

namespace detour {

class LeaderGate {
 public:
  // Without `lease_alive`: open for good (no election). With it: closed
  // until Lead(), then open while `lease_alive()`.
  explicit LeaderGate(std::function<bool()> lease_alive = nullptr);

  // This coordinator leads in `term` (> 0) and has loaded the jobs.
  void Lead(int64_t term);
  // This coordinator follows (or lost its lease): `leader` is the leader's
  // address as last observed ("" = none known).
  void Follow(const std::string& leader);

  // When open, the term to stamp on messages to workers (0 without an
  // election); -1 when closed.
  int64_t OpenTerm() const;
  bool IsOpen() const { return OpenTerm() >= 0; }
  bool elected() const { return static_cast<bool>(lease_alive_); }
  std::string leader() const;

  // OK when open; else UNAVAILABLE naming the leader, with the trailing
  // metadata set on `context` (may be null).
  absl::Status Check(grpc::ServerContextBase* context, const char* call) const;

 private:
  const std::function<bool()> lease_alive_;
  mutable absl::Mutex mu_;
  int64_t term_ ABSL_GUARDED_BY(mu_) = 0;  // > 0 while leading
  std::string leader_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_LEADER_GATE_H_
