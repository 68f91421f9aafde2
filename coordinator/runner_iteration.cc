#include "coordinator/runner_iteration.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/planner/plan_proto.h"
#include "coordinator/runner_elastic.h"
#include "coordinator/runner_links.h"

namespace detour {

RunnerIteration::RunnerIteration(RunnerShared* shared, RunnerLoop* loop, RunnerElastic* elastic,
                                 RunnerLinks* links)
    : RunnerPart(shared, loop), elastic_(elastic), links_(links) {}

void RunnerIteration::Started(uint64_t iteration) {
  started_ = absl::Now();
  started_iteration_ = iteration;
}

void RunnerIteration::ForgetWorker(const std::string& id) {
  straggler_replans_.erase(id);
  stragglers_.erase(id);
}

// One iteration: plan, send, collect norms / step / results (re-planning
// around workers lost meanwhile), check, checkpoint, record.
RunnerIteration::IterationOutcome RunnerIteration::RunIteration(uint64_t iteration) {
  const absl::Time begin = absl::Now();
  const uint64_t planned_epoch = epoch();
  link_.StartIteration();
  membership_.StartIteration();
  auto planned = plan_.PlanIteration(iteration, next_iteration_, epoch());
  if (!planned.ok()) return End(Failed(absl::StrCat("planner: ", planned.status().message())));
  if (plan_.CrossedCut(planned->plan)) {
    // The route search may find what the job's scheduler did not.
    auto around = plan_.PlanAroundCuts(iteration);
    if (around.ok() && !plan_.CrossedCut(around->plan)) {
      LogInfo("job ", job_id_, ": iteration ", iteration,
              ": routes planned by the route search around the cut link(s)");
      planned = *std::move(around);
    }
  }
  if (auto crossed = plan_.CrossedCut(planned->plan); crossed) {
    // One failed transfer may be a connection that broke, not the path:
    // the link is probed before a worker leaves for it.
    std::optional<JobEnd> end;
    if (links_->ConfirmCut(*crossed, &end)) return Done(Outcome::kRetry);
    // Stopped while the probe ran (a cancel, a coordinator stopping with its
    // jobs), or a member's error: nobody leaves for an unfinished check.
    if (end) return End(*std::move(end));
    return RemoveUnreachable(iteration, *crossed);
  }
  auto message = PlanMessage(iteration, *planned);
  if (!message.ok()) return End(Failed(message.status().message()));
  const v1::IterationPlan& plan = message->plan();
  routes_.clear();
  for (const v1::Route& r : plan.routes()) routes_[r.microbatch()] = r;
  IterationRound round(iteration, plan_.total_microbatches(), members(), epoch());
  link_.SendPlan(*message);
  const absl::Time sent = absl::Now();
  Collected collected;
  collected.overhead = absl::Now() - begin;
  if (recovering_since_) {
    host_->runner_metrics().Recovered(absl::ToDoubleSeconds(absl::Now() - *recovering_since_));
    recovering_since_.reset();
  }
  const absl::Time deadline = Now() + options().iteration_timeout;
  if (auto outcome = Collect(iteration, deadline, &round, &collected); outcome) return *outcome;
  // What the workers took, from the plan to the last result: what a re-plan
  // judges the routes by.
  const absl::Duration ran = absl::Now() - sent - collected.held;

  // Checks: replicas identical, every microbatch completed exactly once
  // (or dropped with a lost worker).
  if (absl::Status s = round.Check(); !s.ok()) return End(Failed(s.message()));
  for (const auto& [id, r] : round.results()) last_checksum_[r.stage()] = r.parameter_checksum();
  // An iteration whose microbatches were all dropped has no loss of its
  // own: the last one stands.
  const double loss = round.completed() > 0 ? round.loss_sum() / round.completed() : last_loss_;
  last_loss_ = loss;
  if (!std::isfinite(loss)) {
    return End(Failed(absl::StrCat("the loss became non-finite at iteration ", iteration)));
  }
  // The next re-plan's warm start, kept with the checkpoint too, and what
  // the workers took when nothing was re-run and no stage file was written;
  // of that, K-FAC's work after the pipeline as the bubble planner put it.
  const double kfac_seconds =
      plan_.bubbles() != nullptr ? plan.predicted_time_s() - planned->result.iteration_time_s : 0;
  plan_.KeepRoutes(*planned,
                   epoch() == planned_epoch && collected.rerun == 0 && !plan.checkpoint()
                       ? absl::ToDoubleSeconds(ran)
                       : 0,
                   kfac_seconds);
  if (plan.checkpoint()) {
    if (auto s = CommitCheckpoint(iteration + 1, plan.checkpoint_dir(), round.results(), deadline);
        s) {
      return End(*s);
    }
  }
  if (!round.dropped().empty()) {
    AddEvent(v1::JobHistoryEvent::KIND_MICROBATCHES_DROPPED, iteration, "",
             absl::StrCat("iteration ", iteration, ": dropped microbatch(es) ",
                          absl::StrJoin(round.dropped(), ","),
                          " (part of their backward ran on a lost worker)"));
  }
  rerun_total_ += collected.rerun;
  dropped_total_ += round.dropped().size();
  if (auto e = RecordProgress(iteration, loss, round, plan, collected, begin); e) return End(*e);
  AdaptCosts(iteration, plan, collected.timings);
  return Done(Outcome::kDone);
}

// The iteration's plan for every worker: routes, replica groups, peers,
// K-FAC bubble tasks, checkpoint.
absl::StatusOr<v1::CoordinatorMessage> RunnerIteration::PlanMessage(
    uint64_t iteration, const planner::PlannedIteration& planned) {
  v1::CoordinatorMessage m;
  v1::IterationPlan* plan = m.mutable_plan();
  plan->set_job_id(job_id_);
  plan->set_iteration(iteration);
  plan->set_epoch(epoch());
  AddReplicaGroups(plan->mutable_replica_groups());
  for (const v1::Peer& p : MemberPeers(membership_)) *plan->add_peers() = p;
  for (const sim::Route& r : planned.plan.routes) {
    v1::Route* route = plan->add_routes();
    *route = planner::ToProtoRoute(plan_.cost(), r);
    route->set_epoch(epoch());
  }
  plan->set_predicted_time_s(planned.result.iteration_time_s);
  // A stage without workers has no file to write: no checkpoint is taken
  // while one is empty (the last complete one stays the newest).
  if (RunnerCheckpoints::Due(spec_.checkpoint(), iteration, spec_.iterations(),
                             !plan_.EmptyStages().empty())) {
    plan->set_checkpoint(true);
    plan->set_checkpoint_dir(checkpoints_.Dir(iteration + 1));
  }
  if (planner::BubblePlanner* bubbles = plan_.bubbles(); bubbles != nullptr) {
    // A checkpoint closes the K-FAC refresh window: no refresh is in
    // flight across it, so a job resumed from it plans the same K-FAC
    // work as one that went on (BubblePlanner::PlanIteration). Not the
    // last iteration's: no iteration follows it.
    const bool close = plan->checkpoint() && iteration + 1 < spec_.iterations();
    // The workers anchor their refresh numbers to the planner's.
    const std::optional<uint64_t> last = bubbles->last_activated_refresh();
    plan->set_kfac_refresh_base(last ? *last + 2 : 1);
    auto placed = bubbles->PlanIteration(iteration, planned.plan,
                                         planner::TimelineFromSimulation(planned.result),
                                         /*close_window=*/close);
    if (!placed.ok()) return Annotate(placed.status(), "K-FAC bubble planner");
    for (v1::BubbleTask& t : placed->tasks) *plan->add_bubble_tasks() = std::move(t);
    if (placed->activate_refresh) plan->set_kfac_activate_refresh(*placed->activate_refresh + 1);
    plan->set_predicted_time_s(placed->iteration_time_s);
  }
  return m;
}

// Gradient norms (one per live worker of the epoch), then the step, then
// results; workers lost meanwhile are re-planned around (OnLoss). An
// outcome when the iteration ends otherwise (failure, pause).
std::optional<RunnerIteration::IterationOutcome> RunnerIteration::Collect(uint64_t iteration,
                                                                          absl::Time deadline,
                                                                          IterationRound* round,
                                                                          Collected* collected) {
  bool stepped = false;
  while (!round->ResultsComplete()) {
    RunnerEvent ev = Wait(deadline, [&] {
      return absl::StrCat(
          stepped ? "iteration results" : "gradient norms", " of iteration ", iteration, " from ",
          absl::StrJoin(stepped ? round->MissingResults() : round->MissingNorms(), ", "));
    });
    if (ev.end) return End(*ev.end);
    if (!ev.lost.empty()) {
      auto handled = OnLoss(iteration, ev.lost, stepped, round, &collected->rerun, deadline);
      if (handled) return *handled;
    }
    // After the step every transfer of the iteration is done: a cut found
    // then matters from the next plan on.
    if (!ev.cuts.empty() && !stepped) return RunAgainAroundCuts(iteration, ev.cuts);
    for (auto& [worker, msg] : ev.messages) {
      if (msg.has_grad_norm()) {
        round->AddNorm(worker, msg.grad_norm());
      } else if (msg.has_result()) {
        round->AddResult(worker, msg.result());
      } else if (msg.has_timing() && msg.timing().iteration() == iteration &&
                 !collected->timings.count(worker)) {
        host_->estimates().Add(msg.timing(), plan_.regions(), members());
        collected->timings[worker] = msg.timing();
      }
    }
    if (!stepped && round->NormsComplete()) {
      const absl::Time step_start = absl::Now();
      auto squared = round->SquaredNorm();
      if (!squared.ok()) return End(Failed(squared.status().message()));
      v1::CoordinatorMessage step;
      step.mutable_step()->set_job_id(job_id_);
      step.mutable_step()->set_iteration(iteration);
      step.mutable_step()->set_squared_norm(*squared);
      step.mutable_step()->set_epoch(epoch());
      step.mutable_step()->set_completed_microbatches(static_cast<uint32_t>(
          plan_.total_microbatches() - static_cast<int>(round->dropped().size())));
      // Durably first: a coordinator that dies between two step messages
      // leaves workers an iteration apart, and the one that takes over
      // sends the rest this same step (JobRunner's re-attach).
      // A replicated store out of reach holds the job; the wait for the
      // results starts again when it is back.
      const absl::Time hold_start = absl::Now();
      absl::Status pending = record_.PendingStep(step.step());
      pending = record_.Hold(pending, [this] { return StopRequested(); });
      const absl::Duration held = absl::Now() - hold_start;
      deadline += held;
      collected->held += held;
      if (!pending.ok()) {
        return End(Failed(absl::StrCat("cannot write the job record: ", pending.message())));
      }
      link_.SendToAll(step);
      stepped = true;
      collected->overhead += absl::Now() - step_start;
    }
  }
  return std::nullopt;
}

// Progress of the finished iteration into the job record (durably: a job
// whose record cannot be written stops).
std::optional<JobEnd> RunnerIteration::RecordProgress(uint64_t iteration, double loss,
                                                      const IterationRound& round,
                                                      const v1::IterationPlan& plan,
                                                      const Collected& collected,
                                                      absl::Time begin) {
  IterationRecord r;
  r.iteration = iteration;
  r.total_iterations = spec_.iterations();
  r.loss = loss;
  r.seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  r.elapsed_seconds = absl::ToDoubleSeconds(absl::Now() - started_);
  r.iterations_run = iteration + 1 - started_iteration_;
  r.tokens = round.tokens();
  r.overhead_seconds = absl::ToDoubleSeconds(collected.overhead);
  r.plan = &plan;
  r.timings = &collected.timings;
  r.members = &members();
  if (planner::BubblePlanner* bubbles = plan_.bubbles(); bubbles != nullptr) {
    r.kfac = true;
    r.kfac_refreshes = bubbles->completed_refreshes();
    r.kfac_refresh_interval = bubbles->mean_refresh_interval();
  }
  r.recoveries = recoveries_;
  r.rerun_total = rerun_total_;
  r.dropped_total = dropped_total_;
  r.epoch = epoch();
  absl::Status recorded = record_.Iteration(r);
  // A replicated store out of reach: hold until it is back (or this leader
  // is replaced: the next one re-attaches from the stored record).
  recorded = record_.Hold(recorded, [this] { return StopRequested(); });
  if (!recorded.ok()) {
    // Training on without a durable record would leave the job's state to
    // chance after a restart: stop, with the reason.
    return Failed(absl::StrCat("cannot write the job record: ", recorded.message()));
  }
  LogDebug("job ", job_id_, " iteration ", iteration, " loss ", loss, " in ", r.seconds, " s");
  return std::nullopt;
}

// Every --replan_every iterations: node speeds and links from the timing
// reports, and K-FAC costs from the bubble tasks' measured speed.
void RunnerIteration::AdaptCosts(uint64_t iteration, const v1::IterationPlan& plan,
                                 const std::map<std::string, v1::TimingReport>& timings) {
  const int every = options().replan_every;
  planner::BubblePlanner* bubbles = plan_.bubbles();
  if (bubbles != nullptr) plan_.MeasureKfacSpeeds(plan, timings);
  if (every <= 0 || (iteration + 1) % every != 0) return;
  NoteStragglers(iteration, plan_.UpdateSpeedsFromTimings(host_->estimates()));
  if (bubbles != nullptr) {
    if (absl::Status s = bubbles->UpdateCosts(plan_.KfacWorkload()); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the K-FAC cost estimates: ", s.message());
    }
  }
}

// Workers slow at kStragglerReplans consecutive re-plans become
// stragglers (history STRAGGLER, once per episode); one no longer slow is
// recorded again (REPLANNED). Routing needs no flag: the measured speeds
// already give a slow worker fewer visits.
void RunnerIteration::NoteStragglers(uint64_t iteration,
                                     const std::vector<ForwardSample>& samples) {
  std::map<std::string, Slowdown> slow;
  for (Slowdown& d : FindSlowdowns(samples, kStragglerFactor)) slow[d.worker] = std::move(d);
  for (const ForwardSample& sample : samples) {
    const std::string& id = sample.worker;
    auto found = slow.find(id);
    if (found == slow.end()) {
      straggler_replans_.erase(id);
      if (stragglers_.erase(id) > 0) {
        AddEvent(v1::JobHistoryEvent::KIND_REPLANNED, iteration, id,
                 absl::StrCat("worker ", id, " (stage ", sample.stage,
                              ") is no longer slower than its replicas or its prediction"));
      }
      continue;
    }
    const Slowdown& d = found->second;
    if (++straggler_replans_[id] < kStragglerReplans || stragglers_.count(id)) continue;
    stragglers_[id] = d.factor;
    host_->runner_metrics().StragglerFound();
    AddEvent(v1::JobHistoryEvent::KIND_STRAGGLER, iteration, id,
             absl::StrFormat("worker %s (stage %d) is a straggler: its forward passes take "
                             "%.1fx %s at %d re-plans in a row; routes give it fewer visits",
                             id, d.stage, d.factor,
                             d.replica.empty()
                                 ? std::string("what its speed predicts, relative to the job")
                                 : absl::StrCat("those of its replica ", d.replica),
                             straggler_replans_[id]));
  }
}

// Asks the first data node to write the manifest over the stage files the
// results name, waits for it, then keeps only the newest keep_last.
std::optional<JobEnd> RunnerIteration::CommitCheckpoint(
    uint64_t iterations_done, const std::string& dir,
    const std::map<std::string, v1::IterationResult>& results, absl::Time deadline) {
  v1::CoordinatorMessage m;
  int stages = 0;
  *m.mutable_commit() = checkpoints_.Commit(iterations_done, dir, results, &stages);
  const int num_stages = plan_.assignment().num_stages();
  if (stages != num_stages) {
    const std::string why = absl::StrCat("checkpoint ", dir, ": ", stages, " of ", num_stages,
                                         " stage files were written");
    if (!elastic() || membership_.lost_this_iteration().empty()) return Failed(why);
    // The writer of a stage was lost after the step: this checkpoint is
    // incomplete; the last one stands and the next one will be whole.
    AddEvent(v1::JobHistoryEvent::KIND_CHECKPOINT_SKIPPED, iterations_done, "",
             absl::StrCat(why, " (a writer was lost); skipped, ",
                          checkpoints_.last().empty()
                              ? "no earlier checkpoint"
                              : absl::StrCat(checkpoints_.last(), " stays the newest")));
    return std::nullopt;
  }
  const std::string writer = plan_.StageMembers(0).front();
  if (!link_.SendTo(writer, m)) {
    return Failed(absl::StrCat("worker ", writer, " has no open session"));
  }
  while (true) {
    RunnerEvent ev = Wait(deadline, [&] { return absl::StrCat("checkpoint ", dir); });
    if (ev.end) return ev.end;
    if (!ev.lost.empty() && !membership_.IsMember(writer)) {
      return Failed(absl::StrCat("worker ", writer, " was lost while writing checkpoint ", dir));
    }
    bool committed = false;
    for (auto& [worker, msg] : ev.messages) {
      committed |= msg.has_checkpoint_committed() && msg.checkpoint_committed().dir() == dir;
    }
    if (committed) break;
  }
  LogInfo("job ", job_id_, ": checkpoint ", dir);
  checkpoints_.Committed(dir, spec_.checkpoint().keep_last());
  // What the next plan starts from, for a resume from this checkpoint.
  record_.LastCheckpoint(dir, plan_.WarmStart(dir, iterations_done));
  return std::nullopt;
}

// Links were found cut before the step: the iteration's transfers over them
// fail, so the iteration runs again under a new epoch (the workers drop
// what they did; frames of the old epoch are refused) with routes planned
// around them. Microbatches are run again, none is lost.
RunnerIteration::IterationOutcome RunnerIteration::RunAgainAroundCuts(
    uint64_t iteration, const std::vector<LinkCut>& cuts) {
  std::vector<std::string> links;
  for (const LinkCut& c : cuts) links.push_back(absl::StrCat(c.reporter, " - ", c.peer));
  const std::string reason =
      absl::StrCat("link(s) ", absl::StrJoin(links, ", "), " cut; the iteration runs again");
  link_.AbortIteration(iteration, reason);
  membership_.BumpEpoch();
  host_->runner_metrics().Microbatches("rerun", plan_.total_microbatches());
  AddEvent(v1::JobHistoryEvent::KIND_REROUTED, iteration, "",
           absl::StrCat("iteration ", iteration, ": ", reason, " at epoch ", epoch(),
                        " around the cut link(s)"));
  return Done(Outcome::kRetry);
}

// The planner found no plan that avoids a cut link (e.g. the only worker
// of the next stage, or two replicas whose all-reduce needs it), and its
// probe did not answer (RunnerLinks::ConfirmCut): the reported side of the
// link leaves the job, as a lost worker does, and does not rejoin before
// the join back-off.
RunnerIteration::IterationOutcome RunnerIteration::RemoveUnreachable(
    uint64_t iteration, const std::pair<std::string, std::string>& link) {
  const LinkCut* cut = membership_.CutReport(link);
  const std::string peer = cut != nullptr ? cut->peer : link.second;
  const std::string reporter = cut != nullptr ? cut->reporter : link.first;
  const std::string why = absl::StrCat("unreachable from ", reporter,
                                       cut != nullptr ? absl::StrCat(" (", cut->why, ")") : "",
                                       " and no plan avoids the link");
  membership_.BackOff(peer, Now() + RunnerMembership::kJoinBackoff);
  RemoveMember(peer, why, iteration);
  return Done(Outcome::kRetry);
}

// Workers were lost during `iteration`. Before the step: freeze what
// crossed them, re-plan what can run again, drop the rest. After the step:
// the survivors' results are the iteration's.
std::optional<RunnerIteration::IterationOutcome> RunnerIteration::OnLoss(
    uint64_t iteration, const std::vector<std::string>& lost, bool stepped, IterationRound* round,
    int* rerun, absl::Time deadline) {
  if (!elastic()) {
    return End(Failed(absl::StrCat("worker ", absl::StrJoin(lost, ", "), " lost (",
                                   membership_.loss_reason(), ") during iteration ", iteration,
                                   "; elastic training is disabled (elastic.disabled)")));
  }
  const absl::Time detected = absl::Now();
  if (!recovering_since_) recovering_since_ = detected;
  ++recoveries_;
  membership_.NoteLost(lost);
  if (stepped) {
    // The survivors stepped with a reduction that included the lost
    // workers' gradients; a lost data node's microbatches count as dropped
    // unless its result came in.
    for (const std::string& id : lost) {
      auto r = round->results().find(id);
      if (r != round->results().end()) continue;
      for (const auto& [mb, route] : routes_) {
        if (route.data_node() == id) round->Drop(mb);
      }
    }
    round->SetMembers(members(), epoch());
    RecordStages();
    return std::nullopt;
  }
  if (std::string why = plan_.Infeasible(); !why.empty()) {
    if (auto e = elastic_->Pause(iteration, why); e) return End(*e);
    return Done(Outcome::kRetry);
  }
  round->SetMembers(members(), epoch());
  // Tell the survivors and learn what ran where.
  v1::CoordinatorMessage change;
  v1::MembershipChange* c = change.mutable_membership();
  c->set_job_id(job_id_);
  c->set_iteration(iteration);
  c->set_epoch(epoch());
  for (const std::string& id : membership_.lost_this_iteration()) c->add_lost(id);
  AddReplicaGroups(c->mutable_replica_groups());
  link_.SendToAll(change);
  std::set<uint32_t> backward_ran, completed;
  std::set<std::string> acked;
  while (acked.size() < members().size()) {
    RunnerEvent ev = Wait(deadline, [&] {
      std::vector<std::string> missing;
      for (const auto& [id, s] : members()) {
        if (!acked.count(id)) missing.push_back(id);
      }
      return absl::StrCat("membership acks of epoch ", epoch(), " from ",
                          absl::StrJoin(missing, ", "));
    });
    if (ev.end) return End(*ev.end);
    if (!ev.lost.empty()) {
      // Another loss while recovering: start over with the larger set.
      return OnLoss(iteration, ev.lost, false, round, rerun, deadline);
    }
    if (!ev.cuts.empty()) return RunAgainAroundCuts(iteration, ev.cuts);
    for (auto& [worker, msg] : ev.messages) {
      if (msg.has_membership_ack() && msg.membership_ack().epoch() == epoch() &&
          msg.membership_ack().iteration() == iteration && membership_.IsMember(worker)) {
        acked.insert(worker);
        backward_ran.insert(msg.membership_ack().backward_ran().begin(),
                            msg.membership_ack().backward_ran().end());
        completed.insert(msg.membership_ack().completed().begin(),
                         msg.membership_ack().completed().end());
      } else if (msg.has_result()) {
        round->AddResult(worker, msg.result());
      }
    }
  }
  // Every microbatch whose route crosses a lost worker: completed (its
  // data node says so), dropped (some backward ran), or run again.
  std::vector<uint32_t> again;
  int dropped = 0;
  for (const auto& [mb, route] : routes_) {
    if (round->dropped().count(mb)) continue;
    bool crosses = false;
    for (const std::string& n : route.nodes()) {
      crosses |= membership_.lost_this_iteration().count(n) > 0;
    }
    if (!crosses || completed.count(mb)) continue;
    if (backward_ran.count(mb)) {
      round->Drop(mb);
      ++dropped;
    } else {
      again.push_back(mb);
    }
  }
  v1::CoordinatorMessage amend;
  v1::RouteAmendment* a = amend.mutable_reroute();
  a->set_job_id(job_id_);
  a->set_iteration(iteration);
  a->set_epoch(epoch());
  if (!again.empty()) {
    auto planned =
        plan_.PlanLive(spec_.seed() + iteration * 7919 + epoch(), static_cast<int>(again.size()),
                       nullptr, RunnerPlanner::kRerunEvaluations, std::nullopt);
    if (!planned.ok()) {
      return End(Failed(absl::StrCat("re-planning around ", absl::StrJoin(lost, ", "), ": ",
                                     planned.status().message())));
    }
    // Planned microbatch k stands for the k-th to run again.
    for (const sim::Route& planned_route : planned->plan.routes) {
      v1::Route r = planner::ToProtoRoute(plan_.cost(), planned_route);
      const uint32_t mb = again.at(static_cast<size_t>(planned_route.microbatch));
      r.set_microbatch(mb);
      r.set_epoch(epoch());
      routes_[mb] = r;
      *a->add_routes() = r;
    }
  }
  link_.SendToAll(amend);
  *rerun += static_cast<int>(again.size());
  host_->runner_metrics().Microbatches("rerun", static_cast<int>(again.size()));
  host_->runner_metrics().Microbatches("dropped", dropped);
  host_->runner_metrics().Recovered(absl::ToDoubleSeconds(absl::Now() - *recovering_since_));
  recovering_since_.reset();
  RecordStages();
  AddEvent(v1::JobHistoryEvent::KIND_REROUTED, iteration, "",
           absl::StrCat("iteration ", iteration, " epoch ", epoch(), ": re-planned ", again.size(),
                        " microbatch(es) around ",
                        absl::StrJoin(membership_.lost_this_iteration(), ", "),
                        again.empty() ? "" : absl::StrCat(" (", absl::StrJoin(again, ","), ")"),
                        dropped > 0 ? absl::StrCat(", dropped ", dropped) : "", " in ",
                        absl::FormatDuration(absl::Now() - detected)));
  return std::nullopt;
}

}  // namespace detour
