// A running job's planning model: the cost model over every worker the job
// ever had (lost ones stay in it, unused, so node indices never change),
// corrected by the speeds and links the workers' timing reports show; the
// live members' stage assignment; routes for them, around stages left
// without workers when the job's routes may skip; and the K-FAC workload
// and bubble planner that follow the membership.
//
// No I/O, no threads: the job runner owns one, keeps its membership
// current (RebuildAssignment after every change) and feeds it timings.
// Reads the job's spec and membership through the pointers it is given,
// which must outlive it. Thread-compatible.
#ifndef DETOUR_COORDINATOR_RUNNER_PLANNER_H_
#define DETOUR_COORDINATOR_RUNNER_PLANNER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/kfac_workload.h"
#include "common/sim/cost_model.h"
#include "coordinator/link_matrix.h"
#include "coordinator/planner/bubble_planner.h"
#include "coordinator/planner/planner.h"
#include "coordinator/runner_membership.h"
#include "coordinator/stage_reassignment.h"
#include "coordinator/stragglers.h"
#include "coordinator/timing_estimates.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/job_service.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

class RunnerPlanner {
 public:
  // `network`: region latencies and bandwidths (a ClusterSpec whose nodes
  // are ignored). Route-search simulations per re-plan, per re-run after a
  // loss, and per quick prediction (joins, stage moves).
  static constexpr int kReplanEvaluations = 2000;
  static constexpr int kRerunEvaluations = 300;
  static constexpr int kQuickEvaluations = 200;
  // A re-plan under a cost model refitted since the last routes were
  // adopted keeps them unless the search's are predicted this much faster
  // than they measured, over at least kJudgedIterations iterations (the
  // first on them not counted; a refit can misjudge the routes it was
  // fitted on), and the predicted saving (the lesser of the measure less the
  // prediction and the model's own gain on the measure) over the job's
  // elastic.reassign_horizon_iterations (or the iterations left) exceeds
  // what the first iteration on them took beyond the later ones (new peer
  // connections, cold TCP windows: docs/SCHEDULER.md §"Re-planning a
  // running job"). Under the model the last routes were planned under, or
  // with fewer measured iterations, the search's gain by the model, as a
  // share of what they measured (of the model's prediction for them before
  // any was), must repay the change instead.
  static constexpr double kRouteSwitchMargin = 0.1;
  static constexpr int kJudgedIterations = 2;
  // The routes' measured time is the mean of their last this many
  // iterations (a link that degrades shows within them).
  static constexpr int kMeasuredWindow = 8;
  // What a change of routes costs is the largest of what the first
  // iteration on each of the last this many routes took beyond their mean:
  // a change that reused most peer pairs costs little, and the next one may
  // not.
  static constexpr int kSwitchCosts = 4;

  // `job_id` names the job in log lines.
  RunnerPlanner(std::string job_id, const v1::JobSpec* spec, const v1::ClusterSpec* network,
                const RunnerMembership* membership);

  // Builds the planning cluster over the membership's node order: each
  // worker's region, speed (a measured one where known) and memory slots;
  // regions the network does not describe are one fast network; measured
  // links replace the spec's bandwidths.
  absl::Status BuildCostModel();
  // The assignment (node indices of the cost model) of the live members.
  void RebuildAssignment();

  const sim::CostModel& cost() const { return *cost_; }
  const sim::StageAssignment& assignment() const { return assignment_; }
  const v1::ClusterSpec& cluster() const { return cluster_; }
  // The network the job was given (the region table), as given.
  const v1::ClusterSpec& network() const { return *network_; }
  // Worker id -> region, for the timing estimates.
  const std::map<std::string, std::string>& regions() const { return region_of_; }
  // The live members of `stage`, in node order.
  std::vector<std::string> StageMembers(int stage) const;
  // Stages without a live worker.
  std::vector<int> EmptyStages() const;
  // How many workers each stage has.
  std::vector<int> StageSizes() const;
  // Why the live members cannot train ("" = they can). Stages without a live
  // worker are skipped by every route when the job's routes skip stages
  // anyway (SkipSpec); otherwise, and for stage 0 (the data), the job cannot
  // train.
  std::string Infeasible() const;
  // The pipeline over the stages that have workers when `missing` stages
  // have none (FAILED_PRECONDITION when that is impossible).
  absl::StatusOr<v1::PipelineSpec> SkipSpec(size_t missing) const;
  int total_microbatches() const;

  // The first plan, for the whole spec: chooses the assignment (kept until
  // PlanIteration uses the plan, or the membership changes).
  absl::StatusOr<const planner::PlannedIteration*> PlanFirst(uint64_t seed);
  const std::optional<planner::PlannedIteration>& first_plan() const { return first_plan_; }
  // The plan of `iteration`: the first plan when it is still current
  // (`first_iteration` at epoch 0), otherwise a re-plan from the last
  // iteration's routes; every pipeline.full_model_every-th iteration runs
  // the full pipeline. Under a refitted cost model the last routes stay
  // unless the search's are predicted kRouteSwitchMargin faster than they
  // measured and the saving repays a change; otherwise unless the model's
  // gain on what they measured (or on its prediction for them) repays it;
  // so do the full scheduler's.
  absl::StatusOr<planner::PlannedIteration> PlanIteration(uint64_t iteration,
                                                          uint64_t first_iteration, uint64_t epoch);
  // Routes for `count` microbatches over the live members; `warm` starts
  // the skippipe search.
  absl::StatusOr<planner::PlannedIteration> PlanLive(uint64_t seed, int count,
                                                     const std::vector<sim::Route>* warm,
                                                     int evaluations,
                                                     std::optional<v1::SchedulerKind> scheduler);
  // The iteration time a quick plan predicts for the membership as it is
  // now; infinity when it cannot train or the planner fails.
  double PredictIteration(uint64_t seed);
  // An iteration on `planned` completed in `seconds` (wall time; 0 = not one
  // to judge the routes by, e.g. workers were lost during it): its routes
  // are the last of its scheduler (skippipe's are the next re-plan's warm
  // start; skippipe's and full's are what PlanIteration's rule judges a
  // change against). The first iteration on new routes is not counted
  // either: it opens new peer connections and starts their windows cold.
  // `kfac_seconds`: what of `seconds` the bubble planner put after the
  // pipeline (K-FAC's serial tail and preconditioning), which the search's
  // prediction leaves out; the routes are judged on the rest. Forgotten
  // after a membership change (they route through workers that left).
  void KeepRoutes(const planner::PlannedIteration& planned, double seconds = 0,
                  double kfac_seconds = 0);
  void ForgetRoutes();

  // Resuming where the straight run would go on. A checkpoint's record keeps
  // what the next re-plan starts from (the assignment and the warm-start
  // routes, by stage and replica position); a resume from it makes its
  // first plan that re-plan, so that it plans what the straight run would
  // have. Most route visits (the nodes of all routes together) a kept plan
  // holds; a plan with more is kept without its routes.
  static constexpr int kMaxKeptRouteVisits = 1 << 16;
  // The warm start of the plan after the checkpoint `dir`, taken after
  // `iterations_done` iterations (KeepRoutes must have seen the last plan).
  // No routes when there are none, when they have more visits than that, or
  // when one visits a node the assignment does not hold (the search would
  // not use them either).
  v1::CheckpointPlan WarmStart(const std::string& dir, uint64_t iterations_done) const;
  // Whether `stored` fits the first plan's assignment (PlanFirst) of a job
  // resumed at `iteration`: the same stage sizes (so the same replica
  // counts), every member in the assignment, routes within it. When it
  // does: the planning node order (worker ids) that numbers the first
  // plan's workers by position the way the stored plan numbered its nodes;
  // otherwise an error saying why (the record is input: it is checked).
  absl::StatusOr<std::vector<std::string>> ResumedNodeOrder(const v1::CheckpointPlan& stored,
                                                            uint64_t iteration) const;
  // After BuildCostModel over that order: the assignment becomes the stored
  // one (position for position) and the first plan the re-plan of
  // `iteration` from the stored routes, as PlanIteration would make it.
  absl::Status PlanResumed(const v1::CheckpointPlan& stored, uint64_t iteration);

  // Every link between members with transfers reported since its last fit:
  // the planner keeps the link's latency and takes the bandwidth that makes
  // one activation's transfer last what the workers measured, less the
  // round trip to the peer's acknowledgement. A transfer whose bytes took
  // under kMinWireShare of its time was bound by the round trip, whose
  // jitter is larger than its bytes' time: it leaves the link's bandwidth
  // as it is. Returns how many links were fitted.
  static constexpr double kMinWireShare = 0.1;
  int UpdateLinksFromTimings(const TimingEstimates& estimates);
  // What the job measured of its links (probes, fits); BuildCostModel lays
  // it over the region table. After changing it, RefreshLinks.
  LinkMatrix& links() { return links_; }
  const LinkMatrix& links() const { return links_; }
  // Rebuilds the cost model with the link matrix as it is now (cost_version()
  // moves).
  absl::Status RefreshLinks();
  // The matrix the planner uses now over the live members, as GetLinks
  // answers it (`cuts`: the membership's cut links).
  v1::GetLinksResponse LinkSnapshot(
      const std::set<std::pair<std::string, std::string>>& cuts) const;
  // Re-derives every member's speed from its measured forward time against
  // the cost model's prediction, and rebuilds the cost model when a speed
  // or a link was measured (cost_version() moves then). Returns the samples
  // for straggler detection.
  std::vector<ForwardSample> UpdateSpeedsFromTimings(const TimingEstimates& estimates);
  // Bumped whenever measured speeds change the cost model.
  uint64_t cost_version() const { return cost_version_; }

  // Links between members found cut (RunnerMembership::cut_links): the cost
  // model prices them as a crawl no plan wants, and the warm-start routes
  // are forgotten. Rebuilds the cost model when the set changed.
  absl::Status SetCutLinks(const std::set<std::pair<std::string, std::string>>& cuts);
  // A cut link `plan` still needs, as (a, b) with a < b: two consecutive
  // nodes of a route (the last one's activation goes back to the data
  // node), or two replicas of a stage (the all-reduce joins them).
  std::optional<std::pair<std::string, std::string>> CrossedCut(const sim::Plan& plan) const;
  // A plan of `iteration` by the route search (the skippipe scheduler with
  // the job's own skip ratio, so a full pipeline stays a full pipeline),
  // for when the job's scheduler gave a plan that crosses a cut link: the
  // full scheduler fixes its columns greedily and may leave one column
  // only the cut pair.
  absl::StatusOr<planner::PlannedIteration> PlanAroundCuts(uint64_t iteration);
  // What a cut link costs in the planner: one activation takes hours.
  static constexpr double kCutLinkBytesPerS = 1.0;

  // Seconds the job stands still for `m`: the target stage's state over the
  // link from its first replica, plus `pause`.
  double MoveCost(const StageMove& m, double pause_s) const;

  // K-FAC (jobs with optimizer KFAC only).
  // Every planning node's blocks and the estimated cost of their K-FAC
  // work at the node's current speed; `sync_override` prices another
  // replica sync scheme than the spec's.
  planner::KfacWorkload KfacWorkload(std::optional<kfac::ReplicaSync> sync_override = {});
  absl::Status CreateBubblePlanner();
  planner::BubblePlanner* bubbles() { return bubbles_.get(); }
  // The bubble plan follows the membership: the lost worker's blocks leave
  // it, a joiner's enter it. Logs and keeps the old workload on failure.
  void KfacMembershipChanged();
  // Every worker's K-FAC speed from this iteration's bubble tasks.
  void MeasureKfacSpeeds(const v1::IterationPlan& plan,
                         const std::map<std::string, v1::TimingReport>& timings);

 private:
  // The routes a scheduler's last plans ran (skippipe's are the search's
  // warm start) and what they measured.
  struct RouteRecord {
    std::vector<sim::Route> routes;
    // Iterations completed on them (the first included), the wall times of
    // the first and of the later ones, and the cost model they were planned
    // under.
    int iterations = 0;
    double first_seconds = 0;
    std::deque<double> seconds;  // the last kMeasuredWindow
    uint64_t cost_version = 0;
    // What the first iteration on each of the routes before these took beyond
    // their mean, for the last kSwitchCosts - 1 whose first and a later
    // iteration were measured (kept across Forget).
    std::deque<double> past_costs;
    // The mean of `seconds` (0 when none).
    double Measured() const;
    // What the first iteration on these took beyond their mean; none until
    // it and a later one were measured.
    std::optional<double> OwnCost() const;
    // What a change of routes costs: the largest of OwnCost and
    // `past_costs`.
    double SwitchCost() const;
    // Forgets the routes and their times, keeping what their first
    // iteration cost in `past_costs`.
    void Forget();
  };
  // The record of `scheduler`'s routes; null for the baselines'.
  RouteRecord* Record(v1::SchedulerKind scheduler);
  // `searched`, the search's plan of `iteration`, or the last routes planned
  // again when the rule of PlanIteration says they stay.
  absl::StatusOr<planner::PlannedIteration> JudgeRouteChange(uint64_t iteration, RouteRecord& last,
                                                             planner::PlannedIteration searched);
  // `routes` over the assignment as they are, checked against the scheduler's
  // rules and simulated.
  absl::StatusOr<planner::PlannedIteration> PlanRoutes(const std::vector<sim::Route>& routes,
                                                       v1::SchedulerKind scheduler) const;
  absl::StatusOr<planner::PlannedIteration> PlanAroundEmptyStages(v1::JobSpec live,
                                                                  planner::PlannerOptions o,
                                                                  const std::vector<int>& empty,
                                                                  int count);
  v1::JobSpec LiveSpec(int microbatches) const;
  std::optional<v1::SchedulerKind> ReplanScheduler(uint64_t iteration) const;
  absl::Status CheckStored(const v1::CheckpointPlan& stored, uint64_t iteration) const;
  double KfacFlopsPerSecond(int node) const;
  bool kfac() const;

  const std::string job_id_;
  const v1::JobSpec* const spec_;
  const v1::ClusterSpec* const network_;
  const RunnerMembership* const membership_;

  v1::ClusterSpec cluster_;
  std::unique_ptr<sim::CostModel> cost_;
  sim::StageAssignment assignment_;
  std::map<std::string, std::string> region_of_;
  std::map<std::string, double> speeds_;  // measured relative speeds
  // Measured links: probes and fits.
  LinkMatrix links_;
  // The transfers' round trips the cost model was built with
  // (BuildCostModel computes them once; the refit's log line and
  // LinkSnapshot read them).
  LinkMatrix::TransferRounds planned_rounds_;
  // The region table's bandwidth by node index, before measured links
  // replaced or slowed it (LinkSnapshot shows it as what the table says).
  std::vector<std::vector<double>> table_bandwidth_;
  // Link -> TimingEstimates::TransferReports when it was last fitted.
  std::map<std::pair<std::string, std::string>, uint64_t> refit_reports_;
  std::set<std::pair<std::string, std::string>> cut_links_;
  uint64_t cost_version_ = 0;
  std::optional<planner::PlannedIteration> first_plan_;
  // Of the skippipe plans, and of the full ones (jobs with
  // pipeline.full_model_every run both).
  RouteRecord skip_routes_;
  RouteRecord full_routes_;
  std::unique_ptr<planner::BubblePlanner> bubbles_;
  std::map<std::string, double> kfac_flops_;      // node -> measured K-FAC FLOP/s
  std::map<std::string, double> workload_flops_;  // node -> FLOP/s the planner's costs use
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_PLANNER_H_
