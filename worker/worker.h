// The worker daemon as a library: its gRPC server (ActivationService, health,
// reflection), its control-plane client, the job runtime that executes the
// coordinator's plans, and its Prometheus endpoint. main.cc parses flags and waits for a
// signal; tests can run a Worker in-process.
#ifndef DETOUR_WORKER_WORKER_H_
#define DETOUR_WORKER_WORKER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/http_server.h"
#include "common/metrics/metrics.h"
#include "common/net/address.h"
#include "common/net/server.h"
#include "worker/control_client.h"
#include "worker/runtime/job_runtime.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/direct_server.h"

namespace detour {

struct WorkerOptions {
  HostPort listen{"127.0.0.1", 7071};
  // Address peers and the coordinator use to reach this worker; empty =
  // derived from --listen (the host name when listening on all interfaces).
  std::string advertise_address;
  std::string coordinator = "127.0.0.1:7070";
  std::string worker_id;
  std::string region = "local";
  double speed = 1.0;
  int memory_slots = 3;
  std::string device = "cpu";
  std::string metrics_bind = "127.0.0.1";
  // host:port the coordinator's service discovery lists for this worker's
  // metrics; empty = metrics_bind (for a wildcard bind the advertised host)
  // and the bound metrics port.
  std::string metrics_advertise;
  // TLS for the gRPC port, the coordinator and peers (the certificate's name
  // is the worker id), or plaintext.
  TransportSecurity security;
  int metrics_port = 9471;  // 0 = pick a free port; -1 = none
  // The direct tensor transport's port (on the --listen host): 0 = pick a
  // free one; -1 = none (peers send over the gRPC port).
  int data_port = -1;
  // host:port peers use for it; empty = the advertised host and data_port.
  std::string data_advertise;
  std::string data_dir = "detour-data/worker";
  absl::Duration connect_timeout = absl::ZeroDuration();
  // Peer transfers (JobRuntimeOptions::peer_ack_timeout, peer_connect_timeout).
  absl::Duration peer_ack_timeout = absl::Seconds(60);
  absl::Duration peer_connect_timeout = absl::Seconds(10);
  // LibTorch intra-op threads; 0 = LibTorch's default (all cores).
  int torch_threads = 0;
  // Testing aid: compute tasks take this many times longer
  // (JobRuntimeOptions::compute_slowdown); 1 = off.
  double compute_slowdown = 1.0;
  // Testing aid: --inject_fault (JobRuntimeOptions::fault).
  JobRuntimeOptions::FaultInjection fault;
};

// Thread-safe. Start() returns once registered with the coordinator.
class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Start(const WorkerOptions& options);
  // Start() in two steps, so that a daemon still retrying an unreachable
  // coordinator can be stopped: Create() starts the gRPC and metrics servers;
  // Register() blocks until registered, refused, past --connect_timeout, or
  // ended (CANCELLED) by Drain() from another thread.
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const WorkerOptions& options);
  absl::Status Register();
  ~Worker();

  int grpc_port() const { return server_.port; }
  int metrics_port() const { return metrics_ ? metrics_->port() : -1; }
  int data_port() const { return direct_ ? direct_->port() : -1; }
  std::string worker_id() const { return control_ ? control_->worker_id() : ""; }

  // Graceful stop: health NOT_SERVING, close the session, wait for in-flight
  // RPCs up to `deadline`, stop metrics. Idempotent.
  void Drain(absl::Duration deadline);

 private:
  explicit Worker(const WorkerOptions& options) : options_(options) {}
  absl::Status Init();

  const WorkerOptions options_;
  metrics::Registry metrics_registry_;
  RunningServer server_;
  std::unique_ptr<metrics::MetricsHttpServer> metrics_;
  std::unique_ptr<JobRuntime> runtime_;
  std::unique_ptr<ActivationServer> activations_;
  std::unique_ptr<DirectServer> direct_;
  std::unique_ptr<ControlClient> control_;
  metrics::Counter* heartbeats_sent_ = nullptr;
  metrics::Counter* registrations_ = nullptr;
  metrics::Gauge* connected_ = nullptr;
  absl::Mutex drain_mu_;
  bool drained_ ABSL_GUARDED_BY(drain_mu_) = false;
};

}  // namespace detour

#endif  // DETOUR_WORKER_WORKER_H_
