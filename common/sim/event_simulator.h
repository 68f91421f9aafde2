// Discrete-event simulation of one training iteration on a cluster: every
// microbatch runs forward along its route, its loss on its data node, its
// backward along the reversed route; then each stage's replicas all-reduce.
//
// Model (docs/SCHEDULER.md §"Simulator"):
//  * One compute server per node, non-preemptive. Among ready tasks a node
//    picks by SimOptions::queue_policy (common/sim/queue_policy.h, the rule
//    the workers follow): arrival order by default, or backward/loss work
//    first.
//  * Memory: a node holds at most memory_slots microbatches. A forward task
//    takes a slot when it starts and the microbatch's backward on that node
//    returns it; forward work waits while no slot is free, except swap
//    visits, which keeps every plan deadlock-free (queue_policy.h).
//  * Transfers: latency + bytes/bandwidth. With the default contention model
//    kSenderUplink a node's outgoing transfers share its uplink one at a time
//    (FIFO, each occupying it for bytes/bandwidth); latency is propagation and
//    occupies nothing. kPerLink serialises per ordered node pair; kNone lets
//    every transfer run unhindered.
//  * Events at the same instant are all applied before any node picks its
//    next task, so results do not depend on event insertion order.
//  * After its last backward, each stage runs a ring all-reduce (CostModel::
//    AllReduceTime); the iteration ends when every stage has finished.
#ifndef DETOUR_COMMON_SIM_EVENT_SIMULATOR_H_
#define DETOUR_COMMON_SIM_EVENT_SIMULATOR_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "common/sim/queue_policy.h"

namespace detour::sim {

enum class Contention { kNone, kPerLink, kSenderUplink };

struct SimOptions {
  Contention contention = Contention::kSenderUplink;
  // Which ready task a node runs next (common/sim/queue_policy.h). The
  // default is the workers' default.
  QueuePolicy queue_policy = QueuePolicy::kArrival;
  // Keep per-node activity lists (timelines, idle intervals). Off for the
  // planner's inner loop, which needs only the times.
  bool record_timeline = true;
};

enum class ActivityKind {
  kForward,
  kBackward,
  kLoss,
  kSendActivation,
  kSendGradient,
  kAllReduce,
};
const char* ActivityKindName(ActivityKind kind);

// Something a node did over [start_s, end_s). For sends, the interval is the
// uplink occupancy (the payload arrives `latency` later at `peer`).
struct Activity {
  double start_s = 0;
  double end_s = 0;
  ActivityKind kind = ActivityKind::kForward;
  int microbatch = -1;
  int stage = -1;
  int peer = -1;
};

struct RouteTiming {
  int microbatch = 0;
  double start_s = 0;     // First forward starts on the data node.
  double loss_end_s = 0;  // Loss finished.
  double end_s = 0;       // Backward on the data node finished.
};

struct SimResult {
  // End of the last stage's all-reduce.
  double iteration_time_s = 0;
  // End of the last backward (before the all-reduce), the reference's metric.
  double pipeline_time_s = 0;
  // Compute-busy fraction of (assigned nodes × iteration_time_s).
  double utilization = 0;
  // Same over pipeline_time_s.
  double pipeline_utilization = 0;
  // Per node (all cluster nodes; unused ones stay empty / zero).
  std::vector<double> busy_s;
  std::vector<std::vector<Activity>> compute;  // record_timeline only
  std::vector<std::vector<Activity>> sends;    // record_timeline only
  // Gaps between compute tasks within [0, pipeline_time_s], assigned nodes
  // only; record_timeline only.
  std::vector<std::vector<std::pair<double, double>>> idle;
  // Indexed like Plan::routes.
  std::vector<RouteTiming> routes;
  // Per stage: last backward finished, and the all-reduce duration.
  std::vector<double> stage_done_s;
  std::vector<double> allreduce_s;
  // Collisions: tasks that had to wait for their node's compute (it was busy
  // when they arrived, or another ready task went first). A plan without
  // collisions runs the same under every queue policy. queue_wait_s: the
  // seconds all tasks waited after becoming ready, memory waits included
  // (a data node's later microbatches wait for its slots by design).
  int collisions = 0;
  double queue_wait_s = 0;
  // Events processed (transfers arriving, tasks finishing).
  int64_t events = 0;
};

// Simulates `plan`. INVALID_ARGUMENT for structurally unusable plans (node
// out of range or not holding the stage the route claims, a node twice on a
// route, a route not starting on a stage-0 node); FAILED_PRECONDITION when the
// routes deadlock on memory slots (possible with swaps), naming the stuck
// microbatches. Thread-safe: no shared state.
absl::StatusOr<SimResult> Simulate(const CostModel& cost, const Plan& plan,
                                   const SimOptions& options = SimOptions());

}  // namespace detour::sim

#endif  // DETOUR_COMMON_SIM_EVENT_SIMULATOR_H_
