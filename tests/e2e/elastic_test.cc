// Elastic training end to end: real coordinator and worker
// processes; workers are killed (SIGKILL), stalled (SIGSTOP/SIGCONT) or
// started mid-job, the coordinator is killed and restarted, and jobs resume
// from checkpoints. The coordinator checks every iteration that replicas
// are identical and every microbatch completed exactly once or was dropped
// (and fails the job otherwise), so a job that succeeds proves both.
// This file: workers killed, stalled, slow, misbehaving or joining, and
// stages emptied and refilled (elastic_resume_test.cc: the coordinator killed
// or paused, and resumes; elastic_fixture.h: what both share).
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/elastic_fixture.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST_F(ElasticTest, KilledReplicaJobGoesOn) {
  const uint32_t seed = static_cast<uint32_t>(absl::ToUnixMicros(absl::Now()));
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const v1::JobSpec spec = ElasticJob(3, 2, 2, 0.0, 14);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 6, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const v1::Job before = run.Get();
  const std::string victim = NodeOf(before, 1, 0);
  ASSERT_FALSE(victim.empty());
  SleepIntoIteration(before, seed);
  ById(workers, victim)->process->Signal(SIGKILL);
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  EXPECT_GE(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr(victim));
  EXPECT_GE(job.progress().recoveries(), 1u) << History(job);
  EXPECT_EQ(job.progress().members(), 5u);
  ASSERT_EQ(job.stages(1).nodes_size(), 1);
  EXPECT_NE(NodeOf(job, 1, 0), victim);
  EXPECT_LT(job.progress().loss(), before.progress().loss() + 0.5);
}

// The same with K-FAC in the bubbles and factor sync among replicas: frozen
// microbatches' curvature work is dropped, the survivors reduce gradients
// and factors again, and later iterations keep the replicas identical.
TEST_F(ElasticTest, KilledReplicaOfAKfacJobGoesOn) {
  v1::JobSpec spec = ElasticJob(3, 2, 2, 0.0, 14);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  spec.mutable_optimizer()->mutable_kfac()->set_lr(3e-3);
  spec = *NormalizeJobSpec(spec);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 6, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const v1::Job before = run.Get();
  const std::string victim = NodeOf(before, 2, 1);
  ASSERT_FALSE(victim.empty());
  SleepIntoIteration(before, static_cast<uint32_t>(absl::ToUnixMicros(absl::Now())));
  ById(workers, victim)->process->Signal(SIGKILL);
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  EXPECT_THAT(History(job), HasSubstr(victim));
  EXPECT_GT(job.progress().kfac_refreshes(), 0u);
}

// A data node is killed: the other data node takes all of the iteration's
// microbatches from then on.
TEST_F(ElasticTest, KilledDataNodeJobGoesOn) {
  const uint32_t seed = static_cast<uint32_t>(absl::ToUnixMicros(absl::Now()));
  SCOPED_TRACE(absl::StrCat("seed ", seed));
  const v1::JobSpec spec = ElasticJob(3, 2, 1, 0.0, 12);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 4, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const v1::Job before = run.Get();
  const std::string victim = NodeOf(before, 0, 1);
  ASSERT_FALSE(victim.empty());
  SleepIntoIteration(before, seed);
  ById(workers, victim)->process->Signal(SIGKILL);
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  EXPECT_THAT(History(job), HasSubstr(victim));
  ASSERT_EQ(job.stages(0).nodes_size(), 1);
  EXPECT_EQ(job.progress().members(), 3u);
}

// A worker stalls (SIGSTOP) past the heartbeat silence: it is lost, the job
// goes on without it; when it wakes up (SIGCONT) it is told to drop the job
// and may join again where capacity is missing.
TEST_F(ElasticTest, StalledWorkerIsRoutedAroundAndMayComeBack) {
  const v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, 16);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 5, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(2, absl::Seconds(90))) << c.process->Log();
  const std::string victim = NodeOf(run.Get(), 2, 0);
  ASSERT_FALSE(victim.empty());
  Daemon* stalled = ById(workers, victim);
  stalled->process->Signal(SIGSTOP);
  // --worker_silence is 1.5 s in these tests.
  EXPECT_TRUE(
      Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_WORKER_LOST) >= 1; },
                 absl::Seconds(20)))
      << c.process->Log();
  stalled->process->Signal(SIGCONT);
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  EXPECT_THAT(History(job), HasSubstr(victim));
  // The woken worker is alive and registered again.
  EXPECT_FALSE(stalled->process->Wait(absl::Milliseconds(100)).has_value());
  // The coordinator's log says what happened to it: it was heard again
  // after being marked lost, and the job runs on without it (it used to say
  // the coordinator "does not run" the job).
  const std::string log = c.process->Log();
  EXPECT_THAT(log, ::testing::AnyOf(
                       HasSubstr(absl::StrCat("worker ", victim, " is back holding job ", job.id(),
                                              ", which runs on without it")),
                       // Heard again only after the job ended.
                       HasSubstr(absl::StrCat("still holds job ", job.id(), ", which ended"))));
  EXPECT_THAT(log,
              ::testing::AnyOf(HasSubstr(absl::StrCat("worker ", victim, " heartbeats again")),
                               HasSubstr(absl::StrCat("worker ", victim, " registers again"))));
  EXPECT_THAT(log, ::testing::Not(HasSubstr("does not run")));
}

// Replicas of two stages stall at once and come back: each is lost, drops
// the job when told to, and, idle again, is chosen to refill one of the two
// short stages. Found by the sanitized e2e runs: judging the candidate
// stages erased the returning worker's entry (the job keeps one for every
// worker it ever had), and the next cost model's lookup of it aborted the
// coordinator (std::out_of_range), on every such rejoin.
TEST_F(ElasticTest, TwoStallsComeBackAndRefillTwoShortStages) {
  // Iterations enough not to end first; cancelled once the check is done.
  const v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, 100000);
  Daemon c = StartCoordinator();
  // Exactly the job's five: no spare worker, so the first one back is judged
  // against both short stages.
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 5, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(2, absl::Seconds(90))) << c.process->Log();
  const v1::Job before = run.Get();
  const std::vector<std::string> victims = {NodeOf(before, 1, 0), NodeOf(before, 2, 0)};
  ASSERT_FALSE(victims[0].empty() || victims[1].empty());
  for (const std::string& id : victims) ById(workers, id)->process->Signal(SIGSTOP);
  ASSERT_TRUE(
      Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_WORKER_LOST) >= 2; },
                 absl::Seconds(30)))
      << History(run.Get()) << c.process->Log();
  for (const std::string& id : victims) ById(workers, id)->process->Signal(SIGCONT);
  ASSERT_TRUE(
      Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_WORKER_JOINED) >= 2; },
                 absl::Seconds(90)))
      << History(run.Get()) << c.process->Log();
  EXPECT_FALSE(c.process->Wait(absl::Milliseconds(100)).has_value()) << c.process->Log();
  // Training goes on with both back (the coordinator checks replicas and
  // microbatches every iteration and would fail the job).
  const uint64_t joined_at = run.Get().progress().iteration();
  ASSERT_TRUE(run.ReachIteration(joined_at + 3, absl::Seconds(90)))
      << History(run.Get()) << c.process->Log();
  const v1::Job job = run.Get();
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.message() << "\n" << History(job);
  for (const std::string& id : victims) {
    EXPECT_THAT(History(job), HasSubstr(absl::StrCat("worker ", id, " joined stage")));
  }
  EXPECT_EQ(job.stages(1).nodes_size(), 2);
  EXPECT_EQ(job.stages(2).nodes_size(), 2);
  std::string out;
  EXPECT_EQ(
      RunCtl({Bin(kCtl), absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port), "cancel", run.id()},
             &out),
      0)
      << out;
  EXPECT_EQ(run.AwaitEnd(absl::Seconds(60)).state(), v1::JOB_STATE_CANCELLED);
}

// Both replicas of a stage die: the full pipeline cannot skip it, so the job
// pauses; a worker started then joins the empty stage, and the whole job
// goes back to its newest checkpoint (elastic.on_stage_loss ROLLBACK, the
// default) and finishes.
TEST_F(ElasticTest, StageLosingAllReplicasPausesUntilANewWorkerJoins) {
  v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, 10);
  spec.mutable_checkpoint()->set_every_iterations(2);
  // Otherwise a replica of stage 1 moves to the empty stage at once
  // (StageLosingAllReplicasTakesASpareReplica).
  spec.mutable_elastic()->set_reassign_disabled(true);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 5, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const v1::Job before = run.Get();
  ASSERT_FALSE(before.last_checkpoint().empty());
  ASSERT_GT(before.stages_size(), 2) << before.DebugString();
  for (const std::string& id : before.stages(2).nodes())
    ById(workers, id)->process->Signal(SIGKILL);
  EXPECT_TRUE(Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_PAUSED) >= 1; },
                         absl::Seconds(30)))
      << History(run.Get()) << c.process->Log();
  EXPECT_THAT(run.Get().message(), HasSubstr("paused"));
  Daemon fresh = StartWorker(c.grpc_port, "late", WorkerFlags());
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  EXPECT_GE(Count(job, v1::JobHistoryEvent::KIND_WORKER_JOINED), 1) << History(job);
  EXPECT_GE(Count(job, v1::JobHistoryEvent::KIND_CONTINUED), 1) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("to checkpoint"));
  EXPECT_EQ(job.progress().iteration(), 10u);
  ASSERT_EQ(job.stages(2).nodes_size(), 1);
  EXPECT_EQ(NodeOf(job, 2, 0), fresh.id);
}

// Both replicas of stage 2 die while stage 1 has two: instead of waiting
// for a new worker, a replica of stage 1 moves to the empty stage, the job
// goes back to its newest checkpoint and finishes on the four workers left.
TEST_F(ElasticTest, StageLosingAllReplicasTakesASpareReplica) {
  v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, 10);
  spec.mutable_checkpoint()->set_every_iterations(2);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 5, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const v1::Job before = run.Get();
  ASSERT_FALSE(before.last_checkpoint().empty());
  for (const std::string& id : before.stages(2).nodes())
    ById(workers, id)->process->Signal(SIGKILL);
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_REASSIGNED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("from stage 1 to stage 2"));
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("to checkpoint"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_JOINED), 0) << History(job);
  ASSERT_EQ(job.stages(1).nodes_size(), 1);
  ASSERT_EQ(job.stages(2).nodes_size(), 1);
  EXPECT_EQ(job.progress().members(), 3u);
  EXPECT_EQ(job.progress().iteration(), 10u);
}

// Pins the assignment w0 | w1 w2 | w3 w4 (worker ids are the certificate
// names), so a test knows which worker to slow down.
void PinFiveWorkers(v1::JobSpec* spec) {
  v1::PipelineSpec* p = spec->mutable_pipeline();
  p->clear_assignment();
  p->add_assignment()->add_nodes("w0");
  v1::StageNodes* one = p->add_assignment();
  one->add_nodes("w1");
  one->add_nodes("w2");
  v1::StageNodes* two = p->add_assignment();
  two->add_nodes("w3");
  two->add_nodes("w4");
}

// The five pinned workers' job: skip-pipe routes, which spread stage 1's and
// stage 2's microbatches over both replicas (the full scheduler may send
// them all through one when its links measure faster), 8 microbatches, and
// the assignment kept as pinned.
v1::JobSpec PinnedFiveJob(int iterations) {
  v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, iterations);
  spec.mutable_pipeline()->set_scheduler(v1::SCHEDULER_SKIPPIPE);
  spec.mutable_pipeline()->set_microbatches_per_data_node(8);
  spec.mutable_elastic()->set_reassign_disabled(true);
  PinFiveWorkers(&spec);
  return *NormalizeJobSpec(spec);
}

// Starts w0..w4, giving `odd` the flag `odd_flag` on top of the others'.
std::vector<Daemon> StartFiveWith(ElasticTest* test, int port, const std::string& odd,
                                  const std::string& odd_flag) {
  std::vector<Daemon> workers;
  for (int i = 0; i < 5; ++i) {
    const std::string name = absl::StrCat("w", i);
    std::vector<std::string> flags = WorkerFlags();
    if (name == odd) flags.push_back(odd_flag);
    workers.push_back(test->AddWorker(port, name, flags));
  }
  return workers;
}

// Starts w0..w4; `slow` runs every compute task `factor` times slower.
std::vector<Daemon> StartFive(ElasticTest* test, int port, const std::string& slow, double factor) {
  return StartFiveWith(test, port, slow, absl::StrFormat("--compute_slowdown=%g", factor));
}

// The value of the series `series` (name and labels as exposed) on a
// daemon's /metrics; -1 when absent.
double MetricValue(const Daemon& daemon, const std::string& series) {
  auto scrape = HttpGet(daemon.metrics_port, "/metrics");
  EXPECT_TRUE(scrape.ok()) << scrape.status();
  if (!scrape.ok()) return -1;
  const std::string key = "\n" + series + " ";
  const size_t at = scrape->find(key);
  if (at == std::string::npos) return -1;
  const size_t begin = at + key.size();
  double value = -1;
  EXPECT_TRUE(absl::SimpleAtod(scrape->substr(begin, scrape->find('\n', begin) - begin), &value));
  return value;
}

// Forward tasks a worker ran (its detour_worker_task_seconds count).
double Forwards(const Daemon& worker) {
  return MetricValue(worker, "detour_worker_task_seconds_count{kind=\"forward\"}");
}

// One replica of stage 1 is ten times slower than the other
// (--compute_slowdown): once re-planning has measured it, routes give it
// clearly fewer visits than its fast replica, the history names it a
// straggler, and the job completes. (Four times slower was not enough under
// ASan in CI: the tiny stage's compute is small next to the data node's and
// the links', so an even split of its visits cost the plan nothing.) The
// first plan comes from the spec alone (no link probes), which gives w1 and
// w2 the same links: it splits their visits, so both are measured. With
// probes, loopback latencies read on a machine busy starting six processes
// (0.0-4 ms one way) could make the first plan leave w2 out, and nothing
// would ever measure it.
TEST_F(ElasticTest, SlowReplicaIsRoutedAroundAndNamed) {
  const v1::JobSpec spec = PinnedFiveJob(16);
  Daemon c = StartCoordinator({"--replan_every=2", "--link_probe=false"});
  std::vector<Daemon> workers = StartFive(this, c.grpc_port, "w2", 10);
  ElasticRun run(this, c.grpc_port, spec);
  const v1::Job job = run.AwaitEnd(absl::Seconds(180));
  ExpectHealthyEnd(job, c);
  // w2 is named (other workers may be too on a loaded machine; never w1,
  // the one it is compared with).
  EXPECT_THAT(History(job), HasSubstr("worker w2 (stage 1) is a straggler"));
  EXPECT_THAT(History(job), HasSubstr("those of its replica w1"));
  EXPECT_THAT(History(job), Not(HasSubstr("worker w1 (stage 1) is a straggler")));
  // The last plan: stage 1's eight visits mostly on w1.
  const auto& visits = job.progress().planned_visits();
  ASSERT_TRUE(visits.count("w1") && visits.count("w2")) << job.DebugString();
  EXPECT_EQ(visits.at("w1") + visits.at("w2"), 8u);
  EXPECT_LT(2 * visits.at("w2"), visits.at("w1"))
      << job.progress().DebugString() << c.process->Log();
  EXPECT_EQ(visits.at("w0"), 8u);
  // What ran: over the whole job (the first iterations split evenly), w2
  // ran fewer forwards than w1.
  const double slow = Forwards(workers[2]), fast = Forwards(workers[1]);
  EXPECT_GT(slow, 0);
  EXPECT_LT(slow, fast);
  EXPECT_GE(MetricValue(c, "detour_coordinator_stragglers_total"), 1);
}

// A member whose activations hold NaN (a real worker, made to send them
// from iteration 3 on by fault injection, as a broken or hostile node
// would): the stage-2 worker it sends to drops the frame and names it, the
// coordinator excludes it and re-runs the iteration on its replica, and the
// job finishes with a finite loss instead of failing on a non-finite
// gradient. The NaN rides on the sender's forwards, so its routes must keep
// visiting it: plans come from the spec alone (no link probes, no refits),
// whose routes take stage 1 through w1, not from timings that may route
// around the sender and keep those routes.
TEST_F(ElasticTest, AMemberSendingNaNIsExcludedAndTheJobGoesOn) {
  const v1::JobSpec spec = PinnedFiveJob(8);
  Daemon c = StartCoordinator({"--link_probe=false", "--replan_every=0"});
  std::vector<Daemon> workers =
      StartFiveWith(this, c.grpc_port, "w1", "--inject_fault=nan_activations@3");
  ElasticRun run(this, c.grpc_port, spec);
  const v1::Job job = run.AwaitEnd(absl::Seconds(180));
  ExpectHealthyEnd(job, c);
  const std::string history = History(job);
  EXPECT_GE(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << history;
  EXPECT_THAT(history, HasSubstr("w1")) << history;
  EXPECT_THAT(history, HasSubstr("NaN")) << history;
  EXPECT_THAT(workers[1].process->Log(), HasSubstr("--inject_fault: sending NaN activations"))
      << "w1 forwarded nothing from iteration 3 on:\n"
      << c.process->Log();
  // The receiver that caught it said so; nobody else was excluded.
  EXPECT_THAT(history, Not(HasSubstr("worker w2 leaves"))) << history;
  EXPECT_THAT(c.process->Log(), HasSubstr("worker w1 leaves the job"));
  EXPECT_EQ(job.stages(1).nodes_size(), 1) << job.DebugString();
  EXPECT_EQ(job.stages(1).nodes(0), "w2");
}

// A member that floods its receivers with plausible frames of the next
// iteration (a real worker, by fault injection: with each forward from
// iteration 3 on, copies labelled as the next iteration's, every microbatch
// of the job in each of the next 4 epochs): each receiver's quota for that
// sender takes the flood and refuses the rest, the other replica's real
// tensors still get in, nobody is evicted (the flooder's own links are cut
// when its real tensors no longer fit), and the job finishes. The flood
// rides on w1's forwards: plans come from the spec alone, as in the NaN
// test above.
TEST_F(ElasticTest, AMemberFloodingNextIterationFramesEvictsNobody) {
  const v1::JobSpec spec = PinnedFiveJob(8);
  Daemon c = StartCoordinator({"--link_probe=false", "--replan_every=0"});
  std::vector<Daemon> workers =
      StartFiveWith(this, c.grpc_port, "w1", "--inject_fault=frame_flood@3");
  ElasticRun run(this, c.grpc_port, spec);
  const v1::Job job = run.AwaitEnd(absl::Seconds(180));
  ExpectHealthyEnd(job, c);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  EXPECT_EQ(job.progress().members(), 5u);
  // The flood spends only w1's own quota: when its real tensor no longer
  // fits, w1's link to that receiver is cut and routes avoid it; no other
  // member's link is.
  for (const auto& e : job.history()) {
    if (e.kind() == v1::JobHistoryEvent::KIND_LINK_CUT) {
      EXPECT_THAT(e.message(), HasSubstr("link w1 - ")) << History(job);
    }
  }
  EXPECT_THAT(workers[1].process->Log(), HasSubstr("--inject_fault: flooding"))
      << "w1 forwarded nothing from iteration 3 on:\n"
      << c.process->Log();
  // Stage 2's workers refused (or dropped) what went past w1's quota.
  const double unexpected = MetricValue(workers[3], "detour_worker_frames_unexpected_total") +
                            MetricValue(workers[4], "detour_worker_frames_unexpected_total");
  EXPECT_GE(unexpected, 32) << workers[3].process->Log();
}

// A member reports its replica unreachable while the link works (a real
// worker, by fault injection: its first all-reduce tensor of iteration 3 is
// reported failed, as a connection reset on one of its stripes would fail
// it, though it arrived). The two replicas must all-reduce, so no plan
// avoids the link: the coordinator asks the reporter to probe its replica
// first, the probe answers over the real transport, the link is restored
// and the job goes on with all five; nobody leaves (before, the replica was
// removed at once).
TEST_F(ElasticTest, AReplicaReportedUnreachableThatAnswersItsProbeStays) {
  // Iterations here take about 50 ms; the coordinator judges a report after
  // the reported worker's session has stayed open for 1 s.
  const v1::JobSpec spec = PinnedFiveJob(60);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers =
      StartFiveWith(this, c.grpc_port, "w1", "--inject_fault=broken_transfer@3");
  ElasticRun run(this, c.grpc_port, spec);
  const v1::Job job = run.AwaitEnd(absl::Seconds(180));
  ExpectHealthyEnd(job, c);
  const std::string history = History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << history;
  EXPECT_EQ(job.progress().members(), 5u);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << history << c.process->Log();
  EXPECT_THAT(history, HasSubstr("link w1 - w2 cut")) << history;
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_RESTORED), 1) << history;
  EXPECT_THAT(history, HasSubstr("link w1 -> w2 answered its probe again")) << history;
  EXPECT_THAT(c.process->Log(), HasSubstr("asking w1 to probe w2"));
  EXPECT_THAT(workers[1].process->Log(),
              HasSubstr("--inject_fault: reporting the all-reduce tensor to w2"));
}

// Stage 2's fast replica dies and leaves a slow one (ten times slower)
// while stage 1 has two fast replicas: at the next iteration boundary the
// planner predicts that moving one of them to stage 2 repays its cost, so
// it drops stage 1 and receives stage 2's state from the slow replica
// (bit-identical: the checksum check, then the replica check of every later
// iteration), and the job completes on the four workers left.
TEST_F(ElasticTest, SpareReplicaMovesToAThinSlowStage) {
  v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, 40);
  spec.mutable_pipeline()->set_scheduler(v1::SCHEDULER_SKIPPIPE);
  spec.mutable_pipeline()->set_microbatches_per_data_node(8);
  // A move must repay its cost within 5 iterations. Before the kill stage 2
  // has a fast replica, and moving a stage-1 replica there gains little per
  // iteration (under ASan once 0.036 s, repaid in 28 iterations: with the
  // iterations left as the horizon it moved before the kill; and once, in
  // CI on 2026-12-07, 0.16 s, repaid in 7.7: within the 8 this test had);
  // after the kill the slow replica alone makes every iteration far longer
  // (repaid in 1.6-3.0 plain).
  spec.mutable_elastic()->set_reassign_horizon_iterations(5);
  PinFiveWorkers(&spec);
  spec = *NormalizeJobSpec(spec);
  Daemon c = StartCoordinator({"--replan_every=2"});
  std::vector<Daemon> workers = StartFive(this, c.grpc_port, "w4", 10);
  ElasticRun run(this, c.grpc_port, spec);
  // Two re-plans have measured w4.
  ASSERT_TRUE(run.ReachIteration(5, absl::Seconds(120))) << c.process->Log();
  EXPECT_EQ(Count(run.Get(), v1::JobHistoryEvent::KIND_REASSIGNED), 0) << History(run.Get());
  workers[3].process->Signal(SIGKILL);
  const v1::Job job = run.AwaitEnd(absl::Seconds(240));
  ExpectHealthyEnd(job, c);
  // The first move after the kill is the one this test is about. Later
  // moves are the planner's to make too: once, against a TSan coordinator,
  // it named the slow w4 a straggler 28 iterations later and moved it to
  // stage 1, so only a job with the one move keeps the 1-and-2 layout.
  const v1::JobHistoryEvent* first = nullptr;
  for (const auto& e : job.history()) {
    if (e.kind() == v1::JobHistoryEvent::KIND_REASSIGNED) {
      first = &e;
      break;
    }
  }
  ASSERT_NE(first, nullptr) << History(job);
  EXPECT_THAT(first->message(), HasSubstr("from stage 1 to stage 2")) << History(job);
  EXPECT_THAT(first->message(), HasSubstr("with the state of w4")) << History(job);
  EXPECT_THAT(first->message(), HasSubstr("repaid in")) << History(job);
  const int moves = Count(job, v1::JobHistoryEvent::KIND_REASSIGNED);
  if (moves == 1) {
    EXPECT_EQ(job.stages(1).nodes_size(), 1);
    EXPECT_EQ(job.stages(2).nodes_size(), 2);
  }
  EXPECT_EQ(job.stages(1).nodes_size() + job.stages(2).nodes_size(), 3) << job.DebugString();
  EXPECT_EQ(job.progress().members(), 4u);
  EXPECT_EQ(MetricValue(c, "detour_coordinator_job_workers_reassigned_total"), moves);
}

// With skip routes and elastic.on_stage_loss REINITIALIZE, a stage that
// lost its only worker is skipped by every route (no pause); a worker
// started later fills it again from the newest checkpoint. (ROLLBACK, the
// default, pauses instead: what trains meanwhile would be rolled back.)
TEST_F(ElasticTest, EmptyStageIsSkippedThenRefilled) {
  v1::JobSpec spec = ElasticJob(4, 1, 1, 0.25, 150);  // routes visit 3 of 4 stages
  spec.mutable_checkpoint()->set_every_iterations(2);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_REINITIALIZE);
  RunSkipThenRefill(spec);
}

// The same for K-FAC: the bubble plan covers the stages that have workers
// (the lost worker's blocks leave it, the refill's enter it), so the job
// goes on like an AdamW job instead of pausing.
TEST_F(ElasticTest, EmptyStageOfAKfacJobIsSkippedThenRefilled) {
  v1::JobSpec spec = ElasticJob(4, 1, 1, 0.25, 150);
  spec.mutable_checkpoint()->set_every_iterations(2);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  spec.mutable_optimizer()->mutable_kfac()->set_lr(3e-3);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_REINITIALIZE);
  spec = *NormalizeJobSpec(spec);
  RunSkipThenRefill(spec);
}

}  // namespace

void ElasticTest::RunSkipThenRefill(const v1::JobSpec& spec) {
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 4, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(3, absl::Seconds(90))) << c.process->Log();
  const std::string victim = NodeOf(run.Get(), 2, 0);
  ASSERT_FALSE(victim.empty());
  ById(workers, victim)->process->Signal(SIGKILL);
  ASSERT_TRUE(
      Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_WORKER_LOST) >= 1; },
                 absl::Seconds(20)));
  const uint64_t lost_at = run.Get().progress().iteration();
  // It keeps training with stage 2 empty.
  ASSERT_TRUE(run.ReachIteration(lost_at + 3, absl::Seconds(60)))
      << History(run.Get()) << c.process->Log();
  EXPECT_EQ(run.Get().stages(2).nodes_size(), 0);
  EXPECT_EQ(Count(run.Get(), v1::JobHistoryEvent::KIND_PAUSED), 0) << History(run.Get());
  EXPECT_THAT(History(run.Get()), HasSubstr("every route skips it"));
  Daemon fresh = StartWorker(c.grpc_port, "refill", WorkerFlags());
  const v1::Job job = run.AwaitEnd(absl::Seconds(150));
  ExpectHealthyEnd(job, c);
  ASSERT_EQ(job.stages(2).nodes_size(), 1);
  EXPECT_EQ(NodeOf(job, 2, 0), fresh.id);
  EXPECT_THAT(History(job), HasSubstr("from checkpoint"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 0) << History(job);
  if (spec.optimizer().kind() == v1::OPTIMIZER_KFAC) {
    EXPECT_GT(job.progress().kfac_refreshes(), 0u);
  }
}

namespace {

// A worker started mid-job replaces a lost one: it receives the stage's
// state from the live replica (bit-identical: later iterations pass the
// replica check) and takes part in later routes.
TEST_F(ElasticTest, JoiningWorkerGetsTheReplicaStateAndTakesPart) {
  // Long enough (a few seconds) for a worker process to start mid-job.
  v1::JobSpec spec = ElasticJob(3, 1, 2, 0.0, 150);
  // No stage moves: the planner moves workers on measured speeds, which a
  // sanitizer's slowdown makes uneven (under ASan it moved a worker into the
  // short stage before the joiner registered, and once moved the joiner out
  // of it right after it joined). Moves have tests of their own
  // (SpareReplicaMovesToAThinSlowStage, coordinator_runner_parts_test).
  spec.mutable_elastic()->set_reassign_disabled(true);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 5, WorkerFlags());
  ElasticRun run(this, c.grpc_port, spec);
  ASSERT_TRUE(run.ReachIteration(2, absl::Seconds(90))) << c.process->Log();
  const std::string victim = NodeOf(run.Get(), 1, 0);
  ASSERT_FALSE(victim.empty());
  ById(workers, victim)->process->Signal(SIGKILL);
  ASSERT_TRUE(
      Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_WORKER_LOST) >= 1; },
                 absl::Seconds(20)));
  Daemon fresh = StartWorker(c.grpc_port, "joiner", WorkerFlags());
  ASSERT_TRUE(
      Eventually([&] { return Count(run.Get(), v1::JobHistoryEvent::KIND_WORKER_JOINED) >= 1; },
                 absl::Seconds(60)))
      << History(run.Get()) << c.process->Log();
  const uint64_t joined_at = run.Get().progress().iteration();
  const v1::Job job = run.AwaitEnd(absl::Seconds(120));
  ExpectHealthyEnd(job, c);
  // The joiner refills the stage short of a replica.
  const std::string history = History(job);
  EXPECT_THAT(history,
              HasSubstr(absl::StrCat("worker ", fresh.id, " joined stage 1 at iteration")));
  EXPECT_THAT(history, Not(HasSubstr(" moved from stage "))) << history;
  EXPECT_THAT(history, HasSubstr("with the state of"));
  EXPECT_LT(joined_at, 140u);
  ASSERT_EQ(job.stages(1).nodes_size(), 2);
  EXPECT_EQ(job.progress().members(), 5u);
  // It ran pipeline work after joining.
  auto scrape = HttpGet(fresh.metrics_port, "/metrics");
  ASSERT_TRUE(scrape.ok());
  EXPECT_THAT(*scrape, HasSubstr("detour_worker_iterations_total"));
  EXPECT_THAT(*scrape, Not(HasSubstr("detour_worker_iterations_total 0\n")));
}

// kill -9 of the coordinator mid-job, restarted with the same data dir: the
// workers keep their stages and re-attach; the job finishes.

}  // namespace
}  // namespace detour::testing
