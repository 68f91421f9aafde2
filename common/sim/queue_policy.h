// The rule a node uses to pick its next piece of pipeline work, shared by the
// event simulator (common/sim/event_simulator.h) and the worker's executor
// (worker/runtime/work_queue.h), so a plan is judged under the order the
// workers really follow.
//
// Each node runs one task at a time. Among the tasks that are ready (their
// input arrived) and eligible, the policy picks:
//  * kArrival: the one that became ready first (FIFO), whatever its kind;
//  * kBackwardFirst: loss and backward work first (it frees memory), then
//    forward work, each in the order it became ready.
// Ties (same ready time) go to the lower sequence number, i.e. the order in
// which the node learned of the work.
//
// Memory: a forward takes one of the node's activation slots when it starts
// and the same microbatch's backward on that node returns it. A forward that
// would exceed the slots waits — unless it is a swap visit (its stage is
// below the highest stage the route reached before), which may always start.
// That exception makes every plan deadlock-free under any timing: a waiting
// forward then always climbs to a higher stage than any slot its microbatch
// holds, so waits cannot form a cycle. It oversubscribes a node by at most
// the swaps routed through it.
//
// Header-only, no state: thread-safe.
#ifndef DETOUR_COMMON_SIM_QUEUE_POLICY_H_
#define DETOUR_COMMON_SIM_QUEUE_POLICY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace detour::sim {

enum class QueuePolicy : uint8_t { kArrival, kBackwardFirst };

enum class WorkKind : uint8_t { kForward, kLoss, kBackward };

// What the policy looks at of one ready task.
struct ReadyWork {
  WorkKind kind = WorkKind::kForward;
  // When the task became ready (the simulator's clock; the worker uses its
  // arrival counter, so `seq` alone orders its work).
  double ready = 0;
  int64_t seq = 0;
};

// True when `a` runs before `b` under `policy`; both must be eligible.
inline bool RunsBefore(QueuePolicy policy, const ReadyWork& a, const ReadyWork& b) {
  if (policy == QueuePolicy::kBackwardFirst) {
    const bool fa = a.kind == WorkKind::kForward;
    const bool fb = b.kind == WorkKind::kForward;
    if (fa != fb) return fb;
  }
  if (a.ready != b.ready) return a.ready < b.ready;
  return a.seq < b.seq;
}

// Whether the forward at position `pos` of a route visiting `stages` (stage
// 0 first) must wait for a free memory slot: the data node's start and every
// visit above the route's frontier do; swap visits do not (see above).
inline bool ForwardNeedsSlot(const std::vector<int>& stages, int pos) {
  int frontier = 0;
  for (int i = 0; i < pos && i < static_cast<int>(stages.size()); ++i) {
    if (stages[i] > frontier) frontier = stages[i];
  }
  return pos == 0 || pos >= static_cast<int>(stages.size()) || stages[pos] > frontier;
}

inline const char* QueuePolicyName(QueuePolicy policy) {
  return policy == QueuePolicy::kBackwardFirst ? "backward-first" : "arrival";
}

// "arrival" / "fifo" or "backward-first".
inline absl::StatusOr<QueuePolicy> ParseQueuePolicy(absl::string_view name) {
  if (name == "arrival" || name == "fifo") return QueuePolicy::kArrival;
  if (name == "backward-first" || name == "backward_first") return QueuePolicy::kBackwardFirst;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown queue policy \"", name, "\" (arrival, backward-first)"));
}

}  // namespace detour::sim

#endif  // DETOUR_COMMON_SIM_QUEUE_POLICY_H_
