#include "coordinator/job_metrics.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/metrics/metrics.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/time_util.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/test_paths.h"

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

void Ended(v1::Job* job, absl::Time at) {
  *job->mutable_end_time() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(at));
}

// A restarted coordinator: the jobs it reads back get their series, a job
// that failed before the restart included (it used to get none, so
// DetourJobFailed never fired for it). Retention counts from the job's end.
TEST(JobMetricsTest, RestoredJobsGetTheirSeriesEndedOnesFromTheirEnd) {
  metrics::Registry registry;
  JobMetrics jobs(&registry, {absl::Minutes(10), 50});
  const absl::Time now = kT0 + absl::Hours(1);
  v1::Job failed = MakeJob("job-f", v1::JOB_STATE_FAILED, 3);
  Ended(&failed, now - absl::Minutes(4));
  v1::Job old = MakeJob("job-old", v1::JOB_STATE_SUCCEEDED, 10);
  Ended(&old, now - absl::Minutes(30));
  jobs.Restore(failed, now);
  jobs.Restore(old, now);
  jobs.Restore(MakeJob("job-r", v1::JOB_STATE_RUNNING, 2), now);
  jobs.Restore(MakeJob("job-p", v1::JOB_STATE_PENDING), now);
  const std::string text = registry.Serialize();
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_state{job_id=\"job-f\",state=\"failed\"} 1\n"));
  EXPECT_THAT(text,
              HasSubstr("detour_coordinator_job_state{job_id=\"job-r\",state=\"running\"} 1\n"));
  EXPECT_THAT(text, Not(HasSubstr("job-old"))) << "ended longer than the retention ago";
  EXPECT_THAT(text, Not(HasSubstr("job-p")));
  EXPECT_EQ(jobs.tracked(), 2u);
  jobs.Sweep(now + absl::Minutes(5));  // 9 minutes after its end
  EXPECT_EQ(jobs.tracked(), 2u);
  jobs.Sweep(now + absl::Minutes(7));  // 11
  EXPECT_EQ(jobs.tracked(), 1u);
  EXPECT_THAT(registry.Serialize(), Not(HasSubstr("job-f")));
}

// Runs `command`; its exit status, and its output in `out`.
int RunShell(const std::string& command, std::string* out) {
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) out->append(buffer, n);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The shipped DetourJobFailed rule, evaluated by promtool on the state
// series a restarted coordinator exposes for a job that failed before the
// restart: the alert fires for that job and no other.
TEST(JobMetricsTest, DetourJobFailedFiresOnARestoredFailedJob) {
  if (access("/usr/bin/promtool", X_OK) != 0) {
    GTEST_SKIP() << "promtool is not installed (Debian package prometheus; "
                    "tools/install_deps.sh installs it)";
  }
  metrics::Registry registry;
  JobMetrics jobs(&registry, {});
  const absl::Time now = absl::Now();
  v1::Job failed = MakeJob("job-000007", v1::JOB_STATE_FAILED, 3);
  Ended(&failed, now - absl::Minutes(2));
  v1::Job succeeded = MakeJob("job-000008", v1::JOB_STATE_SUCCEEDED, 10);
  Ended(&succeeded, now - absl::Minutes(1));
  jobs.Restore(failed, now);
  jobs.Restore(succeeded, now);
  jobs.Restore(MakeJob("job-000009", v1::JOB_STATE_RUNNING, 1), now);

  // Every state series of the scrape, as Prometheus would store it.
  std::string series;
  int count = 0;
  for (absl::string_view line : absl::StrSplit(registry.Serialize(), '\n')) {
    if (!absl::StartsWith(line, "detour_coordinator_job_state{")) continue;
    const size_t close = line.rfind('}');
    ASSERT_NE(close, absl::string_view::npos) << line;
    const std::string value(line.substr(close + 2));
    absl::StrAppend(&series, "      - series: '", line.substr(0, close),
                    ",job=\"detour\",instance=\"c:9470\"}'\n        values: '", value, " ", value,
                    " ", value, "'\n");
    ++count;
  }
  ASSERT_EQ(count, 3 * 6) << registry.Serialize();
  const testing::TempDir temp("job_metrics_promtool");
  const std::string& dir = temp.path();
  const std::string rules = testing::SourceDir() + "/deploy/prometheus/detour.rules.yml";
  const std::string test = dir + "/restored.test.yml";
  std::ofstream(test) << "rule_files:\n  - " << rules << "\nevaluation_interval: 1m\ntests:\n"
                      << "  - interval: 1m\n    input_series:\n"
                      << series << R"(    alert_rule_test:
      - eval_time: 1m
        alertname: DetourJobFailed
        exp_alerts:
          - exp_labels:
              severity: critical
              job: detour
              instance: "c:9470"
              job_id: job-000007
              state: failed
            exp_annotations:
              summary: "detour job job-000007 failed"
              description: "See `detourctl get job-000007` for the reason."
)";
  std::string out;
  EXPECT_EQ(RunShell(absl::StrCat("/usr/bin/promtool test rules ", test), &out), 0) << out;
}

TEST(JobMetricsTest, NullRegistryRecordsNothing) {
  JobMetrics jobs(nullptr, {});
  jobs.Observe(MakeJob("job-1", v1::JOB_STATE_RUNNING, 1), kT0);
  jobs.Sweep(kT0);
  EXPECT_EQ(jobs.tracked(), 0u);
}

}  // namespace
}  // namespace detour
