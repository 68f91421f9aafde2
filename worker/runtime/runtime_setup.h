// Taking a stage on one worker: a StageAssignment builds the stage from the
// job's spec (fresh, imported weights, a checkpoint, or waiting for a live
// replica's state), its optimiser and K-FAC state, the data node's tokens,
// the peer transport and what incoming frames are admitted, then tells the
// coordinator the stage is ready. A repeated assignment is answered again;
// one for another stage or job drops the old one first.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_SETUP_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_SETUP_H_

#include "absl/status/status.h"
#include "worker/runtime/job_runtime.h"
#include "worker/runtime/runtime_part.h"

namespace detour {

class RuntimeSetup : private RuntimePart {
 public:
  RuntimeSetup(RuntimeShared* shared, RuntimeCore* core, const JobRuntime::JobFn* set_job)
      : RuntimePart(shared, core), set_job_(*set_job) {}

  void OnAssignment(const v1::StageAssignment& a);

 private:
  absl::Status Build(const v1::StageAssignment& a);

  const JobRuntime::JobFn& set_job_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_SETUP_H_
