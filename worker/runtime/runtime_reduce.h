// The end of an iteration's pipeline work on one worker: this replica's
// gradient (and the K-FAC factors to sync) shared with the stage's other
// replicas, summed in rank order, normalised, and the gradient norm sent to
// the coordinator. A membership change mid-iteration puts the local
// gradient back so the survivors can reduce again.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_REDUCE_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_REDUCE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "worker/runtime/runtime_bubbles.h"
#include "worker/runtime/runtime_part.h"

namespace detour {

class RuntimeReduce : private RuntimePart {
 public:
  RuntimeReduce(RuntimeShared* shared, RuntimeCore* core, RuntimeBubbles* bubbles)
      : RuntimePart(shared, core), bubbles_part_(bubbles) {}

  // Once this node's pipeline work is done: shares the local gradient with
  // the replicas (or reduces alone).
  void MaybeFinishLocal();
  // A replica's all-reduce input for the iteration in progress.
  void Offer(const v1::FrameHeader& h, const at::Tensor& t);
  // Undoes the reduction and the scaling of the local gradient (the sum
  // included workers that are gone, and re-runs may add to it).
  absl::Status PutLocalBack();

 private:
  // The stage's gradients, then the pending K-FAC factors of
  // `sync_layers`, as one flat fp32 tensor (the all-reduce payload).
  absl::StatusOr<at::Tensor> FlatGradients(bool visited, const std::vector<int>& sync_layers);
  // Writes a flat payload (FlatGradients' layout) back: the gradients (when
  // `grads`) and the pending factors of the synced layers.
  absl::Status Unflatten(const at::Tensor& flat, bool grads);
  // Sums the replicas' inputs once all are in, then reports the norm.
  void TryReduce();

  RuntimeBubbles* const bubbles_part_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_REDUCE_H_
