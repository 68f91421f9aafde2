// What the coordinator says to, and logs about, a worker whose heartbeat
// names a job it is no member of.
#include "coordinator/job_manager.h"

#include <filesystem>
#include <string>
#include <system_error>

#include "absl/time/clock.h"
#include "common/metrics/metrics.h"
#include "common/spec.h"
#include "coordinator/control_service.h"
#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::Job Stored(v1::JobState state, const std::string& message) {
  v1::Job job;
  job.set_id("job-000001");
  job.set_state(state);
  job.set_message(message);
  return job;
}

// Regression: a worker that stalled past the silence and came back was told
// the coordinator "no longer runs this job (it restarted)" while it ran the
// job on without it, and the log said the coordinator "does not run" it.
TEST(JudgeWorkerJobTest, AReturningWorkerIsToldWhatHappened) {
  const WorkerJobVerdict back =
      JudgeWorkerJob("w3", "job-000001", /*running=*/true, Stored(v1::JOB_STATE_RUNNING, ""));
  EXPECT_THAT(back.log, HasSubstr("worker w3 is back holding job job-000001, which runs on "
                                  "without it (it was removed from the job when it was lost)"));
  EXPECT_THAT(back.log, Not(HasSubstr("does not run")));
  EXPECT_THAT(back.reason, HasSubstr("runs on without this worker"));
  EXPECT_THAT(back.reason, Not(HasSubstr("restarted")));

  const WorkerJobVerdict ended = JudgeWorkerJob(
      "w3", "job-000001", false, Stored(v1::JOB_STATE_FAILED, "stage 1 has no worker left"));
  EXPECT_THAT(ended.log,
              HasSubstr("which ended (failed: stage 1 has no worker left); telling it to drop"));
  EXPECT_EQ(ended.reason, "the job ended (failed)");

  // Regression: a job that had just ended still had its runner while it
  // wound down, and every worker whose last heartbeat named it was logged
  // as "removed from the job when it was lost" (seen at the end of WAN test
  // bed runs that lost no worker).
  const WorkerJobVerdict winding_down =
      JudgeWorkerJob("w3", "job-000001", /*running=*/true,
                     Stored(v1::JOB_STATE_SUCCEEDED, "trained 30 iterations"));
  EXPECT_THAT(winding_down.log,
              HasSubstr("which ended (succeeded: trained 30 iterations); telling it to drop"));
  EXPECT_THAT(winding_down.log, Not(HasSubstr("lost")));
  EXPECT_EQ(winding_down.reason, "the job ended (succeeded)");

  const WorkerJobVerdict restarted =
      JudgeWorkerJob("w3", "job-000001", false, Stored(v1::JOB_STATE_PENDING, ""));
  EXPECT_THAT(restarted.log,
              HasSubstr("which this coordinator does not run (it restarted; the job is pending)"));
  EXPECT_THAT(restarted.reason, HasSubstr("it restarted"));

  const WorkerJobVerdict unknown =
      JudgeWorkerJob("w3", "job-000009", false, absl::NotFoundError("no job job-000009"));
  EXPECT_THAT(unknown.log, HasSubstr("which this coordinator does not know"));
  EXPECT_EQ(unknown.reason, "the coordinator does not know this job");
}

// Regression: a coordinator serves before it has read back the jobs it ran
// (Coordinator::Start starts gRPC, then recovers). A worker whose heartbeat
// came in that window was told to drop its part of a running job, which the
// coordinator was about to re-attach to: it "does not run" the job.
TEST(JobManagerTest, GivesNoVerdictBeforeItHasRecoveredItsJobs) {
  const testing::TempDir temp("job_manager_test");
  const std::string& dir = temp.path();
  JobStore jobs(dir);
  v1::JobSpec spec;
  spec.set_name("held");
  spec.set_iterations(4);
  spec.mutable_model()->set_preset("tiny");
  spec.mutable_pipeline()->set_num_stages(2);
  spec.mutable_pipeline()->set_data_nodes(1);
  spec.mutable_checkpoint()->set_disabled(true);
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  auto created = jobs.Create(*normalized, absl::Now(), "submitted");
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->id();
  ASSERT_TRUE(jobs.Update(id,
                          [](v1::Job* j) {
                            j->set_state(v1::JOB_STATE_RUNNING);
                            j->add_stages()->add_nodes("w0");
                            j->add_stages()->add_nodes("w1");
                          })
                  .ok());

  WorkerRegistry registry(absl::Seconds(30), absl::Seconds(1));
  ControlServiceImpl control(&registry, /*auth=*/nullptr, /*require_worker_certificates=*/false,
                             {});
  metrics::Registry metrics;
  JobManagerOptions options;
  options.metrics = &metrics;
  options.checkpoint_root = dir + "/checkpoints";
  JobManager manager(&jobs, &registry, &control, options);

  const auto early = manager.CheckWorkerJob("w1", id);
  EXPECT_FALSE(early.has_value()) << "not recovered yet, so the job may be one it re-attaches "
                                     "to; yet it said: "
                                  << early.value_or(WorkerJobVerdict{}).log;
  manager.Recover();
  const auto member = manager.CheckWorkerJob("w1", id);
  EXPECT_FALSE(member.has_value())
      << "w1 holds a stage of the job; yet it said: " << member.value_or(WorkerJobVerdict{}).log;
  const auto stranger = manager.CheckWorkerJob("w9", id);
  ASSERT_TRUE(stranger.has_value()) << "w9 is no member of the running job";
  EXPECT_THAT(stranger->log, HasSubstr("is back holding job " + id));
  const auto unknown = manager.CheckWorkerJob("w8", "job-999999");
  ASSERT_TRUE(unknown.has_value());
  EXPECT_THAT(unknown->log, HasSubstr("which this coordinator does not know"));
  manager.Shutdown();
}

}  // namespace
}  // namespace detour
