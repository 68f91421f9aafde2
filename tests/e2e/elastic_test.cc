// Elastic training end to end: real coordinator and worker
// processes; workers are killed (SIGKILL), stalled (SIGSTOP/SIGCONT) or
// started mid-job, the coordinator is killed and restarted, and jobs resume
// from checkpoints. The coordinator checks every iteration that replicas
// are identical and every microbatch completed exactly once or was dropped
// (and fails the job otherwise), so a job that succeeds proves both.
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"
#include "worker/model/checkpoint.h"
#include "worker/model/corpus.h"
#include "worker/model/token_shards.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
class ElasticTest : public E2eTest {
 public:
  Daemon AddWorker(int port, const std::string& name,
                   std::vector<std::string> flags = WorkerFlags()) {
    return StartWorker(port, name, std::move(flags));
  }
  int RunCtl(const std::vector<std::string>& argv, std::string* out) { return Run(argv, out); }
  v1::Job SubmitJob(int port, const v1::JobSpec& spec) { return Submit(port, spec); }
  v1::Job Job(int port, const std::string& id) { return GetJob(port, id); }
  template <typename P>
  static bool Poll(P predicate, absl::Duration timeout) {
    return Eventually(predicate, timeout);
  }
  // EmptyStageIsSkippedThenRefilled with `spec` (4 stages of one worker
  // each, routes skipping one).
  void RunSkipThenRefill(const v1::JobSpec& spec);
  // Follows a job until its Watch stream ends (at a final state): the loss of
  // every progress update, by the iteration count it reports (a later update
  // of the same count wins, so an iteration redone after a resume replaces
  // the earlier one), and the last job seen in `final_job` when not null.
  std::map<uint64_t, double> WatchLossMap(int port, const std::string& id,
                                          v1::Job* final_job = nullptr,
                                          absl::Duration timeout = absl::Seconds(300)) {
    auto stub = v1::JobService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::WatchJobRequest request;
    request.set_job_id(id);
    auto reader = stub->Watch(&context, request);
    std::map<uint64_t, double> losses;
    v1::JobEvent event;
    while (reader->Read(&event)) {
      const v1::JobProgress& p = event.job().progress();
      if (p.iteration() > 0) losses[p.iteration()] = p.loss();
      if (final_job != nullptr) *final_job = event.job();
    }
    reader->Finish().IgnoreError();
    return losses;
  }
};

// An elastic job that notices a closed session within half a second.
v1::JobSpec ElasticJob(int stages, int data_nodes, int replicas, double skip, int iterations) {
  v1::JobSpec spec = MicroJob(stages, data_nodes, replicas, skip, iterations);
  spec.mutable_elastic()->set_reconnect_grace_ms(500);
  spec.mutable_elastic()->set_pause_timeout_s(120);
  return spec;
}

// The daemon whose worker id is `id`.
Daemon* ById(std::vector<Daemon>& workers, const std::string& id) {
  for (Daemon& d : workers) {
    if (d.id == id) return &d;
  }
  return nullptr;
}

// Node `index` of stage `stage` in `job`; "" and a test failure when the job
// has no such node (a failed Get returns an empty job, which must not be
// indexed: UBSan found that).
std::string NodeOf(const v1::Job& job, int stage, int index) {
  if (stage >= job.stages_size() || index >= job.stages(stage).nodes_size()) {
    ADD_FAILURE() << "the job has no node " << index << " in stage " << stage << ":\n"
                  << job.DebugString();
    return "";
  }
  return job.stages(stage).nodes(index);
}

int Count(const v1::Job& job, v1::JobHistoryEvent::Kind kind) {
  int n = 0;
  for (const auto& e : job.history()) n += e.kind() == kind;
  return n;
}

std::string History(const v1::Job& job) {
  std::string out;
  for (const auto& e : job.history()) {
    absl::StrAppend(&out, v1::JobHistoryEvent::Kind_Name(e.kind()), ": ", e.message(), "\n");
  }
  return out;
}

bool JobDone(const v1::Job& j) {
  return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
         j.state() == v1::JOB_STATE_CANCELLED;
}

// One job on the test's coordinator, followed by polling.
class ElasticRun {
 public:
  ElasticRun(ElasticTest* test, int port, const v1::JobSpec& spec) : test_(test), port_(port) {
    job_ = test_->SubmitJob(port, spec).id();
  }
  // A job submitted already.
  ElasticRun(ElasticTest* test, int port, std::string id)
      : test_(test), port_(port), job_(std::move(id)) {}
  const std::string& id() const { return job_; }
  v1::Job Get() const { return test_->Job(port_, job_); }
  // Waits until `iterations` are done; false on timeout or a final state.
  bool ReachIteration(uint64_t iterations, absl::Duration timeout) const {
    ElasticTest::Poll(
        [&] {
          const v1::Job j = Get();
          return j.progress().iteration() >= iterations || JobDone(j);
        },
        timeout);
    return Get().progress().iteration() >= iterations;
  }
  v1::Job AwaitEnd(absl::Duration timeout) const {
    v1::Job j;
    ElasticTest::Poll(
        [&] {
          j = Get();
          return JobDone(j);
        },
        timeout);
    return j;
  }

 private:
  ElasticTest* test_;
  int port_;
  std::string job_;
};

// Sleeps a pseudo-random fraction of an iteration, so the kill lands at a
// different point of it from run to run (the seed is printed on failure).
void SleepIntoIteration(const v1::Job& job, uint32_t seed) {
  std::mt19937 rng(seed);
  const double iteration_s = std::max(0.05, job.progress().iteration_time_s());
  absl::SleepFor(absl::Seconds(std::uniform_real_distribution<double>(0, iteration_s)(rng)));
}

void ExpectHealthyEnd(const v1::Job& job, const Daemon& c) {
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n"
                                                  << History(job) << c.process->Log();
  EXPECT_TRUE(std::isfinite(job.progress().loss()));
}

// A replica of a middle stage is killed at a random point of an iteration:
// the job goes on with the other replica and finishes.
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
// the links', so an even split of its visits cost the plan nothing.)
TEST_F(ElasticTest, SlowReplicaIsRoutedAroundAndNamed) {
  const v1::JobSpec spec = PinnedFiveJob(16);
  Daemon c = StartCoordinator({"--replan_every=2"});
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
  // A move must repay its cost within 8 iterations. Before the kill stage 2
  // has a fast replica, and moving a stage-1 replica there gains little per
  // iteration (under ASan once 0.036 s, repaid in 28 iterations: with the
  // iterations left as the horizon it moved before the kill); after the
  // kill the slow replica alone makes every iteration far longer.
  spec.mutable_elastic()->set_reassign_horizon_iterations(8);
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
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_REASSIGNED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("from stage 1 to stage 2"));
  EXPECT_THAT(History(job), HasSubstr("with the state of w4"));
  EXPECT_THAT(History(job), HasSubstr("repaid in"));
  ASSERT_EQ(job.stages(1).nodes_size(), 1);
  ASSERT_EQ(job.stages(2).nodes_size(), 2);
  EXPECT_EQ(job.progress().members(), 4u);
  EXPECT_EQ(MetricValue(c, "detour_coordinator_job_workers_reassigned_total"), 1);
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

// A job on a prepared dataset (DATA_SOURCE_SHARDS) checkpoints at iteration
// 8, is cancelled after it, `detourctl resume`d, and continues from the data
// position the checkpoint implies — the data a data node reads is a function
// of the seed and the iteration, so the resumed run's per-iteration losses
// are the uninterrupted run's, bit for bit on CPU (one data node, one
// activation slot, no re-planning: the same computation). Were the resumed
// job to read from the start of the dataset again, iterations 9-16 would
// see other samples and other losses.
TEST_F(ElasticTest, ResumeOnAPreparedDatasetContinuesItsDataPosition) {
  const std::string text = absl::StrCat(dir_, "/corpus.txt");
  ASSERT_TRUE(WriteFileAtomically(text, model::GenerateCorpus(8, 200000)).ok());
  model::PrepareOptions prep;
  prep.inputs = {text};
  prep.output = absl::StrCat(dir_, "/dataset");
  auto prepared = model::PrepareDataset(prep);
  ASSERT_TRUE(prepared.ok()) << prepared.status();

  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 16);
  spec.set_name("shards");
  spec.mutable_data()->set_source(v1::DATA_SOURCE_SHARDS);
  spec.mutable_data()->set_path(prep.output);
  spec.mutable_pipeline()->set_memory_slots(1);
  spec.mutable_checkpoint()->set_every_iterations(8);
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
  ASSERT_EQ(straight.size(), 16u);
  std::set<double> distinct;
  for (const auto& [it, loss] : straight) distinct.insert(loss);
  EXPECT_GT(distinct.size(), 12u) << "the iterations did not see different data";

  const v1::Job interrupted = SubmitJob(c.grpc_port, spec);
  std::map<uint64_t, double> resumed;
  v1::Job cancelled;
  std::thread watch([&] {
    resumed = WatchLossMap(c.grpc_port, interrupted.id(), &cancelled, absl::Seconds(180));
  });
  ElasticRun run(this, c.grpc_port, interrupted.id());
  EXPECT_TRUE(run.ReachIteration(9, absl::Seconds(120)));
  std::string out;
  EXPECT_EQ(RunCtl({Bin(kCtl), at, "cancel", interrupted.id()}, &out), 0) << out;
  watch.join();
  ASSERT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED) << cancelled.message();
  ASSERT_THAT(cancelled.last_checkpoint(), HasSubstr("iter-000008"))
      << "the job got past the next checkpoint before the cancel";
  EXPECT_LT(resumed.rbegin()->first, 16u);
  auto manifest = model::ReadManifest(cancelled.last_checkpoint());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->data.source, "shards");
  EXPECT_EQ(manifest->data.path, prep.output);
  ASSERT_EQ(RunCtl({Bin(kCtl), at, "resume", interrupted.id()}, &out), 0) << out;
  const std::map<uint64_t, double> after =
      WatchLossMap(c.grpc_port, interrupted.id(), &job, absl::Seconds(180));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << History(job);
  EXPECT_EQ(job.resumes(), 1u);
  for (uint64_t it = 9; it <= 16; ++it) EXPECT_EQ(after.count(it), 1u) << "iteration " << it;
  // The resumed run redoes iterations 9-16; what its stream says about
  // iteration 8 is the coordinator's progress reset at the resume: iteration
  // set back to the checkpoint's and no loss yet (not the loss of the last
  // iteration the cancelled run finished).
  if (after.count(8) != 0) {
    EXPECT_EQ(after.at(8), 0.0) << "a stale loss after the resume";
  }
  for (const auto& [it, loss] : after) {
    if (it > 8) resumed[it] = loss;
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
