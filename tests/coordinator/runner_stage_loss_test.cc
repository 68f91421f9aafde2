// RunnerStageLoss on its own: a lost stage's record, rollback, pause and
// refill, driven through a fake drive loop (FakeLoop below) over the fake
// host of tests/coordinator/fake_cluster.h.
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "coordinator/runner_elastic.h"
#include "coordinator/runner_iteration.h"
#include "coordinator/runner_links.h"
#include "coordinator/runner_part.h"
#include "coordinator/runner_stage_loss.h"
#include "tests/coordinator/fake_cluster.h"

namespace detour::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// --- RunnerStageLoss on its own ----------------------------------------------------

// The drive loop's services to a part on its own: assignments are built and
// counted, and every worker sent one reports its stage built at the next
// wait. A wait with nothing to wait for ends the job, so nothing wedges.
class FakeLoop : public RunnerLoop {
 public:
  explicit FakeLoop(const std::string& job_id) : job_id_(job_id) {}

  RunnerEvent Wait(absl::Time, const std::function<std::string()>& describe, bool, bool) override {
    RunnerEvent ev;
    if (building_.empty()) {
      ev.end = JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("nothing to wait for: ", describe())};
      return ev;
    }
    for (const std::string& id : building_) {
      v1::WorkerMessage m;
      m.mutable_stage_ready()->set_job_id(job_id_);
      ev.messages.emplace_back(id, m);
    }
    building_.clear();
    return ev;
  }
  bool StopRequested() const override { return false; }
  void RemoveMember(const std::string&, const std::string&, uint64_t) override {}
  v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                       const std::string&,
                                       const std::string& restore_from) override {
    building_.push_back(id);
    starts.push_back(start);
    v1::CoordinatorMessage m;
    v1::StageAssignment* a = m.mutable_assignment();
    a->set_job_id(job_id_);
    a->set_worker_id(id);
    a->set_stage(static_cast<uint32_t>(stage));
    a->set_start_iteration(start);
    a->set_restore_from(restore_from);
    return m;
  }

  std::vector<uint64_t> starts;  // start_iteration of each assignment built

 private:
  const std::string job_id_;
  std::vector<std::string> building_;
};

// The stage-loss part over the state a runner holds after its first plan:
// a full pipeline of d0, a and b (one worker per stage) at iteration 3.
class RunnerStageLossTest : public JobRunnerTest {
 protected:
  void SetUp() override {
    JobRunnerTest::SetUp();
    for (const char* id : {"d0", "a", "b", "late"}) cluster_->AddWorker(id);
  }
  void TearDown() override {
    Reset();
    JobRunnerTest::TearDown();
  }
  void Reset() {
    loss_.reset();
    iteration_.reset();
    elastic_.reset();
    loop_.reset();
    shared_.reset();
  }

  void Build(v1::StageLossAction action, bool never_join = false) {
    Reset();
    v1::JobSpec spec = Spec(3, 1, 0.0, 8);
    spec.mutable_elastic()->set_on_stage_loss(action);
    spec.mutable_elastic()->set_never_join(never_join);
    Pin(&spec, {{"d0"}, {"a"}, {"b"}});
    auto normalized = NormalizeJobSpec(std::move(spec));
    ASSERT_TRUE(normalized.ok()) << normalized.status();
    auto job = cluster_->jobs().Create(*normalized, absl::Now(), "submitted");
    ASSERT_TRUE(job.ok()) << job.status();
    job_id_ = job->id();
    shared_ = std::make_unique<RunnerShared>(cluster_.get(), job_id_, *normalized);
    loop_ = std::make_unique<FakeLoop>(job_id_);
    for (const v1::WorkerInfo& w : cluster_->Infos({"d0", "a", "b"})) {
      shared_->membership.Admit(w);
    }
    for (const auto& [id, stage] :
         std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a", 1}, {"b", 2}}) {
      shared_->membership.Set(id, stage);
    }
    ASSERT_TRUE(shared_->plan.BuildCostModel().ok());
    shared_->plan.RebuildAssignment();
    shared_->next_iteration = 3;
    elastic_ = std::make_unique<RunnerElastic>(shared_.get(), loop_.get());
    links_ = std::make_unique<RunnerLinks>(shared_.get(), loop_.get());
    iteration_ =
        std::make_unique<RunnerIteration>(shared_.get(), loop_.get(), elastic_.get(), links_.get());
    loss_ = std::make_unique<RunnerStageLoss>(shared_.get(), loop_.get(), elastic_.get(),
                                              iteration_.get());
  }

  // b, stage 2's only worker, leaves the membership as a lost member does.
  void LoseB() {
    ASSERT_EQ(shared_->membership.Remove("b"), 2);
    shared_->membership.BumpEpoch();
    shared_->plan.RebuildAssignment();
  }

  // `id` fills stage `stage` as a joiner does (RunnerElastic::Join).
  void Fill(const std::string& id, int stage) {
    shared_->membership.Admit(cluster_->Infos({id}).at(0));
    ASSERT_TRUE(shared_->plan.BuildCostModel().ok());
    shared_->membership.Set(id, stage);
    shared_->membership.BumpEpoch();
    shared_->plan.RebuildAssignment();
  }

  v1::JobStatus Holding(int stage, uint64_t completed) {
    v1::JobStatus s;
    s.set_job_id(job_id_);
    s.set_stage(static_cast<uint32_t>(stage));
    s.set_completed_iterations(completed);
    return s;
  }

  std::unique_ptr<RunnerShared> shared_;
  std::unique_ptr<FakeLoop> loop_;
  std::unique_ptr<RunnerElastic> elastic_;
  std::unique_ptr<RunnerLinks> links_;
  std::unique_ptr<RunnerIteration> iteration_;
  std::unique_ptr<RunnerStageLoss> loss_;
};

TEST_F(RunnerStageLossTest, EachActionRecordsTheLossOnceWithWhatItWillDo) {
  const std::vector<std::pair<v1::StageLossAction, std::string>> cases = {
      {v1::STAGE_LOSS_ROLLBACK,
       "STAGE_LOSS_ROLLBACK: once every stage has a worker, the whole job starts again at "
       "iteration 0 with fresh parameters (there is no checkpoint)"},
      {v1::STAGE_LOSS_PAUSE,
       "STAGE_LOSS_PAUSE: the job pauses until a worker holding its state (b) comes back, for "
       "up to 60 s; then it fails"},
      {v1::STAGE_LOSS_REINITIALIZE,
       "STAGE_LOSS_REINITIALIZE: a worker that joins it starts from fresh parameters while the "
       "other stages keep theirs"}};
  for (const auto& [action, what] : cases) {
    Build(action);
    LoseB();
    loss_->Lost(2, "b", 3);
    loss_->Lost(2, "b", 3);  // recorded already
    const v1::Job job = Job();
    EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
    EXPECT_THAT(History(job), HasSubstr(absl::StrCat("stage 2 lost its last replica (worker b) "
                                                     "and its state; elastic.on_stage_loss ",
                                                     what)));
    EXPECT_THAT(shared_->lost_stages, ElementsAre(2));
  }
  const std::string scraped = cluster_->Scrape();
  for (const char* action : {"rollback", "pause", "reinitialize"}) {
    EXPECT_THAT(scraped, HasSubstr(absl::StrCat("detour_coordinator_stage_losses_total{action=\"",
                                                action, "\"} 1\n")));
  }
}

TEST_F(RunnerStageLossTest, NothingIsRecordedForAJobWithoutElasticTraining) {
  Build(v1::STAGE_LOSS_PAUSE);
  shared_->spec.mutable_elastic()->set_disabled(true);
  LoseB();
  EXPECT_FALSE(loss_->KeepHolder(2, "b"));
  loss_->Lost(2, "b", 3);
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_STAGE_LOST), 0) << History(Job());
  EXPECT_THAT(shared_->lost_stages, IsEmpty());
}

// PAUSE: only the lost holder, with an open session and at the job's
// iteration, takes its stage back; the others are ignored.
TEST_F(RunnerStageLossTest, OnlyThePausedStagesHolderComesBackAndOnlyInStep) {
  Build(v1::STAGE_LOSS_ROLLBACK);
  LoseB();
  EXPECT_FALSE(loss_->KeepHolder(2, "b")) << "a rollback keeps no holder";

  Build(v1::STAGE_LOSS_PAUSE);
  LoseB();
  EXPECT_TRUE(loss_->KeepHolder(2, "b"));
  loss_->Lost(2, "b", 3);
  EXPECT_FALSE(loss_->KeepHolder(2, "b")) << "the stage's loss is recorded already";
  cluster_->Kill("b");
  loss_->Readmit("a", Holding(2, 3));  // not the holder
  loss_->Readmit("b", Holding(2, 2));  // an iteration behind the job
  loss_->Readmit("b", Holding(1, 3));  // another stage
  loss_->Readmit("b", Holding(2, 3));  // its session is closed
  EXPECT_FALSE(shared_->membership.IsMember("b"));
  EXPECT_THAT(shared_->lost_stages, ElementsAre(2));
  const int aborts = cluster_->Sent("abort");

  cluster_->AddWorker("b");  // the process kept the state and registers again
  const uint64_t epoch = shared_->membership.epoch();
  loss_->Readmit("b", Holding(2, 3));
  ASSERT_TRUE(shared_->membership.IsMember("b"));
  EXPECT_EQ(shared_->membership.members().at("b"), 2);
  EXPECT_THAT(shared_->lost_stages, IsEmpty());
  EXPECT_EQ(shared_->membership.epoch(), epoch + 1);
  EXPECT_EQ(cluster_->Sent("abort"), aborts + 3) << "the iteration starts again with b";
  EXPECT_THAT(History(Job()), HasSubstr("worker b came back holding stage 2's state at "
                                        "iteration 3"));
  ASSERT_EQ(Job().stages_size(), 3);
  EXPECT_THAT(Job().stages(2).nodes(), ElementsAre("b"));
  loss_->Readmit("b", Holding(2, 3));
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_WORKER_JOINED), 1) << "once";
  EXPECT_FALSE(loss_->Recover().has_value());
  EXPECT_TRUE(loop_->starts.empty()) << "nobody rebuilds a stage";
}

// ROLLBACK once the lost stage has a worker again: every member rebuilds
// its stage at the iteration rolled back to (0 without a checkpoint).
TEST_F(RunnerStageLossTest, RollbackRebuildsEveryStageOnceTheLostOneHasAWorker) {
  Build(v1::STAGE_LOSS_ROLLBACK);
  LoseB();
  loss_->Lost(2, "b", 3);
  Fill("late", 2);
  const uint64_t epoch = shared_->membership.epoch();
  const std::optional<JobEnd> end = loss_->Recover();
  ASSERT_FALSE(end.has_value()) << end->message;
  EXPECT_THAT(loop_->starts, ElementsAre(0, 0, 0));
  EXPECT_EQ(shared_->next_iteration, 0u);
  EXPECT_THAT(shared_->lost_stages, IsEmpty());
  EXPECT_EQ(shared_->membership.epoch(), epoch + 1);
  const v1::Job job = Job();
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("rolled back from iteration 3 to iteration 0 (no "
                                      "checkpoint: fresh parameters in every stage) on 3 "
                                      "workers"));
  EXPECT_FALSE(loss_->Recover().has_value());
  EXPECT_EQ(loop_->starts.size(), 3u) << "nothing lost is left to roll back";
}

// A lost stage without a worker pauses the job (here it fails at once:
// never_join forbids the replacement a rollback needs); REINITIALIZE does
// not wait at the boundary at all.
TEST_F(RunnerStageLossTest, ALostStageWithoutAWorkerPausesUnlessItIsReinitialized) {
  Build(v1::STAGE_LOSS_ROLLBACK, /*never_join=*/true);
  LoseB();
  loss_->Lost(2, "b", 3);
  std::optional<JobEnd> end = loss_->Recover();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->state, v1::JOB_STATE_FAILED);
  EXPECT_THAT(end->message, HasSubstr("stage 2 lost its state; waiting for a worker to roll back "
                                      "with and elastic.never_join forbids replacements"));
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_PAUSED), 1) << History(Job());
  EXPECT_TRUE(loop_->starts.empty());

  Build(v1::STAGE_LOSS_REINITIALIZE, /*never_join=*/true);
  LoseB();
  loss_->Lost(2, "b", 3);
  end = loss_->Recover();
  EXPECT_FALSE(end.has_value()) << end->message;
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_PAUSED), 0) << History(Job());
  EXPECT_THAT(shared_->lost_stages, ElementsAre(2)) << "a joiner reinitializes it";
}

}  // namespace
}  // namespace detour::testing
