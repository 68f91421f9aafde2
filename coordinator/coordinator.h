// The coordinator daemon as a library: gRPC server (JobService,
// ControlService, health, reflection), worker registry with loss detection,
// job store, and its Prometheus endpoint. main.cc only parses flags and waits
// for a signal; tests can run a Coordinator in-process.
#ifndef DETOUR_COORDINATOR_COORDINATOR_H_
#define DETOUR_COORDINATOR_COORDINATOR_H_

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/metrics/http_server.h"
#include "common/metrics/metrics.h"
#include "common/net/address.h"
#include "common/net/server.h"
#include "coordinator/client_auth.h"
#include "coordinator/control_service.h"
#include "coordinator/etcd/etcd_client.h"
#include "coordinator/etcd/leader_election.h"
#include "coordinator/job_metrics.h"
#include "coordinator/job_service.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_store.h"
#include "coordinator/leader_gate.h"
#include "coordinator/metered_job_backend.h"
#include "coordinator/worker_directory.h"
#include "coordinator/worker_registry.h"

namespace detour {

struct CoordinatorOptions {
  HostPort listen{"127.0.0.1", 7070};
  // TLS for the gRPC port (workers then need certificates naming their ids),
  // or plaintext.
  TransportSecurity security;
  // Client credentials from --auth_tokens; none = every client certificate
  // from the CA may submit (TLS), or no client authentication (plaintext).
  std::optional<std::vector<TokenEntry>> tokens;
  std::string metrics_bind = "127.0.0.1";
  // 0 = pick a free port; -1 = no metrics endpoint.
  int metrics_port = 9470;
  // host:port Prometheus scrapes this coordinator at, listed first by
  // service discovery; empty = metrics_bind (the host name for a wildcard
  // bind) and the bound metrics port.
  std::string metrics_advertise;
  // How long ended jobs keep their per-job series, and how many.
  JobMetrics::Options job_metrics;
  std::string data_dir = "detour-data/coordinator";
  // Job records in etcd when `etcd.endpoints` is set, under `store_prefix`;
  // else one file per job under data_dir. With etcd, the leader also keeps
  // its workers' records there (EtcdWorkerDirectory, on a lease of
  // worker_silence, at least 3 x leader_ttl) for the next leader.
  EtcdOptions etcd;
  std::string store_prefix = "/detour/";
  // With etcd, coordinators elect a leader under <store_prefix>leader: only
  // the leader loads and drives jobs and registers workers; followers
  // refuse those calls naming the leader and keep campaigning. What
  // followers tell clients and workers about this one when it leads
  // (host:port; "" = --listen's host, the host name for a wildcard, and the
  // bound port), and the lease's time to live.
  std::string advertise_address;
  absl::Duration leader_ttl = absl::Seconds(5);
  // Called once, on the election's thread, when this coordinator loses its
  // lease after leading; the gate is already closed (nothing more goes to
  // workers). Must not block on the coordinator. Unset: log only (the
  // coordinator stays closed; tests).
  std::function<void(const absl::Status& why)> on_leadership_lost;
  absl::Duration worker_silence = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  // Planning network, emulation, timeouts for jobs.
  JobManagerOptions jobs;
};

// Thread-safe. Start() returns a running coordinator; Drain() stops it.
class Coordinator {
 public:
  static absl::StatusOr<std::unique_ptr<Coordinator>> Start(const CoordinatorOptions& options);
  ~Coordinator();

  int grpc_port() const { return grpc_port_; }
  int metrics_port() const { return metrics_ ? metrics_->port() : -1; }
  // Where service discovery says this coordinator's metrics are; "" without
  // a metrics endpoint.
  std::string metrics_target() const;

  // Graceful stop: health NOT_SERVING, refuse new work, end sessions and
  // watch streams, wait for in-flight RPCs up to `deadline`, resign the
  // leadership (over etcd: a follower takes over at once), stop metrics.
  // Idempotent.
  void Drain(absl::Duration deadline);

  // Whether this coordinator serves jobs and workers now (always without an
  // election), and its term (0 without an election or while following).
  bool leading() const { return gate_.IsOpen(); }
  int64_t leader_term() const { return std::max<int64_t>(0, gate_.OpenTerm()); }

  WorkerRegistry& registry() { return registry_; }
  JobStore& jobs() { return jobs_; }

 private:
  Coordinator(const CoordinatorOptions& options, std::unique_ptr<JobBackend> jobs);
  absl::Status Init();
  // The election's part of Init: one campaign at once, then a thread that
  // keeps campaigning while following.
  absl::Status StartElection();
  void CampaignLoop();
  // Elected: loads the jobs, re-attaches to their workers, opens the gate.
  absl::Status TakeOver(int64_t term);
  void ReaperLoop();
  void UpdateGauges();
  // detour_coordinator_worker_info / _worker_state for `workers` (reaper
  // thread only, and Init before it starts).
  void UpdateWorkerSeries(const std::vector<v1::WorkerInfo>& workers);

  const CoordinatorOptions options_;
  metrics::Registry metrics_registry_;
  WorkerRegistry registry_;
  // Owned by jobs_: the backend, timed and counted.
  MeteredJobBackend* const store_;
  JobStore jobs_;
  const ClientAuthorizer auth_;
  // With etcd: the election's own client (keep-alives do not queue behind
  // loads) and the election; the gate consults it.
  std::unique_ptr<EtcdClient> election_client_;
  std::unique_ptr<LeaderElection> election_;
  // The registry's copy for the next leader: etcd, or nowhere.
  std::unique_ptr<WorkerDirectory> directory_;
  LeaderGate gate_;
  std::thread campaigner_;
  absl::Notification stop_campaign_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<ControlServiceImpl> control_service_;
  std::unique_ptr<JobManager> manager_;
  RunningServer server_;
  int grpc_port_ = 0;
  std::unique_ptr<metrics::MetricsHttpServer> metrics_;

  // Metric handles, owned by metrics_registry_.
  metrics::GaugeFamily* workers_gauge_ = nullptr;
  metrics::GaugeFamily* jobs_gauge_ = nullptr;
  metrics::Counter* heartbeats_ = nullptr;
  metrics::Counter* registrations_ = nullptr;
  metrics::Counter* workers_lost_ = nullptr;
  metrics::Gauge* sessions_ = nullptr;
  metrics::Gauge* is_leader_ = nullptr;
  metrics::Gauge* leader_term_ = nullptr;
  metrics::GaugeFamily* worker_info_ = nullptr;
  metrics::GaugeFamily* worker_state_ = nullptr;
  // Worker id -> its info series' label values (UpdateWorkerSeries only).
  std::map<std::string, std::vector<std::string>> worker_info_labels_;
  std::unique_ptr<JobMetrics> job_metrics_;
  uint64_t job_listener_ = 0;

  absl::Notification stop_reaper_;
  std::thread reaper_;
  absl::Mutex drain_mu_;
  bool drained_ ABSL_GUARDED_BY(drain_mu_) = false;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_COORDINATOR_H_
