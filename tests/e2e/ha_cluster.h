// Shared fixture for the end-to-end tests of coordinators electing a leader
// over real etcd (the Debian binary on ports of the test's own, one member
// or more; skipped without it), with real workers: coordinators campaigning
// with a short lease, two of them with workers given both addresses, the
// elastic job they run, and waits on the job as a coordinator answers.
#ifndef DETOUR_TESTS_E2E_HA_CLUSTER_H_
#define DETOUR_TESTS_E2E_HA_CLUSTER_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/coordinator/etcd_cluster.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"

namespace detour::testing {

class HaClusterTest : public E2eTest {
 protected:
  // `etcd_members`: the size of the test's etcd cluster.
  explicit HaClusterTest(int etcd_members = 1) : etcd_members_(etcd_members) {}

  void SetUp() override {
    E2eTest::SetUp();
    if (FindEtcdBinary().empty()) GTEST_SKIP() << kNoEtcd;
    const absl::Status started = etcd_.Start(etcd_members_);
    ASSERT_TRUE(started.ok()) << started;
  }

  // etcd://member,member,... of the test's etcd.
  std::string EtcdStore() const {
    return absl::StrCat("etcd://", absl::StrJoin(etcd_.endpoints(), ","));
  }

  // A coordinator on the test's etcd, campaigning with a lease of `ttl_s`
  // (the fixture's short one by default) and `etcd_timeout_s` per etcd call
  // (0: the coordinator's default).
  Daemon StartHaCoordinator(const std::string& name, int ttl_s = kTtlSeconds,
                            int etcd_timeout_s = 0) {
    std::vector<std::string> flags = {"--store=" + EtcdStore(),
                                      absl::StrCat("--leader_ttl=", ttl_s, "s")};
    if (etcd_timeout_s > 0) flags.push_back(absl::StrCat("--etcd_timeout=", etcd_timeout_s, "s"));
    return StartCoordinator(flags, name);
  }

  // Two coordinators on the test's etcd, c1 started (and campaigning)
  // first, and `workers` workers (w0, w1, ...) registered with c1 and given
  // both addresses, as a deployment lists every coordinator. No worker is
  // started when a coordinator did not start (its port is 0).
  struct HaCluster {
    Daemon c1;
    Daemon c2;
    std::vector<Daemon> workers;
  };
  HaCluster StartHaCluster(int workers, int ttl_s = kTtlSeconds, int etcd_timeout_s = 0) {
    HaCluster h;
    h.c1 = StartHaCoordinator("c1", ttl_s, etcd_timeout_s);
    h.c2 = StartHaCoordinator("c2", ttl_s, etcd_timeout_s);
    if (h.c1.grpc_port <= 0 || h.c2.grpc_port <= 0) return h;
    const std::string both =
        absl::StrCat("--coordinator=127.0.0.1:", h.c1.grpc_port, ",127.0.0.1:", h.c2.grpc_port);
    for (int i = 0; i < workers; ++i) {
      std::vector<std::string> flags = WorkerFlags();
      flags.push_back(both);
      h.workers.push_back(StartWorker(h.c1.grpc_port, absl::StrCat("w", i), flags));
    }
    return h;
  }

  // The job as coordinator `port` answers, or nullopt while it cannot
  // (killed, following, not yet leading).
  std::optional<v1::Job> TryGet(int port, const std::string& id) {
    auto stub = v1::JobService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    if (!stub->Get(&context, request, &job).ok()) return std::nullopt;
    return job;
  }

  // The micro job over three stages that a leader change must not disturb:
  // a short reconnection grace, and room to pause while no one leads.
  static v1::JobSpec ElasticJob(int iterations) {
    v1::JobSpec spec = MicroJob(3, 1, 1, 0.0, iterations);
    spec.mutable_elastic()->set_reconnect_grace_ms(500);
    spec.mutable_elastic()->set_pause_timeout_s(120);
    return spec;
  }

  // Waits (at most `timeout`) until coordinator `port` reports the job at
  // iteration `at_least` or ended; returns the job as last seen (nullopt if
  // it never answered).
  std::optional<v1::Job> WaitForIteration(int port, const std::string& id, uint64_t at_least,
                                          absl::Duration timeout) {
    return WaitForJob(
        port, id,
        [at_least](const v1::Job& j) { return j.progress().iteration() >= at_least || Ended(j); },
        timeout);
  }

  // Waits (at most `timeout`) until coordinator `port` reports the job
  // ended; returns it as last seen.
  std::optional<v1::Job> WaitForEnd(int port, const std::string& id, absl::Duration timeout) {
    return WaitForJob(port, id, Ended, timeout);
  }

  template <typename Done>
  std::optional<v1::Job> WaitForJob(int port, const std::string& id, Done done,
                                    absl::Duration timeout) {
    std::optional<v1::Job> seen;
    Eventually(
        [&] {
          auto j = TryGet(port, id);
          if (j.has_value()) seen = j;
          return j.has_value() && done(*j);
        },
        timeout);
    return seen;
  }

  static bool Ended(const v1::Job& j) {
    return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
           j.state() == v1::JOB_STATE_CANCELLED;
  }

  static constexpr int kTtlSeconds = 3;
  const int etcd_members_;
  EtcdCluster etcd_;
};

inline int Count(const v1::Job& job, v1::JobHistoryEvent::Kind kind) {
  int n = 0;
  for (const auto& e : job.history()) n += e.kind() == kind;
  return n;
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_HA_CLUSTER_H_
