// Step execution on one worker: when the coordinator says step, the
// iteration's remaining K-FAC work runs, the optimiser steps (with the
// job's clipping norm), the timings and the result (microbatches, loss,
// parameter checksum, the stage's checkpoint file when one is due) go to
// the coordinator; a committed checkpoint gets its manifest here.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_STEP_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_STEP_H_

#include "worker/runtime/runtime_bubbles.h"
#include "worker/runtime/runtime_part.h"

namespace detour {

class RuntimeStep : private RuntimePart {
 public:
  RuntimeStep(RuntimeShared* shared, RuntimeCore* core, RuntimeBubbles* bubbles)
      : RuntimePart(shared, core), bubbles_part_(bubbles) {}

  void OnStep(const v1::StepCommand& step);
  void OnCommit(const v1::CommitCheckpoint& commit);

 private:
  // Busy fraction of the iteration: pipeline work, and with K-FAC work.
  void PublishUtilization(const RunningIteration& it, double duration);

  RuntimeBubbles* const bubbles_part_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_STEP_H_
