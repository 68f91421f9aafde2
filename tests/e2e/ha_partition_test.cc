// Network partitions of the HA control plane (coordinators electing a leader
// over real etcd, the Debian binary on ports of the test's own; skipped
// without it), with real workers and a running job. A TCP relay the test
// owns (tests/e2e/tcp_relay.h) stands in for one network path and is cut
// mid-job, then restored:
// - the leader's path to etcd: the leader loses its lease, stops and exits
//   3, the other coordinator leads and the job goes on under it; restarted,
//   the old leader follows;
// - the workers' path to the leader: the leader keeps its lease, the workers
//   cannot reach it (the follower sends them back to it), and the job
//   pauses until the path is back, then completes.
#include <iostream>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/e2e/ha_cluster.h"
#include "tests/e2e/micro_job.h"
#include "tests/e2e/tcp_relay.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class HaPartitionTest : public HaClusterTest {
 protected:
  // A coordinator campaigning with the fixture's short lease and 2 s per
  // etcd call, on `store` (etcd://...), with `extra` flags.
  Daemon StartOn(const std::string& name, const std::string& store,
                 std::vector<std::string> extra = {}) {
    extra.push_back("--store=" + store);
    extra.push_back(absl::StrCat("--leader_ttl=", kTtlSeconds, "s"));
    extra.push_back("--etcd_timeout=2s");
    return StartCoordinator(extra, name);
  }

  // Three workers w0..w2 given `coordinators` (comma-separated).
  void StartWorkers(const std::string& coordinators) {
    for (int i = 0; i < 3; ++i) {
      std::vector<std::string> flags = WorkerFlags();
      flags.push_back("--coordinator=" + coordinators);
      workers_.push_back(StartWorker(0, absl::StrCat("w", i), flags));
    }
  }

  // A gauge's value on the metrics port, or -1 when it cannot be read.
  static double Gauge(int metrics_port, const std::string& name) {
    auto text = HttpGet(metrics_port, "/metrics");
    if (!text.ok()) return -1;
    std::smatch m;
    if (!std::regex_search(*text, m, std::regex("(^|\n)" + name + " ([0-9.e+-]+)"))) return -1;
    double value = -1;
    return absl::SimpleAtod(m[2].str(), &value) ? value : -1;
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

  static std::string Events(const v1::Job& job) {
    std::string out;
    for (const auto& e : job.history()) {
      absl::StrAppend(&out, "  ", v1::JobHistoryEvent::Kind_Name(e.kind()), " @", e.iteration(),
                      ": ", e.message(), "\n");
    }
    return out;
  }

  std::vector<Daemon> workers_;
};

// The leader's path to etcd cut mid-job (its workers still reach it): it
// cannot renew its lease, so its gate closes (not one more plan or step
// leaves it), it steps down and exits 3 without writing anything more; the
// other coordinator is elected in a newer term once the lease has run out,
// the workers (given both addresses) register with it and the job goes on
// from the iteration in flight to SUCCEEDED, never from a checkpoint. With
// the path restored the old leader, restarted as its supervisor would, only
// follows.
TEST_F(HaPartitionTest, ALeaderCutOffFromEtcdStepsDownAndTheOtherLeads) {
  TcpRelay to_etcd;
  ASSERT_TRUE(to_etcd.Listen().ok());
  int etcd_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(etcd_.endpoints()[0].substr(etcd_.endpoints()[0].rfind(':') + 1),
                               &etcd_port));
  to_etcd.Start(etcd_port);
  const std::string c1_store = "etcd://" + to_etcd.address();
  Daemon c1 = StartOn("c1", c1_store);
  Daemon c2 = StartOn("c2", EtcdStore());
  ASSERT_GT(c1.grpc_port, 0);
  ASSERT_GT(c2.grpc_port, 0);
  ASSERT_EQ(Gauge(c1.metrics_port, "detour_coordinator_is_leader"), 1) << c1.process->Log();
  const double term1 = Gauge(c1.metrics_port, "detour_coordinator_leader_term");
  ASSERT_GT(term1, 0);
  StartWorkers(absl::StrCat("127.0.0.1:", c1.grpc_port, ",127.0.0.1:", c2.grpc_port));
  constexpr int kIterations = 20;
  const std::string id = Submit(c1.grpc_port, ElasticJob(kIterations)).id();
  ASSERT_FALSE(id.empty());
  auto before = WaitForIteration(c1.grpc_port, id, 2, absl::Seconds(90));
  ASSERT_TRUE(before.has_value()) << c1.process->Log();
  ASSERT_FALSE(Ended(*before)) << "the job ended before the cut: " << before->message();

  const absl::Time cut = absl::Now();
  to_etcd.Cut();
  // No keep-alive gets through: the leader steps down and exits 3 after its
  // lease (plus at most two etcd calls' timeouts).
  EXPECT_EQ(c1.process->Wait(absl::Seconds(40)), 3) << c1.process->Log();
  EXPECT_THAT(c1.process->Log(), HasSubstr("lost the leadership"));
  std::cout << "cut off from etcd: the leader exited after "
            << absl::FormatDuration(absl::Now() - cut) << "\n";

  // The other coordinator leads in a newer term and serves the job.
  auto taken = WaitForIteration(c2.grpc_port, id, 0, absl::Seconds(60));
  ASSERT_TRUE(taken.has_value()) << c2.process->Log();
  const double term2 = Gauge(c2.metrics_port, "detour_coordinator_leader_term");
  EXPECT_GT(term2, term1);
  EXPECT_EQ(Gauge(c2.metrics_port, "detour_coordinator_is_leader"), 1);

  // Restored, the old leader comes back (restarted, as its supervisor
  // would) as a follower naming the new leader, and the job is not
  // disturbed.
  to_etcd.Restore();
  Daemon c1b = StartOn("c1b", c1_store);
  ASSERT_GT(c1b.grpc_port, 0);
  EXPECT_TRUE(Eventually(
      [&] {
        return absl::StrContains(c1b.process->Log(),
                                 absl::StrCat("the leader is 127.0.0.1:", c2.grpc_port));
      },
      absl::Seconds(30)))
      << c1b.process->Log();
  EXPECT_EQ(Gauge(c1b.metrics_port, "detour_coordinator_is_leader"), 0);
  EXPECT_FALSE(TryGet(c1b.grpc_port, id).has_value()) << "a follower must not serve the job";

  auto job = WaitForEnd(c2.grpc_port, id, absl::Seconds(120));
  ASSERT_TRUE(job.has_value() && Ended(*job)) << c2.process->Log();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->message() << "\n" << c2.process->Log();
  EXPECT_EQ(job->progress().iteration(), static_cast<uint64_t>(kIterations));
  EXPECT_EQ(job->resumes(), 0u) << "a leader change must not resume from a checkpoint";
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_RESUMED), 0);
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 0);
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_REATTACHED), 1) << Events(*job);
  // No iteration lost beyond the one in flight at the cut.
  for (const auto& e : job->history()) {
    if (e.kind() == v1::JobHistoryEvent::KIND_REATTACHED) {
      EXPECT_GE(e.iteration(), before->progress().iteration()) << e.message();
    }
  }
  // One leader at a time: the new leader never lost its lease, the
  // restarted one never led, and every worker registered in the new term.
  EXPECT_THAT(c2.process->Log(), Not(HasSubstr("lost the leadership")));
  EXPECT_THAT(c1b.process->Log(), Not(HasSubstr("leading in term")));
  EXPECT_EQ(Gauge(c1b.metrics_port, "detour_coordinator_is_leader"), 0);
  for (Daemon& w : workers_) {
    EXPECT_THAT(w.process->Log(), HasSubstr(absl::StrCat("leader term ", term2))) << w.id;
  }
  auto stored = StoredJob(id);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(stored->progress().iteration(), static_cast<uint64_t>(kIterations));
}

// The workers' path to the leader cut mid-job (the leader still reaches
// etcd, and so keeps its lease): nobody else may lead, so nobody takes over.
// The workers' sessions end; they try the follower, which sends them back
// to the leader's advertised address (the cut path) every time. The leader
// counts them lost after elastic.reconnect_grace_ms; with one replica per
// stage every stage loses its state, and the job pauses at the iteration in
// flight. Restored, the workers register with the leader again, are told to
// drop the stages they kept (the job went on without them), join the paused
// job as idle workers, and with the default elastic.on_stage_loss
// (ROLLBACK) the job starts again from its newest checkpoint and succeeds.
// One leader, one term throughout.
TEST_F(HaPartitionTest, WorkersCutOffFromTheLeaderPauseTheJobUntilRestored) {
  TcpRelay to_c1;
  ASSERT_TRUE(to_c1.Listen().ok());
  // c1 advertises the relay: the follower sends workers there.
  Daemon c1 = StartOn("c1", EtcdStore(), {"--advertise_address=" + to_c1.address()});
  ASSERT_GT(c1.grpc_port, 0);
  to_c1.Start(c1.grpc_port);
  Daemon c2 = StartOn("c2", EtcdStore());
  ASSERT_GT(c2.grpc_port, 0);
  ASSERT_EQ(Gauge(c1.metrics_port, "detour_coordinator_is_leader"), 1) << c1.process->Log();
  const double term = Gauge(c1.metrics_port, "detour_coordinator_leader_term");
  ASSERT_GT(term, 0);
  StartWorkers(absl::StrCat(to_c1.address(), ",127.0.0.1:", c2.grpc_port));
  constexpr int kIterations = 16;
  v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, kIterations);
  spec.mutable_elastic()->set_reconnect_grace_ms(500);
  spec.mutable_elastic()->set_pause_timeout_s(120);
  spec.mutable_checkpoint()->set_every_iterations(4);
  const std::string id = Submit(c1.grpc_port, spec).id();
  ASSERT_FALSE(id.empty());
  auto before = WaitForIteration(c1.grpc_port, id, 2, absl::Seconds(90));
  ASSERT_TRUE(before.has_value()) << c1.process->Log();
  ASSERT_FALSE(Ended(*before)) << "the job ended before the cut: " << before->message();

  to_c1.Cut();
  // The job pauses under the same leader, which answers for it throughout.
  std::optional<v1::Job> paused;
  ASSERT_TRUE(Eventually(
      [&] {
        paused = TryGet(c1.grpc_port, id);
        return paused.has_value() && Count(*paused, v1::JobHistoryEvent::KIND_PAUSED) > 0;
      },
      absl::Seconds(60)))
      << c1.process->Log();
  ASSERT_FALSE(Ended(*paused)) << paused->message() << "\n" << Events(*paused);
  // The follower sends every worker back to the leader it cannot reach.
  for (Daemon& w : workers_) {
    EXPECT_TRUE(Eventually(
        [&] {
          return absl::StrContains(
              w.process->Log(), "redirected the registration to the leader at " + to_c1.address());
        },
        absl::Seconds(30)))
        << w.process->Log();
  }
  EXPECT_EQ(Gauge(c1.metrics_port, "detour_coordinator_is_leader"), 1);
  EXPECT_EQ(Gauge(c2.metrics_port, "detour_coordinator_is_leader"), 0);
  auto still = TryGet(c1.grpc_port, id);
  ASSERT_TRUE(still.has_value());
  EXPECT_FALSE(Ended(*still)) << still->message();
  EXPECT_THAT(still->message(), HasSubstr("paused"));

  to_c1.Restore();
  auto job = WaitForEnd(c1.grpc_port, id, absl::Seconds(180));
  ASSERT_TRUE(job.has_value() && Ended(*job)) << c1.process->Log();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->message() << "\n"
                                                   << Events(*job) << c1.process->Log();
  EXPECT_EQ(job->progress().iteration(), static_cast<uint64_t>(kIterations));
  // The stages' states were given up with their workers: the job rolled
  // back once, to a checkpoint at or before the iteration of the cut.
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << Events(*job);
  EXPECT_EQ(Count(*job, v1::JobHistoryEvent::KIND_REATTACHED), 0) << Events(*job);
  EXPECT_EQ(job->resumes(), 0u);
  // One leader, one term: c1 never lost its lease, c2 never led, and no
  // worker saw another term.
  EXPECT_THAT(c1.process->Log(), Not(HasSubstr("lost the leadership")));
  EXPECT_THAT(c2.process->Log(), Not(HasSubstr("leading in term")));
  EXPECT_EQ(Gauge(c1.metrics_port, "detour_coordinator_leader_term"), term);
  for (Daemon& w : workers_) {
    EXPECT_THAT(w.process->Log(), Not(HasSubstr("dropped a message of leader term"))) << w.id;
  }
  auto stored = StoredJob(id);
  ASSERT_TRUE(stored.ok()) << stored.status();
  EXPECT_EQ(stored->state(), v1::JOB_STATE_SUCCEEDED);
}

}  // namespace
}  // namespace detour::testing
