// Why a pending job has not started, in words a user reads in `detourctl
// watch`: how many workers it needs against how many are registered and idle,
// and which pinned workers are missing. A job that the registered workers
// could never hold (too few of them, or a pinned worker not registered at
// all) is flagged: it starts only once more workers register. Such a job is
// not refused at submit, because workers may register at any time (a
// coordinator usually starts before its workers). Pure functions.
#ifndef DETOUR_COORDINATOR_PENDING_REASON_H_
#define DETOUR_COORDINATOR_PENDING_REASON_H_

#include <cstddef>
#include <string>
#include <vector>

#include "detour/v1/control_service.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

// Workers a (normalized) spec needs: its data nodes plus the replicas of
// every later stage.
size_t WorkersNeeded(const v1::JobSpec& spec);

// The message for a job that cannot take its workers from `free` (the idle,
// unreserved ones). `registered` holds every worker not marked lost.
std::string PendingReason(const v1::JobSpec& spec, const std::vector<v1::WorkerInfo>& registered,
                          const std::vector<v1::WorkerInfo>& free);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_PENDING_REASON_H_
