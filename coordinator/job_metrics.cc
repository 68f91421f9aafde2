#include "coordinator/job_metrics.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "coordinator/worker_registry.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

constexpr int kFirstState = v1::JOB_STATE_PENDING;
constexpr int kLastState = v1::JOB_STATE_CANCELLED;
constexpr size_t kStates = kLastState - kFirstState + 1;

bool IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

// 50 ms to 27 min: CPU test jobs to large models over slow links.
std::vector<double> IterationBuckets() {
  auto buckets = metrics::ExponentialBuckets(0.05, 2, 16);
  return buckets.ok() ? *buckets : metrics::DefaultLatencyBuckets();
}

template <typename T>
T* Child(metrics::Family<T>* family, const std::string& job_id) {
  if (family == nullptr) return nullptr;
  auto child = family->WithLabels({job_id});
  return child.ok() ? *child : nullptr;
}

}  // namespace

std::string JobMetrics::StateLabel(v1::JobState state) {
  return absl::AsciiStrToLower(v1::JobState_Name(state).substr(10));  // "JOB_STATE_"
}

JobMetrics::JobMetrics(metrics::Registry* m, Options options) : options_(options) {
  if (m == nullptr) return;
  // Jobs holding workers, plus the ended ones kept.
  const size_t jobs = WorkerRegistry::kMaxWorkers + options_.max_ended;
  auto gauge = [&](const char* name, const char* help, std::vector<std::string> labels,
                   size_t series) -> metrics::GaugeFamily* {
    auto f = m->AddGauge(name, help, std::move(labels), series);
    return f.ok() ? *f : nullptr;
  };
  state_ = gauge("detour_coordinator_job_state",
                 "1 for the state the job is in, 0 for the others; jobs that left PENDING, "
                 "and ended jobs for a while (docs/METRICS.md).",
                 {"job_id", "state"}, jobs * kStates);
  last_progress_ = gauge("detour_coordinator_job_last_progress_timestamp_seconds",
                         "When the job last completed an iteration (or started running), "
                         "seconds since the Unix epoch.",
                         {"job_id"}, jobs);
  loss_ =
      gauge("detour_coordinator_job_loss",
            "Mean training loss of the job's last iteration, nats per token.", {"job_id"}, jobs);
  tokens_per_second_ =
      gauge("detour_coordinator_job_tokens_per_second",
            "Training tokens per second of the job's last iteration.", {"job_id"}, jobs);
  completed_ = gauge("detour_coordinator_job_iterations_completed",
                     "Iterations the job has completed (falls when it resumes from an older "
                     "checkpoint).",
                     {"job_id"}, jobs);
  requested_ = gauge("detour_coordinator_job_iterations_requested",
                     "Iterations the job's spec asks for.", {"job_id"}, jobs);
  progress_ = gauge("detour_coordinator_job_progress_ratio",
                    "Iterations completed over iterations requested, 0 to 1.", {"job_id"}, jobs);
  eta_ = gauge("detour_coordinator_job_eta_seconds",
               "Estimated seconds until the job completes at its pace so far.", {"job_id"}, jobs);
  if (auto f = m->AddHistogram("detour_coordinator_job_iteration_seconds",
                               "Wall time of the job's iterations, planning to results.",
                               IterationBuckets(), {"job_id"}, jobs);
      f.ok()) {
    iteration_seconds_ = *f;
  }
}

JobMetrics::~JobMetrics() = default;

void JobMetrics::Observe(const v1::Job& job, absl::Time now) {
  if (state_ == nullptr) return;
  const int state = job.state();
  if (state < kFirstState || state > kLastState) return;
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job.id());
  if (it == jobs_.end()) {
    // A pending job holds nothing yet: it is counted in detour_coordinator_jobs.
    if (state == v1::JOB_STATE_PENDING) return;
    Series series;
    series.iteration = job.progress().iteration();
    if (!Track(job.id(), &series)) return;
    it = jobs_.emplace(job.id(), std::move(series)).first;
  }
  Series& s = it->second;
  if (s.state != job.state()) {
    for (size_t i = 0; i < kStates; ++i) {
      if (s.states[i] != nullptr) s.states[i]->Set(i + kFirstState == static_cast<size_t>(state));
    }
    s.state = job.state();
  }
  if (state == v1::JOB_STATE_RUNNING && !s.progress_stamped && s.last_progress != nullptr) {
    s.last_progress->Set(absl::ToDoubleSeconds(now - absl::UnixEpoch()));
    s.progress_stamped = true;
  }
  RecordProgress(job.id(), job.progress(), &s, now);
  const bool final = IsFinal(job.state());
  if (final && !s.ended) {
    s.ended = true;
    s.ended_at = now;
    EvictEnded(now);
  } else if (!final) {
    s.ended = false;  // resumed
  }
}

void JobMetrics::Restore(const v1::Job& job, absl::Time now) {
  absl::Time at = now;
  if (IsFinal(job.state()) && job.has_end_time()) {
    const int64_t nanos = google::protobuf::util::TimeUtil::TimestampToNanoseconds(job.end_time());
    at = std::min(now, absl::FromUnixNanos(nanos));
  }
  if (now - at >= options_.retention) return;
  Observe(job, at);
  Sweep(now);
}

bool JobMetrics::Track(const std::string& job_id, Series* s) {
  s->states.assign(kStates, nullptr);
  for (size_t i = 0; i < kStates; ++i) {
    auto g = state_->WithLabels({job_id, StateLabel(static_cast<v1::JobState>(i + kFirstState))});
    if (!g.ok()) {
      // Over the bound: no series for this job rather than half of them.
      for (size_t j = 0; j < i; ++j) {
        (void)state_->Remove({job_id, StateLabel(static_cast<v1::JobState>(j + kFirstState))});
      }
      return false;
    }
    s->states[i] = *g;
  }
  s->last_progress = Child(last_progress_, job_id);
  return true;
}

void JobMetrics::RecordProgress(const std::string& job_id, const v1::JobProgress& p, Series* s,
                                absl::Time now) {
  if (p.iteration() < s->iteration) s->iteration = p.iteration();  // resumed from older state
  if (p.iteration() == 0 || (p.iteration() == s->iteration && s->loss != nullptr)) return;
  if (s->loss == nullptr) {
    s->loss = Child(loss_, job_id);
    s->tokens_per_second = Child(tokens_per_second_, job_id);
    s->completed = Child(completed_, job_id);
    s->requested = Child(requested_, job_id);
    s->progress = Child(progress_, job_id);
    s->eta = Child(eta_, job_id);
    s->iteration_seconds = Child(iteration_seconds_, job_id);
    if (s->loss == nullptr) return;
  }
  const bool advanced = p.iteration() > s->iteration;
  s->iteration = p.iteration();
  s->loss->Set(p.loss());
  if (s->tokens_per_second != nullptr) s->tokens_per_second->Set(p.tokens_per_s());
  if (s->completed != nullptr) s->completed->Set(static_cast<double>(p.iteration()));
  if (s->requested != nullptr) s->requested->Set(static_cast<double>(p.total_iterations()));
  if (s->progress != nullptr && p.total_iterations() > 0) {
    s->progress->Set(std::min(
        1.0, static_cast<double>(p.iteration()) / static_cast<double>(p.total_iterations())));
  }
  if (s->eta != nullptr) s->eta->Set(p.eta_s());
  if (advanced) {
    if (s->iteration_seconds != nullptr && p.iteration_time_s() > 0) {
      s->iteration_seconds->Observe(p.iteration_time_s());
    }
    if (s->last_progress != nullptr) {
      s->last_progress->Set(absl::ToDoubleSeconds(now - absl::UnixEpoch()));
      s->progress_stamped = true;
    }
  }
}

void JobMetrics::Sweep(absl::Time now) {
  absl::MutexLock lock(&mu_);
  EvictEnded(now);
}

void JobMetrics::EvictEnded(absl::Time now) {
  std::vector<std::pair<absl::Time, std::string>> ended;
  for (const auto& [id, s] : jobs_) {
    if (s.ended) ended.emplace_back(s.ended_at, id);
  }
  std::sort(ended.begin(), ended.end());
  size_t left = ended.size();
  for (const auto& [at, id] : ended) {
    if (left <= options_.max_ended && now - at < options_.retention) break;
    Untrack(id);
    --left;
  }
}

void JobMetrics::Untrack(const std::string& job_id) {
  for (size_t i = 0; i < kStates; ++i) {
    (void)state_->Remove({job_id, StateLabel(static_cast<v1::JobState>(i + kFirstState))});
  }
  for (metrics::GaugeFamily* f :
       {last_progress_, loss_, tokens_per_second_, completed_, requested_, progress_, eta_}) {
    if (f != nullptr) (void)f->Remove({job_id});
  }
  if (iteration_seconds_ != nullptr) (void)iteration_seconds_->Remove({job_id});
  jobs_.erase(job_id);
}

size_t JobMetrics::tracked() const {
  absl::MutexLock lock(&mu_);
  return jobs_.size();
}

}  // namespace detour
