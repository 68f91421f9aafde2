// Elastic training end to end, the coordinator's side: the coordinator
// killed (SIGKILL, SIGTERM) or paused mid-job while the workers go on, and
// jobs resumed from checkpoints, bit for bit where the run is deterministic
// (real processes; elastic_fixture.h).
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/elastic_fixture.h"
#include "worker/model/checkpoint.h"
#include "worker/model/corpus.h"
#include "worker/model/token_shards.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST_F(ElasticTest, CoordinatorKillKeepsTheJob) {
  const v1::JobSpec spec = ElasticJob(3, 1, 1, 0.0, 12);
  Daemon c = StartCoordinator();
  const int port = c.grpc_port;
  std::vector<Daemon> workers = StartWorkers(port, 3, WorkerFlags());
  ElasticRun run(this, port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  c.process->Signal(SIGKILL);
  c.process->Wait(absl::Seconds(10));
  Daemon c2 = StartCoordinator({absl::StrCat("--listen=127.0.0.1:", port)}, "c2");
  ASSERT_EQ(c2.grpc_port, port) << c2.process->Log();
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c2);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_REATTACHED), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 12u);
}

// A graceful stop (SIGTERM: `systemctl restart`, a rollout) keeps the job
// as kill -9 does: the coordinator exits 0 within its drain timeout leaving
// the job RUNNING and its workers holding their stages; the restarted one
// re-attaches to them. SIGTERM used to FAIL every running job.
TEST_F(ElasticTest, CoordinatorTermKeepsTheJob) {
  const v1::JobSpec spec = ElasticJob(3, 1, 1, 0.0, 12);
  Daemon c = StartCoordinator({"--drain_timeout=5s"});
  const int port = c.grpc_port;
  std::vector<Daemon> workers = StartWorkers(port, 3, WorkerFlags());
  ElasticRun run(this, port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const absl::Time stop = absl::Now();
  c.process->Signal(SIGTERM);
  ASSERT_EQ(c.process->Wait(absl::Seconds(15)), 0) << c.process->Log();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(7)) << "the drain timeout is 5 s";
  EXPECT_THAT(c.process->Log(), HasSubstr("left RUNNING at iteration"));
  EXPECT_THAT(c.process->Log(), Not(HasSubstr("failed: ")));
  Daemon c2 = StartCoordinator({absl::StrCat("--listen=127.0.0.1:", port)}, "c2");
  ASSERT_EQ(c2.grpc_port, port) << c2.process->Log();
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c2);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_REATTACHED), 1) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  EXPECT_EQ(job.progress().iteration(), 12u);
}

// The coordinator stops (SIGSTOP) for longer than the workers' heartbeat
// silence: after SIGCONT nobody counts as lost and the job goes on at once
// (it used to hang until the 10-minute iteration timeout).
TEST_F(ElasticTest, PausedCoordinatorLosesNothing) {
  const v1::JobSpec spec = ElasticJob(3, 1, 1, 0.0, 10);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(2, absl::Seconds(90))) << c.process->Log();
  c.process->Signal(SIGSTOP);
  absl::SleepFor(absl::Seconds(4));
  c.process->Signal(SIGCONT);
  const v1::Job job = run.AwaitEnd(absl::Seconds(60));
  ExpectHealthyEnd(job, c);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
}

// The stage files' checksums of the checkpoint in `dir`.
std::vector<std::string> StageChecksums(const std::string& dir) {
  auto manifest = model::ReadManifest(dir);
  EXPECT_TRUE(manifest.ok()) << manifest.status();
  std::vector<std::string> out;
  if (!manifest.ok()) return out;
  for (const auto& e : manifest->stages) out.push_back(absl::StrCat(e.stage, ":", e.checksum));
  std::sort(out.begin(), out.end());
  return out;
}

// Trains `spec` on `workers` fresh workers (one run), or with a failure
// after the checkpoint halfway and `detourctl resume` on other workers;
// returns the final checkpoint's stage checksums (and the ended job in
// `end` when not null).
std::vector<std::string> TrainStraightOrResumed(ElasticTest* test, const v1::JobSpec& spec,
                                                bool interrupt, int port,
                                                std::vector<Daemon>& workers,
                                                const std::string& ctl, const Daemon& c,
                                                v1::Job* end = nullptr) {
  ElasticRun run(test, port, spec);
  if (interrupt) {
    const uint64_t half = spec.checkpoint().every_iterations();
    EXPECT_TRUE(run.ReachIteration(half + 1, absl::Seconds(120)));
    EXPECT_THAT(run.Get().last_checkpoint(), HasSubstr(absl::StrFormat("iter-%06d", half)));
    const std::string victim = NodeOf(run.Get(), 1, 0);
    if (victim.empty()) return {};  // NodeOf failed the test
    ById(workers, victim)->process->Signal(SIGKILL);
    const v1::Job failed = run.AwaitEnd(absl::Seconds(60));
    EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
    EXPECT_THAT(failed.last_checkpoint(), HasSubstr(absl::StrFormat("iter-%06d", half)))
        << "the run got past the next checkpoint before the kill";
    workers.push_back(test->AddWorker(port, absl::StrCat("spare", workers.size())));
    std::string out;
    EXPECT_EQ(test->RunCtl(
                  {ctl, absl::StrCat("--coordinator=127.0.0.1:", port), "resume", run.id()}, &out),
              0)
        << out;
  }
  const v1::Job job = run.AwaitEnd(absl::Seconds(180));
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED)
      << job.message() << History(job) << c.process->Log();
  if (interrupt) {
    EXPECT_EQ(job.resumes(), 1u);
    EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_RESUMED), 1) << History(job);
  }
  if (end != nullptr) *end = job;
  return StageChecksums(job.last_checkpoint());
}

// N iterations straight equal N/2, a failure, a resume from the checkpoint
// (other workers, the stages restored) and N/2 more — bit for bit on CPU:
// parameters, AdamW moments and K-FAC factors and inverses, the
// learning-rate schedule and the data position all carry over. One data
// node with one activation slot keeps the gradient sums in one order, and
// the coordinator keeps its cost model (--replan_every=0), so both runs are
// the same computation. K-FAC runs with its work at step end (serial) and,
// the default, in the pipeline's bubbles with an adaptive refresh interval:
// a checkpoint closes the refresh window (no refresh is in flight across
// it) and the workers sum curvature in plan order, so the resumed run plans
// and computes the same K-FAC work as the straight one.
TEST_F(ElasticTest, ResumeEqualsAStraightRunBitForBit) {
  Daemon c = StartCoordinator({"--replan_every=0"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const std::string ctl = Bin(kCtl);
  for (const std::string variant : {"adamw", "kfac-serial", "kfac-bubbles"}) {
    SCOPED_TRACE(variant);
    const bool kfac = variant != "adamw";
    v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 24);
    spec.set_name(variant);
    spec.mutable_pipeline()->set_memory_slots(1);
    spec.mutable_checkpoint()->set_every_iterations(12);
    spec.mutable_checkpoint()->set_keep_last(4);
    spec.mutable_elastic()->set_disabled(true);
    if (kfac) {
      spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
      spec.mutable_optimizer()->mutable_kfac()->set_lr(3e-3);
      if (variant == "kfac-serial") {
        spec.mutable_optimizer()->mutable_kfac()->set_refresh_interval(3);
        spec.mutable_optimizer()->mutable_kfac()->set_placement(v1::KFAC_PLACEMENT_SERIAL);
      }
    }
    spec = *NormalizeJobSpec(spec);
    const auto straight = TrainStraightOrResumed(this, spec, false, c.grpc_port, workers, ctl, c);
    const auto resumed = TrainStraightOrResumed(this, spec, true, c.grpc_port, workers, ctl, c);
    ASSERT_EQ(straight.size(), 3u);
    EXPECT_EQ(straight, resumed);
  }
}

// The same on skip specs: SKIPPIPE routes that visit three of four stages,
// two data nodes and three activation slots, so a stage's backwards (and
// its replicas' all-reduce contributions) arrive in an order that varies
// from run to run. Gradients join a stage's sum in microbatch order and
// replicas sum in rank order, so the bits depend on the plan alone (with
// the sums in arrival order instead, even two straight runs end with other
// checksums). The plan must then be the same in both runs: the coordinator
// neither re-plans from measured timings (--replan_every=0: at the default,
// the routes change at the fifth iteration, differently in every run) nor
// from measured links (--link_probe=false: probed latencies pick other
// routes and stage assignments), and the resumed coordinator's first plan
// continues the plan kept with the checkpoint (Job.checkpoint_plan): the
// re-plan the straight run makes there, from the routes it used last. The
// second spec is one where a fresh search at the checkpoint's iteration,
// which the resumed coordinator made before, plans other routes (microbatch
// 0 visits stages 2 and 3 instead of 1 and 2) and the final stage files
// differed. The manifest names one file per stage, the first replica's; the
// coordinator checks every iteration that the replicas' parameters agree,
// so a job that succeeds has them equal.
TEST_F(ElasticTest, ResumeOnSkipSpecsIsBitExact) {
  Daemon c = StartCoordinator({"--replan_every=0", "--link_probe=false"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 8, WorkerFlags());
  const std::string ctl = Bin(kCtl);
  struct Case {
    int replicas;
    int microbatches;  // per data node
    int checkpoint_every;
  };
  for (const Case& k : {Case{2, 3, 8}, Case{1, 4, 6}}) {
    v1::JobSpec spec = MicroJob(4, 2, k.replicas, 0.25, 2 * k.checkpoint_every);
    spec.set_name(absl::StrCat("skip-", k.replicas, "-replicas"));
    SCOPED_TRACE(spec.name());
    spec.mutable_pipeline()->set_microbatches_per_data_node(k.microbatches);
    spec.mutable_pipeline()->set_memory_slots(3);
    spec.mutable_checkpoint()->set_every_iterations(k.checkpoint_every);
    spec.mutable_checkpoint()->set_keep_last(4);
    spec.mutable_elastic()->set_disabled(true);
    spec = *NormalizeJobSpec(spec);
    ASSERT_EQ(spec.pipeline().scheduler(), v1::SCHEDULER_SKIPPIPE);
    std::vector<std::vector<std::string>> results;  // straight, resumed
    for (const bool interrupt : {false, true}) {
      SCOPED_TRACE(interrupt ? "resumed" : "straight");
      v1::Job job;
      results.push_back(
          TrainStraightOrResumed(this, spec, interrupt, c.grpc_port, workers, ctl, c, &job));
      if (interrupt) {
        EXPECT_THAT(History(job), HasSubstr("the plan continues the one kept with the checkpoint"));
      }
      // The last plan: every replica of every stage takes microbatches, and
      // every route visits 2 of the 3 stages after the data nodes.
      ASSERT_EQ(job.stages_size(), 4);
      int visits = 0;
      for (int s = 0; s < 4; ++s) {
        ASSERT_EQ(job.stages(s).nodes_size(), s == 0 ? 2 : k.replicas) << s;
        for (const std::string& id : job.stages(s).nodes()) {
          const auto found = job.progress().planned_visits().find(id);
          ASSERT_NE(found, job.progress().planned_visits().end()) << id;
          EXPECT_GT(found->second, 0u) << "worker " << id << " of stage " << s;
          if (s > 0) visits += static_cast<int>(found->second);
        }
      }
      EXPECT_EQ(visits, 2 * 2 * k.microbatches);
    }
    ASSERT_EQ(results[0].size(), 4u);
    EXPECT_EQ(results[0], results[1])
        << "if the resumed run planned other routes than the straight one, the planner or the "
           "plan kept with the checkpoint changed, not the arithmetic: docs/RUNTIME.md, "
           "\"Resume from a checkpoint\"";
  }
}

// A job on a prepared dataset (DATA_SOURCE_SHARDS) checkpoints every 8
// iterations, is cancelled after the first, `detourctl resume`d, and
// continues from the data position its last checkpoint implies — the data a
// data node reads is a function of the seed and the iteration, so the
// resumed run's per-iteration losses are the uninterrupted run's, bit for
// bit on CPU (one data node, one activation slot, no re-planning: the same
// computation). Were the resumed job to read from the start of the dataset
// again, the iterations after the checkpoint would see other samples and
// other losses. The job runs 32 iterations so that the cancel, sent once it
// reaches iteration 9, comes before its end however loaded the machine (with
// 16 it once ended first).
TEST_F(ElasticTest, ResumeOnAPreparedDatasetContinuesItsDataPosition) {
  const std::string text = absl::StrCat(dir_, "/corpus.txt");
  ASSERT_TRUE(WriteFileAtomically(text, model::GenerateCorpus(8, 200000)).ok());
  model::PrepareOptions prep;
  prep.inputs = {text};
  prep.output = absl::StrCat(dir_, "/dataset");
  auto prepared = model::PrepareDataset(prep);
  ASSERT_TRUE(prepared.ok()) << prepared.status();

  constexpr uint64_t kIterations = 32;
  constexpr uint64_t kEvery = 8;  // checkpoint.every_iterations
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, kIterations);
  spec.set_name("shards");
  spec.mutable_data()->set_source(v1::DATA_SOURCE_SHARDS);
  spec.mutable_data()->set_path(prep.output);
  spec.mutable_pipeline()->set_memory_slots(1);
  spec.mutable_checkpoint()->set_every_iterations(kEvery);
  spec.mutable_checkpoint()->set_keep_last(4);
  spec.mutable_elastic()->set_disabled(true);
  spec = *NormalizeJobSpec(spec);
  Daemon c = StartCoordinator({"--replan_every=0"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const std::string at = absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port);

  v1::Job job;
  const v1::Job straight_job = SubmitJob(c.grpc_port, spec);
  const std::map<uint64_t, double> straight =
      WatchLossMap(c.grpc_port, straight_job.id(), &job, absl::Seconds(180));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << c.process->Log();
  ASSERT_EQ(straight.size(), kIterations);
  std::set<double> distinct;
  for (const auto& [it, loss] : straight) distinct.insert(loss);
  EXPECT_GT(distinct.size(), kIterations * 3 / 4) << "the iterations did not see different data";

  const v1::Job interrupted = SubmitJob(c.grpc_port, spec);
  std::map<uint64_t, double> resumed;
  v1::Job cancelled;
  std::thread watch([&] {
    resumed = WatchLossMap(c.grpc_port, interrupted.id(), &cancelled, absl::Seconds(180));
  });
  ElasticRun run(this, c.grpc_port, interrupted.id());
  EXPECT_TRUE(run.ReachIteration(kEvery + 1, absl::Seconds(120)));
  std::string out;
  EXPECT_EQ(RunCtl({Bin(kCtl), at, "cancel", interrupted.id()}, &out), 0) << out;
  watch.join();
  ASSERT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED) << cancelled.message();
  // The checkpoint the resume starts from: 8, or a later one when the job
  // got past it before the cancel.
  uint64_t saved = 0;
  const std::string name = std::filesystem::path(cancelled.last_checkpoint()).filename().string();
  ASSERT_TRUE(absl::StartsWith(name, "iter-") && absl::SimpleAtoi(name.substr(5), &saved))
      << cancelled.last_checkpoint();
  ASSERT_GE(saved, kEvery);
  ASSERT_LT(saved, kIterations);
  ASSERT_EQ(saved % kEvery, 0u);
  EXPECT_LT(resumed.rbegin()->first, kIterations);
  auto manifest = model::ReadManifest(cancelled.last_checkpoint());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->data.source, "shards");
  EXPECT_EQ(manifest->data.path, prep.output);
  ASSERT_EQ(RunCtl({Bin(kCtl), at, "resume", interrupted.id()}, &out), 0) << out;
  const std::map<uint64_t, double> after =
      WatchLossMap(c.grpc_port, interrupted.id(), &job, absl::Seconds(180));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << History(job);
  EXPECT_EQ(job.resumes(), 1u);
  for (uint64_t it = saved + 1; it <= kIterations; ++it) {
    EXPECT_EQ(after.count(it), 1u) << "iteration " << it;
  }
  // The resumed run redoes the iterations after the checkpoint; what its
  // stream says about the checkpoint's iteration is the coordinator's
  // progress reset at the resume: iteration set back to the checkpoint's and
  // no loss yet (not the loss of the last iteration the cancelled run
  // finished).
  if (after.count(saved) != 0) {
    EXPECT_EQ(after.at(saved), 0.0) << "a stale loss after the resume";
  }
  for (const auto& [it, loss] : after) {
    if (it > saved) resumed[it] = loss;
  }
  EXPECT_EQ(resumed, straight);
}

// A job saved with R replicas per stage resumes (detourctl resume
// --replicas_per_stage) on workers giving another count, both ways: it
// continues at the checkpoint's iteration (its first loss is the one the
// first run logged there, which is computed from the checkpoint's
// parameters alone), completes, and its replicas stay identical.
TEST_F(ElasticTest, ResumeOnOtherReplicaCounts) {
  Daemon c = StartCoordinator({"--replan_every=0"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 5, WorkerFlags());
  const std::string ctl = Bin(kCtl);
  const std::string at = absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port);
  for (const auto& counts : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}}) {
    // Plain variables, not a structured binding: the lambdas below capture
    // them (clang 14, which the checked builds use, cannot capture a binding).
    const int saved = counts.first;
    const int resumed = counts.second;
    SCOPED_TRACE(absl::StrCat(saved, " -> ", resumed, " replicas"));
    v1::JobSpec spec = MicroJob(3, 1, saved, 0.0, 24);
    spec.set_name(absl::StrCat("replicas-", saved, "-", resumed));
    spec.mutable_checkpoint()->set_every_iterations(4);
    spec.mutable_checkpoint()->set_keep_last(10);
    spec = *NormalizeJobSpec(spec);
    ElasticRun run(this, c.grpc_port, spec);
    std::map<uint64_t, double> first;
    std::thread watch_first([&] { first = WatchLossMap(c.grpc_port, run.id()); });
    ASSERT_TRUE(run.ReachIteration(6, absl::Seconds(120))) << c.process->Log();
    std::string out;
    EXPECT_EQ(RunCtl({ctl, at, "cancel", run.id()}, &out), 0) << out;
    const v1::Job cancelled = run.AwaitEnd(absl::Seconds(60));
    watch_first.join();
    ASSERT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED) << cancelled.message();
    ASSERT_LT(cancelled.progress().iteration(), 24u) << "the job ended before the cancel";
    ASSERT_EQ(cancelled.stages(1).nodes_size(), saved);
    const std::string checkpoint =
        (std::filesystem::path(cancelled.last_checkpoint()).parent_path() / "iter-000004").string();
    ASSERT_TRUE(std::filesystem::exists(checkpoint + "/manifest.json")) << checkpoint;
    ASSERT_TRUE(first.count(5)) << "no loss logged for iteration 4";
    EXPECT_NE(RunCtl({ctl, at, "resume", run.id(), "--replicas_per_stage=-1"}, &out), 0);
    EXPECT_THAT(out, HasSubstr("--replicas_per_stage: -1 is outside 0..1024")) << out;
    // The store says CANCELLED at once; the runner may still be telling the
    // workers (resume answers "still running" until it is done).
    EXPECT_TRUE(Eventually(
        [&] {
          return RunCtl({ctl, at, "resume", run.id(), absl::StrCat("--checkpoint=", checkpoint),
                         absl::StrCat("--replicas_per_stage=", resumed)},
                        &out) == 0;
        },
        absl::Seconds(10)))
        << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("with ", resumed, " replicas per stage")));
    std::map<uint64_t, double> second;
    std::thread watch_second([&] { second = WatchLossMap(c.grpc_port, run.id()); });
    const v1::Job job = run.AwaitEnd(absl::Seconds(180));
    watch_second.join();
    ExpectHealthyEnd(job, c);
    EXPECT_EQ(job.progress().iteration(), 24u);
    EXPECT_EQ(job.spec().pipeline().replicas_per_stage(), static_cast<uint32_t>(resumed));
    EXPECT_EQ(job.stages(1).nodes_size(), resumed);
    EXPECT_EQ(job.stages(2).nodes_size(), resumed);
    EXPECT_THAT(History(job), HasSubstr(absl::StrCat("at iteration 4 on ", 1 + 2 * resumed,
                                                     " workers (", resumed, " per stage)")));
    // The plan kept with the checkpoint is for other replica counts (or,
    // when the job got past iteration 8 before the cancel, for another
    // checkpoint): the resumed job plans afresh.
    EXPECT_THAT(History(job), HasSubstr("a new plan (none kept with the checkpoint fits: "));
    // Iteration 4 (progress 5) runs on the checkpoint's parameters: the same
    // loss as the first run's, which had those parameters then.
    ASSERT_TRUE(second.count(5)) << "the resumed run logged no loss for iteration 4";
    EXPECT_NEAR(second.at(5), first.at(5), 1e-6 * std::abs(first.at(5)));
    ASSERT_TRUE(second.count(24));
    EXPECT_TRUE(std::isfinite(second.at(24)));
    EXPECT_LT(second.at(24), second.at(5));
  }
}

}  // namespace
}  // namespace detour::testing
