// Taking over a running job after a coordinator restart (a crash, a
// graceful stop, a leader failover; docs/RUNTIME.md §"Coordinator
// restart"): the stored stages and epoch, the workers that report holding
// the job (JobStatus) within --assign_timeout, the iteration they go on
// from. A part of JobRunner (runner_part.h); the runner's thread only.
#ifndef DETOUR_COORDINATOR_RUNNER_REATTACH_H_
#define DETOUR_COORDINATOR_RUNNER_REATTACH_H_

#include <optional>

#include "coordinator/runner_part.h"

namespace detour {

class RunnerElastic;

class RunnerReattach : private RunnerPart {
 public:
  // `elastic` pauses a job left without a worker for some stage; not owned,
  // outlives this part.
  RunnerReattach(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic);

  // Re-attaches to the workers that come back; the job's end when it cannot
  // go on (none came back, they stopped at different iterations, its cost
  // model cannot be built). The iteration that was in flight is aborted and
  // runs again from its start (next_iteration).
  std::optional<JobEnd> Run();

 private:
  RunnerElastic* const elastic_;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_REATTACH_H_
