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
#include "coordinator/runner_elastic.h"
#include "coordinator/runner_iteration.h"
#include "coordinator/runner_links.h"
#include "coordinator/runner_part.h"
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
  links_cut = counter("detour_coordinator_links_cut",
                      "Links between two live members of a running job found cut (one could not "
                      "reach the other while both talked to the coordinator); routed around.");
  outsider_messages = counter("detour_coordinator_outsider_messages",
                              "Session messages about a job from registered workers the job "
                              "never had (ignored; the log names the kind).");
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
void RunnerMetrics::LinkCut() {
  if (links_cut != nullptr) links_cut->Increment();
}
void RunnerMetrics::OutsiderMessage() {
  if (outsider_messages != nullptr) outsider_messages->Increment();
}
void RunnerMetrics::MembersChanged(int delta) {
  if (members != nullptr) members->Increment(delta);
}

// What the runner's parts share, constructed before them (the parts are
// bases and members of the Impl that take its address).
struct RunnerSharedHolder {
  RunnerSharedHolder(RunnerHost* host, std::string job_id, v1::JobSpec spec)
      : shared(host, std::move(job_id), std::move(spec)) {}
  RunnerShared shared;
};

// The drive loop of one job: the runner's thread, its mailbox (messages,
// pokes, the stop), waiting for workers (Wait: loss detection, errors, a
// returning worker's replay), the start (assignment, or re-attaching after a
// coordinator restart) and the end. The rest is in parts, each with one job
// and its own tests (docs/ARCHITECTURE.md): RunnerIteration (one iteration,
// losses mid-iteration), RunnerElastic (joins, moves, pauses), and the state
// they share (runner_part.h: membership, planning model, checkpoints, the
// link to the members, the record).
class JobRunner::Impl : private RunnerSharedHolder, private RunnerPart, private RunnerLoop {
 public:
  Impl(RunnerHost* host, std::string job_id, v1::JobSpec spec, std::vector<v1::WorkerInfo> workers,
       JobRunner::StartMode start)
      : RunnerSharedHolder(host, std::move(job_id), std::move(spec)),
        RunnerPart(&shared, this),
        start_mode_(start),
        elastic_(&shared, this),
        iteration_(&shared, this, &elastic_),
        links_(&shared, this) {
    for (v1::WorkerInfo& w : workers) membership_.mutable_infos()[w.worker_id()] = std::move(w);
  }

  ~Impl() override {
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

  std::optional<v1::GetLinksResponse> Links() const { return links_.Published(); }

 private:
  using Message = std::pair<std::string, v1::WorkerMessage>;

  void Run() {
    auto end = Drive();
    Finish(end);
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }

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
    iteration_.Started(next_iteration_);
    elastic_.Started();
    while (next_iteration_ < spec_.iterations()) {
      links_.AtBoundary();
      if (auto e = elastic_.Grow(); e) return *e;
      if (auto e = elastic_.Reassign(); e) return *e;
      if (std::string why = plan_.Infeasible(); !why.empty()) {
        if (auto e = elastic_.Pause(next_iteration_, why); e) return *e;
      }
      auto outcome = iteration_.RunIteration(next_iteration_);
      if (!outcome.ok()) return *outcome.status_end;
      if (*outcome.outcome == RunnerIteration::Outcome::kDone) ++next_iteration_;
    }
    return {v1::JOB_STATE_SUCCEEDED, absl::StrCat("trained ", spec_.iterations(), " iterations")};
  }

  std::string LastCheckpointOfRecord() {
    auto job = host_->jobs().Get(job_id_);
    return job.ok() ? job->last_checkpoint() : "";
  }

  v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                       const std::string& state_from,
                                       const std::string& restore_from) override {
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
    // The first plan is made on the links as measured (the region table
    // only seeds what was not).
    links_.ProbeAtStart();
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
    const absl::Time deadline = Now() + options().assign_timeout;
    while (!waiting.empty()) {
      RunnerEvent ev =
          Wait(deadline, [&] { return absl::StrCat(what, absl::StrJoin(waiting, ", ")); });
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
    const absl::Time deadline = Now() + options().assign_timeout;
    while (status.size() < members().size() && Now() < deadline) {
      RunnerEvent ev = Wait(
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
    link_.AbortIteration(next_iteration_, "the coordinator restarted; the iteration runs again");
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
      if (auto e = elastic_.Pause(next_iteration_, why); e) return e;
    }
    RecordStages();
    return std::nullopt;
  }

  // --- waiting for workers, and losing them ----------------------------------------

  // Removes `id` from the membership (a new epoch), tells it to drop the job
  // in case it is alive, and records the event.
  void RemoveMember(const std::string& id, const std::string& why, uint64_t iteration) override {
    const int stage = membership_.Remove(id);
    if (stage < 0) return;
    membership_.ClearSuspicion(id);
    membership_.ForgetLinks(id);
    if (absl::Status s = plan_.SetCutLinks(membership_.cut_links()); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
    }
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
    iteration_.ForgetWorker(id);
    plan_.KfacMembershipChanged();
  }

  // A registered worker the job never had sent a message about it (an error,
  // a report, a norm): ignored, counted, and logged at its first and then
  // every 100th message, so a flood leaves a trace but not a flood of lines.
  void NoteOutsider(const std::string& worker, const v1::WorkerMessage& m) {
    const google::protobuf::FieldDescriptor* field =
        m.GetDescriptor()->FindFieldByNumber(m.kind_case());
    const char* kind = field != nullptr ? field->name().c_str() : "unknown";
    host_->runner_metrics().OutsiderMessage();
    const uint64_t n = ++outsider_messages_[worker];
    if (n == 1 || n % 100 == 0) {
      LogWarning("job ", job_id_, ": ignoring ", n == 1 ? "a " : absl::StrCat(n, " "), kind,
                 " message", n == 1 ? "" : "s", " from ", worker,
                 ", which is not and never was one of its workers");
    }
  }

  // Links found cut between live members: the planner avoids them from now
  // on (the iteration in flight is the iteration part's to redo).
  void OnLinksCut(const std::vector<LinkCut>& cuts) {
    if (absl::Status s = plan_.SetCutLinks(membership_.cut_links()); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
    }
    for (const LinkCut& c : cuts) {
      host_->runner_metrics().LinkCut();
      const std::string message =
          absl::StrCat("link ", c.reporter, " - ", c.peer, " cut: ", c.reporter,
                       " could not reach ", c.peer, " (", c.why, ") while ", c.peer,
                       " still talks to the coordinator; routes and replica groups avoid the pair");
      LogWarning("job ", job_id_, ": ", message);
      AddEvent(v1::JobHistoryEvent::KIND_LINK_CUT, next_iteration_, c.peer, message);
    }
  }

  // The members found lost now (removed from the membership).
  std::vector<std::string> DetectLoss() {
    std::vector<std::string> lost;
    const auto gone = membership_.Judge(host_->registry().List(true), Now(),
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
  RunnerEvent Wait(absl::Time deadline, const std::function<std::string()>& describe,
                   bool detect_loss = true, bool return_on_change = false) override {
    RunnerEvent ev;
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
        check = poked_ || membership_.HasSuspects() || Now() - last_loss_check_ > kLossCheck;
        if (poked_ && return_on_change && !first) {
          poked_ = false;
          ev.changed = true;
          return ev;
        }
        if (!return_on_change) poked_ = false;
      }
      first = false;
      if (detect_loss && check) {
        last_loss_check_ = Now();
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
        if (std::vector<LinkCut> cuts = membership_.TakeNewCuts(); !cuts.empty()) {
          OnLinksCut(cuts);
          ev.cuts = std::move(cuts);
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
        if (!membership_.HasNode(worker) && !membership_.IsMember(worker)) {
          NoteOutsider(worker, m);
          it = ev.messages.erase(it);
          continue;
        }
        if (m.has_error() && m.error().job_id() == job_id_ && membership_.IsMember(worker)) {
          ev.end = Failed(m.error().message());
          return ev;
        }
        if (m.has_job_status()) {
          OnJobStatus(worker, m.job_status());
        } else if (m.has_link_report()) {
          links_.OnReport(worker, m.link_report());
        } else if (m.has_peer_unreachable() && m.peer_unreachable().job_id() == job_id_ &&
                   membership_.IsMember(worker)) {
          membership_.ReportUnreachable(worker, m.peer_unreachable().peer(),
                                        m.peer_unreachable().message(), Now());
        }
        ++it;
      }
      if (!ev.messages.empty()) return ev;
      if (Now() > deadline) {
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

  bool StopRequested() const override {
    absl::MutexLock lock(&mu_);
    return stop_.has_value();
  }

  // --- the end ---------------------------------------------------------------------

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

  std::thread thread_;
  mutable absl::Mutex mu_;
  std::deque<Message> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<JobEnd> stop_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;

  const JobRunner::StartMode start_mode_;
  RunnerElastic elastic_;
  RunnerIteration iteration_;
  RunnerLinks links_;
  absl::Time last_loss_check_ = absl::InfinitePast();
  std::map<std::string, uint64_t> outsider_messages_;  // worker -> messages ignored
  static constexpr absl::Duration kLossCheck = absl::Milliseconds(500);
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
std::optional<v1::GetLinksResponse> JobRunner::Links() const { return impl_->Links(); }

}  // namespace detour
