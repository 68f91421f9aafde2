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
#include "coordinator/runner_elastic.h"
#include "coordinator/runner_iteration.h"
#include "coordinator/runner_links.h"
#include "coordinator/runner_part.h"
#include "coordinator/runner_reattach.h"
#include "coordinator/runner_stage_loss.h"
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
  if (auto f = m->AddCounter("detour_coordinator_outsider_messages",
                             "Session messages about a job from registered workers that are not "
                             "its members (never were, or no longer are), by message kind; "
                             "ignored.",
                             {"kind"});
      f.ok()) {
    outsider_messages = *f;
    // The kinds a job's session carries start at 0: a scrape shows the
    // family, and an alert on increase() sees the first one.
    for (const char* kind : {"error", "peer_unreachable", "grad_norm", "bad_frame"}) {
      (void)outsider_messages->WithLabels({kind});
    }
  }
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
  if (auto f = m->AddCounter("detour_coordinator_stage_losses",
                             "Stages of running jobs that lost their last replica and with it "
                             "their state, by what the job did (elastic.on_stage_loss).",
                             {"action"});
      f.ok()) {
    stage_losses = *f;
    // Every series from the start at 0: an alert on increase() sees the
    // first loss.
    for (const char* action : {"rollback", "pause", "reinitialize"}) {
      (void)stage_losses->WithLabels({action});
    }
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
void RunnerMetrics::OutsiderMessage(const std::string& kind) {
  if (outsider_messages == nullptr) return;
  if (auto c = outsider_messages->WithLabels({kind}); c.ok()) (*c)->Increment();
}
void RunnerMetrics::StageLost(const std::string& action) {
  if (stage_losses == nullptr) return;
  if (auto c = stage_losses->WithLabels({action}); c.ok()) (*c)->Increment();
}
void RunnerMetrics::MembersChanged(int delta) {
  if (members != nullptr) members->Increment(delta);
}

namespace {

// A resume plans what the straight run would have planned next: the
// checkpoint's record (`job`, as stored) keeps the assignment and warm-start
// routes by stage and replica position, the first plan's workers take those
// positions (numbered in the same order) and the first plan becomes the
// re-plan from those routes. A record that is missing, of another
// checkpoint than `restore` or does not fit (other replica counts) leaves
// the fresh search's plan. Returns what it did, for the RESUMED event.
std::string ContinueKeptPlan(const absl::StatusOr<v1::Job>& job, const std::string& restore,
                             uint64_t iteration, const std::string& job_id, RunnerPlanner* plan,
                             RunnerMembership* membership) {
  std::string why;
  if (!job.ok()) {
    why = std::string(job.status().message());
  } else if (!job->has_checkpoint_plan()) {
    why = "the job's record keeps none";
  } else if (job->checkpoint_plan().checkpoint() != restore) {
    why = absl::StrCat("the job's record keeps the plan of ", job->checkpoint_plan().checkpoint());
  }
  if (why.empty()) {
    const v1::CheckpointPlan& stored = job->checkpoint_plan();
    auto order = plan->ResumedNodeOrder(stored, iteration);
    if (!order.ok()) {
      why = std::string(order.status().message());
    } else {
      std::vector<std::string> before = *order;
      std::swap(before, membership->mutable_node_order());
      absl::Status s = plan->BuildCostModel();
      if (s.ok()) s = plan->PlanResumed(stored, iteration);
      if (s.ok()) {
        return "the plan continues the one kept with the checkpoint";
      }
      why = std::string(s.message());
      membership->mutable_node_order() = std::move(before);
      if (absl::Status back = plan->BuildCostModel(); !back.ok()) {
        LogWarning("job ", job_id, ": cost model: ", back.message());
      }
    }
  }
  LogInfo("job ", job_id, ": resuming with a new plan, not one kept with ", restore, ": ", why);
  return absl::StrCat("a new plan (none kept with the checkpoint fits: ", why, ")");
}

}  // namespace

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
// losses mid-iteration), RunnerElastic (joins, moves, pauses),
// RunnerStageLoss (a stage's lost state: rollback, a holder's return),
// RunnerReattach (taking over after a coordinator restart), and the state
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
        links_(&shared, this),
        iteration_(&shared, this, &elastic_, &links_),
        stage_loss_(&shared, this, &elastic_, &iteration_),
        reattach_(&shared, this, &elastic_) {
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

  void Detach() {
    absl::MutexLock lock(&mu_);
    if (stop_ || driven_) return;
    stop_ = JobEnd{v1::JOB_STATE_FAILED, "the coordinator is stopping"};
    detach_ = true;
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
    bool detach = false;
    {
      absl::MutexLock lock(&mu_);
      driven_ = true;
      detach = detach_;
    }
    if (detach) {
      LeaveForTheNextCoordinator();
    } else {
      Finish(end);
    }
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }

  JobEnd Drive() {
    checkpoints_.Load(LastCheckpointOfRecord());
    if (start_mode_ == JobRunner::StartMode::kReattach) {
      if (auto e = reattach_.Run(); e) return *e;
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
      links_.AtBoundary(iteration_.routes());
      if (auto e = elastic_.Grow(); e) return *e;
      if (auto e = elastic_.Reassign(); e) return *e;
      if (auto e = stage_loss_.Recover(); e) return *e;
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
    const std::string continued =
        restore.empty() ? ""
                        : ContinueKeptPlan(host_->jobs().Get(job_id_), restore, next_iteration_,
                                           job_id_, &plan_, &membership_);
    const sim::StageAssignment& assignment = plan_.assignment();
    for (int s = 0; s < assignment.num_stages(); ++s) {
      for (int n : assignment.stage_nodes[s]) membership_.Set(plan_.cost().node_id(n), s);
    }
    host_->runner_metrics().MembersChanged(static_cast<int>(members().size()));
    if (auto e = ConfigureKfac(); e) return e;
    if (!restore.empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_RESUMED, next_iteration_, "",
               absl::StrCat("resuming from checkpoint ", restore, " at iteration ", next_iteration_,
                            " on ", members().size(), " workers (",
                            spec_.pipeline().replicas_per_stage(), " per stage); ", continued));
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

  // --- waiting for workers, and losing them ----------------------------------------

  // Removes `id` from the membership (a new epoch), tells it to drop the job
  // in case it is alive, and records the event.
  void RemoveMember(const std::string& id, const std::string& why, uint64_t iteration) override {
    const int stage = membership_.Remove(id);
    if (stage < 0) return;
    membership_.ClearSuspicion(id);
    membership_.ForgetLinks(id);
    plan_.links().Forget(id);  // a worker that comes back is measured anew
    if (absl::Status s = plan_.SetCutLinks(membership_.cut_links()); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
    }
    membership_.BumpEpoch();
    plan_.RebuildAssignment();
    plan_.ForgetRoutes();  // the warm start routes through it
    const bool emptied = plan_.assignment().stage_nodes[stage].empty();
    // Under STAGE_LOSS_PAUSE the last holder of a stage may come back with
    // its state: it keeps its reservation (no heartbeat makes the manager
    // tell it to drop the job) and is not told to drop it.
    // An excluded worker is not one to wait for (RunnerMembership::Exclude).
    const bool may_return =
        emptied && !membership_.Excluded(id, Now()) && stage_loss_.KeepHolder(stage, id);
    host_->runner_metrics().WorkerLost();
    host_->runner_metrics().MembersChanged(-1);
    if (!may_return) {
      host_->Unreserve(job_id_, id);
      v1::CoordinatorMessage cancel;
      cancel.mutable_cancel()->set_job_id(job_id_);
      cancel.mutable_cancel()->set_reason(absl::StrCat("left the job: ", why));
      link_.SendOnce(id, cancel);
    }
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, iteration, id,
             absl::StrCat("worker ", id, " (stage ", stage, ") lost: ", why));
    if (emptied) stage_loss_.Lost(stage, id, iteration);
    if (plan_.assignment().stage_nodes[stage].empty() && plan_.Infeasible().empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_REROUTED, iteration, "",
               absl::StrCat("stage ", stage,
                            " has no worker left: every route skips it until a "
                            "worker joins (no checkpoints meanwhile)"));
    }
    iteration_.ForgetWorker(id);
    plan_.KfacMembershipChanged();
  }

  // A registered worker the job never had, or one that left it, sent a
  // message about it (an error, a report, a norm): ignored, counted by kind,
  // and logged at its first and then every 100th per worker, so a flood
  // leaves a trace but not a flood of lines.
  void NoteOutsider(const std::string& worker, const v1::WorkerMessage& m, bool former) {
    const google::protobuf::FieldDescriptor* field =
        m.GetDescriptor()->FindFieldByNumber(m.kind_case());
    const std::string kind = field != nullptr ? field->name() : "unknown";
    host_->runner_metrics().OutsiderMessage(kind);
    const uint64_t n = ++outsider_messages_[worker];
    if (n == 1 || n % 100 == 0) {
      LogWarning("job ", job_id_, ": ignoring ", n == 1 ? "a " : absl::StrCat(n, " "), kind,
                 " message", n == 1 ? "" : "s", " from ", worker,
                 former ? ", which is no longer one of its workers"
                        : ", which is not and never was one of its workers");
    }
  }

  // A member dropped a frame of another for its values (BadFrame): the
  // sender leaves the job like a lost worker (the next loss check finds it
  // gone; the iteration re-runs what crossed it) and is not taken back for
  // RunnerMembership::kExcludeBackoff. RunnerMembership::ReportBadFrame
  // weighs the report; one refused is logged at the first and every 100th.
  void OnBadFrame(const std::string& reporter, const v1::BadFrame& b) {
    const bool current = b.iteration() == next_iteration_;
    const bool sends =
        current && v1::Direction_IsValid(b.direction()) &&
        membership_.PlanSends(iteration_.routes(), b.sender(), reporter,
                              static_cast<v1::Direction>(b.direction()), b.microbatch());
    std::string refused;
    auto exclusion = membership_.ReportBadFrame(reporter, b.sender(), sends, b.message(), &refused);
    if (!exclusion) {
      if (!current) {
        refused = absl::StrCat("iteration ", b.iteration(), " is not the one in flight (",
                               next_iteration_, ")");
      }
      if (++bad_frame_reports_refused_ % 100 == 1) {
        LogWarning("job ", job_id_, ": ignoring a bad-frame report from ", reporter, ": ", refused,
                   " (", bad_frame_reports_refused_, " refused so far)");
      }
      return;
    }
    LogWarning("job ", job_id_, ": worker ", exclusion->member, " leaves the job, ",
               exclusion->why);
    membership_.Exclude(exclusion->member, exclusion->why, Now());
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
          NoteOutsider(worker, m, /*former=*/false);
          it = ev.messages.erase(it);
          continue;
        }
        // A worker that left the job (lost, excluded) has nothing to say
        // about its iterations: its errors, reports and norms are dropped
        // here, where they are counted, instead of by each handler below.
        if (!membership_.IsMember(worker) &&
            (m.has_error() || m.has_peer_unreachable() || m.has_grad_norm() || m.has_bad_frame())) {
          NoteOutsider(worker, m, /*former=*/true);
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
        } else if (m.has_bad_frame() && m.bad_frame().job_id() == job_id_) {
          OnBadFrame(worker, m.bad_frame());
        }
        ++it;
      }
      if (!ev.messages.empty()) return ev;
      if (Now() > deadline) {
        ev.end = Failed(absl::StrCat("timed out waiting for ", describe()));
        ev.timed_out = true;
        return ev;
      }
    }
  }

  // A member's session reopened (or the coordinator restarted): it still
  // holds the job. What it may have missed is sent again.
  void OnJobStatus(const std::string& worker, const v1::JobStatus& status) {
    if (status.job_id() != job_id_) return;
    if (!membership_.IsMember(worker)) {
      stage_loss_.Readmit(worker, status);
      return;
    }
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
    // The record first: a member's heartbeat that finds it released then
    // finds the job ended too, and is told so (JudgeWorkerJob).
    record_.End(end);
    host_->Release(job_id_);
    if (end.state == v1::JOB_STATE_FAILED) {
      LogWarning("job ", job_id_, " failed: ", end.message);
    } else {
      LogInfo("job ", job_id_, " ", v1::JobState_Name(end.state), ": ", end.message);
    }
  }

  // A graceful stop of the coordinator (Detach): nothing is ended and the
  // workers are not told, exactly as when the coordinator dies, so the next
  // coordinator re-attaches the same way after either (RunnerReattach). The
  // reservations stay too: until the sessions close, no heartbeat of a
  // member makes the manager tell it to drop the job.
  void LeaveForTheNextCoordinator() {
    host_->runner_metrics().MembersChanged(-static_cast<int>(members().size()));
    auto stored = host_->jobs().Get(job_id_);
    if (stored.ok() && stored->state() == v1::JOB_STATE_ASSIGNING) {
      // Stages half built are not worth keeping: Recover would fail the job.
      const std::string why = "the coordinator stopped while the job's stages were being assigned";
      for (const auto& [id, s] : members()) {
        v1::CoordinatorMessage m;
        m.mutable_cancel()->set_job_id(job_id_);
        m.mutable_cancel()->set_reason(why);
        link_.SendOnce(id, m);
      }
      host_->Release(job_id_);
      record_.Requeue(absl::StrCat(why, "; it waits to be scheduled again"));
      LogInfo("job ", job_id_, " back to PENDING: ", why);
      return;
    }
    LogInfo("job ", job_id_, " left RUNNING at iteration ", next_iteration_,
            " for the next coordinator: its workers keep their stages and re-attach");
  }

  std::thread thread_;
  mutable absl::Mutex mu_;
  std::deque<Message> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<JobEnd> stop_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool driven_ ABSL_GUARDED_BY(mu_) = false;  // Drive returned
  bool detach_ ABSL_GUARDED_BY(mu_) = false;  // the stop is a Detach

  const JobRunner::StartMode start_mode_;
  RunnerElastic elastic_;
  RunnerLinks links_;
  RunnerIteration iteration_;
  RunnerStageLoss stage_loss_;
  RunnerReattach reattach_;
  absl::Time last_loss_check_ = absl::InfinitePast();
  std::map<std::string, uint64_t> outsider_messages_;  // worker -> messages ignored
  uint64_t bad_frame_reports_refused_ = 0;
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
void JobRunner::Detach() { impl_->Detach(); }
bool JobRunner::finished() const { return impl_->finished(); }
std::optional<v1::GetLinksResponse> JobRunner::Links() const { return impl_->Links(); }

}  // namespace detour
