// The job runner's links on a fake host and fake workers
// (tests/coordinator/fake_cluster.h): cut links routed around or judged
// against a worker, bad frames and outsiders' messages, and the link probes
// at start and while the job runs, as the planner's matrix shows them.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/job_runner.h"
#include "coordinator/link_matrix.h"
#include "coordinator/runner_links.h"
#include "tests/coordinator/fake_cluster.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;

// --- link faults ------------------------------------------------------------

// True when a route of `routes` sends between `a` and `b` (either way,
// the last hop's activation going back to the data node included).
bool UsesLink(const std::vector<v1::Route>& routes, const std::string& a, const std::string& b) {
  auto is = [&](const std::string& x, const std::string& y) {
    return (x == a && y == b) || (x == b && y == a);
  };
  for (const v1::Route& r : routes) {
    const int n = r.nodes_size();
    for (int i = 0; i + 1 < n; ++i) {
      if (is(r.nodes(i), r.nodes(i + 1))) return true;
    }
    if (n > 1 && is(r.nodes(n - 1), r.nodes(0))) return true;
  }
  return false;
}

// a1 cannot reach b1 while b1 still talks to the coordinator: the link is
// cut, not the worker. The iteration runs again under a new epoch with
// routes that avoid a1 - b1, nobody is evicted, and every later plan keeps
// avoiding the pair.
TEST_F(JobRunnerTest, ACutLinkIsRoutedAroundWithoutEvictingEither) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  EXPECT_EQ(job.progress().members(), 5u);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("link a1 - b1 cut: a1 could not reach b1 (connection "
                                      "timed out) while b1 still talks to the coordinator"));
  EXPECT_THAT(History(job),
              HasSubstr("iteration 1: link(s) a1 - b1 cut; the iteration runs again"));
  EXPECT_EQ(job.progress().microbatches_dropped(), 0u);
  int after = 0;
  for (const auto& [key, routes] : cluster_->Routes()) {
    const auto [iteration, epoch] = key;
    if (iteration < 1 || (iteration == 1 && epoch == 0)) continue;
    ++after;
    EXPECT_FALSE(UsesLink(routes, "a1", "b1")) << "iteration " << iteration << " epoch " << epoch;
  }
  EXPECT_EQ(after, 4) << "iteration 1 again, then 2, 3 and 4";
}

// Whether `probe`, sent to `by`, is the check of a cut link no plan avoids:
// `by` asked to probe `peer` alone, round trips only.
bool IsCutCheck(const v1::LinkProbe& probe, const std::string& by, const std::string& reporter,
                const std::string& peer) {
  return by == reporter && probe.peers_size() == 1 && probe.peers(0).worker_id() == peer &&
         probe.bulk_max_bytes() == 0;
}

// With one worker per stage no plan avoids a cut a - b. a is asked to
// probe b first; b does not answer, so the reported side leaves the job as
// a lost worker does (and backs off from joining again); an idle worker
// takes its stage and the job finishes.
TEST_F(JobRunnerTest, AnUnavoidableCutLinkRemovesTheUnreachableSide) {
  for (const char* id : {"d0", "a", "b", "spare"}) cluster_->AddWorker(id);
  cluster_->SetLink("a", "b", {0.02, 1e8, "connection timed out"});
  v1::JobSpec spec = Spec(3, 1, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->ReportUnreachableWhenPlanArrives("a", "b", 1);
  Start(spec, {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_RESTORED), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b (stage 2) lost: unreachable from a (connection "
                                      "timed out) and no plan avoids the link"));
  EXPECT_THAT(History(job), HasSubstr("worker spare joined stage 2"));
  EXPECT_EQ(job.progress().iteration(), 4u);
  // The check: a probe of that link alone, sent to the reporter, and the
  // peer told to take it (a worker refuses probes its newest request does
  // not name).
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  const std::vector<std::string> by = cluster_->ProbedBy();
  int checks = 0, accepts = 0;
  for (size_t i = 0; i < probes.size(); ++i) {
    if (IsCutCheck(probes[i], by[i], "a", "b")) {
      ++checks;
      EXPECT_EQ(probes[i].round(), probes.back().round());
    }
    if (by[i] == "b" && probes[i].peers_size() == 0 && probes[i].accept_from_size() == 1 &&
        probes[i].accept_from(0) == "a" && probes[i].round() == probes.back().round()) {
      ++accepts;
    }
  }
  EXPECT_EQ(checks, 1);
  EXPECT_EQ(accepts, 1);
}

// d0, a and b, one per stage: a reports b unreachable at iteration 1, no
// plan avoids the link, and a never answers the probe it is then asked
// for. The job's spec; the caller starts it and awaits the check
// (AwaitCutCheck).
v1::JobSpec HangingCutCheck(FakeCluster* cluster) {
  for (const char* id : {"d0", "a", "b"}) cluster->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster->ReportUnreachableWhenPlanArrives("a", "b", 1);
  cluster->SilenceProbesAfterPlan("a", 1);
  return spec;
}

// Waits up to 10 s until `reporter` has been asked to probe `peer` alone
// (IsCutCheck).
bool AwaitCutCheck(FakeCluster* cluster, const std::string& reporter, const std::string& peer) {
  for (int i = 0; i < 200; ++i) {
    const std::vector<v1::LinkProbe> probes = cluster->Probes();
    const std::vector<std::string> by = cluster->ProbedBy();
    for (size_t p = 0; p < probes.size(); ++p) {
      if (IsCutCheck(probes[p], by[p], reporter, peer)) return true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

// The coordinator stops (and leaves its jobs to the next one) while the
// probe of a cut link no plan avoids is out: the unfinished check removes
// nobody, and the job stays RUNNING with its three workers untold.
TEST_F(JobRunnerTest, AStopWhileACutLinkIsProbedRemovesNobody) {
  Start(HangingCutCheck(cluster_.get()), {"d0", "a", "b"});
  ASSERT_TRUE(AwaitCutCheck(cluster_.get(), "a", "b")) << History(Job());
  runner_->Detach();
  runner_.reset();
  cluster_->set_runner(nullptr);
  const v1::Job left = Job();
  ASSERT_EQ(left.state(), v1::JOB_STATE_RUNNING) << left.message() << "\n" << History(left);
  EXPECT_EQ(Count(left, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(left);
  EXPECT_EQ(cluster_->Sent("cancel"), 0) << History(left);
}

// A member reports a fatal error while the probe of a cut link no plan
// avoids is out: the job fails with that error, as it would at any other
// time, and nobody is removed for the unfinished check.
TEST_F(JobRunnerTest, AMemberErrorWhileACutLinkIsProbedFailsTheJob) {
  Start(HangingCutCheck(cluster_.get()), {"d0", "a", "b"});
  ASSERT_TRUE(AwaitCutCheck(cluster_.get(), "a", "b")) << History(Job());
  v1::WorkerMessage error;
  error.mutable_error()->set_job_id(job_id_);
  error.mutable_error()->set_message("stage 0: out of memory");
  runner_->Post("d0", error);
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.message() << "\n" << History(job);
  EXPECT_THAT(job.message(), HasSubstr("stage 0: out of memory"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
}

// Regression (seen over the WAN test bed): one stripe of a replica pair's
// connections broke ("TLS read: no detail"), the sender reported its peer
// unreachable, and since the two replicas must all-reduce, no plan avoided
// the link and a live, reachable worker left the job at once. Now the
// reporter probes the peer first: it answers, the link is restored, the
// iteration runs again with both, and nobody leaves.
TEST_F(JobRunnerTest, AnUnavoidableCutLinkThatAnswersItsProbeIsRestoredNotRemoved) {
  for (const char* id : {"d0", "a1", "a2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(2, 2, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a1", "a2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "a2", 1);
  Start(spec, {"d0", "a1", "a2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 4u);
  EXPECT_EQ(job.progress().members(), 3u);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_RESTORED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("link a1 -> a2 answered its probe again"));
  EXPECT_EQ(job.progress().microbatches_dropped(), 0u);
}

// The same link restored by its probe and cut again within ten minutes is
// not probed again: a path whose pings pass but whose transfers fail would
// otherwise cost an iteration each time. The second cut removes the
// reported side.
TEST_F(JobRunnerTest, AnUnavoidableCutLinkCutAgainAfterItsProbeAnsweredRemovesTheWorker) {
  for (const char* id : {"d0", "a1", "a2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(2, 2, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a1", "a2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "a2", 1);
  cluster_->ReportUnreachableWhenPlanArrives("a1", "a2", 3);
  Start(spec, {"d0", "a1", "a2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 2) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_RESTORED), 1) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker a2 (stage 1) lost: unreachable from a1"));
}

// Two members cannot reach b1: the evidence is about b1, which is lost and
// routed around as before; no link is cut.
TEST_F(JobRunnerTest, TwoReportersAgainstAWorkerMakeItLost) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "b1", 1);
  cluster_->ReportUnreachableWhenPlanArrives("a2", "b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b1 (stage 2) lost: a1 and a2 could not reach it"));
  EXPECT_EQ(job.progress().iteration(), 4u);
}

// A member reports a replica's all-reduce input as holding NaN: the sender
// leaves the job as a lost worker would (the event says it was excluded and
// why), the iteration runs again among the survivors and the job succeeds
// instead of failing on a non-finite gradient; the sender is not taken
// back. A report about a member that sends the reporter nothing in the
// plan (d0 about b1, of another stage) excludes nobody.
TEST_F(JobRunnerTest, AMemberThatSendsBadFramesIsExcludedAndTheJobGoesOn) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportBadFrameWhenPlanArrives("a2", "a1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return !cluster_->PlannedIterations().empty(); }));
  for (uint64_t iteration = 0; iteration < 4; ++iteration) {  // whichever is in flight
    v1::WorkerMessage forged;
    forged.mutable_bad_frame()->set_job_id(job_id_);
    forged.mutable_bad_frame()->set_iteration(iteration);
    forged.mutable_bad_frame()->set_sender("b1");
    forged.mutable_bad_frame()->set_direction(v1::DIRECTION_ALLREDUCE);
    runner_->Post("d0", forged);
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job),
              HasSubstr("worker a1 (stage 1) lost: excluded: a2 received a frame from it with "
                        "values no honest training sends (it holds NaN)"));
  EXPECT_EQ(job.progress().iteration(), 4u);
  for (const auto& [key, routes] : cluster_->Routes()) {
    if (key.first < 2) continue;
    for (const v1::Route& r : routes) {
      for (const std::string& n : r.nodes()) EXPECT_NE(n, "a1") << "iteration " << key.first;
    }
  }
}

// A member excluded for its bad frames keeps talking about the job (a
// JobError, a report against its accuser, a NaN norm): the job neither
// fails nor loses anyone else, and the messages are counted by kind. b1
// turns mute once a1 is gone, so the job waits while they arrive.
TEST_F(JobRunnerTest, MessagesFromAnExcludedMemberAreIgnoredAndCounted) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 1000);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportBadFrameWhenPlanArrives("a2", "a1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  ASSERT_TRUE(AwaitJob(
      [](const v1::Job& j) { return Count(j, v1::JobHistoryEvent::KIND_WORKER_LOST) == 1; }));
  cluster_->Mute("b1");
  v1::WorkerMessage error;
  error.mutable_error()->set_job_id(job_id_);
  error.mutable_error()->set_message("forged failure");
  v1::WorkerMessage report;
  report.mutable_bad_frame()->set_job_id(job_id_);
  report.mutable_bad_frame()->set_sender("a2");
  report.mutable_bad_frame()->set_direction(v1::DIRECTION_ALLREDUCE);
  v1::WorkerMessage norm;
  norm.mutable_grad_norm()->set_job_id(job_id_);
  norm.mutable_grad_norm()->set_squared_norm(std::numeric_limits<double>::quiet_NaN());
  for (uint64_t iteration = 0; iteration < 1000; iteration += 100) {
    report.mutable_bad_frame()->set_iteration(iteration);
    runner_->Post("a1", report);
  }
  runner_->Post("a1", error);
  runner_->Post("a1", norm);
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return cluster_->OutsiderMessages() == 12; },
                       absl::Seconds(20)))
      << cluster_->OutsiderMessages();
  EXPECT_EQ(cluster_->OutsiderMessages("bad_frame"), 10);
  EXPECT_EQ(cluster_->OutsiderMessages("error"), 1);
  const v1::Job job = Job();
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  runner_->RequestStop(JobEnd{v1::JOB_STATE_CANCELLED, "the test is done"});
  EXPECT_EQ(AwaitEnd().state(), v1::JOB_STATE_CANCELLED);
}

// A registered worker that was never part of the job sends it a JobError,
// a NaN gradient norm and a report against a member while the job waits for
// b's norm (b is mute): all are dropped and counted, and the forged error
// neither fails the job nor costs it a worker.
TEST_F(JobRunnerTest, MessagesFromWorkersTheJobNeverHadAreIgnoredAndCounted) {
  for (const char* id : {"d0", "a", "b", "stranger"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->Mute("b");
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return !cluster_->PlannedIterations().empty(); }));
  v1::WorkerMessage error;
  error.mutable_error()->set_job_id(job_id_);
  error.mutable_error()->set_message("forged failure");
  v1::WorkerMessage norm;
  norm.mutable_grad_norm()->set_job_id(job_id_);
  norm.mutable_grad_norm()->set_squared_norm(std::numeric_limits<double>::quiet_NaN());
  v1::WorkerMessage report;
  report.mutable_peer_unreachable()->set_job_id(job_id_);
  report.mutable_peer_unreachable()->set_peer("a");
  for (int i = 0; i < 3; ++i) runner_->Post("stranger", error);
  runner_->Post("stranger", norm);
  runner_->Post("stranger", report);
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return cluster_->OutsiderMessages() == 5; },
                       absl::Seconds(20)))
      << cluster_->OutsiderMessages();
  absl::SleepFor(absl::Milliseconds(1200));  // a loss check and a link confirmation later
  const v1::Job job = Job();
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 0) << History(job);
  EXPECT_EQ(cluster_->OutsiderMessages(), 5);
}

// Before the first plan every worker probes every other; the planner's
// matrix (what GetLinks shows) holds what they measured: half the round
// trip as latency, the bulk rate as bandwidth, and a failed probe's error.
TEST_F(JobRunnerTest, ProbesAtStartMeasureEveryLinkForTheFirstPlan) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  cluster_->SetLink("a", "b", {0.2, 5e6, ""});
  cluster_->SetLink("b", "a", {0, 0, "connect: timed out"});
  // The region table (all three are in region "local"): 40 ms, 2 GB/s.
  cluster_->mutable_options()->network.set_intra_region_latency_ms(40);
  cluster_->mutable_options()->network.set_intra_region_bandwidth_gbytes_per_s(2);
  Start(Spec(3, 1, 0.0, 2), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("link probes: 5 of 6 links answered (5 with a bulk rate)"));
  EXPECT_THAT(History(job), HasSubstr("one-way latency 10.0-100.0 ms, bandwidth 5.0-100.0 MB/s"));
  // At the start a latency round to all three, each asked about the other
  // two, then two bulk rounds (the interval is 60 s: nothing more), in each
  // of which every worker probes one other and takes one other's probes,
  // a -> b, b -> d0, d0 -> a, then a -> d0, b -> a, d0 -> b.
  EXPECT_EQ(cluster_->Sent("probe"), 9);
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  ASSERT_EQ(probes.size(), 9u);
  std::map<std::string, int> named, taken;  // in the bulk rounds
  for (size_t i = 0; i < probes.size(); ++i) {
    SCOPED_TRACE(probes[i].ShortDebugString());
    if (i < 3) {
      EXPECT_EQ(probes[i].bulk_max_bytes(), 0u);
      EXPECT_EQ(probes[i].peers_size(), 2);  // the other two
      // Nothing measured yet: the table's figures for both.
      ASSERT_EQ(probes[i].expected_size(), 2);
      EXPECT_DOUBLE_EQ(probes[i].expected(1).rtt_s(), 0.08);
      EXPECT_DOUBLE_EQ(probes[i].expected(1).bandwidth_bytes_per_s(), 2e9);
      EXPECT_EQ(probes[i].accept_from_size(), 0);
      EXPECT_EQ(probes[i].round(), probes[0].round());
      continue;
    }
    EXPECT_EQ(probes[i].bulk_max_bytes(), uint64_t{32} << 20);
    ASSERT_EQ(probes[i].peers_size(), 1);
    ASSERT_EQ(probes[i].accept_from_size(), 1);
    // What the planner expects of the link goes with it, for the worker's
    // check of its socket limits: what the latency round measured, and
    // the region table's figures for what it did not (b -> a failed).
    ASSERT_EQ(probes[i].expected_size(), 1);
    const v1::LinkExpectation& x = probes[i].expected(0);
    EXPECT_EQ(x.peer(), probes[i].peers(0).worker_id());
    EXPECT_DOUBLE_EQ(x.bandwidth_bytes_per_s(), 2e9);  // no rate measured yet: the table's
    const bool b_to_a = x.peer() == "a" && probes[i].accept_from(0) == "d0";
    if (b_to_a) {
      EXPECT_DOUBLE_EQ(x.rtt_s(), 0.08);  // 2 x 40 ms, the table's
    } else {
      EXPECT_GT(x.rtt_s(), 0);
      EXPECT_NE(x.rtt_s(), 0.08);  // measured by the fakes' pings
    }
    EXPECT_NE(probes[i].peers(0).worker_id(), probes[i].accept_from(0));
    named[probes[i].peers(0).worker_id()]++;
    taken[probes[i].accept_from(0)]++;
    // A slot's three requests share a round, one round after another.
    EXPECT_EQ(probes[i].round(), probes[0].round() + 1 + (i - 3) / 3);
  }
  // Every worker is probed by both others, and probes both.
  const std::map<std::string, int> twice = {{"a", 2}, {"b", 2}, {"d0", 2}};
  EXPECT_EQ(named, twice);
  EXPECT_EQ(taken, twice);
  // The bulk rounds share link_probe_budget (their needs, 15.2 s, are
  // less), each slot by its need against what is left when it starts: the
  // first holds a -> b (1 s + 60 x 200 ms = 13 s), the second none over
  // 2.2 s (b -> a did not answer: 1 s). As the fakes answer at once, the
  // second gets what the first left.
  EXPECT_NEAR(probes[3].budget_ms(), 20000 * 13 / 15.2, 200);
  EXPECT_NEAR(probes[6].budget_ms(), 20000, 200);
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  EXPECT_EQ(links->probe_rounds(), 3u);
  ASSERT_EQ(links->links_size(), 6);
  for (const v1::JobLink& l : links->links()) {
    SCOPED_TRACE(l.ShortDebugString());
    if (l.from() == "b" && l.to() == "a") {
      // Not measured: the region table's figures, and why.
      EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_REGION_TABLE);
      EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_REGION_TABLE);
      EXPECT_EQ(l.probe_error(), "connect: timed out");
      EXPECT_FALSE(l.has_latency_measured());
      continue;
    }
    EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_PROBE);
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE);
    EXPECT_TRUE(l.has_latency_measured());
    const bool slow = l.from() == "a" && l.to() == "b";
    EXPECT_DOUBLE_EQ(l.latency_seconds(), slow ? 0.1 : 0.01);
    EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s(), slow ? 5e6 : 1e8);
  }
}

// The bulk rounds' schedule: every ordered pair of workers exactly once; in
// a slot a worker sends to at most one and takes from at most one, and no
// pair is probed both ways at once.
TEST(ProbeScheduleTest, EveryLinkOnceOneProbeInAndOutAndNoPairBothWays) {
  for (size_t n = 0; n <= 9; ++n) {
    SCOPED_TRACE(n);
    std::vector<std::string> ids;
    for (size_t i = 0; i < n; ++i) ids.push_back(absl::StrCat("w", i));
    const auto slots = RunnerLinks::ProbeSchedule(ids);
    EXPECT_EQ(slots.size(), n < 2 ? 0 : (n % 2 == 0 ? n : n - 1));
    std::set<std::pair<std::string, std::string>> probed;
    for (const auto& slot : slots) {
      std::set<std::string> senders, takers;
      std::set<std::pair<std::string, std::string>> pairs;
      for (const auto& [from, to] : slot) {
        EXPECT_NE(from, to);
        EXPECT_TRUE(senders.insert(from).second) << from;
        EXPECT_TRUE(takers.insert(to).second) << to;
        EXPECT_TRUE(pairs.insert(std::minmax(from, to)).second) << from << " <-> " << to;
        EXPECT_TRUE(probed.insert({from, to}).second) << from << " -> " << to;
      }
    }
    EXPECT_EQ(probed.size(), n * (n - 1));
  }
}

// One slot of links that the schedule spreads over several: each worker
// sends one probe stream and takes one, no pair both ways; the links that
// would break a rule wait, in their order.
TEST(ProbeScheduleTest, OneSlotTakesWhatItsRulesAllowInOrder) {
  using Links = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(RunnerLinks::OneSlotOf({}), Links{});
  EXPECT_EQ(RunnerLinks::OneSlotOf({{"a", "b"},
                                    {"a", "c"},  // a sends already
                                    {"c", "b"},  // b takes already
                                    {"b", "a"},  // a <-> b both ways
                                    {"c", "c"},  // no link
                                    {"c", "d"},
                                    {"b", "c"},
                                    {"d", "a"}}),
            (Links{{"a", "b"}, {"c", "d"}, {"b", "c"}, {"d", "a"}}));
}

// Over long round trips a TCP window takes long to open: the bulk rounds'
// budget grows with the round trips the latency round measured (1 s and 60
// round trips per link, the neediest link of each slot of pairs).
TEST_F(JobRunnerTest, TheBulkRoundsBudgetGrowsWithTheRoundTrips) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  cluster_->SetLink("a", "b", {1.0, 5e6, ""});
  cluster_->SetLink("a", "d0", {0.5, 5e6, ""});
  Start(Spec(3, 1, 0.0, 2), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  ASSERT_GE(probes.size(), 9u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(probes[i].bulk_max_bytes(), 0u);
    EXPECT_EQ(probes[i].budget_ms(), 5000u);
  }
  // Two slots: a -> b (1 s + 60 x 1.0 s = 61 s) with b -> d0, d0 -> a
  // (2.2 s each), then a -> d0 (31 s) with b -> a, d0 -> b: 92 s in all,
  // shared by need.
  EXPECT_THAT(History(job), HasSubstr("(bulk budget 92 s for the round trips)"));
  ASSERT_EQ(probes.size(), 9u);
  for (size_t i = 3; i < 9; ++i) EXPECT_EQ(probes[i].budget_ms(), probes[3 * (i / 3)].budget_ms());
  // What a slot ends early leaves goes to the later one: at least its share,
  // at most all that is left.
  EXPECT_GE(probes[3].budget_ms(), 61000u - 100);
  EXPECT_GE(probes[6].budget_ms(), 31000u - 100);
  EXPECT_LE(probes[6].budget_ms(), 92000u);
}

// A lost worker's measured links go with it: when it comes back and joins
// again, the planner has the region table's figures for its links (until a
// probe measures them), not what was measured of the process that died.
TEST_F(JobRunnerTest, ALostWorkersMeasuredLinksAreForgotten) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  for (const char* id : {"d0", "a1", "a2", "b2"}) {
    cluster_->SetLink("b1", id, {0.2, 5e6, ""});
    cluster_->SetLink(id, "b1", {0.2, 5e6, ""});
  }
  v1::JobSpec spec = Spec(3, 2, 0.0, 6);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillWhenPlanArrives("b1", 1);    // routed around
  cluster_->ReviveWhenPlanArrives("b1", 3);  // the same id, a new process
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_THAT(History(job), HasSubstr("worker b1 joined stage 2"));
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  int with_b1 = 0;
  for (const v1::JobLink& l : links->links()) {
    SCOPED_TRACE(l.ShortDebugString());
    if (l.from() != "b1" && l.to() != "b1") {
      EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_PROBE);
      continue;
    }
    ++with_b1;
    EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_REGION_TABLE);
    EXPECT_NE(l.latency_seconds(), 0.1);
  }
  EXPECT_EQ(with_b1, 8);  // to and from d0, a1, a2 and b2
}

// Reports are bounded: a round trip or rate out of bounds, a peer the
// worker was not asked about, and reports of an old round are ignored.
TEST(LinkMatrixTest, IgnoresWhatWasNotAskedAndWhatIsOutOfBounds) {
  LinkMatrix m;
  v1::LinkReport r;
  r.set_round(1);
  auto add = [&](const std::string& peer, double rtt, double rate) {
    v1::LinkMeasurement* l = r.add_links();
    l->set_peer(peer);
    l->set_rtt_seconds(rtt);
    l->set_bandwidth_bytes_per_s(rate);
  };
  add("b", 0.04, 2e8);
  add("c", -1, 1e20);           // both out of bounds
  add("x", 0.01, 1e6);          // not asked about
  add("b", 0.5, 1);             // the same peer twice
  add("d", std::nan(""), 1e6);  // NaN round trip, a good rate
  const absl::Time now = absl::Now();
  const LinkMatrix::Applied a = m.AddReport("a", r, {"b", "c", "d"}, now);
  EXPECT_EQ(a.answered, std::vector<std::string>({"b"}));
  EXPECT_EQ(a.rejected, 4);
  EXPECT_EQ(a.measured.latencies, 1);
  EXPECT_DOUBLE_EQ(a.measured.min_latency_s, 0.02);
  EXPECT_DOUBLE_EQ(a.measured.max_latency_s, 0.02);
  EXPECT_EQ(a.measured.rates, 2);  // b's and d's
  EXPECT_DOUBLE_EQ(a.measured.min_rate, 1e6);
  EXPECT_DOUBLE_EQ(a.measured.max_rate, 2e8);
  const LinkMatrix::Entry* b = m.Find({"a", "b"});
  ASSERT_NE(b, nullptr);
  EXPECT_DOUBLE_EQ(*b->latency_s, 0.02);
  EXPECT_DOUBLE_EQ(*b->bandwidth, 2e8);
  const LinkMatrix::Entry* c = m.Find({"a", "c"});
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->latency_s.has_value());
  EXPECT_FALSE(c->bandwidth.has_value());
  EXPECT_EQ(m.Find({"a", "x"}), nullptr);
  ASSERT_NE(m.Find({"a", "d"}), nullptr);
  EXPECT_FALSE(m.Find({"a", "d"})->latency_s.has_value());
  EXPECT_DOUBLE_EQ(*m.Find({"a", "d"})->bandwidth, 1e6);
  // A fit to the job's traffic replaces the bandwidth, not the latency.
  m.Fitted({"a", "b"}, 3e8, 1.0, now);
  EXPECT_DOUBLE_EQ(*m.Find({"a", "b"})->bandwidth, 3e8);
  EXPECT_EQ(m.Find({"a", "b"})->bandwidth_source, v1::JobLink::SOURCE_TRAFFIC);
  EXPECT_EQ(m.Find({"a", "b"})->latency_source, v1::JobLink::SOURCE_PROBE);
  m.Forget("b");
  EXPECT_EQ(m.Find({"a", "b"}), nullptr);
}

// How long the job's transfers stay on the wire, in round trips: the median
// over the links fitted to them, 0 until kMinFitLinks links are; a fit
// without round trips, or out of bounds, or a link probed again since its
// fit, does not count. And a link known by probes only is planned at its
// probe's rate or that many of its round trips, whichever is slower.
TEST(LinkMatrixTest, TheJobsTransfersRoundTripsPlanTheLinksOnlyProbesMeasured) {
  LinkMatrix m;
  v1::LinkReport r;
  r.set_round(1);
  for (const char* peer : {"b", "c", "d", "e"}) {
    v1::LinkMeasurement* l = r.add_links();
    l->set_peer(peer);
    l->set_rtt_seconds(0.1);
    l->set_bandwidth_bytes_per_s(1e8);
  }
  const absl::Time now = absl::Now();
  m.AddReport("a", r, {"b", "c", "d", "e"}, now);
  EXPECT_DOUBLE_EQ(m.TransferRoundTrips().round_trips, 0);
  EXPECT_EQ(m.TransferRoundTrips().links, 0);
  m.Fitted({"a", "b"}, 1e7, 0.5, now);
  m.Fitted({"a", "c"}, 2e7, 2.0, now);
  m.Fitted({"x", "y"}, 1e3, std::nan(""), now);  // no round trip known
  LinkMatrix::TransferRounds rounds = m.TransferRoundTrips();
  EXPECT_EQ(rounds.links, 2);
  EXPECT_DOUBLE_EQ(rounds.round_trips, 0) << "too few links to tell";
  EXPECT_DOUBLE_EQ(rounds.low, 0.5);
  EXPECT_DOUBLE_EQ(rounds.high, 2.0);
  m.Fitted({"a", "d"}, 5e7, 0.8, now);
  rounds = m.TransferRoundTrips();
  EXPECT_EQ(rounds.links, 3);
  EXPECT_DOUBLE_EQ(rounds.round_trips, 0.8);
  // Refitted, the link counts its last fit.
  m.Fitted({"a", "b"}, 3e7, 0.9, now);
  EXPECT_DOUBLE_EQ(m.TransferRoundTrips().round_trips, 0.9);
  // Out of bounds: the fit stands, its round trips do not.
  m.Fitted({"a", "b"}, 3e7, LinkMatrix::kMaxRoundTrips * 2, now);
  EXPECT_EQ(m.TransferRoundTrips().links, 2);
  m.Fitted({"a", "b"}, 3e7, -1, now);
  EXPECT_EQ(m.TransferRoundTrips().links, 2);
  EXPECT_EQ(m.Find({"a", "b"})->bandwidth_source, v1::JobLink::SOURCE_TRAFFIC);
  // A probe measures a fitted link again: it no longer counts.
  v1::LinkReport again;
  again.set_round(2);
  v1::LinkMeasurement* l = again.add_links();
  l->set_peer("d");
  l->set_rtt_seconds(0.1);
  l->set_bandwidth_bytes_per_s(1e8);
  m.AddReport("a", again, {"d"}, now);
  EXPECT_EQ(m.TransferRoundTrips().links, 1);

  // 64 KiB over a 100 ms round trip: at 100 MB/s the bytes take 0.66 ms,
  // half a round trip 50 ms, so the link is planned at 64 KiB / 50 ms; at
  // 1 MB/s the bytes take 66 ms, longer: the probe's rate stands.
  const double bytes = 65536;
  EXPECT_DOUBLE_EQ(LinkMatrix::PlannedProbeRate(1e8, bytes, 0.1, 0.5), bytes / 0.05);
  EXPECT_DOUBLE_EQ(LinkMatrix::PlannedProbeRate(1e6, bytes, 0.1, 0.5), 1e6);
  // Unknown round trips, round trip or size: the probe's rate.
  EXPECT_DOUBLE_EQ(LinkMatrix::PlannedProbeRate(1e8, bytes, 0.1, 0), 1e8);
  EXPECT_DOUBLE_EQ(LinkMatrix::PlannedProbeRate(1e8, bytes, 0, 0.5), 1e8);
  EXPECT_DOUBLE_EQ(LinkMatrix::PlannedProbeRate(1e8, 0, 0.1, 0.5), 1e8);
}

using LinkPair = std::pair<std::string, std::string>;

// The (prober, peer) links each probe round of `probes` asked about, by
// round; `by` names the worker each probe was sent to.
std::map<uint64_t, std::set<LinkPair>> ProbedLinksByRound(const std::vector<v1::LinkProbe>& probes,
                                                          const std::vector<std::string>& by) {
  std::map<uint64_t, std::set<LinkPair>> out;
  EXPECT_EQ(probes.size(), by.size());
  for (size_t i = 0; i < probes.size() && i < by.size(); ++i) {
    for (const v1::Peer& peer : probes[i].peers()) {
      out[probes[i].round()].insert({by[i], peer.worker_id()});
    }
  }
  return out;
}

// The one entry of `links` from `from` to `to`; nullptr, and a failure,
// unless there is exactly one.
const v1::JobLink* OnlyLink(const v1::GetLinksResponse& links, const std::string& from,
                            const std::string& to) {
  const v1::JobLink* found = nullptr;
  int seen = 0;
  for (const v1::JobLink& l : links.links()) {
    if (l.from() != from || l.to() != to) continue;
    ++seen;
    found = &l;
  }
  EXPECT_EQ(seen, 1) << from << " -> " << to;
  return seen == 1 ? found : nullptr;
}

// The running probes: a latency round every 1 ms, each followed by a bulk
// slot of the start's schedule when link_probe_bulk_interval (1 ms) has
// passed. RunPipeline runs the full pipeline d0 -> a -> b -> c (the loss back
// to d0), 24 iterations: of the four slots over a, b, c, d0 the two with
// links it leaves to the probes are a -> c, b -> d0 (there_, first in turn)
// and c -> a, d0 -> b (back_). The start's probe rounds are 1-5 (a latency
// round and four slots).
class RunningBulkSlotsTest : public JobRunnerTest {
 protected:
  void SetUp() override {
    JobRunnerTest::SetUp();
    cluster_->mutable_options()->link_probe_interval = absl::Milliseconds(1);
    cluster_->mutable_options()->link_probe_bulk_interval = absl::Milliseconds(1);
  }

  // Runs the pipeline to its end (a failure, with its history, unless it
  // succeeded).
  v1::Job RunPipeline() {
    const std::vector<std::string> workers = {"d0", "a", "b", "c"};
    for (const std::string& id : workers) cluster_->AddWorker(id);
    v1::JobSpec spec = Spec(4, 1, 0.0, 24);
    Pin(&spec, {{"d0"}, {"a"}, {"b"}, {"c"}});
    Start(spec, workers);
    const v1::Job job = AwaitEnd();
    EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
    return job;
  }

  // The planner's entry for from -> to at the end; a failure unless there
  // is exactly one.
  std::optional<v1::JobLink> FinalLink(const std::string& from, const std::string& to) {
    const std::optional<v1::GetLinksResponse> links = runner_->Links();
    EXPECT_TRUE(links.has_value());
    if (!links) return std::nullopt;
    const v1::JobLink* l = OnlyLink(*links, from, to);
    return l != nullptr ? std::optional<v1::JobLink>(*l) : std::nullopt;
  }

  const std::set<LinkPair> there_ = {{"a", "c"}, {"b", "d0"}};
  const std::set<LinkPair> back_ = {{"c", "a"}, {"d0", "b"}};
};

// While the job runs, a latency round is followed by one bulk slot of the
// start's schedule when link_probe_bulk_interval has passed, slot after slot
// in turn, each over the links the last iteration did not cross: every
// worker probes at most one peer and takes at most one other's probes,
// within a budget of the slot's need, and what the probes find replaces
// what the start measured.
TEST_F(RunningBulkSlotsTest, WhileTheJobRunsBulkSlotsFollowLatencyRoundsSlotAfterSlot) {
  cluster_->SetLink("a", "c", {0.2, 5e6, ""});
  cluster_->SetLinkFromRound("a", "c", 6, {0.2, 7e6, ""});
  ASSERT_EQ(RunPipeline().state(), v1::JOB_STATE_SUCCEEDED);
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  std::map<uint64_t, std::set<LinkPair>> probed = ProbedLinksByRound(probes, cluster_->ProbedBy());
  std::map<uint64_t, std::vector<v1::LinkProbe>> rounds;
  for (const v1::LinkProbe& p : probes) rounds[p.round()].push_back(p);
  ASSERT_GE(rounds.size(), 9u);  // the start's five, then two of each kind at least
  bool after_latency = false;
  int bulk_rounds = 0;
  for (const auto& [round, requests] : rounds) {
    if (round <= 5) continue;
    SCOPED_TRACE(round);
    const bool bulk = requests.front().bulk_max_bytes() > 0;
    // A bulk slot only right after a latency round (not every latency round
    // is followed by one: the bulk interval, 1 ms, may not have passed).
    if (bulk) {
      EXPECT_TRUE(after_latency);
    }
    after_latency = !bulk;
    for (const v1::LinkProbe& p : requests) EXPECT_EQ(p.bulk_max_bytes() > 0, bulk);
    if (!bulk) {
      ASSERT_EQ(requests.size(), 4u);
      for (const v1::LinkProbe& p : requests) EXPECT_EQ(p.peers_size(), 3);
      continue;
    }
    // Two probe, two take: the slots in turn, the one with a -> c first;
    // each has its need as its budget: 1 s + 60 round trips of its slowest
    // link (a -> c 200 ms, the others 20 ms).
    ASSERT_EQ(requests.size(), 4u);
    const bool first = ++bulk_rounds % 2 == 1;
    EXPECT_EQ(probed[round], first ? there_ : back_);
    EXPECT_NEAR(requests.front().budget_ms(), first ? 13000 : 2200, 2);
    for (const v1::LinkProbe& p : requests) {
      EXPECT_EQ(p.bulk_max_bytes(), uint64_t{32} << 20);
      EXPECT_EQ(p.peers_size() + p.accept_from_size(), 1) << p.ShortDebugString();
    }
  }
  EXPECT_GE(bulk_rounds, 2);
  const std::optional<v1::JobLink> ac = FinalLink("a", "c");
  ASSERT_TRUE(ac.has_value());
  EXPECT_EQ(ac->bandwidth_source(), v1::JobLink::SOURCE_PROBE);
  EXPECT_DOUBLE_EQ(ac->bandwidth_bytes_per_s(), 7e6);  // a bulk slot while it ran
}

// The links the start's bulk probes could not rate (their probe gave a
// round trip and no rate: planned at the region table's) are measured by
// the first running bulk slot, out of turn, together where the schedule has
// them in different slots; the turn then goes on where it was. c -> a (in
// back_) and b -> d0 (in there_) are unrated.
TEST_F(RunningBulkSlotsTest, ARunningBulkSlotMeasuresALinkTheStartCouldNotRateFirst) {
  cluster_->SetLink("c", "a", {0.2, 0, ""});
  cluster_->SetLinkFromRound("c", "a", 6, {0.2, 7e6, ""});
  cluster_->SetLink("b", "d0", {0.02, 0, ""});
  cluster_->SetLinkFromRound("b", "d0", 6, {0.02, 9e6, ""});
  const v1::Job job = RunPipeline();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_THAT(History(job),
              HasSubstr("link probes: 12 of 12 links answered (10 with a bulk rate)"));
  // The running bulk slots' links (the start's rounds are 1-5).
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  const std::map<uint64_t, std::set<LinkPair>> probed =
      ProbedLinksByRound(probes, cluster_->ProbedBy());
  std::map<uint64_t, std::set<LinkPair>> bulk;
  for (const v1::LinkProbe& p : probes) {
    if (p.round() > 5 && p.bulk_max_bytes() > 0) bulk[p.round()] = probed.at(p.round());
  }
  ASSERT_GE(bulk.size(), 3u);
  auto slot = bulk.begin();
  EXPECT_EQ(slot->second, (std::set<LinkPair>{{"b", "d0"}, {"c", "a"}}));  // out of turn
  EXPECT_EQ((++slot)->second, there_);                                     // the turn's first
  EXPECT_EQ((++slot)->second, back_);
  const std::optional<v1::JobLink> ca = FinalLink("c", "a");
  ASSERT_TRUE(ca.has_value());
  EXPECT_EQ(ca->bandwidth_source(), v1::JobLink::SOURCE_PROBE);
  EXPECT_DOUBLE_EQ(ca->bandwidth_bytes_per_s(), 7e6);
  const std::optional<v1::JobLink> bd = FinalLink("b", "d0");
  ASSERT_TRUE(bd.has_value());
  EXPECT_EQ(bd->bandwidth_source(), v1::JobLink::SOURCE_PROBE);
  EXPECT_DOUBLE_EQ(bd->bandwidth_bytes_per_s(), 9e6);
}

// The running bulk slots leave out the links the last iteration crossed
// (every hop both ways, the loss back to the data node, the replicas of a
// stage among themselves), and a link's fit to the job's transfers stops
// once no transfer crosses it: what a slot measured of it stays.
TEST_F(RunningBulkSlotsTest, RunningBulkSlotsLeaveOutTheLinksTheLastIterationCrossed) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->replan_every = 1;
  cluster_->ReportTransfers(0.05);
  v1::JobSpec spec = Spec(3, 2, 0.0, 30);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  using Link = std::pair<std::string, std::string>;
  const auto routes = cluster_->Routes();
  auto crossed = [&](uint64_t iteration) {
    std::set<Link> out = {{"a1", "a2"}, {"a2", "a1"}, {"b1", "b2"}, {"b2", "b1"}};
    for (const auto& [key, rs] : routes) {
      if (key.first != iteration) continue;
      for (const v1::Route& r : rs) {
        std::vector<std::string> ring(r.nodes().begin(), r.nodes().end());
        ring.push_back(r.data_node());
        for (size_t i = 0; i + 1 < ring.size(); ++i) {
          out.insert({ring[i], ring[i + 1]});
          out.insert({ring[i + 1], ring[i]});
        }
      }
    }
    return out;
  };
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  const std::vector<std::string> by = cluster_->ProbedBy();
  const std::vector<uint64_t> after = cluster_->ProbedAfter();
  ASSERT_EQ(probes.size(), by.size());
  ASSERT_EQ(probes.size(), after.size());
  std::map<Link, uint64_t> probed;  // by the running slots: after which iteration, last
  for (size_t i = 25; i < probes.size(); ++i) {  // the start sent 25
    if (probes[i].bulk_max_bytes() == 0) continue;
    SCOPED_TRACE(probes[i].ShortDebugString());
    // The plan of iteration after[i] was the last one sent.
    const std::set<Link> carried = crossed(after[i]);
    for (const v1::Peer& peer : probes[i].peers()) {
      EXPECT_FALSE(carried.count({by[i], peer.worker_id()})) << by[i] << " -> " << peer.worker_id();
      // Sent before iteration after[i] + 1, answered during it, published
      // at the boundary after it: the last boundary is before iteration 29.
      if (after[i] + 1 < 29) probed[{by[i], peer.worker_id()}] = after[i];
    }
  }
  EXPECT_FALSE(probed.empty());
  // A link no iteration crossed after its last probe keeps what the probe
  // measured: no fit to old transfers overwrote it (what Links() shows was
  // published at the last boundary, before iteration 29).
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  int kept = 0;
  for (const v1::JobLink& l : links->links()) {
    auto p = probed.find({l.from(), l.to()});
    if (p == probed.end()) continue;
    bool crossed_since = false;
    for (uint64_t it = p->second; it < 29; ++it) crossed_since |= crossed(it).count(p->first) > 0;
    if (crossed_since) continue;
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE) << l.ShortDebugString();
    ++kept;
  }
  EXPECT_GT(kept, 0);
}

// A link's bandwidth is refitted from the job's transfers less their round
// trip: a transfer is timed until the peer's acknowledgement, which comes
// back over the reverse link. Two links whose transfers take the same time
// beyond their (very different) round trips are fitted the same rate.
TEST_F(JobRunnerTest, TransfersAreFittedLessTheirRoundTrip) {
  auto links = RunTransfersBeyondRoundTrips(0.4, 0.02, 0.05);
  const v1::JobLink& far = links[{"d0", "a"}];
  const v1::JobLink& near = links[{"a", "b"}];
  ASSERT_EQ(far.bandwidth_source(), v1::JobLink::SOURCE_TRAFFIC) << far.ShortDebugString();
  ASSERT_EQ(near.bandwidth_source(), v1::JobLink::SOURCE_TRAFFIC) << near.ShortDebugString();
  // Less one way only, d0 -> a read (0.01 + 0.05) / (0.2 + 0.05) = 0.24 of
  // a -> b.
  EXPECT_NEAR(far.bandwidth_bytes_per_s() / near.bandwidth_bytes_per_s(), 1.0, 1e-6);
}

// A transfer that took its round trip and next to nothing more was bound by
// the round trip: its bytes' time is within the round trip's jitter, and
// the link keeps the bandwidth its probes measured.
TEST_F(JobRunnerTest, ARoundTripBoundTransferLeavesTheLinksBandwidthAlone) {
  // 0.3 s + 10 ms: the bytes took 3 % of it.
  auto links = RunTransfersBeyondRoundTrips(0.3, 0.3, 0.01);
  for (const auto& link : {std::make_pair("d0", "a"), std::make_pair("a", "b")}) {
    const v1::JobLink& l = links[link];
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE) << l.ShortDebugString();
    EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s(), 5e7) << l.ShortDebugString();
  }
}

// A cut link is re-probed by the latency rounds while the job runs; once
// its reporter reaches the peer again in a round sent after the cut, the
// link is restored (history LINK_RESTORED) and the job goes on.
TEST_F(JobRunnerTest, ACutLinkThatAnswersItsProbeAgainIsRestored) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->link_probe_interval = absl::Milliseconds(1);
  v1::JobSpec spec = Spec(3, 2, 0.0, 6);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_RESTORED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("link a1 -> b1 answered its probe again"));
  // Bulk slots only every link_probe_bulk_interval (5 minutes): none while
  // this job ran. The start sent 5 latency requests and 5 x 4 in its slots.
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  ASSERT_GT(probes.size(), 25u);
  for (size_t i = 25; i < probes.size(); ++i) EXPECT_EQ(probes[i].bulk_max_bytes(), 0u) << i;
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  for (const v1::JobLink& l : links->links()) EXPECT_FALSE(l.cut()) << l.ShortDebugString();
}

}  // namespace
}  // namespace detour::testing
