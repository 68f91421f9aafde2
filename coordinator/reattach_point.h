// Where a job goes on after a coordinator restart (docs/RUNTIME.md,
// "Coordinator restart"), from what its workers report once their sessions
// reopen (JobStatus) and the step the old coordinator wrote before sending it
// (Job.pending_step).
//
// Workers normally report one count of completed iterations. They report two,
// N and N + 1, when the old coordinator died between its step messages of
// iteration N: a worker that applied a step cannot take it back, so the ones
// at N (still waiting for it) get that same step and the job goes on at N + 1.
//
// Pure functions; thread-safe.
#ifndef DETOUR_COORDINATOR_REATTACH_POINT_H_
#define DETOUR_COORDINATOR_REATTACH_POINT_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/job_service.pb.h"

namespace detour {

struct ReattachPoint {
  // The iteration the job runs next.
  uint64_t next_iteration = 0;
  // Workers one step behind the others, to be sent `pending_step` first
  // (sorted).
  std::vector<std::string> laggards;
};

// `status`: each member's report (at least one); `pending`: the stored step
// of the iteration in flight, or null. FAILED_PRECONDITION, saying why, when
// the workers cannot go on together: counts more than one apart, or one
// apart without the step that parts them (no pending step of iteration N, a
// worker at N that is not waiting for a step, or one at another epoch than
// the step's).
absl::StatusOr<ReattachPoint> FindReattachPoint(const std::map<std::string, v1::JobStatus>& status,
                                                const v1::PendingStep* pending);

// The step message `pending` stood for.
v1::CoordinatorMessage StepMessage(const std::string& job_id, const v1::PendingStep& pending);

// Every stage's members hold the same parameters: `checksums` by worker,
// `stages` by worker (a worker without a stage is left out).
// FAILED_PRECONDITION naming the first two that differ: "replicas of stage S
// <differ> (worker X differs from Y)", `differ` saying when (e.g. "differ
// after iteration 4").
absl::Status CheckReplicasAgree(const std::map<std::string, uint64_t>& checksums,
                                const std::map<std::string, int>& stages,
                                const std::string& differ);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_REATTACH_POINT_H_
