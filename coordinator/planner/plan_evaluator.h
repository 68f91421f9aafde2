// What the planner minimises, in one place: the route search and the
// assignment search both judge a route set by simulating it (with link
// contention and memory slots) under the workers' queue policy and, when
// robust, under the other policy too. A plan runs under the workers' policy;
// the other policy stands for the timing noise of real workers (near-
// simultaneous arrivals in either order), so a quarter of what a plan would
// lose under it counts against it.
//
// Score (seconds, lower is better): the objective's time (the iteration plus
// a tenth of the pipeline, or the pipeline alone) + a quarter of the other policy's excess +
// 1e-3 × the mean microbatch end + 1e-4 × the time tasks spent queued (tie
// breakers on plateaus: earlier completion, fewer collisions).
//
// Thread-compatible: one instance per planning thread. Does not own `cost`,
// which must outlive it.
#ifndef DETOUR_COORDINATOR_PLANNER_PLAN_EVALUATOR_H_
#define DETOUR_COORDINATOR_PLANNER_PLAN_EVALUATOR_H_

#include <limits>
#include <vector>

#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/plan.h"

namespace detour::planner {

enum class Objective {
  // Iteration time (pipeline + all-reduce), plus a tenth of the pipeline
  // time (among equal iterations, the one whose stages finish earlier
  // leaves the longer gaps for K-FAC and the all-reduce).
  kIteration,
  // Pipeline time alone (the SkipPipe paper's metric).
  kPipeline,
};

struct EvaluatorOptions {
  Objective objective = Objective::kIteration;
  sim::Contention contention = sim::Contention::kSenderUplink;
  // The workers' policy.
  sim::QueuePolicy queue_policy = sim::QueuePolicy::kArrival;
  bool robust = true;
};

class PlanEvaluator {
 public:
  // Share of the other queue policy's excess that counts.
  static constexpr double kOtherPolicyWeight = 0.25;
  // Weight of the pipeline time next to the iteration time (kIteration).
  static constexpr double kPipelineShare = 0.1;

  PlanEvaluator(const sim::CostModel& cost, const EvaluatorOptions& options)
      : cost_(cost), options_(options) {}

  // The score of `routes` on `assignment`; infinity when they cannot be
  // simulated. Above `threshold` the result may be a lower bound (the other
  // policy is not simulated once the first already exceeds it).
  double Score(const sim::StageAssignment& assignment, const std::vector<sim::Route>& routes,
               double threshold = std::numeric_limits<double>::infinity());

  int evaluations() const { return evaluations_; }

 private:
  const sim::CostModel& cost_;
  EvaluatorOptions options_;
  sim::Plan scratch_;
  int evaluations_ = 0;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_PLAN_EVALUATOR_H_
