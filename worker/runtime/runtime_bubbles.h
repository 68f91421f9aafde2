// K-FAC work in the pipeline's bubbles on one worker (docs/KFAC.md): which
// task runs while the executor is idle, running one, and draining what is
// left of an iteration's tasks when the pipeline work no longer waits.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_BUBBLES_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_BUBBLES_H_

#include <functional>

#include "worker/runtime/runtime_part.h"

namespace detour {

class RuntimeBubbles : private RuntimePart {
 public:
  RuntimeBubbles(RuntimeShared* shared, RuntimeCore* core) : RuntimePart(shared, core) {}

  // The next bubble task to run while idle, or null. Serial ones only once
  // this node's pipeline work is done.
  const v1::BubbleTask* Next();
  // Runs one task (returned by the schedule) and removes it. False when the
  // job failed.
  bool Run(const v1::BubbleTask* task, bool at_step_end);
  // Runs this iteration's bubble tasks now, until none that `wanted`
  // selects is left. `factors_final`: the step arrived, so synced factors
  // are final and their layers may be inverted (before it, a membership
  // change could still redo the all-reduce). False when the job failed.
  bool Drain(const std::function<bool(const v1::BubbleTask&)>& wanted, bool factors_final);
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_BUBBLES_H_
