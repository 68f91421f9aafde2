// What the coordinator says to, and logs about, a worker whose heartbeat
// names a job it is no member of.
#include "coordinator/job_manager.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace detour
