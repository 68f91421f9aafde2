// End-to-end training: real coordinator and worker processes on loopback
// train a small model over gRPC streams. The full-pipeline run must follow
// the in-process engine's loss trajectory (same seed, same routes), which
// proves the transport and the backward routing; skip runs with replicas must
// train with replicas identical and every microbatch completed exactly once
// (the coordinator checks both every iteration and fails the job otherwise).
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>

#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"
#include "worker/model/checkpoint.h"
#include "worker/model/engine.h"
#include "worker/model/corpus.h"
#include "worker/model/text_data.h"
#include "worker/model/token_shards.h"
#include "worker/model/tokenizer.h"
#include "common/files.h"

namespace detour::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
class TrainingTest : public E2eTest {
 protected:
  // Polls job `id` until it failed or succeeded (at most 90 s); the last view.
  v1::Job AwaitFailureOrSuccess(int port, const std::string& id) {
    v1::Job job;
    const absl::Time deadline = absl::Now() + absl::Seconds(90);
    while (absl::Now() < deadline) {
      job = GetJob(port, id);
      if (job.state() == v1::JOB_STATE_FAILED || job.state() == v1::JOB_STATE_SUCCEEDED) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return job;
  }
};

// `base` with K-FAC on and its K-FAC settings changed by `configure`.
v1::JobSpec KfacJob(v1::JobSpec base, const std::function<void(v1::KfacSpec*)>& configure) {
  base.mutable_optimizer()->set_kind(v1::OPTIMIZER_KFAC);
  v1::KfacSpec* k = base.mutable_optimizer()->mutable_kfac();
  k->set_lr(3e-3);
  configure(k);
  return *NormalizeJobSpec(base);
}

// Trains `spec` (3 stages, one data node, full routes, 4 iterations) on real
// daemons and in the in-process engine: the losses must agree at every
// iteration and the final checkpoint must hold the engine's weights.
class FollowTest : public E2eTest {
 protected:
  void Follow(const v1::JobSpec& spec);
};

TEST_F(FollowTest, FullPipelineFollowsTheInProcessEngine) { Follow(MicroJob(3, 1, 1, 0.0, 4)); }

// bf16 mixed precision in a distributed job: the workers compute in bf16
// exactly as the in-process engine does, and the checkpoint holds the
// engine's float32 master weights.
TEST_F(FollowTest, Bf16MixedPrecisionFollowsTheInProcessEngine) {
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 4);
  spec.mutable_pipeline()->set_precision(v1::PRECISION_BF16);
  Follow(*NormalizeJobSpec(spec));
}

// Activation recomputation in a distributed job, with bf16 as well (the
// recomputed forward multiplies with the same cached bf16 weight copies): the
// workers keep only each microbatch's input, redo the forward at the backward,
// and still follow the in-process engine and end with its weights.
TEST_F(FollowTest, RecomputedBf16ActivationsFollowTheInProcessEngine) {
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 4);
  spec.mutable_pipeline()->set_recompute_activations(true);
  spec.mutable_pipeline()->set_precision(v1::PRECISION_BF16);
  Follow(*NormalizeJobSpec(spec));
}

void FollowTest::Follow(const v1::JobSpec& spec) {
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  const std::vector<double> distributed =
      WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(120));
  ASSERT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message() << "\n"
                                                        << c.process->Log();
  ASSERT_EQ(distributed.size(), 4u);

  // The same job in one process: full routes 0 -> 1 -> 2 for every microbatch.
  auto engine = model::PipelineEngine::Create(spec, c10::Device(c10::kCPU));
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto data = model::LoadDataset(spec.data());
  ASSERT_TRUE(data.ok());
  std::vector<v1::Route> routes(2);
  for (int mb = 0; mb < 2; ++mb) {
    routes[mb].set_microbatch(mb);
    for (int s = 0; s < 3; ++s) routes[mb].add_stages(s);
  }
  for (uint64_t it = 0; it < 4; ++it) {
    auto mbs = model::IterationMicrobatches(spec, data->train, it, c10::Device(c10::kCPU));
    ASSERT_TRUE(mbs.ok());
    auto stats = (*engine)->RunIteration(it, routes, *mbs);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_NEAR(distributed[it], stats->loss, 1e-4 * std::max(1.0, stats->loss))
        << "iteration " << it;
  }
  EXPECT_LT(distributed.back(), distributed.front());

  // The checkpoint written at the end holds the same weights as the engine.
  ASSERT_FALSE(final_job.last_checkpoint().empty());
  auto restored = model::PipelineEngine::Create(spec, c10::Device(c10::kCPU));
  ASSERT_TRUE(restored.ok());
  auto manifest = model::LoadCheckpoint(final_job.last_checkpoint(), **restored);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->iteration, 4u);
  for (int s = 0; s < 3; ++s) {
    const auto expected = (*engine)->stage(s).Parameters();
    const auto got = (*restored)->stage(s).Parameters();
    ASSERT_EQ(expected.size(), got.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      EXPECT_EQ(got[i].second.scalar_type(), at::kFloat) << expected[i].first;
      EXPECT_TRUE(expected[i].second.allclose(got[i].second, 1e-4, 1e-5))
          << "stage " << s << " " << expected[i].first;
    }
  }
}

TEST_F(TrainingTest, SkipWithReplicasTrainsAndKeepsReplicasIdentical) {
  // 4 stages, 2 data nodes, 2 replicas of each other stage, each microbatch
  // visits 3 of the 4 stages; activations and gradients travel as bf16.
  v1::JobSpec spec = MicroJob(4, 2, 2, 0.25, 6);
  spec.mutable_pipeline()->set_wire_dtype("bf16");  // half-size activations on the wire
  // Re-plan with measured speeds every 2 iterations.
  Daemon c = StartCoordinator({"--replan_every=2", "--log_level=debug"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 8, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  const std::vector<double> losses =
      WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(180));
  // The coordinator fails the job if replicas diverge or a microbatch is
  // lost or doubled, so success proves both.
  ASSERT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message() << "\n"
                                                        << c.process->Log();
  ASSERT_EQ(losses.size(), 6u);
  EXPECT_LT(losses.back(), losses.front());
  // The workers the routes visit report their timings, and a refit uses
  // them. Every plan visits both data nodes and at least one replica of each
  // of the other 3 stages, so at least 5 workers; which of the 8 beyond that
  // depends on what the probes measured on this machine at the time (a link
  // the job has not used yet is planned from its probe), so 5 is the bound a
  // plan must meet, for the last plan and for the timings a refit had.
  int visited = 0;
  for (const auto& [worker, visits] : final_job.progress().planned_visits()) {
    if (visits > 0) ++visited;
  }
  int timed = 0;  // the most workers a refit had timings from
  const std::string log = c.process->Log();
  const std::string marker = "node speeds updated from ";
  for (size_t at = log.find(marker); at != std::string::npos; at = log.find(marker, at + 1)) {
    timed = std::max(timed, std::atoi(log.c_str() + at + marker.size()));
  }
  EXPECT_GE(visited, 5);
  EXPECT_GE(timed, 5) << log;
  EXPECT_LE(timed, 8) << log;
  ASSERT_EQ(final_job.stages_size(), 4);
  for (const auto& stage : final_job.stages()) EXPECT_EQ(stage.nodes_size(), 2);
  // Workers are released afterwards.
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::ListWorkersResponse now = ListWorkers(c.grpc_port, false);
        for (const auto& w : now.workers()) {
          if (w.state() != v1::WORKER_STATE_IDLE) return false;
        }
        return now.workers_size() == 8;
      },
      absl::Seconds(10)));
}

// A pinned assignment is what the job gets (the coordinator waits for those
// workers, ignoring a spare one), and workers that order their ready work
// backward-first (pipeline.queue_policy) within one memory slot each train
// with replicas identical and every microbatch done once.
TEST_F(TrainingTest, PinnedAssignmentAndBackwardFirstQueue) {
  v1::JobSpec spec = MicroJob(4, 2, 2, 0.25, 3);
  spec.mutable_pipeline()->set_queue_policy(v1::QUEUE_POLICY_BACKWARD_FIRST);
  spec.mutable_pipeline()->set_max_swaps(1);
  Daemon c = StartCoordinator();
  // One activation slot per worker: forwards queue for slots, swap visits
  // bypass them.
  std::vector<std::string> flags = WorkerFlags();
  flags.push_back("--memory_slots=1");
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 9, flags);
  // Stages from the end of the worker list; workers[0] stays spare.
  std::vector<std::vector<std::string>> pinned = {{workers[8].id, workers[7].id},
                                                  {workers[6].id, workers[5].id},
                                                  {workers[4].id, workers[3].id},
                                                  {workers[2].id, workers[1].id}};
  for (const auto& group : pinned) {
    v1::StageNodes* g = spec.mutable_pipeline()->add_assignment();
    for (const std::string& id : group) g->add_nodes(id);
  }
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  const std::vector<double> losses =
      WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(180));
  ASSERT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message() << "\n"
                                                        << c.process->Log();
  ASSERT_EQ(losses.size(), 3u);
  ASSERT_EQ(final_job.stages_size(), 4);
  for (int s = 0; s < 4; ++s) {
    std::vector<std::string> got(final_job.stages(s).nodes().begin(),
                                 final_job.stages(s).nodes().end());
    std::vector<std::string> want = pinned[s];
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want) << "stage " << s;
  }
}

// A pin naming a worker that never registers keeps the job pending and says
// which worker it waits for.
TEST_F(TrainingTest, PinnedAssignmentWaitsForItsWorkers) {
  v1::JobSpec spec = MicroJob(2, 1, 1, 0.0, 1);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 2, WorkerFlags());
  spec.mutable_pipeline()->add_assignment()->add_nodes(workers[0].id);
  spec.mutable_pipeline()->add_assignment()->add_nodes("no-such-worker");
  const v1::Job submitted = Submit(c.grpc_port, spec);
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::Job j = GetJob(c.grpc_port, submitted.id());
        return j.state() == v1::JOB_STATE_PENDING &&
               j.message().find(
                   "pinned workers (pipeline.assignment): no-such-worker is not registered") !=
                   std::string::npos;
      },
      absl::Seconds(10)))
      << GetJob(c.grpc_port, submitted.id()).DebugString();
}

// K-FAC on every projection with its work planned into the pipeline's gaps;
// two data nodes and two replicas per stage, kept identical by `sync`.
// Refresh as often as the bubbles allow.
class KfacReplicasTest : public E2eTest {
 protected:
  void KeepsReplicasIdentical(v1::KfacReplicaSync sync, int iterations);
};

void KfacReplicasTest::KeepsReplicasIdentical(v1::KfacReplicaSync sync, int iterations) {
  // With FACTORS every replica inverts the same factors: in the finest
  // granules (a cap far below any item's time) the inverses must still be
  // bit-identical (docs/KFAC.md "Granules"). PRECONDITIONED and AUTO: the
  // default cap.
  const v1::JobSpec spec = KfacJob(MicroJob(3, 2, 2, 0.0, iterations), [&](v1::KfacSpec* k) {
    if (sync != v1::KFAC_REPLICA_SYNC_AUTO) k->set_replica_sync(sync);
    if (sync == v1::KFAC_REPLICA_SYNC_FACTORS) k->set_max_granule_ms(0.01);
  });
  // AUTO is the default for replicated stages.
  ASSERT_EQ(spec.optimizer().kfac().replica_sync(), sync);
  ASSERT_EQ(spec.optimizer().kfac().sync_factors(), sync == v1::KFAC_REPLICA_SYNC_FACTORS);
  // The scheme is judged on the cost model of loopback links (the region
  // table's 5 GB/s): link probes on a loaded test machine would make it a
  // judgement of the load.
  Daemon c = StartCoordinator({"--log_level=debug", "--link_probe=false"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 6, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  const std::vector<double> losses =
      WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(180));
  // Success means replicas stayed bit-identical every iteration (the
  // coordinator compares their checksums) with K-FAC preconditioning on.
  ASSERT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message() << "\n"
                                                        << c.process->Log();
  ASSERT_EQ(losses.size(), static_cast<size_t>(iterations));
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front());
  // Refreshes took effect, and the workers did K-FAC work.
  EXPECT_GE(final_job.progress().kfac_refreshes(), 1u);
  EXPECT_GT(final_job.progress().kfac_refresh_interval(), 0);
  EXPECT_GT(final_job.progress().utilization(), 0);
  EXPECT_GT(final_job.progress().utilization_with_kfac(), final_job.progress().utilization());
  EXPECT_THAT(c.process->Log(), Not(HasSubstr("diverged")));
  // The scheme the job ran: AUTO is resolved by the coordinator before it
  // assigns the stages, into the stored spec and the history.
  const v1::KfacReplicaSync ran = final_job.spec().optimizer().kfac().replica_sync();
  std::string configured;
  for (const v1::JobHistoryEvent& e : final_job.history()) {
    if (e.kind() == v1::JobHistoryEvent::KIND_CONFIGURED) configured += e.message();
  }
  if (sync == v1::KFAC_REPLICA_SYNC_AUTO) {
    // The tiny model's factors over loopback links cost next to nothing
    // against the bubbles: the exact scheme.
    EXPECT_EQ(ran, v1::KFAC_REPLICA_SYNC_FACTORS) << configured;
    EXPECT_TRUE(final_job.spec().optimizer().kfac().sync_factors());
    EXPECT_THAT(configured, HasSubstr("K-FAC replica sync FACTORS: with the factor all-reduce"));
    EXPECT_THAT(c.process->Log(), HasSubstr("K-FAC replica sync FACTORS"));
  } else {
    EXPECT_EQ(ran, sync);
    EXPECT_EQ(configured, "");
  }
  // Factor sync tasks only with FACTORS; with PRECONDITIONED every replica
  // of every stage holding blocks steps with K-FAC from its own factors.
  int preconditioning = 0;
  for (const Daemon& w : workers) {
    preconditioning += w.process->Log().find("preconditions layer(s)") != std::string::npos;
  }
  if (ran == v1::KFAC_REPLICA_SYNC_PRECONDITIONED) {
    EXPECT_EQ(preconditioning, 6);
    EXPECT_THAT(c.process->Log(), Not(HasSubstr("KIND_SYNC_FACTORS")));
  } else {
    EXPECT_EQ(preconditioning, 0);
  }

  // Every worker exports its K-FAC work and busy fractions, promtool-clean.
  for (const Daemon& w : workers) {
    auto response = HttpGet(w.metrics_port, "/metrics");
    ASSERT_TRUE(response.ok()) << response.status();
    EXPECT_THAT(*response, HasSubstr("detour_worker_kfac_tasks_total{kind=\"curvature_a\""));
    EXPECT_THAT(*response, HasSubstr("detour_worker_kfac_seconds_total{placement="));
    EXPECT_THAT(*response, HasSubstr("detour_worker_busy_fraction{work=\"pipeline_and_kfac\"}"));
    const std::string file = dir_ + "/scrape-" + w.id + ".txt";
    std::ofstream(file) << response->substr(response->find("\r\n\r\n") + 4);
    std::string out;
    EXPECT_EQ(Run({"/bin/sh", "-c", absl::StrCat("promtool check metrics < ", file)}, &out), 0)
        << out;
  }
}

TEST_F(KfacReplicasTest, PreconditionedReplicasTrainInTheBubblesAndStayIdentical) {
  KeepsReplicasIdentical(v1::KFAC_REPLICA_SYNC_PRECONDITIONED, 8);
}

TEST_F(KfacReplicasTest, FactorSyncKeepsReplicasIdentical) {
  KeepsReplicasIdentical(v1::KFAC_REPLICA_SYNC_FACTORS, 6);
}

TEST_F(KfacReplicasTest, TheDefaultSchemeIsChosenFromTheCostModel) {
  KeepsReplicasIdentical(v1::KFAC_REPLICA_SYNC_AUTO, 4);
}

TEST_F(TrainingTest, KfacWithSkipRoutesAndAFixedRefreshInterval) {
  // Skip routes leave each stage different gaps; a refresh every 3
  // iterations from 2 curvature microbatches per node; one replica per stage
  // (no factor sync), so every node inverts from its own curvature.
  const v1::JobSpec spec = KfacJob(MicroJob(4, 1, 1, 0.25, 7), [](v1::KfacSpec* k) {
    k->set_refresh_interval(3);
    k->set_curvature_microbatches(2);
  });
  ASSERT_FALSE(spec.optimizer().kfac().sync_factors());
  Daemon c = StartCoordinator({"--log_level=debug"});
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 4, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  v1::Job final_job;
  const std::vector<double> losses =
      WatchLosses(c.grpc_port, submitted.id(), &final_job, absl::Seconds(180));
  ASSERT_EQ(final_job.state(), v1::JOB_STATE_SUCCEEDED) << final_job.message() << "\n"
                                                        << c.process->Log();
  ASSERT_EQ(losses.size(), 7u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), losses.front());
  // Activations at the ends of iterations 3 and 6.
  EXPECT_EQ(final_job.progress().kfac_refreshes(), 2u);
  EXPECT_DOUBLE_EQ(final_job.progress().kfac_refresh_interval(), 3);
}

TEST_F(TrainingTest, CancelStopsTheJobWithinSeconds) {
  const v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 100000);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  ASSERT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, submitted.id()).progress().iteration() >= 2; },
                 absl::Seconds(60)));
  std::string out;
  ASSERT_EQ(Run({Bin(kCtl), absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port), "cancel",
                 submitted.id()},
                &out),
            0)
      << out;
  const absl::Time cancelled = absl::Now();
  EXPECT_EQ(GetJob(c.grpc_port, submitted.id()).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::ListWorkersResponse now = ListWorkers(c.grpc_port, false);
        for (const auto& w : now.workers()) {
          if (w.state() != v1::WORKER_STATE_IDLE) return false;
        }
        return true;
      },
      absl::Seconds(10)));
  EXPECT_LT(absl::Now() - cancelled, absl::Seconds(10));
  // Its progress stops.
  const uint64_t at = GetJob(c.grpc_port, submitted.id()).progress().iteration();
  absl::SleepFor(absl::Seconds(1));
  EXPECT_EQ(GetJob(c.grpc_port, submitted.id()).progress().iteration(), at);
}

// With elastic training off (elastic.disabled) a lost worker fails the job,
// naming it, and frees the others.
TEST_F(TrainingTest, KilledWorkerFailsTheJobNamingIt) {
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, 100000);
  spec.mutable_elastic()->set_disabled(true);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 3, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, spec);
  ASSERT_TRUE(
      Eventually([&] { return GetJob(c.grpc_port, submitted.id()).progress().iteration() >= 1; },
                 absl::Seconds(60)));
  workers[1].process->Signal(SIGKILL);
  v1::Job job;
  EXPECT_TRUE(Eventually(
      [&] {
        job = GetJob(c.grpc_port, submitted.id());
        return job.state() == v1::JOB_STATE_FAILED;
      },
      absl::Seconds(15)))
      << job.message();
  EXPECT_THAT(job.message(), HasSubstr(workers[1].id));
  // The surviving workers are released.
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::ListWorkersResponse now = ListWorkers(c.grpc_port, false);
        int idle = 0;
        for (const auto& w : now.workers()) idle += w.state() == v1::WORKER_STATE_IDLE;
        return idle == 2;
      },
      absl::Seconds(10)));
}

// The replica check is shown to fail on real processes: one replica of stage
// 1 nudges a parameter after its step of iteration 2 (fault injection), and
// the coordinator fails the job at that iteration, naming the stage and the
// worker, instead of training on with replicas that disagree.
TEST_F(TrainingTest, DivergedReplicaFailsTheJobNamingIt) {
  v1::JobSpec spec = MicroJob(2, 1, 2, 0.0, 100000);
  spec.mutable_elastic()->set_disabled(true);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 2, WorkerFlags());
  std::vector<std::string> faulty = WorkerFlags();
  faulty.push_back("--inject_fault=diverge@2");
  workers.push_back(StartWorker(c.grpc_port, "w2", faulty));
  ASSERT_EQ(workers.size(), 3u);
  // The data node is w0; w1 and the faulty w2 replicate stage 1.
  spec.mutable_pipeline()->add_assignment()->add_nodes(workers[0].id);
  v1::StageNodes* replicas = spec.mutable_pipeline()->add_assignment();
  replicas->add_nodes(workers[1].id);
  replicas->add_nodes(workers[2].id);
  const v1::Job job = AwaitFailureOrSuccess(c.grpc_port, Submit(c.grpc_port, spec).id());
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.message(), HasSubstr("replicas of stage 1 diverged at iteration 2"));
  EXPECT_THAT(job.message(), AnyOf(HasSubstr(workers[1].id), HasSubstr(workers[2].id)));
}

// The exactly-once check on real processes: the data node reports a
// microbatch twice at iteration 1, or leaves one out at iteration 2; either
// fails the job naming the microbatch and the iteration.
TEST_F(TrainingTest, DuplicatedOrMissingMicrobatchFailsTheJob) {
  struct Case {
    std::string fault, expect;
  };
  for (const Case& f : {Case{"duplicate_microbatch@1", "of iteration 1 completed 2 times"},
                        Case{"missing_microbatch@2", "of iteration 2 completed 0 times"}}) {
    SCOPED_TRACE(f.fault);
    v1::JobSpec spec = MicroJob(2, 1, 1, 0.0, 100000);
    spec.mutable_elastic()->set_disabled(true);
    Daemon c = StartCoordinator({}, absl::StrCat("c-", f.fault.substr(0, 4)));
    std::vector<std::string> faulty = WorkerFlags();
    faulty.push_back("--inject_fault=" + f.fault);
    Daemon data = StartWorker(c.grpc_port, "d0", faulty);
    Daemon stage = StartWorker(c.grpc_port, "s1", WorkerFlags());
    spec.mutable_pipeline()->add_assignment()->add_nodes(data.id);
    spec.mutable_pipeline()->add_assignment()->add_nodes(stage.id);
    const v1::Job job = AwaitFailureOrSuccess(c.grpc_port, Submit(c.grpc_port, spec).id());
    EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
    EXPECT_THAT(job.message(), HasSubstr(f.expect));
  }
}

// A job on a prepared dataset with a subword vocabulary: the data node maps
// the token files and the job trains; a model whose vocabulary is smaller
// than the tokenizer's fails with a message that says so.
TEST_F(TrainingTest, PreparedSubwordDatasetTrainsAndAShortVocabularyFails) {
  if (::access("/usr/bin/spm_train", X_OK) != 0) GTEST_SKIP() << "no spm_train";
  const std::string text = absl::StrCat(dir_, "/corpus.txt");
  ASSERT_TRUE(WriteFileAtomically(text, model::GenerateCorpus(5, 300000)).ok());
  model::SentencePieceTraining t;
  t.vocab_size = 320;
  auto sp = model::TrainSentencePiece(t, text);
  ASSERT_TRUE(sp.ok()) << sp.status();
  ASSERT_TRUE(WriteFileAtomically(absl::StrCat(dir_, "/t.model"), *sp).ok());
  model::PrepareOptions prep;
  prep.inputs = {text};
  prep.output = absl::StrCat(dir_, "/dataset");
  prep.tokenizer_path = absl::StrCat(dir_, "/t.model");
  auto manifest = model::PrepareDataset(prep);
  ASSERT_TRUE(manifest.ok()) << manifest.status();

  v1::JobSpec spec = MicroJob(2, 1, 1, 0.0, 6);
  spec.mutable_model()->set_vocab_size(manifest->vocab_size());
  spec.mutable_data()->set_source(v1::DATA_SOURCE_SHARDS);
  spec.mutable_data()->set_path(prep.output);
  spec.mutable_data()->set_validation_fraction(0);
  Daemon c = StartCoordinator();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 2, WorkerFlags());
  const v1::Job submitted = Submit(c.grpc_port, *NormalizeJobSpec(spec));
  v1::Job job;
  ASSERT_TRUE(Eventually(
      [&] {
        job = GetJob(c.grpc_port, submitted.id());
        return job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED;
      },
      absl::Seconds(120)))
      << c.process->Log();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message();
  EXPECT_GT(job.progress().loss(), 0);
  EXPECT_LT(job.progress().loss(), std::log(320.0) + 0.5);
  // The checkpoint records its data: detour-eval evaluates on the dataset's
  // validation split by default and refuses text tokenised otherwise.
  ASSERT_FALSE(job.last_checkpoint().empty());
  std::string out;
  EXPECT_EQ(
      Run({Bin("tools/detour_eval/detour-eval"), "--checkpoint", job.last_checkpoint(), "--json"},
          &out, absl::Seconds(60)),
      0)
      << out;
  EXPECT_THAT(out, HasSubstr("the checkpoint's data: shards"));
  EXPECT_THAT(out, HasSubstr("\"perplexity\""));
  EXPECT_EQ(Run({Bin("tools/detour_eval/detour-eval"), "--checkpoint", job.last_checkpoint(),
                 "--data", text},
                &out, absl::Seconds(60)),
            1)
      << out;
  EXPECT_THAT(out, HasSubstr("tokenizer"));
  // Exported for other tools with the tokenizer the checkpoint records.
  const std::string hf = absl::StrCat(dir_, "/hf");
  EXPECT_EQ(Run({Bin("tools/detour_export/detour-export"), "--quiet", job.last_checkpoint(), hf},
                &out, absl::Seconds(60)),
            0)
      << out;
  auto copied = ReadFileToString(hf + "/tokenizer.model");
  ASSERT_TRUE(copied.ok()) << out;
  EXPECT_EQ(*copied, *sp);

  spec.mutable_model()->set_vocab_size(256);
  const v1::Job short_vocab = Submit(c.grpc_port, *NormalizeJobSpec(spec));
  ASSERT_TRUE(Eventually(
      [&] {
        job = GetJob(c.grpc_port, short_vocab.id());
        return job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED;
      },
      absl::Seconds(60)));
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.message(), HasSubstr("vocab_size"));
}

}  // namespace
}  // namespace detour::testing
