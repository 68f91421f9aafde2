// What a running job does when a stage loses its last replica, and with it
// its state (elastic.on_stage_loss, docs/RUNTIME.md §"Elastic training"):
// ROLLBACK waits for a worker in every lost stage, then takes the whole job
// back to its newest checkpoint (or to iteration 0); PAUSE waits for the
// lost holder to come back with the state (Readmit); REINITIALIZE lets a
// joiner start the stage afresh (RunnerElastic::Join). Each loss is recorded
// (history, the detour_coordinator_stage_losses metric, the log). A part of
// JobRunner (runner_part.h); the runner's thread only.
#ifndef DETOUR_COORDINATOR_RUNNER_STAGE_LOSS_H_
#define DETOUR_COORDINATOR_RUNNER_STAGE_LOSS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "coordinator/runner_part.h"

namespace detour {

class RunnerElastic;
class RunnerIteration;

class RunnerStageLoss : private RunnerPart {
 public:
  // `elastic` pauses the job while a lost stage has no worker; `iteration`
  // counts the run's progress from the iteration a rollback goes back to.
  // Neither is owned; both outlive this part.
  RunnerStageLoss(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic,
                  RunnerIteration* iteration);

  // `worker`, the last member of `stage`, was just removed. Under
  // STAGE_LOSS_PAUSE it may come back holding the stage's state: it is
  // remembered as the holder and true is returned (it keeps its reservation
  // and is not told to drop the job). False otherwise.
  bool KeepHolder(int stage, const std::string& worker);
  // `stage` lost its last replica `worker` at `iteration`: records the loss
  // of its state and what elastic.on_stage_loss will do about it. Nothing
  // when the job is not elastic or the stage's loss is already recorded.
  void Lost(int stage, const std::string& worker, uint64_t iteration);
  // At an iteration boundary, with stages lost: ROLLBACK and PAUSE pause the
  // job while a lost stage has no worker; then ROLLBACK rolls every member
  // back. REINITIALIZE does nothing here (the joins did it).
  std::optional<JobEnd> Recover();
  // `worker`, not a member, reports holding the job (`status`): the lost
  // holder of a stage back at the iteration the job waits at takes its
  // stage again. Anyone else is ignored.
  void Readmit(const std::string& worker, const v1::JobStatus& status);

 private:
  // Every member rebuilds its stage from the newest checkpoint (or from the
  // seeded parameters at iteration 0): the model is one version again.
  std::optional<JobEnd> Rollback();

  RunnerElastic* const elastic_;
  RunnerIteration* const iteration_;
  std::map<int, std::string> holders_;  // lost stage -> its last worker (STAGE_LOSS_PAUSE)
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_STAGE_LOSS_H_
