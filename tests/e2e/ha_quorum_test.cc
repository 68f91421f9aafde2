// Two coordinators over a 3-member etcd cluster (the Debian binary on ports
// of the test's own; skipped without it) with real workers and a running
// job: one member killed changes nothing; the quorum killed makes the leader
// step down and the job pause, nothing is corrupted, and with the quorum back
// the other coordinator leads, re-attaches the workers and the job
// completes. detourctl given a name finds the leader.
#include <signal.h>

#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/e2e/ha_cluster.h"
#include "tests/e2e/micro_job.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class HaQuorumTest : public HaClusterTest {
 protected:
  HaQuorumTest() : HaClusterTest(/*etcd_members=*/3) {}

  // Two coordinators (the first leads) and three workers given both.
  void StartAll(int ttl_s = kTtlSeconds, int etcd_timeout_s = 2) {
    HaCluster h = StartHaCluster(3, ttl_s, etcd_timeout_s);
    c1_ = std::move(h.c1);
    c2_ = std::move(h.c2);
    workers_ = std::move(h.workers);
    ASSERT_GT(c1_.grpc_port, 0);
    ASSERT_GT(c2_.grpc_port, 0);
  }

  std::string SubmitJob(int iterations) {
    return Submit(c1_.grpc_port, ElasticJob(iterations)).id();
  }

  // The job's record as etcd holds it, parsed.
  absl::StatusOr<v1::Job> StoredJob(const std::string& id) {
    auto client = etcd_.Client(absl::Seconds(10));
    auto kv = client->Get(absl::StrCat("/detour/jobs/", id));
    if (!kv.ok()) return kv.status();
    if (!kv->has_value()) return absl::NotFoundError(absl::StrCat("no record of ", id));
    v1::Job job;
    auto parsed = google::protobuf::util::JsonStringToMessage((*kv)->value, &job);
    if (!parsed.ok()) return absl::DataLossError(std::string(parsed.message()));
    return job;
  }

  Daemon c1_, c2_;
  std::vector<Daemon> workers_;
};

// One member of three killed mid-job (the one every client asks first):
// the leader keeps its lease through the others, nobody takes over, and the
// job completes under the same leader, never re-attached or resumed.
TEST_F(HaQuorumTest, AKilledEtcdMemberChangesNothing) {
  // The default lease, and room for etcd's own election when the member
  // killed was its leader (on a loaded machine): a bound, not a measure.
  ASSERT_NO_FATAL_FAILURE(StartAll(/*ttl_s=*/5, /*etcd_timeout_s=*/4));
  constexpr int kIterations = 16;
  const std::string id = SubmitJob(kIterations);
  ASSERT_FALSE(id.empty());
  auto before = WaitForIteration(c1_.grpc_port, id, 2, absl::Seconds(90));
  ASSERT_TRUE(before.has_value()) << c1_.process->Log();
  ASSERT_FALSE(Ended(*before)) << "the job ended before the kill: " << before->message();

  etcd_.Kill(0);
  auto after =
      WaitForIteration(c1_.grpc_port, id, before->progress().iteration() + 3, absl::Seconds(60));
  ASSERT_TRUE(after.has_value()) << c1_.process->Log();
  const std::optional<v1::Job> job = WaitForEnd(c1_.grpc_port, id, absl::Seconds(90));
  ASSERT_TRUE(job.has_value() && Ended(*job)) << c1_.process->Log();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->message() << "\n" << c1_.process->Log();
  EXPECT_EQ(job->progress().iteration(), static_cast<uint64_t>(kIterations));
  EXPECT_EQ(job->resumes(), 0u);
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_REATTACHED), 0);
  EXPECT_THAT(c1_.process->Log(), Not(HasSubstr("lost the leadership")));
  EXPECT_THAT(c2_.process->Log(), Not(HasSubstr("leading in term")));
  auto stored = StoredJob(id);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::JOB_STATE_SUCCEEDED);
}

// Two members of three killed mid-job: the leader cannot renew its lease,
// stops sending (its gate closes), steps down and exits 3; the follower
// cannot be elected without a quorum, so no coordinator serves the job and
// the workers hold their stages. With the quorum back the follower leads,
// loads the record (intact), re-attaches the workers and the job completes
// from where it paused, never resumed from a checkpoint.
TEST_F(HaQuorumTest, QuorumLossPausesTheJobAndItCompletesWhenQuorumReturns) {
  ASSERT_NO_FATAL_FAILURE(StartAll());
  constexpr int kIterations = 24;
  const std::string id = SubmitJob(kIterations);
  ASSERT_FALSE(id.empty());
  auto before = WaitForIteration(c1_.grpc_port, id, 2, absl::Seconds(90));
  ASSERT_TRUE(before.has_value()) << c1_.process->Log();
  ASSERT_FALSE(Ended(*before)) << "the job ended before the quorum loss: " << before->message();

  const absl::Time lost = absl::Now();
  etcd_.Kill(1);
  etcd_.Kill(2);
  // The leader steps down once a keep-alive fails (--etcd_timeout), and
  // exits 3: its jobs in memory may be stale from now on.
  EXPECT_EQ(c1_.process->Wait(absl::Seconds(30)), 3) << c1_.process->Log();
  EXPECT_THAT(c1_.process->Log(), HasSubstr("lost the leadership"));
  std::cout << "quorum lost: the leader exited after " << absl::FormatDuration(absl::Now() - lost)
            << "\n";
  // Without a quorum nobody leads: the follower answers nothing about the
  // job (UNAVAILABLE).
  EXPECT_FALSE(TryGet(c2_.grpc_port, id).has_value());
  EXPECT_THAT(c2_.process->Log(), Not(HasSubstr("leading in term")));

  ASSERT_TRUE(etcd_.Restart(1).ok());
  ASSERT_TRUE(etcd_.Restart(2).ok());
  const absl::Time restored = absl::Now();
  // The old leader's lease runs out on the restored cluster; the follower
  // is elected and takes the job over.
  auto resumed = WaitForIteration(c2_.grpc_port, id, 0, absl::Seconds(60));
  ASSERT_TRUE(resumed.has_value()) << c2_.process->Log();
  std::cout << "quorum restored: the new leader served the job after "
            << absl::FormatDuration(absl::Now() - restored) << "\n";
  const std::optional<v1::Job> job = WaitForEnd(c2_.grpc_port, id, absl::Seconds(120));
  ASSERT_TRUE(job.has_value() && Ended(*job)) << c2_.process->Log();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->message() << "\n" << c2_.process->Log();
  EXPECT_EQ(job->progress().iteration(), static_cast<uint64_t>(kIterations));
  EXPECT_EQ(job->resumes(), 0u) << "a quorum loss must not resume the job from a checkpoint";
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_RESUMED), 0);
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_REATTACHED), 1);
  // Continued at or after the iteration seen before the loss.
  for (const auto& e : job->history()) {
    if (e.kind() == v1::JobHistoryEvent::KIND_REATTACHED) {
      EXPECT_GE(e.iteration(), before->progress().iteration()) << e.message();
    }
  }
  EXPECT_THAT(c2_.process->Log(), HasSubstr("leading in term"));
  auto stored = StoredJob(id);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(stored->progress().iteration(), static_cast<uint64_t>(kIterations));
}

// One name for the coordinators (here "localhost", as a DNS name with an A
// record per coordinator would be): detourctl given a name asks for the
// leader and follows the follower it reached to it, where an IP literal of
// a follower is refused (exit 3) as before.
TEST_F(HaQuorumTest, DetourctlGivenANameFindsTheLeader) {
  c1_ = StartHaCoordinator("c1", kTtlSeconds, /*etcd_timeout_s=*/2);
  c2_ = StartHaCoordinator("c2", kTtlSeconds, /*etcd_timeout_s=*/2);
  ASSERT_GT(c2_.grpc_port, 0);
  std::string out;
  EXPECT_EQ(Run({Bin(kCtl), absl::StrCat("--coordinator=127.0.0.1:", c2_.grpc_port), "list"}, &out),
            3)
      << out;
  EXPECT_THAT(out, HasSubstr("not the leader"));
  EXPECT_EQ(Run({Bin(kCtl), absl::StrCat("--coordinator=localhost:", c2_.grpc_port), "list"}, &out),
            0)
      << out;
}

}  // namespace
}  // namespace detour::testing
