// K-FAC work in the pipeline's idle gaps (pipefisher.md §3–4): the bubble
// planner. No LibTorch; runs in the coordinator and in detour-sim.
//
// Every node holding transformer blocks owes, per K-FAC refresh and per block:
//   CURVATURE_A(layer, mb)  after the forward of mb on that node (module "")
//   CURVATURE_B(layer, mb)  after the backward of mb on that node (module "")
//   SYNC_FACTORS(layer)     replicated stages with sync on: after every
//                           replica's curvature of the layer; runs in the
//                           iteration's all-reduce (placed at its end, serial);
//                           for refresh q+1 only once q inverted the layer on
//                           every replica in an earlier iteration and has no
//                           bubble inversion of it in this one
//   INVERT_A(layer, m), INVERT_B(layer, m) for each projection m: after all
//                           curvature (and sync) of the layer; for refresh
//                           q+1 after q's inversions of the layer there
// The planner is stateful: work that does not fit an iteration's gaps spills
// into the following iterations. Refreshes overlap, at most two in flight:
// refresh q+1 joins as soon as q is in flight and collects its curvature of a
// layer on a node only after q's first inversion of that layer there (the
// worker's K-FAC finalises the layer's pending factor sums at that inversion;
// in the same iteration: from its end), and places its inversions of a layer
// once q's inversions of it on the node are placed (rule 2'; the worker
// stages inverses per refresh and Kfac::Activate(q) promotes q's only) —
// with a fixed interval only in iterations after q's activation. Refresh
// q's new inverses take effect on all
// workers at once at the step of the iteration in which its last item ends
// (IterationBubbles::activate_refresh). A microbatch feeds at most one refresh
// per layer and kind (the older refresh takes the lowest ids). The refresh
// interval is the number of iterations between two activations (the first:
// up to and including its activation). An item goes serial at step end
// (serial = true; counted as overhead) when, in `serial_after` iterations in
// which it was ready, no gap of its node after its ready time was as long as
// duration·(1+slack) (other K-FAC work not counted: an item crowded out by
// other K-FAC work spills instead). With a fixed KfacSpec.refresh_interval K,
// refreshes are activated exactly every K iterations: everything refresh q
// still owes in the K-th iteration after q-1's activation runs serially there
// (also when its work ended earlier, it is activated there); q+1 joins in that
// last iteration. KFAC_PLACEMENT_SERIAL puts all of a refresh's work at the
// end of one iteration (every iteration, or the K-th with a fixed interval),
// without overlap.
// Serial work starts at end_s, in the order curvature (older refresh first),
// sync, inversions (older refresh first).
//
// Curvature microbatches: on each node, the first `curvature_microbatches`
// microbatches (lowest ids) of the iteration whose route visits the node and
// that still owe curvature for the current refresh. A microbatch's A and B
// items are placed in the iteration the microbatch runs in (its saved inputs
// and output gradients live only there); what cannot be placed there is owed
// by later microbatches. A node that no microbatch visits for `serial_after`
// iterations (or in the last iteration of a fixed interval) contributes fewer
// curvature microbatches to the refresh rather than stall it.
//
// Placement: greedy first-fit in time order per node, priority the next part
// of what was begun (a curvature microbatch, then an inversion), the older
// refresh's CURVATURE_A, CURVATURE_B, the next refresh's CURVATURE_A,
// CURVATURE_B (with a fixed interval: after the older refresh's inversions),
// the older refresh's INVERT_A, INVERT_B, the next refresh's INVERT_A,
// INVERT_B (layer order within a kind, then microbatch resp. projection,
// then part); an item is placed at t when its
// dependencies are met by t and t + duration·(1+slack) <= gap end; the next
// item may start at t + duration·(1+slack).
// Granules: an item whose estimated time exceeds KfacSpec.max_granule_ms is
// split into parts (common/kfac_workload.h: curvature by projection group,
// an inversion by units of the blocked algorithm; the fewest parts within
// the cap). Parts of an item are placed in order, each its own task
// (BubbleTask.part/num_parts); an inversion's parts may spread over
// iterations, a curvature microbatch's must end in its iteration (serially
// when its remaining parts find no gap). Tasks are emitted per node (workload
// order), bubble tasks before serial ones, by planned start, then refresh.
// Details and formulas: docs/KFAC.md §Planner.
//
// Thread-compatible.
#ifndef DETOUR_COORDINATOR_PLANNER_BUBBLE_PLANNER_H_
#define DETOUR_COORDINATOR_PLANNER_BUBBLE_PLANNER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/kfac_workload.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/plan.h"
#include "detour/v1/plan.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour::planner {

// The projections of a block (kfac::ModuleNames()): q k v o gate up down.
const std::vector<std::string>& KfacModules();

// Durations of one block's K-FAC work on one node, in seconds.
struct KfacLayerCost {
  double curvature_a_s = 0;  // one microbatch, every projection's A
  double curvature_b_s = 0;  // one microbatch, every projection's B
  // Per projection, indexed like KfacModules().
  std::vector<double> invert_a_s;
  std::vector<double> invert_b_s;
  double precondition_s = 0;  // at every step, serial
  double sync_s = 0;          // factor all-reduce among the replicas (network:
                              // EstimateKfacLayerCost leaves it 0)
  // The block's dimensions, from which an item's parts and their share of
  // its time follow (kfac::BlockWorkload). All zero: items are never split.
  kfac::BlockShape shape;
};

// FLOP-count estimate of KfacLayerCost for one block (common/kfac_workload.h)
// with `tokens_per_microbatch` tokens on a node doing `flops_per_s` (the cost
// model's effective speed), documented in docs/KFAC.md. sync_s is left 0:
// StageSyncSeconds prices it from the links.
KfacLayerCost EstimateKfacLayerCost(const kfac::BlockWorkload& block, double tokens_per_microbatch,
                                    double flops_per_s);
KfacLayerCost EstimateKfacLayerCost(const v1::ModelShape& shape, double tokens_per_microbatch,
                                    double flops_per_s);

// KfacLayerCost.sync_s of one block for a stage held by `group` (cost-model
// node indices): what `sync` adds to the stage's all-reduce in the runtime
// (kfac::SyncSeconds over the group's slowest link).
double StageSyncSeconds(const sim::CostModel& cost, const std::vector<int>& group,
                        const kfac::BlockWorkload& block, kfac::ReplicaSync sync);

struct KfacNodeWork {
  std::string node_id;
  int stage = -1;
  std::vector<int> layers;           // global block indices held
  std::vector<KfacLayerCost> costs;  // indexed like layers
};

struct KfacWorkload {
  // Indexed like the timelines' nodes (e.g. cluster node index); nodes that
  // hold no blocks have empty `layers`.
  std::vector<KfacNodeWork> nodes;
};

// One node's compute during an iteration.
struct BusyInterval {
  enum class Kind { kForward, kBackward, kLoss, kOther };
  double start_s = 0;
  double end_s = 0;
  Kind kind = Kind::kOther;
  int microbatch = -1;
};

struct NodeTimeline {
  std::vector<BusyInterval> busy;  // sorted by start, non-overlapping
};

// One iteration as seen by the planner. Gaps are [0, end_s) minus busy time;
// end_s is the iteration's end before the step (all-reduce included).
struct IterationTimeline {
  double end_s = 0;
  std::vector<NodeTimeline> nodes;  // indexed like KfacWorkload::nodes
};

// Timeline of a simulated iteration (SimResult with record_timeline): forward,
// backward and loss are pipeline work; the gradient all-reduce is kOther (busy:
// the worker is in its collective). end_s = iteration_time_s.
IterationTimeline TimelineFromSimulation(const sim::SimResult& result);

// Timeline from workers' timing reports (TaskTiming start/duration relative
// to each worker's plan receipt); `node_ids` gives the index of each node.
// FORWARD/BACKWARD/LOSS are pipeline work, ALLREDUCE/OPTIMIZER kOther; BUBBLE
// tasks are left out (they are this planner's own work, re-placed each
// iteration). Overlaps are trimmed. end_s = max iteration_time_s.
// Reports of unknown nodes are ignored; missing nodes get empty timelines.
IterationTimeline TimelineFromReports(const std::vector<v1::TimingReport>& reports,
                                      const std::vector<std::string>& node_ids);

struct IterationBubbles {
  // The iteration's tasks for every node (bubble and serial ones).
  std::vector<v1::BubbleTask> tasks;
  // Refresh whose inverses take effect at this iteration's step.
  std::optional<uint64_t> activate_refresh;
  // Per node: K-FAC seconds inside gaps; the serial span after end_s (serial
  // work plus waiting for replicas to sync at once); the preconditioning of
  // every step (sum of the layers' precondition_s, no task emitted: the
  // worker does it in its step).
  std::vector<double> bubble_s;
  std::vector<double> serial_s;
  std::vector<double> precondition_s;
  // Iteration time with K-FAC: end_s + max over nodes (serial_s + precondition_s).
  double iteration_time_s = 0;
  // Busy (pipeline: forward, backward, loss) fraction of nodes holding blocks
  // over end_s, and the same plus all K-FAC compute (bubble, serial,
  // precondition; not the factor sync, which is network time) over
  // iteration_time_s.
  double utilization_before = 0;
  double utilization_after = 0;
};

struct BubblePlannerOptions {
  // Iterations without a gap large enough before an item goes serial.
  int serial_after = 2;
};

class BubblePlanner {
 public:
  // `kfac` defaulted (NormalizeJobSpec); max_granule_ms 0 = no cap (items
  // are never split). INVALID_ARGUMENT for a node with costs not matching
  // its layers (or invert_* not sized like KfacModules()), negative or
  // non-finite durations or dimensions, negative slack or max_granule_ms,
  // serial_after < 1.
  static absl::StatusOr<BubblePlanner> Create(KfacWorkload workload, const v1::KfacSpec& kfac,
                                              BubblePlannerOptions options = {});

  // Places work into iteration `iteration`'s timeline. `plan` gives the
  // routes (which microbatches visit which node) in index form. Iterations
  // must be planned in increasing order (gaps allowed). INVALID_ARGUMENT when
  // the timeline has another node count than the workload, or the iteration
  // does not increase.
  //
  // `close_window`: the iteration ends with a checkpoint. Everything the
  // oldest refresh still owes finishes in it (serially where the gaps do not
  // suffice, like the last iteration of a fixed interval) and the refresh is
  // activated at its step; a younger refresh in flight is abandoned (the
  // curvature it collected stays in the workers' pending sums and counts
  // toward the next refresh; the next refresh takes its number, and with it
  // what it finalised and staged on the workers) and none joins. The planner's state after it is
  // then that of a new planner (refresh numbers and statistics aside), so a
  // job resumed from the checkpoint plans the same tasks as one that ran on.
  absl::StatusOr<IterationBubbles> PlanIteration(uint64_t iteration, const sim::Plan& plan,
                                                 const IterationTimeline& timeline,
                                                 bool close_window = false);

  // The job's membership changed (workers lost, joined or moved between
  // stages): replaces the workload, whose nodes may differ in number, stage
  // and layers (a node without layers holds no stage). Refreshes in flight
  // are abandoned — their curvature stays in the workers' pending sums and
  // counts toward the next refresh — and the next planned iteration starts a
  // new one; refresh numbers go on increasing. INVALID_ARGUMENT for a bad
  // workload (as Create); nothing changes then.
  absl::Status SetWorkload(KfacWorkload workload);

  // Replaces the cost estimates (e.g. after measuring speeds); the nodes,
  // their stages and layers must stay the same (INVALID_ARGUMENT otherwise,
  // nothing changes). Work already queued is re-timed with the new costs.
  absl::Status UpdateCosts(const KfacWorkload& workload);

  // Refreshes completed (activated) so far, and the iterations between
  // consecutive activations (the first: up to and including its activation).
  uint64_t completed_refreshes() const;
  // The number of the refresh activated last (none before the first). Not
  // completed_refreshes() - 1: a membership change abandons numbers.
  std::optional<uint64_t> last_activated_refresh() const;
  const std::vector<int>& refresh_intervals() const;
  // Mean of refresh_intervals(), 0 before the first.
  double mean_refresh_interval() const;

  BubblePlanner(BubblePlanner&&) noexcept;
  BubblePlanner& operator=(BubblePlanner&&) noexcept;
  ~BubblePlanner();

 private:
  struct State;          // bubble_state.h
  struct IterationPass;  // bubble_state.h: one PlanIteration in phases
  explicit BubblePlanner(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_BUBBLE_PLANNER_H_
