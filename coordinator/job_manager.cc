#include "coordinator/job_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "coordinator/pending_reason.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

google::protobuf::Timestamp Now() {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
}

}  // namespace

JobManager::JobManager(JobStore* jobs, WorkerRegistry* registry, ControlServiceImpl* control,
                       JobManagerOptions options)
    : jobs_(jobs),
      registry_(registry),
      control_(control),
      options_(std::move(options)),
      estimates_(options_.metrics),
      runner_metrics_(options_.metrics) {
  registry_->SetListener([this] { OnRegistryChange(); });
  scheduler_ = std::thread([this] { ScheduleLoop(); });
}

JobManager::~JobManager() { Shutdown(); }

void JobManager::OnRegistryChange() {
  absl::MutexLock lock(&mu_);
  wake_ = true;
  for (auto& [id, runner] : runners_) runner->Poke();
}

void JobManager::Recover() {
  for (const v1::Job& job : jobs_->List(v1::JOB_STATE_UNSPECIFIED)) {
    if (job.state() == v1::JOB_STATE_RUNNING && job.stages_size() > 0) {
      auto spec = NormalizeJobSpec(job.spec());
      if (!spec.ok() || spec->elastic().disabled()) {
        jobs_
            ->Update(job.id(),
                     [&](v1::Job* j) {
                       j->set_state(v1::JOB_STATE_FAILED);
                       j->set_message(
                           !spec.ok()
                               ? absl::StrCat("stored spec is invalid: ", spec.status().message())
                               : "coordinator restarted while the job was running "
                                 "(elastic.disabled); resume it from its checkpoint");
                       *j->mutable_end_time() = Now();
                     })
            .IgnoreError();
        continue;
      }
      // Its workers keep their stages and reconnect: re-attach to them.
      absl::MutexLock lock(&mu_);
      for (const v1::StageNodes& stage : job.stages()) {
        for (const std::string& id : stage.nodes()) reserved_[id] = job.id();
      }
      auto runner = std::make_unique<JobRunner>(this, job.id(), *std::move(spec),
                                                std::vector<v1::WorkerInfo>{},
                                                JobRunner::StartMode::kReattach);
      runner->Start();
      runners_[job.id()] = std::move(runner);
    } else if (job.state() == v1::JOB_STATE_ASSIGNING || job.state() == v1::JOB_STATE_RUNNING) {
      jobs_
          ->Update(job.id(),
                   [](v1::Job* j) {
                     j->set_state(v1::JOB_STATE_FAILED);
                     j->set_message(
                         "coordinator restarted while the job's stages were being assigned; "
                         "resubmit it");
                     *j->mutable_end_time() = Now();
                   })
          .IgnoreError();
    } else if (job.state() == v1::JOB_STATE_PENDING) {
      // A stored spec is input like any other: one that no longer validates
      // (limits added since, a hand-edited file) fails its job instead of
      // reaching the planner.
      Add(job.id(), "stored spec is invalid: ");
    }
  }
  absl::MutexLock lock(&mu_);
  recovered_ = true;
}

void JobManager::Add(const std::string& job_id, const std::string& invalid_prefix) {
  auto job = jobs_->Get(job_id);
  if (!job.ok()) return;
  auto spec = NormalizeJobSpec(job->spec());
  if (!spec.ok()) {
    jobs_
        ->Update(job_id,
                 [&](v1::Job* j) {
                   j->set_state(v1::JOB_STATE_FAILED);
                   j->set_message(absl::StrCat(invalid_prefix, spec.status().message()));
                   *j->mutable_end_time() = Now();
                 })
        .IgnoreError();
    return;
  }
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return;
  if (auto r = runners_.find(job_id); r != runners_.end()) {
    if (!r->second->finished()) return;
    runners_.erase(r);  // a resumed job's old runner, ended
  }
  for (const Pending& p : pending_) {
    if (p.job_id == job_id) return;
  }
  pending_.push_back(Pending{job_id, *std::move(spec), ""});
  wake_ = true;
}

void JobManager::Cancel(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->job_id == job_id) {
      pending_.erase(it);  // the store already says CANCELLED
      return;
    }
  }
  auto it = runners_.find(job_id);
  if (it != runners_.end()) {
    it->second->RequestStop(JobEnd{v1::JOB_STATE_CANCELLED, "cancelled by request"});
  }
}

absl::StatusOr<v1::GetLinksResponse> JobManager::Links(const std::string& job_id) const {
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(job_id));
  absl::MutexLock lock(&mu_);
  auto it = runners_.find(job_id);
  if (job.state() != v1::JOB_STATE_RUNNING || it == runners_.end() || it->second->finished()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is ",
                                                      v1::JobState_Name(job.state()),
                                                      ", not running: it has no live links"));
  }
  std::optional<v1::GetLinksResponse> links = it->second->Links();
  if (!links) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " has not planned its first iteration yet"));
  }
  return *std::move(links);
}

absl::StatusOr<v1::Job> JobManager::Resume(const std::string& job_id, const std::string& checkpoint,
                                           uint32_t replicas_per_stage) {
  {
    absl::MutexLock lock(&mu_);
    if (runners_.count(job_id) && !runners_.at(job_id)->finished()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is still running"));
    }
  }
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(job_id));
  if (job.state() != v1::JOB_STATE_FAILED && job.state() != v1::JOB_STATE_CANCELLED) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", v1::JobState_Name(job.state()),
                     "; only FAILED or CANCELLED jobs can be resumed"));
  }
  const std::string dir = checkpoint.empty() ? job.last_checkpoint() : checkpoint;
  if (dir.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " has no checkpoint to resume from"));
  }
  v1::JobSpec spec = job.spec();
  spec.mutable_checkpoint()->set_resume_from(dir);
  // The checkpoint holds the weights now; the import was only the start.
  spec.mutable_checkpoint()->clear_init_from();
  const uint32_t was = spec.pipeline().replicas_per_stage();
  if (replicas_per_stage > 0) spec.mutable_pipeline()->set_replicas_per_stage(replicas_per_stage);
  if (auto valid = NormalizeJobSpec(spec); !valid.ok()) {
    return replicas_per_stage > 0
               ? Annotate(valid.status(), absl::StrCat("replicas_per_stage ", replicas_per_stage))
               : valid.status();
  }
  const bool changed = replicas_per_stage > 0 && replicas_per_stage != was;
  ASSIGN_OR_RETURN(v1::Job resumed, jobs_->Update(job_id, [&](v1::Job* j) {
    *j->mutable_spec() = spec;
    j->set_state(v1::JOB_STATE_PENDING);
    j->set_message(absl::StrCat(
        "resuming from ", dir,
        changed ? absl::StrCat(" with ", replicas_per_stage, " replicas per stage (was ", was, ")")
                : ""));
    j->clear_end_time();
    j->set_resumes(j->resumes() + 1);
  }));
  Add(job_id);
  return resumed;
}

// One loop for all pending jobs (no thread per job): it wakes when a job is
// added, a job releases its workers, the registry changes or the manager
// stops (and every 2 s regardless), then starts every pending job (in
// submission order) whose workers are idle now.
void JobManager::ScheduleLoop() {
  while (true) {
    std::vector<std::pair<std::string, std::string>> messages;  // job -> why it waits
    {
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wake_ || shutting_down_; };
      mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Seconds(2));
      if (shutting_down_) return;
      wake_ = false;
      for (auto it = runners_.begin(); it != runners_.end();) {
        it = it->second->finished() ? runners_.erase(it) : std::next(it);
      }
      if (pending_.empty()) continue;
      std::vector<v1::WorkerInfo> free;
      const std::vector<v1::WorkerInfo> registered = registry_->List(false);
      for (const v1::WorkerInfo& w : registered) {
        // A worker whose session stream is not open (yet: it registers,
        // then opens it) cannot take an assignment.
        if (w.state() == v1::WORKER_STATE_IDLE && w.session_open() &&
            !reserved_.count(w.worker_id())) {
          free.push_back(w);
        }
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        std::string why;
        auto workers = TakeWorkers(it->spec, free, registered, &why);
        if (!workers) {
          if (why != it->message) {
            it->message = why;
            messages.push_back({it->job_id, why});
          }
          ++it;
          continue;
        }
        for (const v1::WorkerInfo& w : *workers) reserved_[w.worker_id()] = it->job_id;
        auto runner =
            std::make_unique<JobRunner>(this, it->job_id, std::move(it->spec), *std::move(workers));
        runner->Start();
        runners_[it->job_id] = std::move(runner);
        it = pending_.erase(it);
      }
    }
    // Store writes (fsync) outside the lock that routes worker messages.
    for (const auto& message : messages) {
      const std::string& why = message.second;
      jobs_
          ->Update(message.first,
                   [&](v1::Job* j) {
                     if (j->state() == v1::JOB_STATE_PENDING) j->set_message(why);
                   })
          .IgnoreError();
    }
  }
}

std::optional<std::vector<v1::WorkerInfo>> JobManager::TakeWorkers(
    const v1::JobSpec& spec, std::vector<v1::WorkerInfo>& free,
    const std::vector<v1::WorkerInfo>& registered, std::string* why) {
  const size_t needed = WorkersNeeded(spec);
  std::set<std::string> pinned;
  for (const v1::StageNodes& g : spec.pipeline().assignment()) {
    pinned.insert(g.nodes().begin(), g.nodes().end());
  }
  std::vector<size_t> chosen;
  for (size_t i = 0; i < free.size() && chosen.size() < needed; ++i) {
    if (pinned.empty() || pinned.count(free[i].worker_id())) chosen.push_back(i);
  }
  if (chosen.size() < needed) {
    *why = PendingReason(spec, registered, free);
    return std::nullopt;
  }
  std::vector<v1::WorkerInfo> taken;
  for (size_t i : chosen) taken.push_back(free[i]);
  for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) free.erase(free.begin() + *it);
  return taken;
}

void JobManager::OnWorkerMessage(const std::string& worker_id, const v1::WorkerMessage& message) {
  std::string job;
  switch (message.kind_case()) {
    case v1::WorkerMessage::kStageReady: job = message.stage_ready().job_id(); break;
    case v1::WorkerMessage::kTiming: job = message.timing().job_id(); break;
    case v1::WorkerMessage::kResult: job = message.result().job_id(); break;
    case v1::WorkerMessage::kError: job = message.error().job_id(); break;
    case v1::WorkerMessage::kGradNorm: job = message.grad_norm().job_id(); break;
    case v1::WorkerMessage::kCheckpointCommitted:
      job = message.checkpoint_committed().job_id();
      break;
    case v1::WorkerMessage::kMembershipAck: job = message.membership_ack().job_id(); break;
    case v1::WorkerMessage::kPeerUnreachable: job = message.peer_unreachable().job_id(); break;
    case v1::WorkerMessage::kStateReceived: job = message.state_received().job_id(); break;
    case v1::WorkerMessage::kJobStatus: job = message.job_status().job_id(); break;
    case v1::WorkerMessage::kLinkReport: job = message.link_report().job_id(); break;
    case v1::WorkerMessage::kBadFrame: job = message.bad_frame().job_id(); break;
    default: return;
  }
  absl::MutexLock lock(&mu_);
  auto it = runners_.find(job);
  if (it != runners_.end()) it->second->Post(worker_id, message);
}

absl::Status JobManager::Send(const std::string& worker, const v1::CoordinatorMessage& message) {
  return control_->Send(worker, message);
}

std::vector<v1::WorkerInfo> JobManager::ReserveIdle(const std::string& job, size_t count,
                                                    const std::set<std::string>& exclude) {
  std::vector<v1::WorkerInfo> taken;
  absl::MutexLock lock(&mu_);
  if (shutting_down_) return taken;
  for (const v1::WorkerInfo& w : registry_->List(false)) {
    if (taken.size() >= count) break;
    // Idle as a heartbeat since its registration said (heartbeats > 0): a
    // worker that registered again (reconnected, or back from a partition)
    // counts as idle until its first heartbeat, which may name a job it
    // still holds; it is told to drop that first (CheckWorkerJob), which a
    // reservation for the same job would skip.
    if (w.state() != v1::WORKER_STATE_IDLE || w.heartbeats() == 0 || !w.session_open() ||
        reserved_.count(w.worker_id()) || exclude.count(w.worker_id())) {
      continue;
    }
    reserved_[w.worker_id()] = job;
    taken.push_back(w);
  }
  return taken;
}

void JobManager::Unreserve(const std::string& job, const std::string& worker) {
  absl::MutexLock lock(&mu_);
  auto it = reserved_.find(worker);
  if (it != reserved_.end() && it->second == job) reserved_.erase(it);
  wake_ = true;
}

void JobManager::Shutdown() {
  std::map<std::string, std::unique_ptr<JobRunner>> runners;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    runners.swap(runners_);
  }
  if (scheduler_.joinable()) scheduler_.join();
  // Running jobs are left RUNNING with their workers, who re-attach to the
  // next coordinator (JobRunner::Detach); pending jobs have no runner and
  // stay PENDING in the store for the next start.
  for (auto& [id, runner] : runners) runner->Detach();
  runners.clear();  // each destructor joins its runner
}

std::optional<WorkerJobVerdict> JobManager::CheckWorkerJob(const std::string& worker_id,
                                                           const std::string& job_id) {
  bool running = false;
  {
    absl::MutexLock lock(&mu_);
    // Stopping: the next coordinator decides what the worker keeps. Not
    // recovered yet: the job may be one this coordinator is about to
    // re-attach to.
    if (shutting_down_ || !recovered_) return std::nullopt;
    auto reserved = reserved_.find(worker_id);
    if (reserved != reserved_.end() && reserved->second == job_id) return std::nullopt;  // live
    const absl::Time now = absl::Now();
    auto told = told_to_drop_.find(worker_id);
    if (told != told_to_drop_.end() && now - told->second < absl::Seconds(5)) return std::nullopt;
    told_to_drop_[worker_id] = now;
    running = runners_.count(job_id) > 0;
  }
  const WorkerJobVerdict verdict = JudgeWorkerJob(worker_id, job_id, running, jobs_->Get(job_id));
  LogInfo(verdict.log);
  v1::CoordinatorMessage m;
  m.mutable_cancel()->set_job_id(job_id);
  m.mutable_cancel()->set_reason(verdict.reason);
  control_->Send(worker_id, std::move(m)).IgnoreError();
  return verdict;
}

WorkerJobVerdict JudgeWorkerJob(const std::string& worker_id, const std::string& job_id,
                                bool running, const absl::StatusOr<v1::Job>& stored) {
  WorkerJobVerdict v;
  const std::string told = "; telling it to drop its part";
  const bool ended = stored.ok() && JobStore::IsFinal(stored->state());
  if (running && !ended) {
    // A worker that stalled or was cut off past --worker_silence: the job
    // lost it and went on (or paused) without it. A job that has just ended
    // still has its runner while it winds down, and its workers' last
    // heartbeats name it: they were not lost.
    v.log = absl::StrCat("worker ", worker_id, " is back holding job ", job_id,
                         ", which runs on without it (it was removed from the job when it was "
                         "lost)",
                         told);
    v.reason =
        "the job runs on without this worker: it was removed from the job while it was "
        "unreachable";
  } else if (!stored.ok()) {
    v.log = absl::StrCat("worker ", worker_id, " holds job ", job_id,
                         ", which this coordinator does not know", told);
    v.reason = "the coordinator does not know this job";
  } else if (ended) {
    const std::string state = absl::AsciiStrToLower(v1::JobState_Name(stored->state()).substr(10));
    v.log = absl::StrCat("worker ", worker_id, " still holds job ", job_id, ", which ended (",
                         state, ": ", stored->message(), ")", told);
    v.reason = absl::StrCat("the job ended (", state, ")");
  } else {
    v.log = absl::StrCat("worker ", worker_id, " still holds job ", job_id,
                         ", which this coordinator does not run (it restarted; the job is ",
                         absl::AsciiStrToLower(v1::JobState_Name(stored->state()).substr(10)), ")",
                         told);
    v.reason = "the coordinator no longer runs this job (it restarted)";
  }
  return v;
}

void JobManager::Release(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto it = reserved_.begin(); it != reserved_.end();) {
    it = it->second == job_id ? reserved_.erase(it) : std::next(it);
  }
  wake_ = true;  // pending jobs may fit now
}

}  // namespace detour
