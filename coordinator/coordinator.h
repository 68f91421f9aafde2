// The coordinator daemon as a library: gRPC server (JobService,
// ControlService, health, reflection), worker registry with loss detection,
// job store, and its Prometheus endpoint. main.cc only parses flags and waits
// for a signal; tests can run a Coordinator in-process.
#ifndef DETOUR_COORDINATOR_COORDINATOR_H_
#define DETOUR_COORDINATOR_COORDINATOR_H_

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
#include "coordinator/job_metrics.h"
#include "coordinator/job_service.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_store.h"
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
  // else one file per job under data_dir.
  EtcdOptions etcd;
  std::string store_prefix = "/detour/";
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
  // watch streams, wait for in-flight RPCs up to `deadline`, stop metrics.
  // Idempotent.
  void Drain(absl::Duration deadline);

  WorkerRegistry& registry() { return registry_; }
  JobStore& jobs() { return jobs_; }

 private:
  Coordinator(const CoordinatorOptions& options, std::unique_ptr<JobBackend> jobs);
  absl::Status Init();
  void ReaperLoop();
  void UpdateGauges();
  // detour_coordinator_worker_info / _worker_state for `workers` (reaper
  // thread only, and Init before it starts).
  void UpdateWorkerSeries(const std::vector<v1::WorkerInfo>& workers);

  const CoordinatorOptions options_;
  metrics::Registry metrics_registry_;
  WorkerRegistry registry_;
  JobStore jobs_;
  const ClientAuthorizer auth_;
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
