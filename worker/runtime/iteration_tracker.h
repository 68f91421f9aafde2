// The pipeline bookkeeping of one iteration on one worker: which microbatch
// tasks this node owes (from the plan's routes), which ran, whether an
// incoming tensor is expected, and — when workers are lost — which
// microbatches freeze and which come back on new routes.
//
// A microbatch's route has an epoch (Route.epoch). Freeze(lost) stops every
// microbatch whose route crosses a lost worker and is not finished here: no
// more of its work is owed, and its tensors of that route are refused from
// then on. Amend(routes) gives frozen microbatches new routes of a newer
// epoch; tensors of the new route that arrive before the amendment are
// "early" (the caller keeps them and offers them again after Amend).
//
// No LibTorch, no threads: the runtime's executor owns it. Unit-tested with
// hand-made plans (tests/runtime/iteration_tracker_test.cc).
#ifndef DETOUR_WORKER_RUNTIME_ITERATION_TRACKER_H_
#define DETOUR_WORKER_RUNTIME_ITERATION_TRACKER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/plan.pb.h"

namespace detour {

class IterationTracker {
 public:
  // `plan` must outlive nothing: routes are copied. `me` = this worker.
  IterationTracker(const v1::IterationPlan& plan, std::string me);

  uint64_t iteration() const { return iteration_; }

  // The route of `mb`, or null when the plan has none or it is frozen.
  const v1::Route* route(uint32_t mb) const;
  // Microbatches this node starts as their data node, in plan order.
  std::vector<uint32_t> Own() const;
  // Stage list of every live route (for the work queue).
  std::map<uint32_t, std::vector<int>> RouteStages() const;

  enum class Verdict {
    kRun,         // expected: run it (now marked applied)
    kUnexpected,  // not this node's hop, or a duplicate: drop and count
    kStale,       // a frozen or replaced route's tensor: drop silently
    kEarly,       // a newer route's tensor before its amendment: keep
  };
  struct Incoming {
    Verdict verdict = Verdict::kUnexpected;
    int hop = 0;
    bool loss = false;  // a forward back at the data node: run the loss
  };
  // Classifies a forward or backward tensor: kRun only for this node's hop
  // of a live route, once, and from the node the route has send it.
  Incoming Accept(const v1::FrameHeader& header);

  // Work that ran here: the forward at the route's position (the data
  // node's start included), the loss (data node), the backward.
  void ForwardRan(uint32_t mb);
  void LossRan(uint32_t mb, double loss, uint64_t tokens);
  void BackwardRan(uint32_t mb, int hop);

  bool ForwardDone(uint32_t mb) const;
  bool BackwardDone(uint32_t mb) const;
  // The smallest microbatch whose backward this node still owes (not
  // frozen); nullopt when none.
  std::optional<uint32_t> FirstBackwardOwed() const;
  // Backward visits of this node (microbatches whose backward ran here).
  int visits() const { return visits_; }
  // Microbatches whose backward reached this node as their data node (they
  // completed), and the loss and tokens of those.
  std::vector<uint32_t> Completed() const;
  double completed_loss() const;
  uint64_t completed_tokens() const;

  // Microbatches not frozen (after the amendment: those that complete).
  int live_microbatches() const;

  // Every task this node owes ran (and no amendment is outstanding).
  bool LocalWorkDone() const;

  struct Frozen {
    std::vector<uint32_t> microbatches;  // frozen by this call
    // Every frozen microbatch (this call's and earlier ones') whose backward
    // or loss ran here.
    std::vector<uint32_t> backward_ran;
    // Routes crossing a lost worker that completed here (this data node)
    // before: not frozen, nothing of them lost.
    std::vector<uint32_t> completed;
  };
  // Freezes every unfinished microbatch whose route crosses a worker in
  // `lost` (or one lost before in this iteration) and sets the membership
  // epoch. Until Amend for that epoch,
  // LocalWorkDone is false (re-runs may still come to this node).
  Frozen Freeze(const std::set<std::string>& lost, uint64_t epoch);
  // New routes for frozen microbatches, all of `epoch` (the freeze's).
  // INVALID_ARGUMENT for a route of a microbatch that is not frozen, of
  // another epoch, or through a lost worker; FAILED_PRECONDITION for an
  // amendment of another epoch than the last freeze.
  absl::Status Amend(uint64_t epoch, const std::vector<v1::Route>& routes);

  uint64_t epoch() const { return epoch_; }
  bool awaiting_amendment() const { return awaiting_amendment_; }
  const std::set<std::string>& lost() const { return lost_; }

 private:
  struct Mb {
    v1::Route route;
    bool frozen = false;
    bool forward = false;   // this node's forward ran
    bool loss = false;      // the loss ran (data node)
    bool backward = false;  // this node's backward ran
    double loss_value = 0;
    uint64_t tokens = 0;
    std::set<std::string> applied;  // "direction/hop" tensors taken
    int position = -1;              // this node's position on the route, -1 = none
  };
  void SetRoute(Mb& m, const v1::Route& route);
  // This node's work on `m` is finished.
  bool Finished(const Mb& m) const;

  const std::string me_;
  const uint64_t iteration_;
  std::map<uint32_t, Mb> mbs_;
  std::vector<uint32_t> plan_order_;
  int visits_ = 0;
  uint64_t epoch_ = 0;
  bool awaiting_amendment_ = false;
  std::set<std::string> lost_;
};

// The workers `me` sends tensors to in `plan`: on each route it is on, the
// next one (activations; the last stage's go back to the data node, which
// computes the loss) and the one before (gradients; the data node's go to
// the last stage), and `group`, its replicas (the all-reduce). Sorted, once
// each, `me` left out.
std::vector<std::string> PlanSendTargets(const v1::IterationPlan& plan, const std::string& me,
                                         const std::vector<std::string>& group);

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_ITERATION_TRACKER_H_
