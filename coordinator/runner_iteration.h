// One iteration of a running job (docs/RUNTIME.md §"A job's life"): plan,
// send, collect gradient norms, step, collect results, check them
// (iteration_round.h), checkpoint, record the progress and adapt the costs;
// workers lost meanwhile are re-planned around (OnLoss): before the step what
// crossed them is frozen, re-planned or dropped, after it the survivors'
// results are the iteration's. Stragglers are named from the measured speeds.
// A part of JobRunner (runner_part.h); the runner's thread only.
#ifndef DETOUR_COORDINATOR_RUNNER_ITERATION_H_
#define DETOUR_COORDINATOR_RUNNER_ITERATION_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/iteration_round.h"
#include "coordinator/runner_part.h"
#include "coordinator/stragglers.h"

namespace detour {

class RunnerElastic;
class RunnerLinks;

class RunnerIteration : private RunnerPart {
 public:
  // How an iteration ended: done, or to be run again (the job paused).
  enum class Outcome { kDone, kRetry };
  struct IterationOutcome {
    std::optional<Outcome> outcome;
    std::optional<JobEnd> status_end;
    bool ok() const { return outcome.has_value(); }
  };
  static IterationOutcome End(JobEnd e) { return {std::nullopt, std::move(e)}; }
  static IterationOutcome Done(Outcome o) { return {o, std::nullopt}; }

  // What one iteration collected, for the record.
  struct Collected {
    std::map<std::string, v1::TimingReport> timings;
    int rerun = 0;
    absl::Duration overhead;  // coordinator work, not waiting
    absl::Duration held;      // holding for the job record (a store out of reach)
  };

  // `elastic` pauses the job when a loss leaves it unable to train;
  // `links` checks a cut link no plan avoids before a worker leaves for it.
  RunnerIteration(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic,
                  RunnerLinks* links);

  // The run (or the resumed run) starts at `iteration`: the ETA counts from
  // here.
  void Started(uint64_t iteration);
  // `id` left the job: it is no longer a straggler candidate.
  void ForgetWorker(const std::string& id);

  IterationOutcome RunIteration(uint64_t iteration);
  // The routes of the iteration in flight (re-runs replace theirs).
  const std::map<uint32_t, v1::Route>& routes() const { return routes_; }

 private:
  absl::StatusOr<v1::CoordinatorMessage> PlanMessage(uint64_t iteration,
                                                     const planner::PlannedIteration& planned);
  std::optional<IterationOutcome> Collect(uint64_t iteration, absl::Time deadline,
                                          IterationRound* round, Collected* collected);
  std::optional<JobEnd> RecordProgress(uint64_t iteration, double loss, const IterationRound& round,
                                       const v1::IterationPlan& plan, const Collected& collected,
                                       absl::Time begin);
  void AdaptCosts(uint64_t iteration, const v1::IterationPlan& plan,
                  const std::map<std::string, v1::TimingReport>& timings);
  void NoteStragglers(uint64_t iteration, const std::vector<ForwardSample>& samples);
  std::optional<JobEnd> CommitCheckpoint(uint64_t iterations_done, const std::string& dir,
                                         const std::map<std::string, v1::IterationResult>& results,
                                         absl::Time deadline);
  IterationOutcome RunAgainAroundCuts(uint64_t iteration, const std::vector<LinkCut>& cuts);
  IterationOutcome RemoveUnreachable(uint64_t iteration,
                                     const std::pair<std::string, std::string>& link);
  std::optional<IterationOutcome> OnLoss(uint64_t iteration, const std::vector<std::string>& lost,
                                         bool stepped, IterationRound* round, int* rerun,
                                         absl::Time deadline);

  RunnerElastic* const elastic_;
  RunnerLinks* const links_;
  uint64_t started_iteration_ = 0;
  absl::Time started_;
  // This iteration's routes (re-runs replace theirs).
  std::map<uint32_t, v1::Route> routes_;
  std::optional<absl::Time> recovering_since_;
  // Stragglers: consecutive re-plans each worker was found slow at, and
  // those recorded as stragglers (worker -> slowdown).
  std::map<std::string, int> straggler_replans_;
  std::map<std::string, double> stragglers_;
  static constexpr double kStragglerFactor = 2.0;
  static constexpr int kStragglerReplans = 3;
  uint64_t recoveries_ = 0;
  double last_loss_ = 0;
  uint64_t rerun_total_ = 0;
  uint64_t dropped_total_ = 0;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_ITERATION_H_
