#include "coordinator/job_metrics.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/metrics/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::Job MakeJob(const std::string& id, v1::JobState state, uint64_t iteration = 0,
                uint64_t total = 10) {
  v1::Job job;
  job.set_id(id);
  job.set_state(state);
  v1::JobProgress* p = job.mutable_progress();
  p->set_iteration(iteration);
  p->set_total_iterations(total);
  p->set_loss(5.5 - 0.1 * static_cast<double>(iteration));
  p->set_tokens_per_s(1000);
  p->set_iteration_time_s(0.25);
  p->set_eta_s(2.5);
  return job;
}

const absl::Time kT0 = absl::FromUnixSeconds(1700000000);

TEST(JobMetricsTest, PendingJobsHaveNoSeriesRunningOnesHaveAll) {
  metrics::Registry registry;
  JobMetrics jobs(&registry, {});
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_PENDING), kT0);
  EXPECT_EQ(jobs.tracked(), 0u);
  EXPECT_THAT(registry.Serialize(), Not(HasSubstr("job-1")));

  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_ASSIGNING), kT0);
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING), kT0 + absl::Seconds(1));
  std::string text = registry.Serialize();
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_state{job_id=\"job-1\",state=\"running\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_state{job_id=\"job-1\",state=\"assigning\"} 0\n"));
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_state{job_id=\"job-1\",state=\"pending\"} 0\n"));
  // Running without progress: stamped with the start, no loss yet (0 would
  // read as a perfect model).
  EXPECT_THAT(
      text,
      HasSubstr(
          "detour_coordinator_job_last_progress_timestamp_seconds{job_id=\"job-1\"} 1700000001\n"));
  EXPECT_THAT(text, Not(HasSubstr("detour_coordinator_job_loss")));

  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 4), kT0 + absl::Seconds(3));
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 4), kT0 + absl::Seconds(4));  // no new
  text = registry.Serialize();
  EXPECT_THAT(text, HasSubstr("detour_coordinator_job_loss{job_id=\"job-1\"} 5.1\n"));
  EXPECT_THAT(text, HasSubstr("detour_coordinator_job_tokens_per_second{job_id=\"job-1\"} 1000\n"));
  EXPECT_THAT(text, HasSubstr("detour_coordinator_job_iterations_completed{job_id=\"job-1\"} 4\n"));
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_iterations_requested{job_id=\"job-1\"} 10\n"));
  EXPECT_THAT(text, HasSubstr("detour_coordinator_job_progress_ratio{job_id=\"job-1\"} 0.4\n"));
  EXPECT_THAT(text, HasSubstr("detour_coordinator_job_eta_seconds{job_id=\"job-1\"} 2.5\n"));
  // One observation per completed-iteration change, not per job update.
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_iteration_seconds_count{job_id=\"job-1\"} 1\n"));
  EXPECT_THAT(
      text,
      HasSubstr(
          "detour_coordinator_job_iteration_seconds_bucket{job_id=\"job-1\",le=\"0.4\"} 1\n"));
  EXPECT_THAT(
      text,
      HasSubstr(
          "detour_coordinator_job_last_progress_timestamp_seconds{job_id=\"job-1\"} 1700000003\n"));
}

TEST(JobMetricsTest, EndedJobsKeepSeriesForTheRetentionOnly) {
  metrics::Registry registry;
  JobMetrics jobs(&registry, {absl::Minutes(10), 50});
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 1), kT0);
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_FAILED, 1), kT0 + absl::Seconds(5));
  EXPECT_THAT(registry.Serialize(),
              HasSubstr("detour_coordinator_job_state{job_id=\"job-1\",state=\"failed\"} 1\n"));
  jobs.Sweep(kT0 + absl::Minutes(9));
  EXPECT_EQ(jobs.tracked(), 1u);
  jobs.Sweep(kT0 + absl::Minutes(11));
  EXPECT_EQ(jobs.tracked(), 0u);
  EXPECT_THAT(registry.Serialize(), Not(HasSubstr("job-1")));
}

TEST(JobMetricsTest, AtMostMaxEndedJobsKeepSeriesOldestGoFirst) {
  metrics::Registry registry;
  JobMetrics jobs(&registry, {absl::Hours(1), 3});
  for (int i = 0; i < 6; ++i) {
    const std::string id = absl::StrCat("job-", i);
    jobs.Observe(MakeJob(id, v1::JOB_STATE_RUNNING, 1), kT0 + absl::Seconds(i));
    jobs.Observe(MakeJob(id, v1::JOB_STATE_SUCCEEDED, 1), kT0 + absl::Seconds(i));
  }
  jobs.Observe(MakeJob("live", v1::JOB_STATE_RUNNING, 1), kT0 + absl::Seconds(9));
  EXPECT_EQ(jobs.tracked(), 4u);  // 3 ended + the running one
  const std::string text = registry.Serialize();
  for (int i = 0; i < 3; ++i) EXPECT_THAT(text, Not(HasSubstr(absl::StrCat("job-", i, "\""))));
  for (int i = 3; i < 6; ++i) EXPECT_THAT(text, HasSubstr(absl::StrCat("job-", i, "\"")));
  EXPECT_THAT(text, HasSubstr("job_id=\"live\""));
}

TEST(JobMetricsTest, ResumedJobIsLiveAgainAndItsHistogramRestartsCleanly) {
  metrics::Registry registry;
  JobMetrics jobs(&registry, {absl::Minutes(10), 50});
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 6), kT0);
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_FAILED, 6), kT0);
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_PENDING, 6), kT0 + absl::Minutes(5));
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 4), kT0 + absl::Minutes(6));
  jobs.Sweep(kT0 + absl::Hours(2));
  EXPECT_EQ(jobs.tracked(), 1u);  // not ended any more
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 5), kT0 + absl::Hours(2));
  const std::string text = registry.Serialize();
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_state{job_id=\"job-1\",state=\"running\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("detour_coordinator_job_iterations_completed{job_id=\"job-1\"} 5\n"));
  // First seen at 6 (nothing to time), back to 4, then one iteration: 1.
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_iteration_seconds_count{job_id=\"job-1\"} 1\n"));
}

TEST(JobMetricsTest, NullRegistryRecordsNothing) {
  JobMetrics jobs(nullptr, {});
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 1), kT0);
  jobs.Sweep(kT0);
  EXPECT_EQ(jobs.tracked(), 0u);
}

}  // namespace
}  // namespace detour
