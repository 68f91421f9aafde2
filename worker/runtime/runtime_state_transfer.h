// A stage's state between replicas on one worker: a live replica packs its
// parameters, optimiser moments and K-FAC state (stage_state.h) and streams
// them to a joining worker between iterations; the joining side checks the
// sender, loads the state and reports its parameter checksum.
#ifndef DETOUR_WORKER_RUNTIME_RUNTIME_STATE_TRANSFER_H_
#define DETOUR_WORKER_RUNTIME_RUNTIME_STATE_TRANSFER_H_

#include "worker/runtime/runtime_part.h"

namespace detour {

class RuntimeStateTransfer : private RuntimePart {
 public:
  RuntimeStateTransfer(RuntimeShared* shared, RuntimeCore* core) : RuntimePart(shared, core) {}

  // A live replica sends this stage's state to a joining one (between
  // iterations: the state is the one after the last step).
  void OnSendState(const v1::SendState& request);
  // The joining side: the state of the replica we join, checked and loaded.
  void OnState(const v1::FrameHeader& h, const at::Tensor& bytes);
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_RUNTIME_STATE_TRANSFER_H_
