// Shared fixture for the end-to-end tests of coordinators electing a leader
// over real etcd (the Debian binary on ports of the test's own; skipped
// without it), with real workers: coordinators campaigning with a short
// lease, two of them with workers given both addresses, and the job as a
// coordinator answers.
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
  void SetUp() override {
    E2eTest::SetUp();
    if (FindEtcdBinary().empty()) GTEST_SKIP() << kNoEtcd;
    ASSERT_TRUE(etcd_.Start(1).ok());
  }

  // A coordinator on the test's etcd, campaigning with a short lease.
  Daemon StartHaCoordinator(const std::string& name) {
    return StartCoordinator({absl::StrCat("--store=etcd://", absl::StrJoin(etcd_.endpoints(), ",")),
                             absl::StrCat("--leader_ttl=", kTtlSeconds, "s")},
                            name);
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
  HaCluster StartHaCluster(int workers) {
    HaCluster h;
    h.c1 = StartHaCoordinator("c1");
    h.c2 = StartHaCoordinator("c2");
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

  static constexpr int kTtlSeconds = 3;
  EtcdCluster etcd_;
};

inline int Count(const v1::Job& job, v1::JobHistoryEvent::Kind kind) {
  int n = 0;
  for (const auto& e : job.history()) n += e.kind() == kind;
  return n;
}

inline bool Ended(const v1::Job& j) {
  return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
         j.state() == v1::JOB_STATE_CANCELLED;
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_HA_CLUSTER_H_
