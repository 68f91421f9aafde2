// Per-job Prometheus series on the coordinator (docs/METRICS.md §Jobs): state,
// loss, throughput, progress, ETA, time of the last progress and a histogram
// of iteration times, labelled `job_id`. Fed with every change of every job
// (a JobStore listener).
//
// Cardinality is bounded: a job gets series once it leaves PENDING (jobs
// holding workers are at most the workers, WorkerRegistry::kMaxWorkers), and
// an ended job's series are removed `retention` after it ended, or sooner,
// oldest first, while more than `max_ended` ended jobs have series.
//
// Thread-safe. Does not own the registry, which must outlive it.
#ifndef DETOUR_COORDINATOR_JOB_METRICS_H_
#define DETOUR_COORDINATOR_JOB_METRICS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "detour/v1/job_service.pb.h"

namespace detour {

class JobMetrics {
 public:
  struct Options {
    // How long an ended job's series stay (alerts on failed jobs need them
    // for at least their `for:` plus a few evaluations).
    absl::Duration retention = absl::Hours(1);
    // Most ended jobs with series at once.
    size_t max_ended = 50;
  };

  // `registry` may be null: nothing is recorded.
  JobMetrics(metrics::Registry* registry, Options options);
  ~JobMetrics();
  JobMetrics(const JobMetrics&) = delete;
  JobMetrics& operator=(const JobMetrics&) = delete;

  // Records the job's current state and progress.
  void Observe(const v1::Job& job, absl::Time now);
  // A job read back from the store when the coordinator starts or takes
  // over: its series as Observe would have left them, so that an alert on a
  // job that failed before the restart still fires. An ended job's
  // retention counts from its end_time; one that ended `retention` or more
  // before `now` gets none.
  void Restore(const v1::Job& job, absl::Time now);
  // Removes the series of jobs that ended more than `retention` before `now`.
  void Sweep(absl::Time now);
  // Jobs that have series.
  size_t tracked() const;

  // "pending", "assigning", ... as in the `state` label.
  static std::string StateLabel(v1::JobState state);

 private:
  struct Series {
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    uint64_t iteration = 0;  // progress.iteration last seen
    bool ended = false;
    absl::Time ended_at;
    bool progress_stamped = false;
    std::vector<metrics::Gauge*> states;  // one per v1::JobState value, index = value
    metrics::Gauge* last_progress = nullptr;
    // Created with the first completed iteration.
    metrics::Gauge* loss = nullptr;
    metrics::Gauge* tokens_per_second = nullptr;
    metrics::Gauge* completed = nullptr;
    metrics::Gauge* requested = nullptr;
    metrics::Gauge* progress = nullptr;
    metrics::Gauge* eta = nullptr;
    metrics::Histogram* iteration_seconds = nullptr;
  };

  bool Track(const std::string& job_id, Series* series) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordProgress(const std::string& job_id, const v1::JobProgress& progress, Series* series,
                      absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Untrack(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EvictEnded(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  metrics::GaugeFamily* state_ = nullptr;
  metrics::GaugeFamily* last_progress_ = nullptr;
  metrics::GaugeFamily* loss_ = nullptr;
  metrics::GaugeFamily* tokens_per_second_ = nullptr;
  metrics::GaugeFamily* completed_ = nullptr;
  metrics::GaugeFamily* requested_ = nullptr;
  metrics::GaugeFamily* progress_ = nullptr;
  metrics::GaugeFamily* eta_ = nullptr;
  metrics::HistogramFamily* iteration_seconds_ = nullptr;

  mutable absl::Mutex mu_;
  std::map<std::string, Series> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_METRICS_H_
