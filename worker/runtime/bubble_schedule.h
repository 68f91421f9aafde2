// Which K-FAC bubble task a worker runs next (docs/KFAC.md §Runtime): this
// node's tasks of the iteration's plan, in plan order with the serial ones
// last, and the readiness rules — curvature after its microbatch's forward
// (A) or backward (B) ran here, after every earlier curvature task of the
// same layer and kind (factor sums accumulate in plan order, so the result
// does not depend on timing), and once the layer's previous refresh is
// finalised; an inversion once no curvature of the same or an earlier
// refresh of its layer is left and its factors are not waiting for the
// all-reduce. Persists across iterations per job (the newest refresh each
// layer inverted).
//
// No LibTorch, no threads: the runtime's executor owns it and runs the tasks.
#ifndef DETOUR_WORKER_RUNTIME_BUBBLE_SCHEDULE_H_
#define DETOUR_WORKER_RUNTIME_BUBBLE_SCHEDULE_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "detour/v1/plan.pb.h"
#include "worker/runtime/iteration_tracker.h"

namespace detour {

class BubbleSchedule {
 public:
  // Layers [begin, end) of this node's stage; `kfac`: the job uses K-FAC.
  BubbleSchedule(bool kfac, int layer_begin, int layer_end)
      : kfac_(kfac), layer_begin_(layer_begin), layer_end_(layer_end) {}

  // Takes this node's tasks of `plan` (the previous iteration's are
  // forgotten). Fills `capture` with the curvature microbatches whose block
  // inputs and output gradients must be kept. INVALID_ARGUMENT for a task
  // this node cannot run (no K-FAC, a layer it does not hold, a microbatch
  // without a route, an unknown kind). `replicated`: the stage has replicas
  // (factors sync only then).
  absl::Status Take(const v1::IterationPlan& plan, const std::string& me, bool replicated,
                    std::vector<uint32_t>* capture);

  // The next task to run while the executor is idle, or null. Serial tasks
  // only once `pipeline_done`.
  const v1::BubbleTask* Next(const IterationTracker& tracker, bool pipeline_done,
                             bool waiting_step) const;

  // At step end (or before the all-reduce): the next task among those
  // `wanted` selects — the first ready wanted one, else the first ready
  // inversion (it may unblock the next refresh's curvature). kDone when no
  // wanted task is left, kStuck (with the first wanted one in `task`) when
  // wanted tasks remain but none can run.
  enum class Drain { kTask, kDone, kStuck };
  Drain NextToDrain(const IterationTracker& tracker, bool waiting_step,
                    const std::function<bool(const v1::BubbleTask&)>& wanted,
                    const v1::BubbleTask** task) const;

  // Removes a task returned by Next/NextToDrain and returns it.
  v1::BubbleTask Remove(const v1::BubbleTask* task);
  // Records a finished inversion (it finalises its layer's refresh).
  void Inverted(const v1::BubbleTask& task);
  // Forgets the curvature tasks of a frozen microbatch.
  void DropMicrobatch(uint32_t mb);

  const std::vector<int>& sync_layers() const { return sync_layers_; }
  bool SyncsLayer(int layer) const;
  bool empty() const { return tasks_.empty(); }

  static std::string Name(const v1::BubbleTask& t);
  static bool IsCurvature(const v1::BubbleTask& t);
  static bool IsInversion(const v1::BubbleTask& t);

 private:
  bool Ready(const v1::BubbleTask& t, const IterationTracker& tracker, bool waiting_step) const;

  const bool kfac_;
  const int layer_begin_;
  const int layer_end_;
  std::list<v1::BubbleTask> tasks_;
  std::vector<int> sync_layers_;
  std::map<int, uint64_t> finalized_refresh_;  // layer -> newest refresh inverted
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_BUBBLE_SCHEDULE_H_
