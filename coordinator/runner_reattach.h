// Taking over a running job after a coordinator restart (a crash, a
// graceful stop, a leader failover; docs/RUNTIME.md §"Coordinator
// restart"): the stored stages and epoch, the workers that report holding
// the job (JobStatus) within --assign_timeout, the iteration they go on
// from. A part of JobRunner (runner_part.h); the runner's thread only.
#ifndef DETOUR_COORDINATOR_RUNNER_REATTACH_H_
#define DETOUR_COORDINATOR_RUNNER_REATTACH_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/runner_part.h"

namespace detour {

class RunnerElastic;

class RunnerReattach : private RunnerPart {
 public:
  // `elastic` pauses a job left without a worker for some stage; not owned,
  // outlives this part.
  RunnerReattach(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic);

  // Re-attaches to the workers that come back; the job's end when it cannot
  // go on (none came back, they cannot be joined at one iteration:
  // reattach_point.h, its cost model cannot be built). Workers the old
  // coordinator died before sending the step get it first; then the
  // iteration that was in flight is aborted and runs again from its start
  // (next_iteration).
  std::optional<JobEnd> Run();

 private:
  // The old coordinator died between its step messages of
  // `pending.iteration()`: `laggards` (still waiting for it) get that same
  // step. One that does not apply it within --assign_timeout leaves the job
  // (its parameters are a step behind) and is added to `behind`. `status`
  // takes the others' checksums after the step and their new count.
  std::optional<JobEnd> CatchUp(const v1::PendingStep& pending,
                                const std::vector<std::string>& laggards,
                                std::map<std::string, v1::JobStatus>* status,
                                std::vector<std::string>* behind);

  RunnerElastic* const elastic_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_REATTACH_H_
