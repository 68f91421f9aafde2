// Coordinators electing a leader over real etcd (the Debian binary on ports
// of the test's own; skipped without it), with real workers: the leader is
// killed mid-job and the follower takes the job over; the leader paused
// past its lease steps down and exits when it wakes; a follower redirects
// detourctl and workers to the leader.
#include <signal.h>

#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/ha_cluster.h"
#include "tests/e2e/micro_job.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;

class HaTest : public HaClusterTest {};

// kill -9 of the leader mid-job: the follower's campaign wins once the
// lease runs out, it loads the job from etcd, the workers (given both
// addresses) re-attach to it, and the job goes on from where it was to
// SUCCEEDED, never resumed from a checkpoint.
TEST_F(HaTest, LeaderKillKeepsTheJob) {
  HaCluster h = StartHaCluster(3);
  ASSERT_GT(h.c1.grpc_port, 0);
  ASSERT_GT(h.c2.grpc_port, 0);
  Daemon& c1 = h.c1;
  Daemon& c2 = h.c2;
  v1::JobSpec spec = ElasticJob(12);
  spec.mutable_checkpoint()->set_every_iterations(4);
  const std::string id = Submit(c1.grpc_port, spec).id();
  ASSERT_FALSE(id.empty());
  const std::optional<v1::Job> running = WaitForIteration(c1.grpc_port, id, 3, absl::Seconds(90));
  ASSERT_TRUE(running.has_value() && running->progress().iteration() >= 3) << c1.process->Log();
  const uint64_t before = running->progress().iteration();
  ASSERT_FALSE(Ended(*running)) << "the job ended before the kill: " << running->message();

  const absl::Time killed = absl::Now();
  c1.process->Signal(SIGKILL);
  c1.process->Wait(absl::Seconds(10));
  // The follower leads, and the job completes an iteration beyond the one
  // in flight at the kill.
  const std::optional<v1::Job> on_c2 =
      WaitForIteration(c2.grpc_port, id, before + 2, absl::Seconds(60));
  const uint64_t seen = on_c2.has_value() ? on_c2->progress().iteration() : 0;
  ASSERT_TRUE(on_c2.has_value() && (seen > before + 1 || Ended(*on_c2)))
      << "iteration " << seen << " after " << before << "\n"
      << c2.process->Log();
  const absl::Duration failover = absl::Now() - killed;
  std::cout << "failover (lease " << kTtlSeconds << " s): kill -9 of the leader at iteration "
            << before << " to iteration " << seen
            << " completed on the new leader: " << absl::FormatDuration(failover) << "\n";

  const std::optional<v1::Job> ended = WaitForEnd(c2.grpc_port, id, absl::Seconds(120));
  ASSERT_TRUE(ended.has_value() && Ended(*ended)) << c2.process->Log();
  const v1::Job& job = *ended;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << c2.process->Log();
  EXPECT_EQ(job.progress().iteration(), 12u);
  EXPECT_EQ(job.resumes(), 0u) << "the leader change must not resume from a checkpoint";
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_RESUMED), 0);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_REATTACHED), 1);
  EXPECT_THAT(c2.process->Log(), HasSubstr("leading in term"));
  // The workers followed: each names the new leader's term.
  for (Daemon& w : h.workers) {
    EXPECT_THAT(w.process->Log(), HasSubstr(absl::StrCat("127.0.0.1:", c2.grpc_port)));
  }
}

// The leader stops (SIGSTOP) past its lease: the follower takes over and
// the workers move to it. On SIGCONT the old leader finds its lease gone and
// exits 3 without sending anything more; the job succeeds under the new
// leader, never resumed from a checkpoint.
TEST_F(HaTest, PausedLeaderStepsDown) {
  HaCluster h = StartHaCluster(3);
  ASSERT_GT(h.c1.grpc_port, 0);
  ASSERT_GT(h.c2.grpc_port, 0);
  Daemon& c1 = h.c1;
  Daemon& c2 = h.c2;
  const std::string id = Submit(c1.grpc_port, ElasticJob(10)).id();
  const std::optional<v1::Job> running = WaitForIteration(c1.grpc_port, id, 2, absl::Seconds(90));
  ASSERT_TRUE(running.has_value() && (running->progress().iteration() >= 2 || Ended(*running)))
      << c1.process->Log();
  c1.process->Signal(SIGSTOP);
  // The follower leads once the paused leader's lease ran out.
  const bool took_over = Eventually(
      [&] {
        auto j = TryGet(c2.grpc_port, id);
        return j.has_value();
      },
      absl::Seconds(30));
  c1.process->Signal(SIGCONT);
  ASSERT_TRUE(took_over) << c2.process->Log();
  EXPECT_EQ(c1.process->Wait(absl::Seconds(20)), 3) << c1.process->Log();
  EXPECT_THAT(c1.process->Log(), HasSubstr("lost the leadership"));
  const std::optional<v1::Job> ended = WaitForEnd(c2.grpc_port, id, absl::Seconds(120));
  ASSERT_TRUE(ended.has_value() && Ended(*ended)) << c2.process->Log();
  const v1::Job& job = *ended;
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << c2.process->Log();
  EXPECT_EQ(job.resumes(), 0u);
  EXPECT_EQ(job.progress().iteration(), 10u);
}

// A follower refuses detourctl naming the leader; given both addresses
// (the follower first) detourctl finds the leader.
TEST_F(HaTest, FollowerRedirectsDetourctl) {
  HaCluster h = StartHaCluster(0);
  ASSERT_GT(h.c1.grpc_port, 0);
  ASSERT_GT(h.c2.grpc_port, 0);
  Daemon& c1 = h.c1;
  Daemon& c2 = h.c2;
  const std::string leader = absl::StrCat("127.0.0.1:", c1.grpc_port);
  const std::string follower = absl::StrCat("127.0.0.1:", c2.grpc_port);
  std::string out;
  EXPECT_EQ(Run({Bin(kCtl), "--coordinator=" + follower, "list"}, &out), 3) << out;
  EXPECT_THAT(out, HasSubstr("not the leader; the leader is at " + leader));
  EXPECT_EQ(Run({Bin(kCtl), absl::StrCat("--coordinator=", follower, ",", leader), "list"}, &out),
            0)
      << out;
  // A worker given only the follower is sent to the leader.
  std::vector<std::string> flags = WorkerFlags();
  Daemon w = StartWorker(c2.grpc_port, "w0", flags);
  EXPECT_THAT(w.process->Log(),
              HasSubstr("redirected the registration to the leader at " + leader));
  EXPECT_EQ(ListWorkers(c1.grpc_port, false).workers_size(), 1);
  // Metrics say who leads.
  auto follower_metrics = HttpGet(c2.metrics_port, "/metrics");
  ASSERT_TRUE(follower_metrics.ok()) << follower_metrics.status();
  EXPECT_THAT(*follower_metrics, HasSubstr("detour_coordinator_is_leader 0"));
  auto leader_metrics = HttpGet(c1.metrics_port, "/metrics");
  ASSERT_TRUE(leader_metrics.ok()) << leader_metrics.status();
  EXPECT_THAT(*leader_metrics, HasSubstr("detour_coordinator_is_leader 1"));
}

// The leader's workers are in etcd too: the follower elected after a kill -9
// lists them (lost, awaiting their reconnection) before they register with
// it, and once they do they are back under the same ids.
TEST_F(HaTest, ANewLeaderListsTheKilledLeadersWorkers) {
  HaCluster h = StartHaCluster(2);
  ASSERT_GT(h.c1.grpc_port, 0);
  ASSERT_GT(h.c2.grpc_port, 0);
  ASSERT_EQ(h.workers.size(), 2u);
  ASSERT_TRUE(Eventually([&] { return ListWorkers(h.c1.grpc_port, false).workers_size() == 2; },
                         absl::Seconds(30)));
  // Frozen workers cannot register with the new leader: what it lists comes
  // from etcd. They go on (SIGCONT) however the test ends.
  struct Thaw {
    std::vector<Daemon>* workers;
    ~Thaw() {
      for (Daemon& w : *workers) w.process->Signal(SIGCONT);
    }
  } thaw{&h.workers};
  for (Daemon& w : h.workers) w.process->Signal(SIGSTOP);
  h.c1.process->Signal(SIGKILL);
  h.c1.process->Wait(absl::Seconds(10));
  // ListWorkers on c2, or nullopt while it follows.
  auto list = [&](bool include_lost) -> std::optional<v1::ListWorkersResponse> {
    auto stub = v1::ControlService::NewStub(Channel(h.c2.grpc_port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListWorkersRequest request;
    request.set_include_lost(include_lost);
    v1::ListWorkersResponse response;
    if (!stub->ListWorkers(&context, request, &response).ok()) return std::nullopt;
    return response;
  };
  std::optional<v1::ListWorkersResponse> awaiting;
  ASSERT_TRUE(Eventually([&] { return (awaiting = list(true)).has_value(); }, absl::Seconds(60)))
      << h.c2.process->Log();
  ASSERT_EQ(awaiting->workers_size(), 2) << h.c2.process->Log();
  for (const v1::WorkerInfo& w : awaiting->workers()) {
    EXPECT_EQ(w.state(), v1::WORKER_STATE_LOST) << w.worker_id();
    EXPECT_FALSE(w.session_open()) << w.worker_id();
  }
  EXPECT_EQ(awaiting->workers(0).worker_id(), "w0");
  EXPECT_EQ(awaiting->workers(1).worker_id(), "w1");
  EXPECT_THAT(h.c2.process->Log(), HasSubstr("await their workers"));

  for (Daemon& w : h.workers) w.process->Signal(SIGCONT);
  ASSERT_TRUE(Eventually(
      [&] {
        auto back = list(false);
        if (!back.has_value() || back->workers_size() != 2) return false;
        for (const v1::WorkerInfo& w : back->workers()) {
          if (w.state() != v1::WORKER_STATE_IDLE) return false;
        }
        return back->workers(0).worker_id() == "w0" && back->workers(1).worker_id() == "w1";
      },
      absl::Seconds(60)))
      << h.c2.process->Log();
}

}  // namespace
}  // namespace detour::testing
