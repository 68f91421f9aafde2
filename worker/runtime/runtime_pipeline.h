// An iteration's pipeline work on one worker: the plan taken (membership,
// replica group, data, K-FAC captures, the work queue's iteration), the
// data node's microbatch starts, every forward, loss and backward as its
// tensor arrives, and the tensors sent on along each route. Tensors that
// belong to work not known yet are kept, within a bound, until it is.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_PIPELINE_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_PIPELINE_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "worker/runtime/runtime_part.h"
#include "worker/runtime/runtime_reduce.h"

namespace detour {

class RuntimePipeline : private RuntimePart {
 public:
  RuntimePipeline(RuntimeShared* shared, RuntimeCore* core, RuntimeReduce* reduce)
      : RuntimePart(shared, core), reduce_(reduce) {}

  void OnPlan(const v1::IterationPlan& plan);
  // A pipeline or all-reduce tensor of the job held (state frames go to
  // RuntimeStateTransfer).
  void OnTensor(const v1::FrameHeader& h, at::Tensor t);

  // The iteration's data, once a data node first needs it.
  absl::Status LoadMicrobatches(const std::vector<uint32_t>& own);
  // Queues the data node's microbatches as forwards that need a slot.
  void QueueStarts(const std::vector<uint32_t>& own);
  // Tensors kept for later (the next iteration's, a newer route's) queue up
  // again; those still not due are kept again.
  void OfferEarly();

 private:
  void StartMicrobatch(uint64_t iteration, uint32_t mb);
  // Forward of `mb` at position `pos` of its route (this node), then on.
  void RunForward(uint32_t mb, int pos, const at::Tensor& input);
  void RunLoss(uint32_t mb, const at::Tensor& hidden);
  void RunBackward(uint32_t mb, int pos, const at::Tensor& grad);
  // A tensor that belongs to work not known yet (the next iteration's plan
  // or a newer route is on the way): kept until that work arrives. What one
  // sender may hold here is bounded where its frames are admitted
  // (FrameAdmission's quota), which refuses a flood's excess to its sender.
  void KeepEarly(const v1::FrameHeader& h, const at::Tensor& t);

  RuntimeReduce* const reduce_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_PIPELINE_H_
