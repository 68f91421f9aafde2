#include "coordinator/planner/replica_sync_choice.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace detour::planner {

absl::StatusOr<ReplicaSyncChoice> ChooseReplicaSync(const KfacWorkload& workload,
                                                    const v1::KfacSpec& kfac, const sim::Plan& plan,
                                                    const IterationTimeline& timeline,
                                                    int refreshes, int max_iterations) {
  if (refreshes < 1 || max_iterations < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replica sync choice: refreshes (%d) and max_iterations (%d) must be >= 1",
                        refreshes, max_iterations));
  }
  v1::KfacSpec factors_spec = kfac;
  factors_spec.set_replica_sync(v1::KFAC_REPLICA_SYNC_FACTORS);
  factors_spec.set_sync_factors(true);
  v1::KfacSpec preconditioned_spec = kfac;
  preconditioned_spec.set_replica_sync(v1::KFAC_REPLICA_SYNC_PRECONDITIONED);
  preconditioned_spec.set_sync_factors(false);
  KfacWorkload unsynced = workload;
  for (KfacNodeWork& node : unsynced.nodes) {
    for (KfacLayerCost& c : node.costs) c.sync_s = 0;
  }
  ASSIGN_OR_RETURN(BubblePlanner factors, BubblePlanner::Create(workload, factors_spec));
  ASSIGN_OR_RETURN(BubblePlanner preconditioned,
                   BubblePlanner::Create(std::move(unsynced), preconditioned_spec));
  ReplicaSyncChoice choice;
  choice.pipeline_s = timeline.end_s;
  double factors_sum = 0, preconditioned_sum = 0;
  const auto done = [&](const BubblePlanner& p) {
    return p.completed_refreshes() >= static_cast<uint64_t>(refreshes);
  };
  for (int i = 0; i < max_iterations && !(done(factors) && done(preconditioned)); ++i) {
    ASSIGN_OR_RETURN(IterationBubbles f, factors.PlanIteration(i, plan, timeline));
    ASSIGN_OR_RETURN(IterationBubbles p, preconditioned.PlanIteration(i, plan, timeline));
    factors_sum += f.iteration_time_s;
    preconditioned_sum += p.iteration_time_s;
    ++choice.iterations;
  }
  choice.factors_s = factors_sum / choice.iterations;
  choice.preconditioned_s = preconditioned_sum / choice.iterations;
  const double above =
      choice.preconditioned_s > 0 ? choice.factors_s / choice.preconditioned_s - 1 : 0;
  const bool take_factors =
      choice.factors_s <= choice.preconditioned_s * (1 + kAutoFactorsTolerance);
  choice.sync = take_factors ? kfac::ReplicaSync::kFactors : kfac::ReplicaSync::kPreconditioned;
  choice.reason = absl::StrFormat(
      "K-FAC replica sync %s: with the factor all-reduce the modelled iteration is %.4g s, "
      "%+.1f%% against %.4g s with preconditioned replicas (%.4g s without K-FAC; mean of %d "
      "planned iterations), %s the %.0f%% that the exact factors' faster convergence is "
      "worth",
      take_factors ? "FACTORS" : "PRECONDITIONED", choice.factors_s, 100 * above,
      choice.preconditioned_s, choice.pipeline_s, choice.iterations,
      take_factors ? "within" : "more than", 100 * kAutoFactorsTolerance);
  return choice;
}

}  // namespace detour::planner
