// Membership and epochs on one worker mid-iteration (docs/RUNTIME.md
// §"Elastic training"): when the coordinator reports lost workers, the
// microbatches whose routes crossed them freeze, the local gradient is put
// back, the replica group and the epoch change, and the coordinator hears
// what ran here; its amended routes bring the frozen microbatches back.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_MEMBERSHIP_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_MEMBERSHIP_H_

#include "worker/runtime/runtime_part.h"
#include "worker/runtime/runtime_pipeline.h"
#include "worker/runtime/runtime_reduce.h"

namespace detour {

class RuntimeMembership : private RuntimePart {
 public:
  RuntimeMembership(RuntimeShared* shared, RuntimeCore* core, RuntimePipeline* pipeline,
                    RuntimeReduce* reduce)
      : RuntimePart(shared, core), pipeline_(pipeline), reduce_(reduce) {}

  // Workers were lost mid-iteration: freeze what crossed them, reduce again
  // among the survivors, tell the coordinator what ran here.
  void OnMembership(const v1::MembershipChange& change);
  // New routes for frozen microbatches (possibly none).
  void OnReroute(const v1::RouteAmendment& amendment);

 private:
  RuntimePipeline* const pipeline_;
  RuntimeReduce* const reduce_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_MEMBERSHIP_H_
