#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"
#include "coordinator/iteration_round.h"
#include "coordinator/planner/plan_proto.h"
#include "coordinator/planner/replica_sync_choice.h"
#include "coordinator/runner_checkpoints.h"
#include "coordinator/runner_link.h"
#include "coordinator/runner_membership.h"
#include "coordinator/runner_planner.h"
#include "coordinator/runner_record.h"
#include "coordinator/stage_reassignment.h"
#include "coordinator/stragglers.h"

namespace detour {

RunnerMetrics::RunnerMetrics(metrics::Registry* m) {
  if (m == nullptr) return;
  auto counter = [&](const char* name, const char* help) {
    return metrics::OptionalCounter(m, name, help);
  };
  recoveries = counter("detour_coordinator_recoveries",
                       "Recoveries of running jobs from lost workers (re-planned around them).");
  lost = counter("detour_coordinator_job_workers_lost", "Workers that left a running job.");
  joined = counter("detour_coordinator_job_workers_joined", "Workers that joined a running job.");
  reassigned = counter("detour_coordinator_job_workers_reassigned",
                       "Workers moved from one stage of a running job to another (the planner "
                       "predicted a gain repaying the move).");
  stragglers = counter("detour_coordinator_stragglers",
                       "Workers found persistently slower than their replicas or their "
                       "prediction (routed around with fewer visits).");
  if (auto f = m->AddHistogram("detour_coordinator_recovery_seconds",
                               "From the detection of a lost worker to the job running again "
                               "(re-planned microbatches sent, or the next iteration planned).",
                               metrics::DefaultLatencyBuckets());
      f.ok()) {
    if (auto h = (*f)->WithLabels({}); h.ok()) recovery_seconds = *h;
  }
  if (auto f = m->AddCounter("detour_coordinator_microbatches_recovered",
                             "Microbatches of iterations that lost a worker: rerun on new routes, "
                             "or dropped (their backward had partly run).",
                             {"outcome"});
      f.ok()) {
    microbatches = *f;
  }
  if (auto f =
          m->AddGauge("detour_coordinator_job_members", "Workers taking part in running jobs.");
      f.ok()) {
    if (auto g = (*f)->WithLabels({}); g.ok()) members = *g;
  }
}

void RunnerMetrics::Recovered(double seconds) {
  if (recoveries != nullptr) recoveries->Increment();
  if (recovery_seconds != nullptr) recovery_seconds->Observe(seconds);
}
void RunnerMetrics::Microbatches(const char* outcome, int n) {
  if (microbatches == nullptr || n <= 0) return;
  if (auto c = microbatches->WithLabels({outcome}); c.ok()) (void)(*c)->IncrementBy(n);
}
void RunnerMetrics::WorkerLost() {
  if (lost != nullptr) lost->Increment();
}
void RunnerMetrics::WorkerJoined() {
  if (joined != nullptr) joined->Increment();
}
void RunnerMetrics::WorkerReassigned() {
  if (reassigned != nullptr) reassigned->Increment();
}
void RunnerMetrics::StragglerFound() {
  if (stragglers != nullptr) stragglers->Increment();
}
void RunnerMetrics::MembersChanged(int delta) {
  if (members != nullptr) members->Increment(delta);
}

// The drive loop of one job. The parts it ties together each own one concern
// and are tested on their own: RunnerMembership (who is in the job, and the
// evidence that one is gone), RunnerPlanner (the cost model, the live plan
// and the K-FAC workload), RunnerCheckpoints, RunnerLink (messages to the
// members and their replay) and RunnerRecord (the stored job record). The
// loop itself waits for the workers' messages and makes the elastic
// decisions: join, move, pause, re-route (tests/coordinator/job_runner_test.cc
// drives it with fake workers).
class JobRunner::Impl {
 public:
  Impl(RunnerHost* host, std::string job_id, v1::JobSpec spec, std::vector<v1::WorkerInfo> workers,
       JobRunner::StartMode start)
      : host_(host),
        job_id_(std::move(job_id)),
        spec_(std::move(spec)),
        start_mode_(start),
        plan_(job_id_, &spec_, &host->options().network, &membership_),
        checkpoints_(host->options().checkpoint_root, job_id_),
        link_([host](const std::string& worker,
                     const v1::CoordinatorMessage& m) { return host->Send(worker, m); },
              job_id_, &membership_),
        record_(&host->jobs(), job_id_) {
    for (v1::WorkerInfo& w : workers) membership_.mutable_infos()[w.worker_id()] = std::move(w);
  }

  ~Impl() {
    RequestStop(JobEnd{v1::JOB_STATE_FAILED, "coordinator stopped while the job was running"});
    if (thread_.joinable()) thread_.join();
  }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  void Post(const std::string& worker_id, const v1::WorkerMessage& message) {
    absl::MutexLock lock(&mu_);
    inbox_.emplace_back(worker_id, message);
  }

  void Poke() {
    absl::MutexLock lock(&mu_);
    poked_ = true;
  }

  void RequestStop(JobEnd stop) {
    absl::MutexLock lock(&mu_);
    if (!stop_) stop_ = std::move(stop);
  }

  bool finished() const {
    absl::MutexLock lock(&mu_);
    return finished_;
  }

 private:
  using Message = std::pair<std::string, v1::WorkerMessage>;

  // What one wait brought: messages, workers found lost, or the end.
  struct Event {
    std::deque<Message> messages;
    std::vector<std::string> lost;  // already removed from the membership
    std::optional<JobEnd> end;
    bool changed = false;  // the registry changed (return_on_change)
  };

  // How an iteration ended.
  enum class Outcome { kDone, kRetry };

  void Run() {
    auto end = Drive();
    Finish(end);
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }

  bool elastic() const { return !spec_.elastic().disabled(); }
  bool kfac() const { return spec_.optimizer().kind() == v1::OPTIMIZER_KFAC; }
  const JobManagerOptions& options() const { return host_->options(); }
  const std::map<std::string, int>& members() const { return membership_.members(); }
  uint64_t epoch() const { return membership_.epoch(); }

  JobEnd Drive() {
    checkpoints_.Load(LastCheckpointOfRecord());
    if (start_mode_ == JobRunner::StartMode::kReattach) {
      if (auto e = Reattach(); e) return *e;
    } else {
      record_.SetState(
          v1::JOB_STATE_ASSIGNING,
          absl::StrCat("assigning stages to ", membership_.infos().size(), " workers"));
      if (auto e = Assign(); e) return *e;
    }
    record_.SetState(v1::JOB_STATE_RUNNING, "training");
    record_.MarkStarted();
    started_ = absl::Now();
    started_iteration_ = next_iteration_;
    reassign_epoch_ = epoch();
    while (next_iteration_ < spec_.iterations()) {
      if (auto e = Grow(); e) return *e;
      if (auto e = Reassign(); e) return *e;
      if (std::string why = plan_.Infeasible(); !why.empty()) {
        if (auto e = Pause(next_iteration_, why); e) return *e;
      }
      auto outcome = RunIteration(next_iteration_);
      if (!outcome.ok()) return *outcome.status_end;
      if (*outcome.outcome == Outcome::kDone) ++next_iteration_;
    }
    return {v1::JOB_STATE_SUCCEEDED, absl::StrCat("trained ", spec_.iterations(), " iterations")};
  }

  std::string LastCheckpointOfRecord() {
    auto job = host_->jobs().Get(job_id_);
    return job.ok() ? job->last_checkpoint() : "";
  }

  // --- messages and the record -------------------------------------------------

  v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                       const std::string& state_from,
                                       const std::string& restore_from) {
    v1::CoordinatorMessage m;
    v1::StageAssignment* a = m.mutable_assignment();
    a->set_job_id(job_id_);
    *a->mutable_spec() = spec_;
    a->set_stage(stage);
    auto layers = StageLayers(static_cast<int>(spec_.model().num_layers()),
                              static_cast<int>(spec_.pipeline().num_stages()), stage);
    if (layers.ok()) {
      a->set_layer_begin(layers->begin);
      a->set_layer_end(layers->end);
    }
    for (const v1::Peer& p : MemberPeers(membership_)) *a->add_peers() = p;
    for (const std::string& r : plan_.StageMembers(stage)) a->add_replica_group(r);
    a->set_seed(spec_.seed());
    a->set_worker_id(id);
    a->set_start_iteration(start);
    a->set_state_from(state_from);
    a->set_restore_from(restore_from);
    a->set_epoch(epoch());
    if (options().emulate_network) *a->mutable_emulate_network() = plan_.cluster();
    return m;
  }

  void AddReplicaGroups(google::protobuf::RepeatedPtrField<v1::ReplicaGroup>* groups) const {
    for (int s = 0; s < plan_.assignment().num_stages(); ++s) {
      v1::ReplicaGroup* g = groups->Add();
      g->set_stage(s);
      for (const std::string& id : plan_.StageMembers(s)) g->add_nodes(id);
    }
  }

  void AddEvent(v1::JobHistoryEvent::Kind kind, uint64_t iteration, const std::string& worker,
                const std::string& message) {
    record_.AddEvent(kind, iteration, worker, message, epoch());
  }

  // The job record's stage lists follow the membership.
  void RecordStages() {
    std::vector<std::vector<std::string>> stages;
    for (int s = 0; s < plan_.assignment().num_stages(); ++s) {
      stages.push_back(plan_.StageMembers(s));
    }
    record_.Stages(stages, epoch(), members().size());
  }

  // --- assignment --------------------------------------------------------------

  std::optional<JobEnd> Assign() {
    // A resumed job (or one started from another job's checkpoint) restores
    // every stage and continues at the checkpoint's iteration.
    std::string restore = spec_.checkpoint().resume_from();
    if (!restore.empty()) {
      auto done = RunnerCheckpoints::IterationOf(restore);
      if (!done.ok())
        return Failed(absl::StrCat("checkpoint.resume_from: ", done.status().message()));
      if (*done >= spec_.iterations()) {
        return Failed(absl::StrCat("checkpoint.resume_from: ", restore, " was taken after ", *done,
                                   " iterations; the job has only ", spec_.iterations()));
      }
      next_iteration_ = *done;
    }
    for (const auto& [id, w] : membership_.infos()) membership_.mutable_node_order().push_back(id);
    if (absl::Status s = plan_.BuildCostModel(); !s.ok()) return Failed(s.message());
    // The plan of iteration i is seeded with seed + i, resumed or not.
    auto first = plan_.PlanFirst(spec_.seed() + next_iteration_);
    if (!first.ok()) return Failed(absl::StrCat("planner: ", first.status().message()));
    const sim::StageAssignment& assignment = plan_.assignment();
    for (int s = 0; s < assignment.num_stages(); ++s) {
      for (int n : assignment.stage_nodes[s]) membership_.Set(plan_.cost().node_id(n), s);
    }
    host_->runner_metrics().MembersChanged(static_cast<int>(members().size()));
    if (auto e = ResolveReplicaSync(); e) return e;
    if (auto e = CreateBubblePlanner(); e) return e;
    if (!restore.empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_RESUMED, next_iteration_, "",
               absl::StrCat("resuming from checkpoint ", restore, " at iteration ", next_iteration_,
                            " on ", members().size(), " workers (",
                            spec_.pipeline().replicas_per_stage(), " per stage)"));
      // Progress restarts at the checkpoint: what came after it is redone.
      record_.RestartProgressAt(next_iteration_, spec_.iterations());
    }
    if (restore.empty() && !spec_.checkpoint().init_from().empty()) {
      LogInfo("job ", job_id_, ": workers initialise their stages from ",
              spec_.checkpoint().init_from(), " (checkpoint.init_from)");
    }
    RecordStages();
    std::set<std::string> waiting;
    for (const auto& [id, s] : members()) {
      waiting.insert(id);
      if (!link_.SendTo(id, AssignmentFor(id, s, next_iteration_, "", restore))) {
        return Failed(absl::StrCat("worker ", id, " has no open session"));
      }
    }
    return AwaitStageReady(waiting, "stage builds of ");
  }

  std::optional<JobEnd> AwaitStageReady(std::set<std::string> waiting, const char* what) {
    const absl::Time deadline = absl::Now() + options().assign_timeout;
    while (!waiting.empty()) {
      Event ev = Wait(deadline, [&] { return absl::StrCat(what, absl::StrJoin(waiting, ", ")); });
      if (ev.end) return ev.end;
      // A worker lost while building fails the job: there is nothing to
      // recover yet.
      if (!ev.lost.empty()) {
        return Failed(absl::StrCat("worker ", absl::StrJoin(ev.lost, ", "),
                                   " lost while building its stage"));
      }
      for (auto& [worker, m] : ev.messages) {
        if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_) waiting.erase(worker);
      }
    }
    LogInfo("job ", job_id_, ": all ", members().size(), " stages built");
    return std::nullopt;
  }

  // optimizer.kfac.replica_sync AUTO: FACTORS or PRECONDITIONED for the
  // whole job, from the cost model on the first plan's timeline
  // (planner::ChooseReplicaSync). The choice goes into spec_ (the workers'
  // assignments carry it), into the stored job's spec before any worker
  // holds a stage (a resumed or re-attached job keeps it), and into the
  // history with both modelled iteration times.
  std::optional<JobEnd> ResolveReplicaSync() {
    v1::KfacSpec* k = spec_.mutable_optimizer()->mutable_kfac();
    if (!kfac() || k->replica_sync() != v1::KFAC_REPLICA_SYNC_AUTO) return std::nullopt;
    if (!plan_.first_plan()) {
      // A re-attached job's stored spec holds the choice made before its
      // stages were recorded; without a first plan there is nothing to judge.
      return Failed("K-FAC replica sync: AUTO was never resolved for this job; resume it");
    }
    const planner::PlannedIteration& first = *plan_.first_plan();
    auto choice =
        planner::ChooseReplicaSync(plan_.KfacWorkload(kfac::ReplicaSync::kFactors), *k, first.plan,
                                   planner::TimelineFromSimulation(first.result));
    if (!choice.ok()) {
      return Failed(absl::StrCat("K-FAC replica sync choice: ", choice.status().message()));
    }
    const bool factors = choice->sync == kfac::ReplicaSync::kFactors;
    const v1::KfacReplicaSync chosen =
        factors ? v1::KFAC_REPLICA_SYNC_FACTORS : v1::KFAC_REPLICA_SYNC_PRECONDITIONED;
    k->set_replica_sync(chosen);
    k->set_sync_factors(factors);
    if (absl::Status recorded = record_.ReplicaSync(chosen, factors); !recorded.ok()) {
      return Failed(absl::StrCat("cannot write the job record: ", recorded.message()));
    }
    LogInfo("job ", job_id_, ": ", choice->reason);
    AddEvent(v1::JobHistoryEvent::KIND_CONFIGURED, next_iteration_, "", choice->reason);
    return std::nullopt;
  }

  std::optional<JobEnd> CreateBubblePlanner() {
    if (absl::Status s = plan_.CreateBubblePlanner(); !s.ok()) {
      return Failed(absl::StrCat("K-FAC bubble planner: ", s.message()));
    }
    return std::nullopt;
  }

  // --- re-attaching after a coordinator restart -----------------------------------

  std::optional<JobEnd> Reattach() {
    auto stored = host_->jobs().Get(job_id_);
    if (!stored.ok()) return Failed(std::string(stored.status().message()));
    membership_.set_epoch(stored->epoch() + 1);
    for (int s = 0; s < stored->stages_size(); ++s) {
      for (const std::string& id : stored->stages(s).nodes()) membership_.Set(id, s);
    }
    if (members().empty()) {
      return Failed("coordinator restarted before the job's stages were assigned; resume it");
    }
    record_.SetState(v1::JOB_STATE_RUNNING, absl::StrCat("re-attaching to ", members().size(),
                                                         " workers after a coordinator restart"));
    // Workers re-register and report what they hold (JobStatus) once their
    // session reopens.
    std::map<std::string, v1::JobStatus> status;
    const absl::Time deadline = absl::Now() + options().assign_timeout;
    while (status.size() < members().size() && absl::Now() < deadline) {
      Event ev = Wait(
          deadline, [&] { return "workers to re-attach"; }, /*detect_loss=*/false);
      if (ev.end && StopRequested()) return ev.end;
      if (ev.end) break;  // timed out: the missing ones are lost
      for (auto& [worker, m] : ev.messages) {
        if (m.has_job_status() && m.job_status().job_id() == job_id_ &&
            membership_.IsMember(worker)) {
          status[worker] = m.job_status();
        }
      }
    }
    for (const v1::WorkerInfo& w : host_->registry().List(true)) {
      if (membership_.IsMember(w.worker_id())) membership_.mutable_infos()[w.worker_id()] = w;
    }
    std::vector<std::string> missing;
    for (const auto& [id, stage] : std::map<std::string, int>(members())) {
      if (status.count(id) && membership_.infos().count(id)) continue;
      missing.push_back(id);
      host_->Unreserve(job_id_, id);
      membership_.Remove(id);
    }
    for (const auto& [id, s] : members()) membership_.mutable_node_order().push_back(id);
    std::set<uint64_t> completed;
    for (const auto& [id, st] : status) {
      if (membership_.IsMember(id)) completed.insert(st.completed_iterations());
    }
    if (members().empty() || completed.size() != 1) {
      return Failed(absl::StrCat("coordinator restarted; ",
                                 members().empty() ? "no worker of the job came back"
                                                   : "the workers stopped at different "
                                                     "iterations",
                                 "; resume the job from its last checkpoint (detourctl resume ",
                                 job_id_, ")"));
    }
    next_iteration_ = *completed.begin();
    if (absl::Status s = plan_.BuildCostModel(); !s.ok()) return Failed(s.message());
    plan_.RebuildAssignment();
    host_->runner_metrics().MembersChanged(static_cast<int>(members().size()));
    if (auto e = ResolveReplicaSync(); e) return e;
    if (auto e = CreateBubblePlanner(); e) return e;
    // Whatever iteration was in flight is run again from its start.
    v1::CoordinatorMessage abort;
    abort.mutable_abort()->set_job_id(job_id_);
    abort.mutable_abort()->set_iteration(next_iteration_);
    abort.mutable_abort()->set_reason("the coordinator restarted; the iteration runs again");
    link_.SendToAll(abort);
    for (const std::string& id : missing) {
      AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
               absl::StrCat("worker ", id, " did not come back after the coordinator restarted"));
    }
    AddEvent(v1::JobHistoryEvent::KIND_REATTACHED, next_iteration_, "",
             absl::StrCat("re-attached ", members().size(),
                          " workers after a coordinator "
                          "restart; continuing at iteration ",
                          next_iteration_));
    if (std::string why = plan_.Infeasible(); !why.empty()) {
      if (auto e = Pause(next_iteration_, why); e) return e;
    }
    RecordStages();
    return std::nullopt;
  }

  // --- one iteration ------------------------------------------------------------

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
  };

  // One iteration: plan, send, collect norms / step / results (re-planning
  // around workers lost meanwhile), check, checkpoint, record.
  IterationOutcome RunIteration(uint64_t iteration) {
    const absl::Time begin = absl::Now();
    link_.StartIteration();
    membership_.StartIteration();
    auto planned = plan_.PlanIteration(iteration, next_iteration_, epoch());
    if (!planned.ok()) return End(Failed(absl::StrCat("planner: ", planned.status().message())));
    auto message = PlanMessage(iteration, *planned);
    if (!message.ok()) return End(Failed(message.status().message()));
    const v1::IterationPlan& plan = message->plan();
    routes_.clear();
    for (const v1::Route& r : plan.routes()) routes_[r.microbatch()] = r;
    IterationRound round(iteration, plan_.total_microbatches(), members(), epoch());
    link_.SendPlan(*message);
    Collected collected;
    collected.overhead = absl::Now() - begin;
    if (recovering_since_) {
      host_->runner_metrics().Recovered(absl::ToDoubleSeconds(absl::Now() - *recovering_since_));
      recovering_since_.reset();
    }
    const absl::Time deadline = absl::Now() + options().iteration_timeout;
    if (auto outcome = Collect(iteration, deadline, &round, &collected); outcome) return *outcome;

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
    if (plan.checkpoint()) {
      if (auto s =
              CommitCheckpoint(iteration + 1, plan.checkpoint_dir(), round.results(), deadline);
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
    plan_.KeepRoutes(*planned);
    AdaptCosts(iteration, plan, collected.timings);
    return Done(Outcome::kDone);
  }

  // The iteration's plan for every worker: routes, replica groups, peers,
  // K-FAC bubble tasks, checkpoint.
  absl::StatusOr<v1::CoordinatorMessage> PlanMessage(uint64_t iteration,
                                                     const planner::PlannedIteration& planned) {
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
  std::optional<IterationOutcome> Collect(uint64_t iteration, absl::Time deadline,
                                          IterationRound* round, Collected* collected) {
    bool stepped = false;
    while (!round->ResultsComplete()) {
      Event ev = Wait(deadline, [&] {
        return absl::StrCat(
            stepped ? "iteration results" : "gradient norms", " of iteration ", iteration, " from ",
            absl::StrJoin(stepped ? round->MissingResults() : round->MissingNorms(), ", "));
      });
      if (ev.end) return End(*ev.end);
      if (!ev.lost.empty()) {
        auto handled = OnLoss(iteration, ev.lost, stepped, round, &collected->rerun, deadline);
        if (handled) return *handled;
      }
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
        link_.SendToAll(step);
        stepped = true;
        collected->overhead += absl::Now() - step_start;
      }
    }
    return std::nullopt;
  }

  // Progress of the finished iteration into the job record (durably: a job
  // whose record cannot be written stops).
  std::optional<JobEnd> RecordProgress(uint64_t iteration, double loss, const IterationRound& round,
                                       const v1::IterationPlan& plan, const Collected& collected,
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
    if (absl::Status recorded = record_.Iteration(r); !recorded.ok()) {
      // Training on without a durable record would leave the job's state to
      // chance after a restart: stop, with the reason.
      return Failed(absl::StrCat("cannot write the job record: ", recorded.message()));
    }
    LogDebug("job ", job_id_, " iteration ", iteration, " loss ", loss, " in ", r.seconds, " s");
    return std::nullopt;
  }

  // Every --replan_every iterations: node speeds and links from the timing
  // reports, and K-FAC costs from the bubble tasks' measured speed.
  void AdaptCosts(uint64_t iteration, const v1::IterationPlan& plan,
                  const std::map<std::string, v1::TimingReport>& timings) {
    const int every = options().replan_every;
    planner::BubblePlanner* bubbles = plan_.bubbles();
    if (bubbles != nullptr) plan_.MeasureKfacSpeeds(plan, timings);
    if (every <= 0 || (iteration + 1) % every != 0) return;
    bool rebuilt = false;
    NoteStragglers(iteration, plan_.UpdateSpeedsFromTimings(host_->estimates(), &rebuilt));
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
  void NoteStragglers(uint64_t iteration, const std::vector<ForwardSample>& samples) {
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
  std::optional<JobEnd> CommitCheckpoint(uint64_t iterations_done, const std::string& dir,
                                         const std::map<std::string, v1::IterationResult>& results,
                                         absl::Time deadline) {
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
      Event ev = Wait(deadline, [&] { return absl::StrCat("checkpoint ", dir); });
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
    record_.LastCheckpoint(dir);
    return std::nullopt;
  }

  // --- losing workers --------------------------------------------------------------

  // Workers were lost during `iteration`. Before the step: freeze what
  // crossed them, re-plan what can run again, drop the rest. After the step:
  // the survivors' results are the iteration's.
  std::optional<IterationOutcome> OnLoss(uint64_t iteration, const std::vector<std::string>& lost,
                                         bool stepped, IterationRound* round, int* rerun,
                                         absl::Time deadline) {
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
      if (auto e = Pause(iteration, why); e) return End(*e);
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
      Event ev = Wait(deadline, [&] {
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
             absl::StrCat("iteration ", iteration, " epoch ", epoch(), ": re-planned ",
                          again.size(), " microbatch(es) around ",
                          absl::StrJoin(membership_.lost_this_iteration(), ", "),
                          again.empty() ? "" : absl::StrCat(" (", absl::StrJoin(again, ","), ")"),
                          dropped > 0 ? absl::StrCat(", dropped ", dropped) : "", " in ",
                          absl::FormatDuration(absl::Now() - detected)));
    return std::nullopt;
  }

  // Removes `id` from the membership (a new epoch), tells it to drop the job
  // in case it is alive, and records the event.
  void RemoveMember(const std::string& id, const std::string& why, uint64_t iteration) {
    const int stage = membership_.Remove(id);
    if (stage < 0) return;
    membership_.ClearSuspicion(id);
    membership_.BumpEpoch();
    plan_.RebuildAssignment();
    plan_.ForgetRoutes();  // the warm start routes through it
    host_->Unreserve(job_id_, id);
    host_->runner_metrics().WorkerLost();
    host_->runner_metrics().MembersChanged(-1);
    v1::CoordinatorMessage cancel;
    cancel.mutable_cancel()->set_job_id(job_id_);
    cancel.mutable_cancel()->set_reason(absl::StrCat("left the job: ", why));
    link_.SendOnce(id, cancel);
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, iteration, id,
             absl::StrCat("worker ", id, " (stage ", stage, ") lost: ", why));
    if (plan_.assignment().stage_nodes[stage].empty() && plan_.Infeasible().empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_REROUTED, iteration, "",
               absl::StrCat("stage ", stage,
                            " has no worker left: every route skips it until a "
                            "worker joins (no checkpoints meanwhile)"));
    }
    straggler_replans_.erase(id);
    stragglers_.erase(id);
    plan_.KfacMembershipChanged();
  }

  // The members found lost now (removed from the membership).
  std::vector<std::string> DetectLoss() {
    std::vector<std::string> lost;
    const auto gone = membership_.Judge(host_->registry().List(true), absl::Now(),
                                        absl::Milliseconds(spec_.elastic().reconnect_grace_ms()),
                                        host_->registry().silence());
    for (const auto& [id, why] : gone) {
      membership_.set_loss_reason(why);
      RemoveMember(id, why, next_iteration_);
      lost.push_back(id);
    }
    return lost;
  }

  // Waits until a message arrives, the deadline passes, a worker of the job
  // is lost or reports an error, or the job is stopped.
  template <typename Describe>
  Event Wait(absl::Time deadline, Describe describe, bool detect_loss = true,
             bool return_on_change = false) {
    Event ev;
    bool first = true;
    while (true) {
      bool check = false;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) {
          ev.end = stop_;
          return ev;
        }
        // The registry changed, suspicions are pending, or a while passed.
        check = poked_ || membership_.HasSuspects() || absl::Now() - last_loss_check_ > kLossCheck;
        if (poked_ && return_on_change && !first) {
          poked_ = false;
          ev.changed = true;
          return ev;
        }
        if (!return_on_change) poked_ = false;
      }
      first = false;
      if (detect_loss && check) {
        last_loss_check_ = absl::Now();
        std::vector<std::string> lost = DetectLoss();
        if (!lost.empty()) {
          if (!elastic()) {
            ev.end =
                Failed(absl::StrCat("worker ", absl::StrJoin(lost, ", "), " lost (",
                                    membership_.loss_reason(), ") while waiting for ", describe()));
            return ev;
          }
          ev.lost = std::move(lost);
          return ev;
        }
      }
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !inbox_.empty() || stop_.has_value() || poked_;
        };
        mu_.AwaitWithTimeout(absl::Condition(&ready), kLossCheck);
        ev.messages.swap(inbox_);
      }
      for (auto it = ev.messages.begin(); it != ev.messages.end();) {
        const auto& [worker, m] = *it;
        if (m.has_error() && m.error().job_id() == job_id_ && membership_.IsMember(worker)) {
          ev.end = Failed(m.error().message());
          return ev;
        }
        if (m.has_job_status()) {
          OnJobStatus(worker, m.job_status());
        } else if (m.has_peer_unreachable() && m.peer_unreachable().job_id() == job_id_ &&
                   membership_.IsMember(worker)) {
          membership_.Suspect(
              m.peer_unreachable().peer(),
              absl::StrCat(worker, " could not reach it (", m.peer_unreachable().message(), ")"),
              absl::Now());
        }
        ++it;
      }
      if (!ev.messages.empty()) return ev;
      if (absl::Now() > deadline) {
        ev.end = Failed(absl::StrCat("timed out waiting for ", describe()));
        return ev;
      }
    }
  }

  // A member's session reopened (or the coordinator restarted): it still
  // holds the job. What it may have missed is sent again.
  void OnJobStatus(const std::string& worker, const v1::JobStatus& status) {
    if (status.job_id() != job_id_ || !membership_.IsMember(worker)) return;
    membership_.ClearSuspicion(worker);
    for (const v1::WorkerInfo& w : host_->registry().List(true)) {
      if (w.worker_id() == worker) membership_.mutable_infos()[worker] = w;
    }
    link_.Replay(worker);
  }

  // --- pausing and joining ---------------------------------------------------------

  // The live members cannot train: abort the iteration, wait for workers to
  // fill the gaps (pause_timeout_s), then run the iteration again.
  std::optional<JobEnd> Pause(uint64_t iteration, const std::string& why) {
    v1::CoordinatorMessage abort;
    abort.mutable_abort()->set_job_id(job_id_);
    abort.mutable_abort()->set_iteration(iteration);
    abort.mutable_abort()->set_reason(absl::StrCat("paused: ", why));
    link_.SendToAll(abort);
    const uint32_t timeout_s = spec_.elastic().pause_timeout_s();
    // The state first: whoever sees the event also sees the paused state.
    record_.SetState(v1::JOB_STATE_RUNNING, absl::StrCat("paused: ", why, "; waiting for workers"));
    AddEvent(v1::JobHistoryEvent::KIND_PAUSED, iteration, "",
             absl::StrCat("paused at iteration ", iteration, ": ", why, "; waiting up to ",
                          timeout_s, " s for workers to join"));
    if (spec_.elastic().never_join()) {
      return Failed(absl::StrCat(why, " and elastic.never_join forbids replacements"));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
    while (!plan_.Infeasible().empty()) {
      if (auto e = Grow(); e) return e;
      if (auto e = Reassign(); e) return e;
      if (plan_.Infeasible().empty()) break;
      Event ev = Wait(
          deadline, [&] { return absl::StrCat("workers to join (", why, ")"); },
          /*detect_loss=*/true, /*return_on_change=*/true);
      if (ev.end) return ev.end;
    }
    record_.SetState(v1::JOB_STATE_RUNNING, "training");
    AddEvent(v1::JobHistoryEvent::KIND_CONTINUED, iteration, "",
             absl::StrCat("continuing at iteration ", iteration, " with ", members().size(),
                          " workers"));
    return std::nullopt;
  }

  // At an iteration boundary: idle workers join where the job lacks
  // capacity, the empty stages first, then the stage whose new replica the
  // planner predicts the shortest iteration for.
  std::optional<JobEnd> Grow() {
    if (spec_.elastic().never_join() || !elastic()) return std::nullopt;
    std::map<int, int> deficit = RunnerMembership::Deficit(spec_.pipeline(), plan_.StageSizes());
    int wanted = 0;
    for (const auto& [s, n] : deficit) wanted += n;
    if (wanted == 0) return std::nullopt;
    std::vector<v1::WorkerInfo> idle =
        host_->ReserveIdle(job_id_, wanted, membership_.NotJoinable(absl::Now()));
    for (v1::WorkerInfo& w : idle) {
      const int stage = ChooseStage(w, deficit);
      if (auto e = Join(w, stage); e) return e;
      if (--deficit[stage] == 0) deficit.erase(stage);
    }
    return std::nullopt;
  }

  int ChooseStage(const v1::WorkerInfo& w, const std::map<int, int>& deficit) {
    for (const auto& [s, n] : deficit) {
      if (plan_.assignment().stage_nodes[s].empty()) return s;
    }
    if (deficit.size() == 1) return deficit.begin()->first;
    // Judge each candidate by the plan it allows (a quick route search), with
    // `w` tried in each stage; then everything is put back as it was. `w` may
    // be a worker the job had before (lost, then back and idle): it keeps its
    // entry and node index, which BuildCostModel needs for every node.
    int best = deficit.begin()->first;
    double best_time = std::numeric_limits<double>::infinity();
    const std::string id = w.worker_id();
    auto& infos = membership_.mutable_infos();
    const auto had_info = infos.find(id);
    const std::optional<v1::WorkerInfo> old_info =
        had_info != infos.end() ? std::optional<v1::WorkerInfo>(had_info->second) : std::nullopt;
    const bool had_node = membership_.HasNode(id);
    membership_.Admit(w);
    if (plan_.BuildCostModel().ok()) {
      for (const auto& [s, n] : deficit) {
        membership_.Set(id, s);
        plan_.RebuildAssignment();
        auto p = plan_.PlanLive(spec_.seed() + s, plan_.total_microbatches(), nullptr,
                                RunnerPlanner::kQuickEvaluations, std::nullopt);
        if (p.ok() && p->result.iteration_time_s < best_time) {
          best_time = p->result.iteration_time_s;
          best = s;
        }
      }
    }
    membership_.Remove(id);
    if (!had_node) membership_.mutable_node_order().pop_back();
    if (old_info.has_value()) {
      infos[id] = *old_info;
    } else {
      infos.erase(id);
    }
    plan_.BuildCostModel().IgnoreError();
    plan_.RebuildAssignment();
    return best;
  }

  // `w` joins stage `stage` at the next iteration: it builds the stage and
  // receives a live replica's state (or the newest checkpoint's). With
  // `move`, `w` is a member moving from move->from (it already left it): it
  // drops that stage and takes the new one the same way.
  std::optional<JobEnd> Join(const v1::WorkerInfo& w, int stage, const StageMove* move = nullptr) {
    const std::string id = w.worker_id();
    membership_.Admit(w);
    if (absl::Status s = plan_.BuildCostModel(); !s.ok()) return Failed(s.message());
    const std::vector<std::string> replicas = plan_.StageMembers(stage);
    const std::string donor = replicas.empty() ? "" : replicas.front();
    membership_.Set(id, stage);
    membership_.BumpEpoch();
    plan_.RebuildAssignment();
    plan_.ForgetRoutes();
    if (move == nullptr) host_->runner_metrics().MembersChanged(1);
    plan_.KfacMembershipChanged();
    const std::string restore = donor.empty() ? checkpoints_.last() : "";
    const std::string verb = move == nullptr ? "join" : "move to";
    auto fail_join = [&](const std::string& why) -> std::optional<JobEnd> {
      // Not again for a while: a worker that cannot join would otherwise be
      // tried at every iteration.
      membership_.BackOff(id, absl::Now() + kJoinBackoff);
      AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
               absl::StrCat("worker ", id, " could not ", verb, " stage ", stage, ": ", why));
      RemoveMember(id, why, next_iteration_);
      return std::nullopt;
    };
    const absl::Time begin = absl::Now();
    if (!link_.SendTo(id, AssignmentFor(id, stage, next_iteration_, donor, restore))) {
      return fail_join("it has no open session");
    }
    const absl::Time deadline = absl::Now() + options().assign_timeout;
    bool ready = false;
    bool received = donor.empty();
    uint64_t checksum = 0;
    while (!ready || !received) {
      Event ev = Wait(deadline,
                      [&] { return absl::StrCat("worker ", id, " to ", verb, " stage ", stage); });
      if (ev.end) {
        if (ev.end->state == v1::JOB_STATE_FAILED && !StopRequested()) {
          return fail_join(ev.end->message);
        }
        return ev.end;
      }
      if (!ev.lost.empty()) {
        if (!membership_.IsMember(id)) return std::nullopt;  // the joiner itself
        if (!donor.empty() && !membership_.IsMember(donor)) return fail_join("its donor was lost");
      }
      for (auto& [worker, m] : ev.messages) {
        if (worker != id) continue;
        if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_ && !ready) {
          ready = true;
          if (!donor.empty()) {
            v1::CoordinatorMessage send;
            send.mutable_send_state()->set_job_id(job_id_);
            send.mutable_send_state()->set_to(id);
            send.mutable_send_state()->set_epoch(epoch());
            for (const v1::Peer& p : MemberPeers(membership_)) {
              if (p.worker_id() == id) *send.mutable_send_state()->mutable_peer() = p;
            }
            link_.SendTo(donor, send);
          }
        } else if (m.has_state_received() && m.state_received().job_id() == job_id_) {
          received = true;
          checksum = m.state_received().parameter_checksum();
        }
      }
    }
    if (!donor.empty() && last_checksum_.count(stage) && checksum != last_checksum_.at(stage)) {
      return fail_join(absl::StrCat("the state it received has checksum ", checksum,
                                    ", its replicas ", last_checksum_.at(stage)));
    }
    RecordStages();
    const std::string source =
        donor.empty() ? (restore.empty() ? " (fresh parameters: no replica or checkpoint was left)"
                                         : absl::StrCat(" from checkpoint ", restore))
                      : absl::StrCat(" with the state of ", donor);
    if (move == nullptr) {
      host_->runner_metrics().WorkerJoined();
      AddEvent(v1::JobHistoryEvent::KIND_WORKER_JOINED, next_iteration_, id,
               absl::StrCat("worker ", id, " joined stage ", stage, " at iteration ",
                            next_iteration_, source));
      return std::nullopt;
    }
    host_->runner_metrics().WorkerReassigned();
    AddEvent(
        v1::JobHistoryEvent::KIND_REASSIGNED, next_iteration_, id,
        absl::StrCat("worker ", id, " moved from stage ", move->from, " to stage ", stage,
                     " at iteration ", next_iteration_, source, " in ",
                     absl::FormatDuration(absl::Trunc(absl::Now() - begin, absl::Milliseconds(1))),
                     " (", MoveReason(*move), ")"));
    return std::nullopt;
  }

  // --- moving workers between stages -----------------------------------------------

  // At an iteration boundary after a membership change or a re-plan with
  // measured speeds: moves one worker from a stage with spare replicas to
  // another stage when the planner predicts a gain that repays the move
  // within the horizon, or to a stage left empty (stage_reassignment.h).
  std::optional<JobEnd> Reassign() {
    if (!elastic() || spec_.elastic().reassign_disabled()) return std::nullopt;
    if (epoch() == reassign_epoch_ && plan_.cost_version() == reassign_costs_) return std::nullopt;
    reassign_epoch_ = epoch();
    reassign_costs_ = plan_.cost_version();
    const uint64_t left = spec_.iterations() - next_iteration_;
    const uint64_t horizon =
        std::min<uint64_t>(spec_.elastic().reassign_horizon_iterations(), left);
    if (horizon == 0) return std::nullopt;
    std::vector<std::vector<std::string>> stages;
    for (int s = 0; s < plan_.assignment().num_stages(); ++s) {
      stages.push_back(plan_.StageMembers(s));
    }
    auto seconds = [this](const std::string& id, int stage) {
      const int n = plan_.cost().NodeIndex(id);
      return n < 0 ? 0.0 : plan_.cost().ForwardTime(n, stage) + plan_.cost().BackwardTime(n, stage);
    };
    std::vector<StageMove> moves = CandidateMoves(stages, seconds, /*limit=*/-1);
    if (moves.empty()) return std::nullopt;
    // Every candidate is judged by the same quick route search.
    const uint64_t seed = spec_.seed() + next_iteration_;
    const double current = plan_.PredictIteration(seed);
    if (std::isfinite(current)) {  // workers that can train: recent moves settle first
      const size_t before = moves.size();
      moves.erase(std::remove_if(moves.begin(), moves.end(),
                                 [&](const StageMove& m) {
                                   return MoveMustSettle(m, made_moves_, next_iteration_, epoch());
                                 }),
                  moves.end());
      if (moves.size() < before) {
        LogDebug("job ", job_id_, ": ", before - moves.size(),
                 " stage move(s) wait for a recent move of their worker to settle");
      }
    }
    if (moves.size() > static_cast<size_t>(kMoveCandidates)) moves.resize(kMoveCandidates);
    if (moves.empty()) return std::nullopt;
    for (StageMove& m : moves) {
      membership_.Set(m.worker, m.to);
      plan_.RebuildAssignment();
      m.predicted_iteration_s = plan_.PredictIteration(seed);
      membership_.Set(m.worker, m.from);
      plan_.RebuildAssignment();
      m.cost_s = plan_.MoveCost(m, absl::ToDoubleSeconds(kMovePause));
    }
    std::optional<StageMove> move = ChooseMove(current, moves, horizon);
    if (!move) {
      LogDebug("job ", job_id_, ": no stage move pays within ", horizon, " iterations (",
               moves.size(), " judged)");
      return std::nullopt;
    }
    move_baseline_s_ = current;
    LogInfo("job ", job_id_, ": moving worker ", move->worker, " from stage ", move->from,
            " to stage ", move->to, " (", MoveReason(*move), ")");
    membership_.Remove(move->worker);
    plan_.RebuildAssignment();
    std::optional<JobEnd> end = Join(membership_.infos().at(move->worker), move->to, &*move);
    auto moved = members().find(move->worker);
    if (!end && moved != members().end() && moved->second == move->to) {
      made_moves_[move->worker] = MadeMove{next_iteration_, horizon, epoch()};
    }
    return end;
  }

  std::string MoveReason(const StageMove& m) const {
    if (m.fills_empty_stage) {
      return absl::StrFormat("stage %d had no worker; predicted iteration %.3g s", m.to,
                             m.predicted_iteration_s);
    }
    if (!std::isfinite(move_baseline_s_)) {
      return absl::StrFormat("the workers left could not train; predicted iteration %.3g s",
                             m.predicted_iteration_s);
    }
    const double gain = move_baseline_s_ - m.predicted_iteration_s;
    return absl::StrFormat(
        "predicted iteration %.3g s -> %.3g s; the move costs %.3g s, repaid in %.1f iterations",
        move_baseline_s_, m.predicted_iteration_s, m.cost_s, gain > 0 ? m.cost_s / gain : 0.0);
  }

  bool StopRequested() const {
    absl::MutexLock lock(&mu_);
    return stop_.has_value();
  }

  // --- the end ---------------------------------------------------------------------

  JobEnd Failed(absl::string_view message) const {
    return JobEnd{v1::JOB_STATE_FAILED, std::string(message)};
  }

  void Finish(const JobEnd& end) {
    // Release every worker of the job, whatever the outcome.
    for (const auto& [id, s] : members()) {
      v1::CoordinatorMessage m;
      m.mutable_cancel()->set_job_id(job_id_);
      m.mutable_cancel()->set_reason(end.message);
      link_.SendOnce(id, m);
    }
    host_->runner_metrics().MembersChanged(-static_cast<int>(members().size()));
    host_->Release(job_id_);
    record_.End(end);
    if (end.state == v1::JOB_STATE_FAILED) {
      LogWarning("job ", job_id_, " failed: ", end.message);
    } else {
      LogInfo("job ", job_id_, " ", v1::JobState_Name(end.state), ": ", end.message);
    }
  }

  RunnerHost* const host_;
  const std::string job_id_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::deque<Message> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<JobEnd> stop_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;

  // Runner-thread state: the parts, then the loop's own.
  v1::JobSpec spec_;
  const JobRunner::StartMode start_mode_;
  RunnerMembership membership_;
  RunnerPlanner plan_;
  RunnerCheckpoints checkpoints_;
  RunnerLink link_;
  RunnerRecord record_;

  uint64_t next_iteration_ = 0;
  uint64_t started_iteration_ = 0;
  absl::Time started_;
  // This iteration's routes (re-runs replace theirs).
  std::map<uint32_t, v1::Route> routes_;
  std::map<uint32_t, uint64_t> last_checksum_;  // stage -> parameters after the last step
  std::optional<absl::Time> recovering_since_;
  absl::Time last_loss_check_ = absl::InfinitePast();
  static constexpr absl::Duration kLossCheck = absl::Milliseconds(500);
  // Stage reassignment: the epoch and cost model last judged, and the
  // iteration time predicted before the move being made.
  uint64_t reassign_epoch_ = 0;
  uint64_t reassign_costs_ = 0;
  double move_baseline_s_ = 0;
  // Each worker's last stage move (MoveMustSettle).
  std::map<std::string, MadeMove> made_moves_;
  static constexpr int kMoveCandidates = 4;
  static constexpr absl::Duration kMovePause = absl::Seconds(1);
  // Stragglers: consecutive re-plans each worker was found slow at, and
  // those recorded as stragglers (worker -> slowdown).
  std::map<std::string, int> straggler_replans_;
  std::map<std::string, double> stragglers_;
  static constexpr double kStragglerFactor = 2.0;
  static constexpr int kStragglerReplans = 3;
  static constexpr absl::Duration kJoinBackoff = absl::Seconds(60);
  uint64_t recoveries_ = 0;
  double last_loss_ = 0;
  uint64_t rerun_total_ = 0;
  uint64_t dropped_total_ = 0;
};

JobRunner::JobRunner(RunnerHost* host, std::string job_id, v1::JobSpec spec,
                     std::vector<v1::WorkerInfo> workers, StartMode start)
    : impl_(std::make_unique<Impl>(host, std::move(job_id), std::move(spec), std::move(workers),
                                   start)) {}
JobRunner::~JobRunner() = default;
void JobRunner::Start() { impl_->Start(); }
void JobRunner::Post(const std::string& worker_id, const v1::WorkerMessage& message) {
  impl_->Post(worker_id, message);
}
void JobRunner::Poke() { impl_->Poke(); }
void JobRunner::RequestStop(JobEnd stop) { impl_->RequestStop(std::move(stop)); }
bool JobRunner::finished() const { return impl_->finished(); }

}  // namespace detour
