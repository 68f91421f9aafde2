// The job runner's elastic decisions on a fake host and fake workers
// (tests/coordinator/fake_cluster.h): losses, joins, pauses, rollbacks, a
// coordinator restart's re-attach, stage moves, and deadlines on the
// runner's clock.
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "common/clock.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_store.h"
#include "tests/coordinator/fake_cluster.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST_F(JobRunnerTest, TrainsEveryIterationAndReleasesTheWorkers) {
  for (const char* id : {"d0", "a", "b", "c"}) cluster_->AddWorker(id);
  Start(Spec(4, 1, 0.0, 5), {"d0", "a", "b", "c"});
  const v1::Job job = AwaitEnd();
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  EXPECT_EQ(job.progress().loss(), 2.5);
  EXPECT_EQ(job.progress().members(), 4u);
  EXPECT_EQ(cluster_->Sent("assignment"), 4);
  EXPECT_EQ(cluster_->Sent("plan"), 5 * 4);
  EXPECT_EQ(cluster_->Sent("step"), 5 * 4);
  EXPECT_EQ(cluster_->Sent("cancel"), 4) << "every worker is released at the end";
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
}

// A replica dies when the plan of iteration 2 reaches it: the survivors get
// a new epoch, every microbatch that crossed it runs again on other routes,
// and the job ends with one worker fewer and no iteration lost.
TEST_F(JobRunnerTest, WorkerLostMidIterationIsRoutedAround) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 6);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillOnRouteWhenPlanArrives(1, 2);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 6u);
  EXPECT_EQ(job.progress().members(), 4u);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("(stage 1) lost: its session closed"));
  EXPECT_THAT(History(job), HasSubstr("iteration 2 epoch 1: re-planned"));
  EXPECT_GT(job.progress().microbatches_rerun(), 0u);
  EXPECT_EQ(job.progress().microbatches_dropped(), 0u);
  EXPECT_GE(cluster_->Sent("membership"), 4);
  ASSERT_EQ(job.stages_size(), 3);
  EXPECT_EQ(job.stages(1).nodes_size(), 1);
}

// After the loss above, an idle worker is taken at the next iteration
// boundary and joins the stage that lacks a replica with its live
// replica's state (the donor streams it; the checksums agree).
TEST_F(JobRunnerTest, IdleWorkerJoinsWithAReplicasState) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 8);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillWhenPlanArrives("b1", 3);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_JOINED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker spare joined stage 2 at iteration 4 with the "
                                      "state of b2"));
  EXPECT_EQ(cluster_->Sent("send_state"), 1);
  EXPECT_EQ(job.progress().members(), 5u);
  EXPECT_EQ(cluster_->StageOf("spare"), -1) << "released at the end";
}

// The full pipeline cannot skip a stage: losing the only worker of stage 2
// pauses the job at that iteration until a worker registers. With
// elastic.on_stage_loss REINITIALIZE (asked for), it then joins with fresh
// parameters (no replica, no checkpoint) and the job goes on; the loss is
// recorded all the same.
TEST_F(JobRunnerTest, StageWithoutWorkersPausesUntilOneJoins) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_REINITIALIZE);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 1);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  v1::Job paused = Job();
  ASSERT_EQ(paused.state(), v1::JOB_STATE_RUNNING) << paused.message() << "\n" << History(paused);
  EXPECT_THAT(paused.message(), HasSubstr("paused: stage 2 has no worker left"));
  EXPECT_EQ(paused.progress().iteration(), 1u);
  cluster_->AddWorker("late");
  runner_->Poke();
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker late joined stage 2 at iteration 1 (fresh "
                                      "parameters"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_CONTINUED), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("STAGE_LOSS_REINITIALIZE: a worker that joins it starts "
                                      "from fresh parameters"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 0) << History(job);
  EXPECT_THAT(cluster_->Scrape(),
              HasSubstr("detour_coordinator_stage_losses_total{action=\"reinitialize\"} 1\n"));
}

// The default (elastic.on_stage_loss ROLLBACK): the only worker of stage 2
// dies at iteration 5; a worker that registers fills the stage, and the
// whole job goes back to its newest checkpoint (after 4 iterations) before
// it trains again: every stage restores it, iterations 4 and on run again.
// It used to go on with stage 2 restored alone or from fresh parameters
// while the other stages kept theirs, visible only in the history.
TEST_F(JobRunnerTest, StageLossRollsTheWholeJobBackToItsNewestCheckpoint) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 8);
  spec.mutable_checkpoint()->set_disabled(false);
  spec.mutable_checkpoint()->set_every_iterations(2);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 5);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  EXPECT_THAT(Job().message(), HasSubstr("stage 2 has no worker left"));
  cluster_->AddWorker("late");
  runner_->Poke();
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("stage 2 lost its last replica (worker b) and its state; "
                                      "elastic.on_stage_loss STAGE_LOSS_ROLLBACK"));
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("rolled back from iteration 5 to checkpoint"));
  EXPECT_THAT(History(job), HasSubstr("(iteration 4) on 3 workers"));
  EXPECT_THAT(History(job), Not(HasSubstr("fresh parameters")));
  // The joiner's assignment, then all three members' restore the checkpoint.
  const std::vector<std::string> restored = cluster_->Restored();
  ASSERT_EQ(restored.size(), 4u);
  for (const std::string& dir : restored) EXPECT_EQ(dir, restored.back());
  const std::vector<uint64_t> planned = cluster_->PlannedIterations();
  ASSERT_GE(planned.size(), 2u);
  // Each plan is counted once per worker it reaches (3).
  EXPECT_EQ(std::count(planned.begin(), planned.end(), 4u), 2 * 3) << "iteration 4 ran again";
  EXPECT_EQ(job.progress().iteration(), 8u);
  EXPECT_THAT(cluster_->Scrape(),
              HasSubstr("detour_coordinator_stage_losses_total{action=\"rollback\"} 1\n"));
}

// ROLLBACK without a checkpoint: the whole job starts again at iteration 0
// with the seeded parameters in every stage (one model version), and says so.
TEST_F(JobRunnerTest, StageLossWithoutACheckpointRollsBackToIterationZero) {
  for (const char* id : {"d0", "a", "b", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 3);
  Start(spec, {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("the whole job starts again at iteration 0 with fresh "
                                      "parameters (there is no checkpoint)"));
  EXPECT_THAT(History(job), HasSubstr("rolled back from iteration 3 to iteration 0 (no "
                                      "checkpoint: fresh parameters in every stage) on 3 workers"));
  const std::vector<uint64_t> planned = cluster_->PlannedIterations();
  EXPECT_EQ(std::count(planned.begin(), planned.end(), 0u), 2 * 3) << "iteration 0 ran again";
  EXPECT_EQ(cluster_->Sent("assignment"), 3 + 1 + 3);
  EXPECT_EQ(job.progress().iteration(), 5u);
}

// ROLLBACK, and the only worker of stage 2 is lost in iteration 2 (cut off
// from the coordinator): the job pauses, with no other worker to fill the
// stage. The lost worker itself comes back idle (it dropped its part) and
// fills it; the job rolls back and completes. A worker lost in the
// iteration a job paused in used to be kept out of the job until that
// iteration ended, which a paused job's never does: it failed when the
// pause timed out.
TEST_F(JobRunnerTest, AWorkerLostInThePausedIterationMayFillItsStageAgain) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  spec.mutable_elastic()->set_pause_timeout_s(20);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 2);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << History(Job());
  EXPECT_THAT(Job().message(), HasSubstr("stage 2 has no worker left"));
  cluster_->AddWorker("b");  // back, idle
  runner_->Poke();
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b joined stage 2 at iteration 2"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
}

// PAUSE: the stage's last worker is lost (its session closes) at iteration
// 2; an idle worker is there but may not take the stage from fresh
// parameters. The lost worker comes back holding the stage at the job's
// iteration: it takes its stage again and the job goes on from there.
TEST_F(JobRunnerTest, StageLossPausedUntilItsHolderComesBack) {
  for (const char* id : {"d0", "a", "b", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 6);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_PAUSE);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 2);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << History(Job());
  EXPECT_THAT(Job().message(), HasSubstr("stage 2 has no worker left"));
  runner_->Poke();  // the spare is idle all along: it is not taken
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(cluster_->Sent("assignment"), 3) << History(Job());
  // b's process survived: it registers again and reports the stage it holds.
  cluster_->AddWorker("b");
  cluster_->Hold("b", 2, 1002);
  ReportHolding("b", 2, 2, 0);
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("STAGE_LOSS_PAUSE: the job pauses until a worker holding "
                                      "its state (b) comes back"));
  EXPECT_THAT(History(job), HasSubstr("worker b came back holding stage 2's state at iteration 2"));
  EXPECT_EQ(cluster_->Sent("assignment"), 3) << "nobody rebuilt a stage";
  EXPECT_EQ(cluster_->StageOf("spare"), -1);
  EXPECT_EQ(job.progress().iteration(), 6u);
  EXPECT_THAT(cluster_->Scrape(),
              HasSubstr("detour_coordinator_stage_losses_total{action=\"pause\"} 1\n"));
}

// PAUSE, and the stage's last worker is excluded for a bad forward frame
// (b reports a's activation of microbatch 0): the job pauses, and a coming
// back with the stage's state is not taken back; the job fails when the
// pause times out instead of training on with the excluded worker.
TEST_F(JobRunnerTest, AnExcludedHolderOfAPausedStageIsNotTakenBack) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 6);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_PAUSE);
  spec.mutable_elastic()->set_pause_timeout_s(3);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->ReportBadFrameWhenPlanArrives("b", "a", 2, v1::DIRECTION_FORWARD);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << History(Job());
  EXPECT_THAT(History(Job()), HasSubstr("worker a (stage 1) lost: excluded: b received"));
  ReportHolding("a", 1, 2, 0);
  const v1::Job job = AwaitEnd();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), Not(HasSubstr("worker a came back"))) << History(job);
}

// The coordinator restarted while the job ran: the runner re-attaches to
// the workers that report the job (JobStatus), aborts the iteration that was
// in flight and continues from the iterations they completed. A worker that
// does not come back within the wait is lost, not waited for.
TEST_F(JobRunnerTest, ReattachesAfterACoordinatorRestart) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 7);
  cluster_->mutable_options()->assign_timeout = absl::Seconds(2);  // a2 never reports
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  // What the store held when the old coordinator died: a running job, its
  // stages, its epoch.
  StoreRunningJob(*normalized);
  cluster_->Hold("d0", 0, 7);
  cluster_->Hold("a1", 1, 8);
  cluster_->Hold("b", 2, 9);
  cluster_->Kill("a2");  // never reports back
  // The workers report what they hold once their sessions reopen.
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage] :
       std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a1", 1}, {"b", 2}}) {
    ReportHolding(id, stage, 3, 4);
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("re-attached 3 workers after a coordinator restart; "
                                      "continuing at iteration 3"));
  EXPECT_THAT(History(job), HasSubstr("worker a2 did not come back"));
  EXPECT_EQ(job.epoch(), 5u) << "a new epoch after the restart";
  EXPECT_EQ(cluster_->Sent("assignment"), 0) << "the workers keep their stages";
  EXPECT_EQ(cluster_->Sent("abort"), 3);
  const std::vector<uint64_t> planned = cluster_->PlannedIterations();
  ASSERT_FALSE(planned.empty());
  EXPECT_EQ(planned.front(), 3u);
  EXPECT_EQ(job.progress().iteration(), 7u);
}

// A worker back after the restart whose heartbeat names no part of the job
// (the old coordinator told it to drop the job before it died) is not
// waited for until --assign_timeout: the others re-attach at once, and a
// job whose workers all came back empty-handed fails at once, saying so.
TEST_F(JobRunnerTest, ReattachDoesNotWaitForWorkersBackWithoutTheJob) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->assign_timeout = absl::Hours(1);
  auto normalized = NormalizeJobSpec(Spec(3, 2, 0.0, 7));
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  for (const bool any_holds : {true, false}) {
    SCOPED_TRACE(any_holds ? "three still hold the job" : "none holds it");
    StoreRunningJob(*normalized);
    if (any_holds) {
      cluster_->Hold("d0", 0, 7);
      cluster_->Hold("a1", 1, 8);
      cluster_->Hold("b", 2, 9);
    }
    cluster_->Beat("a2", "");
    const absl::Time start = absl::Now();
    Start(*normalized, {}, JobRunner::StartMode::kReattach);
    if (any_holds) {
      for (const auto& [id, stage] :
           std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a1", 1}, {"b", 2}}) {
        cluster_->Beat(id, job_id_);
        ReportHolding(id, stage, 3, 4);
      }
    } else {
      for (const char* id : {"d0", "a1", "b"}) cluster_->Beat(id, "");
    }
    const v1::Job job = AwaitEnd();
    EXPECT_LT(absl::Now() - start, absl::Minutes(1)) << "waited for --assign_timeout";
    if (!any_holds) {
      ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << History(job);
      EXPECT_THAT(job.message(),
                  HasSubstr("no worker of the job came back holding its part (a1, a2, b, d0 came "
                            "back without it)"));
      continue;
    }
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
    EXPECT_THAT(History(job), HasSubstr("re-attached 3 workers after a coordinator restart"));
    EXPECT_THAT(History(job), HasSubstr("worker a2 came back after the coordinator restarted "
                                        "without its part of the job"));
    EXPECT_EQ(job.progress().iteration(), 7u);
  }
}

// The old coordinator died between its step messages of iteration 3: d0
// and a1 applied the step (4 iterations done), a2 and b wait for it. The
// runner sends a2 and b the step the record holds, checks that a2 now
// matches its replica a1, and goes on at iteration 4. Without the stored
// step the job fails, naming what is missing.
TEST_F(JobRunnerTest, ReattachSendsTheStepTheOldCoordinatorDiedSending) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 7);
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  for (const bool stored_step : {true, false}) {
    SCOPED_TRACE(stored_step ? "the record holds the step" : "no step in the record");
    StoreRunningJob(*normalized, [&](v1::Job* j) {
      if (stored_step) StepOfIteration3(j);
    });
    // a2's parameters before the step; a1 applied it (FakeCluster's step:
    // checksum * 31 + iteration + 1).
    const uint64_t before = 8, after = before * 31 + 4;
    cluster_->Hold("d0", 0, 7);
    cluster_->Hold("a1", 1, after);
    cluster_->HoldInIteration("a2", 1, before, 3, 4);
    cluster_->HoldInIteration("b", 2, 9, 3, 4);
    Start(*normalized, {}, JobRunner::StartMode::kReattach);
    for (const auto& [id, stage, done] : std::vector<std::tuple<std::string, int, uint64_t>>{
             {"d0", 0, 4}, {"a1", 1, 4}, {"a2", 1, 3}, {"b", 2, 3}}) {
      ReportHolding(id, stage, done, 4, /*in_iteration=*/done == 3,
                    id == "a1"   ? after
                    : id == "a2" ? before
                                 : 0);
    }
    const v1::Job job = AwaitEnd();
    if (!stored_step) {
      ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << History(job);
      EXPECT_THAT(job.message(), HasSubstr("the workers stopped at different iterations (3 and 4) "
                                           "and the record holds no step of iteration 3"));
      continue;
    }
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
    EXPECT_THAT(History(job), HasSubstr("re-attached 4 workers after a coordinator restart; "
                                        "continuing at iteration 4 (2 of them first applied the "
                                        "step of iteration 3"));
    const auto steps = cluster_->Steps();
    ASSERT_GE(steps.size(), 2u);
    EXPECT_EQ(steps[0], std::make_tuple(std::string("a2"), uint64_t{3}, 2.25));
    EXPECT_EQ(steps[1], std::make_tuple(std::string("b"), uint64_t{3}, 2.25));
    const std::vector<uint64_t> planned = cluster_->PlannedIterations();
    ASSERT_FALSE(planned.empty());
    EXPECT_EQ(planned.front(), 4u);
    EXPECT_EQ(job.progress().iteration(), 7u);
    EXPECT_FALSE(job.has_pending_step()) << "cleared with the progress of its iteration";
  }
}

// A laggard that does not apply the stored step within --assign_timeout
// (here: its runtime drops it, being in another iteration than it reported)
// leaves the job; the others go on at iteration 4. The new epoch is above
// every epoch in play, though the stored one lags the workers'.
TEST_F(JobRunnerTest, ReattachDropsALaggardThatDoesNotApplyTheStep) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->assign_timeout = absl::Seconds(2);
  auto normalized = NormalizeJobSpec(Spec(3, 2, 0.0, 7));
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  StoreRunningJob(*normalized, [](v1::Job* j) {
    j->set_epoch(3);  // its last stage-list write was lost
    StepOfIteration3(j);
  });
  cluster_->Hold("d0", 0, 7);
  cluster_->Hold("a1", 1, 8);
  cluster_->HoldInIteration("a2", 1, 8, 2, 4);  // drops the step of iteration 3
  cluster_->HoldInIteration("b", 2, 9, 3, 4);
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage, done] : std::vector<std::tuple<std::string, int, uint64_t>>{
           {"d0", 0, 4}, {"a1", 1, 4}, {"a2", 1, 3}, {"b", 2, 3}}) {
    ReportHolding(id, stage, done, 4, /*in_iteration=*/done == 3);
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker a2 did not apply the step of iteration 3"));
  EXPECT_THAT(History(job), HasSubstr("re-attached 3 workers after a coordinator restart; "
                                      "continuing at iteration 4 (1 of them first applied"));
  EXPECT_EQ(job.epoch(), 5u) << "above the workers' 4, not the stored 3 + 1";
  ASSERT_EQ(job.stages(1).nodes_size(), 1);
  EXPECT_EQ(job.stages(1).nodes(0), "a1");
}

// Every step message goes out after the job record holds it: a coordinator
// that dies between two of them leaves its successor the step to finish
// with.
TEST_F(JobRunnerTest, EveryStepIsInTheRecordBeforeAWorkerGetsIt) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  Start(Spec(3, 1, 0.0, 4), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(cluster_->Sent("step"), 12);
  EXPECT_EQ(cluster_->StepsNotInRecord(), 0);
}

// A graceful stop of the coordinator (JobManager::Shutdown detaches every
// runner): the job stays RUNNING with its stages recorded and its workers
// untold, and a runner started on the same store re-attaches to them and
// finishes the job, as after a crash. It used to end FAILED ("coordinator
// stopped while the job was running") with every worker told to drop it.
TEST_F(JobRunnerTest, DetachLeavesTheJobRunningForTheNextCoordinator) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 100000);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return j.progress().iteration() >= 3 || JobStore::IsFinal(j.state());
  })) << History(Job());
  runner_->Detach();
  runner_->RequestStop(JobEnd{v1::JOB_STATE_FAILED, "a later stop changes nothing"});
  runner_.reset();
  cluster_->set_runner(nullptr);
  v1::Job left = Job();
  ASSERT_EQ(left.state(), v1::JOB_STATE_RUNNING) << left.message() << "\n" << History(left);
  ASSERT_EQ(left.stages_size(), 3);
  EXPECT_FALSE(left.has_end_time());
  EXPECT_EQ(cluster_->Sent("cancel"), 0) << "the workers keep their stages";
  const uint64_t done = left.progress().iteration();
  ASSERT_LT(done, 100000u);

  // The next coordinator: a runner re-attaching to what the store holds,
  // with a short job left so that the test ends.
  ASSERT_TRUE(cluster_->jobs()
                  .Update(job_id_, [&](v1::Job* j) { j->mutable_spec()->set_iterations(done + 3); })
                  .ok());
  spec.set_iterations(done + 3);
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage] :
       std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a", 1}, {"b", 2}}) {
    ReportHolding(id, stage, done, left.epoch());
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_REATTACHED), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), done + 3);
  EXPECT_EQ(cluster_->Sent("assignment"), 3) << "only the first runner assigned stages";
}

// PAUSE when the holder never comes back: the job fails once
// elastic.pause_timeout_s has passed, naming what it waited for; never_join
// does not fail it sooner (the holder's return is no replacement).
TEST_F(JobRunnerTest, StageLossPauseFailsWhenTheHolderDoesNotComeBack) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 6);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_PAUSE);
  spec.mutable_elastic()->set_never_join(true);
  spec.mutable_elastic()->set_pause_timeout_s(1);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 2);
  Start(spec, {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << History(job);
  EXPECT_THAT(job.message(), HasSubstr("timed out waiting for workers to join (stage 2 has no "
                                       "worker left)"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 2u);
}

// Routes that skip stages go on around a stage left without workers; at the
// next iteration boundary a spare replica of stage 1 or 3 moves there (a
// move into an empty stage always pays), and the job ends with every stage
// held.
TEST_F(JobRunnerTest, SpareReplicaMovesIntoAnEmptyStage) {
  const std::vector<std::string> all = {"d0", "a1", "a2", "b1", "b2", "c1", "c2"};
  for (const std::string& id : all) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(4, 2, 0.25, 8);  // routes visit 3 of 4 stages
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}, {"c1", "c2"}});
  cluster_->KillWhenPlanArrives("b1", 2);
  cluster_->KillWhenPlanArrives("b2", 2);
  Start(spec, all);
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("stage 2 has no worker left: every route skips it"));
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_REASSIGNED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("to stage 2"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_PAUSED), 0) << History(job);
  ASSERT_EQ(job.stages_size(), 4);
  EXPECT_EQ(job.stages(1).nodes_size() + job.stages(3).nodes_size(), 3);
  EXPECT_EQ(job.stages(2).nodes_size(), 1);
  EXPECT_EQ(job.progress().iteration(), 8u);
}

// Elastic training off: the first loss fails the job, naming the worker.
TEST_F(JobRunnerTest, LossFailsAJobWithoutElasticTraining) {
  for (const char* id : {"d0", "a1", "a2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(2, 2, 0.0, 5);
  spec.mutable_elastic()->set_disabled(true);
  Pin(&spec, {{"d0"}, {"a1", "a2"}});
  cluster_->KillWhenPlanArrives("a1", 1);
  Start(spec, {"d0", "a1", "a2"});
  const v1::Job job = AwaitEnd();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.message(), HasSubstr("worker a1 lost (its session closed"));
}

// --- the runner's clock -----------------------------------------------------

// The runner judges deadlines by its host's clock: a worker that takes the
// plan and never answers times the iteration out once the clock passes the
// iteration timeout (30 s here), and not before, however long it waits.
TEST_F(JobRunnerTest, AnUnansweredPlanTimesOutOnTheRunnersClock) {
  FakeClock& clock = fake_clock_;
  cluster_->UseClock(&clock);
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->Mute("b");
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return !cluster_->PlannedIterations().empty(); }));
  absl::SleepFor(absl::Milliseconds(1200));  // more than two of the loop's wait slices
  EXPECT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << Job().message();
  clock.Advance(absl::Seconds(31));
  // Well before 30 real seconds: the clock, not the wall, timed it out.
  ASSERT_TRUE(
      AwaitJob([](const v1::Job& j) { return JobStore::IsFinal(j.state()); }, absl::Seconds(10)));
  const v1::Job job = Job();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.message(), HasSubstr("timed out waiting for"));
}

// A worker whose session closed is lost only once the reconnect grace has
// passed on the runner's clock (60 s here); until then the job waits for it,
// then routes around it and finishes.
TEST_F(JobRunnerTest, AClosedSessionIsLostOnlyAfterTheGraceOnTheRunnersClock) {
  FakeClock& clock = fake_clock_;
  cluster_->UseClock(&clock);
  cluster_->mutable_options()->iteration_timeout = absl::Minutes(10);
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 4);
  spec.mutable_elastic()->set_reconnect_grace_ms(60000);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillWhenPlanArrives("b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return cluster_->PlannedIterations().size() >= 10; }));
  absl::SleepFor(absl::Milliseconds(1200));
  v1::Job waiting = Job();
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Count(waiting, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(waiting);
  clock.Advance(absl::Seconds(61));
  ASSERT_TRUE(
      AwaitJob([](const v1::Job& j) { return JobStore::IsFinal(j.state()); }, absl::Seconds(10)))
      << History(Job());
  const v1::Job job = Job();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b1 (stage 2) lost: its session closed 1m1s ago"));
  EXPECT_EQ(job.progress().iteration(), 4u);
}

}  // namespace
}  // namespace detour::testing
