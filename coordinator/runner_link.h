// The runner's messages to its members. Each message sent during an
// iteration is kept, so a worker whose session reopens (it reports a
// JobStatus) gets what it may have missed again; a send that fails (no open
// session) makes the worker suspect, not lost (RunnerMembership). An
// iteration plan goes to each member with only its own K-FAC tasks.
// Thread-compatible (the job runner's thread).
#ifndef DETOUR_COORDINATOR_RUNNER_LINK_H_
#define DETOUR_COORDINATOR_RUNNER_LINK_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "coordinator/runner_membership.h"
#include "detour/v1/control_service.pb.h"

namespace detour {

class RunnerLink {
 public:
  // Delivers one message to one worker; an error when it has no session.
  using Sender =
      std::function<absl::Status(const std::string& worker, const v1::CoordinatorMessage& m)>;

  // `membership` and `clock` must outlive the link; `clock` times the
  // suspicion of a worker without a session.
  RunnerLink(Sender send, std::string job_id, RunnerMembership* membership,
             const Clock* clock = &Clock::Real());

  // Sends to a member and keeps the message for a replay. False (the worker
  // becomes suspect) when it has no session.
  bool SendTo(const std::string& id, const v1::CoordinatorMessage& m);
  void SendToAll(const v1::CoordinatorMessage& m);
  // An iteration plan: to every member with only its own bubble tasks
  // (split into granules, a job's tasks run into thousands per iteration).
  void SendPlan(const v1::CoordinatorMessage& m);
  // Tells every member to drop `iteration` (it runs again), with `reason`.
  void AbortIteration(uint64_t iteration, const std::string& reason);
  // Once, not kept (a CancelJob to a worker leaving the job).
  void SendOnce(const std::string& id, const v1::CoordinatorMessage& m);
  // Sends `worker` again what it was sent since the iteration began.
  void Replay(const std::string& worker);
  // A new iteration: forget the kept messages.
  void StartIteration() { sent_.clear(); }

 private:
  Sender send_;
  const std::string job_id_;
  RunnerMembership* const membership_;
  const Clock* const clock_;
  std::map<std::string, std::vector<v1::CoordinatorMessage>> sent_;
};

// Worker `id` as a peer (address, data address, region; no stage).
v1::Peer PeerOf(const std::string& id, const v1::WorkerInfo& info);
// The live members as peers (address, data address, region, stage).
std::vector<v1::Peer> MemberPeers(const RunnerMembership& membership);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_LINK_H_
