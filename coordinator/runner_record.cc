#include "coordinator/runner_record.h"

#include <algorithm>

#include "common/log.h"
#include "common/timing.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

google::protobuf::Timestamp Now() {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
}

}  // namespace

RunnerRecord::RunnerRecord(JobStore* jobs, std::string job_id)
    : jobs_(jobs), job_id_(std::move(job_id)) {}

void RunnerRecord::AddEvent(v1::JobHistoryEvent::Kind kind, uint64_t iteration,
                            const std::string& worker, const std::string& message, uint64_t epoch) {
  LogInfo("job ", job_id_, ": ", message);
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 v1::JobHistoryEvent* e = j->add_history();
                 *e->mutable_time() = Now();
                 e->set_kind(kind);
                 e->set_iteration(iteration);
                 e->set_worker(worker);
                 e->set_message(message);
                 if (j->history_size() > kMaxHistory) {
                   j->mutable_history()->DeleteSubrange(0, j->history_size() - kMaxHistory);
                 }
                 j->set_epoch(epoch);
               })
      .IgnoreError();
}

void RunnerRecord::SetState(v1::JobState state, const std::string& message) {
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 j->set_state(state);
                 j->set_message(message);
               })
      .IgnoreError();
}

void RunnerRecord::MarkStarted() {
  jobs_
      ->Update(job_id_,
               [](v1::Job* j) {
                 if (!j->has_start_time()) *j->mutable_start_time() = Now();
               })
      .IgnoreError();
}

void RunnerRecord::Stages(const std::vector<std::vector<std::string>>& stages, uint64_t epoch,
                          size_t members) {
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 j->clear_stages();
                 for (const auto& ids : stages) {
                   auto* nodes = j->add_stages();
                   for (const std::string& id : ids) nodes->add_nodes(id);
                 }
                 j->set_epoch(epoch);
                 j->mutable_progress()->set_members(static_cast<uint32_t>(members));
               })
      .IgnoreError();
}

void RunnerRecord::RestartProgressAt(uint64_t iteration, uint64_t total_iterations) {
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 v1::JobProgress* p = j->mutable_progress();
                 p->set_iteration(iteration);
                 p->set_total_iterations(total_iterations);
                 p->clear_loss();
                 p->clear_tokens_per_s();
                 p->clear_iteration_time_s();
                 p->clear_eta_s();
               })
      .IgnoreError();
}

absl::Status RunnerRecord::ReplicaSync(v1::KfacReplicaSync chosen, bool sync_factors) {
  return jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 v1::KfacSpec* stored = j->mutable_spec()->mutable_optimizer()->mutable_kfac();
                 stored->set_replica_sync(chosen);
                 stored->set_sync_factors(sync_factors);
               })
      .status();
}

absl::Status RunnerRecord::Hold(absl::Status failed, const std::function<bool()>& stop,
                                absl::Duration retry) {
  auto held = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kUnavailable ||
           s.code() == absl::StatusCode::kDeadlineExceeded ||
           s.code() == absl::StatusCode::kFailedPrecondition;
  };
  if (failed.ok() || !jobs_->backend().Replicated() || !held(failed)) return failed;
  LogWarning("job ", job_id_, ": holding until its record can be written (", failed.message(), ")");
  const absl::Time started = absl::Now();
  while (held(failed)) {
    // Polls the store: nothing here is told when it is back.
    for (absl::Time until = absl::Now() + retry; absl::Now() < until;) {
      if (stop()) return failed;
      absl::SleepFor(std::min(absl::Milliseconds(100), until - absl::Now()));
    }
    if (stop()) return failed;
    // The record as it stands in memory (the failed write's change
    // included), on the revision last stored.
    failed = jobs_->Update(job_id_, [](v1::Job*) {}).status();
  }
  if (failed.ok()) {
    LogInfo("job ", job_id_, ": its record is written again after ",
            absl::FormatDuration(absl::Now() - started), "; going on");
  }
  return failed;
}

absl::Status RunnerRecord::Iteration(const IterationRecord& r) {
  // Measured busy fractions, mean over the workers that reported.
  double utilization = 0, utilization_kfac = 0, max_delay = 0;
  const auto& timings = *r.timings;
  for (const auto& [id, t] : timings) {
    max_delay = std::max(max_delay, t.bubble_delay_max_s());
    if (!(t.iteration_time_s() > 0)) continue;
    const BusySeconds busy = SumBusy(t);
    utilization += busy.pipeline / t.iteration_time_s() / static_cast<double>(timings.size());
    utilization_kfac +=
        (busy.pipeline + busy.kfac) / t.iteration_time_s() / static_cast<double>(timings.size());
  }
  return jobs_
      ->Update(
          job_id_,
          [&](v1::Job* j) {
            v1::JobProgress* p = j->mutable_progress();
            p->set_iteration(r.iteration + 1);
            p->set_total_iterations(r.total_iterations);
            p->set_loss(r.loss);
            p->set_iteration_time_s(r.seconds);
            p->set_predicted_iteration_time_s(r.plan->predicted_time_s());
            p->set_utilization(utilization);
            p->set_utilization_with_kfac(utilization_kfac);
            if (r.kfac) {
              p->set_kfac_refreshes(r.kfac_refreshes);
              p->set_kfac_refresh_interval(r.kfac_refresh_interval);
              p->set_kfac_max_delay_s(max_delay);
            }
            p->set_coordinator_overhead_s(r.overhead_seconds);
            p->set_tokens_per_s(r.seconds > 0 ? r.tokens / r.seconds : 0);
            const double per_iteration = r.elapsed_seconds / static_cast<double>(r.iterations_run);
            p->set_eta_s(per_iteration * static_cast<double>(r.total_iterations - r.iteration - 1));
            p->set_recoveries(r.recoveries);
            p->set_microbatches_rerun(r.rerun_total);
            p->set_microbatches_dropped(r.dropped_total);
            p->set_members(static_cast<uint32_t>(r.members->size()));
            p->clear_planned_visits();
            for (const auto& [id, stage] : *r.members) (*p->mutable_planned_visits())[id] = 0;
            for (const v1::Route& route : r.plan->routes()) {
              for (const std::string& id : route.nodes()) {
                auto v = p->mutable_planned_visits()->find(id);
                if (v != p->mutable_planned_visits()->end()) ++v->second;
              }
            }
            j->set_epoch(r.epoch);
            j->clear_pending_step();  // every worker applied it
          })
      .status();
}

absl::Status RunnerRecord::PendingStep(const v1::StepCommand& step) {
  return jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 v1::PendingStep* p = j->mutable_pending_step();
                 p->set_iteration(step.iteration());
                 p->set_squared_norm(step.squared_norm());
                 p->set_epoch(step.epoch());
                 p->set_completed_microbatches(step.completed_microbatches());
               })
      .status();
}

void RunnerRecord::LastCheckpoint(const std::string& dir, const v1::CheckpointPlan& plan) {
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 j->set_last_checkpoint(dir);
                 *j->mutable_checkpoint_plan() = plan;
               })
      .IgnoreError();
}

void RunnerRecord::End(const JobEnd& end) {
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 if (JobStore::IsFinal(j->state())) return;  // e.g. cancelled by request
                 j->set_state(end.state);
                 j->set_message(end.message);
                 *j->mutable_end_time() = Now();
               })
      .IgnoreError();
}

void RunnerRecord::Requeue(const std::string& message) {
  jobs_
      ->Update(job_id_,
               [&](v1::Job* j) {
                 if (JobStore::IsFinal(j->state())) return;
                 j->set_state(v1::JOB_STATE_PENDING);
                 j->set_message(message);
                 j->clear_stages();
               })
      .IgnoreError();
}

}  // namespace detour
