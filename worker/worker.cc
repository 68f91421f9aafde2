#include "worker/worker.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/metrics/grpc_metrics.h"
#include "common/metrics/process_metrics.h"
#include "common/status.h"
#include "common/version.h"

namespace detour {
namespace {

std::string AdvertiseAddress(const WorkerOptions& options, int port) {
  if (!options.advertise_address.empty()) return options.advertise_address;
  HostPort address = options.listen;
  address.port = port;
  if (address.host == "0.0.0.0" || address.host == "::") {
    char name[256] = {0};
    address.host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
  }
  return address.ToString();
}

// Where Prometheus reaches /metrics: the bind address, or for a wildcard
// bind the host peers use for the gRPC port (the advertised address).
std::string MetricsAdvertiseAddress(const WorkerOptions& options, const std::string& advertised,
                                    int metrics_port) {
  if (!options.metrics_advertise.empty()) return options.metrics_advertise;
  HostPort address{options.metrics_bind, metrics_port};
  if (address.host == "0.0.0.0" || address.host == "::") {
    auto parsed = ParseHostPort(advertised, "address", /*allow_port_zero=*/false);
    address.host = parsed.ok() ? parsed->host : "localhost";
  }
  return address.ToString();
}

// Where peers reach the direct transport: --data_advertise, or the host of
// the advertised gRPC address and the bound data port.
std::string DataAdvertiseAddress(const WorkerOptions& options, const std::string& advertised,
                                 int data_port) {
  if (!options.data_advertise.empty()) return options.data_advertise;
  auto parsed = ParseHostPort(advertised, "address", /*allow_port_zero=*/false);
  return HostPort{parsed.ok() ? parsed->host : "localhost", data_port}.ToString();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Start(const WorkerOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<Worker> worker, Create(options));
  RETURN_IF_ERROR(worker->Register());
  return worker;
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options) {
  std::unique_ptr<Worker> worker(new Worker(options));
  RETURN_IF_ERROR(worker->Init());
  return worker;
}

absl::Status Worker::Register() {
  absl::Status registered = control_->Start();
  if (!registered.ok()) Drain(absl::ZeroDuration());
  return registered;
}

Worker::~Worker() { Drain(absl::Seconds(1)); }

absl::Status Worker::Init() {
  metrics::Registry& m = metrics_registry_;
  RETURN_IF_ERROR(metrics::RegisterProcessMetrics(m));
  RETURN_IF_ERROR(metrics::RegisterBuildInfo(m, "worker", kVersion, kGitRevision));
  ASSIGN_OR_RETURN(auto* sent, m.AddCounter("detour_worker_heartbeats_sent",
                                            "Heartbeats sent to the coordinator."));
  ASSIGN_OR_RETURN(heartbeats_sent_, sent->WithLabels({}));
  ASSIGN_OR_RETURN(auto* registrations,
                   m.AddCounter("detour_worker_registrations",
                                "Successful registrations with the coordinator."));
  ASSIGN_OR_RETURN(registrations_, registrations->WithLabels({}));
  ASSIGN_OR_RETURN(auto* connected,
                   m.AddGauge("detour_worker_coordinator_connected",
                              "1 while a Session stream with the coordinator is open."));
  ASSIGN_OR_RETURN(connected_, connected->WithLabels({}));

  JobRuntimeOptions runtime_options;
  runtime_options.region = options_.region;
  runtime_options.data_dir = options_.data_dir;
  runtime_options.device = options_.device;
  runtime_options.torch_threads = options_.torch_threads;
  runtime_options.compute_slowdown = options_.compute_slowdown;
  runtime_options.fault = options_.fault;
  runtime_options.memory_slots = options_.memory_slots;
  runtime_options.metrics = &metrics_registry_;
  runtime_options.security = options_.security;
  runtime_options.peer_ack_timeout = options_.peer_ack_timeout;
  runtime_options.peer_connect_timeout = options_.peer_connect_timeout;
  // direct_ is set below, before the session that brings jobs opens; the
  // runtime is stopped before it shuts down (Drain).
  runtime_options.peers_changed = [this](const std::vector<std::string>& addresses) {
    if (direct_) direct_->SetKnownPeers(addresses);
    if (server_.relay) server_.relay->SetKnownPeers(addresses);
  };
  runtime_ = std::make_unique<JobRuntime>(
      runtime_options,
      [this](v1::WorkerMessage message) {
        return control_ ? control_->Send(std::move(message))
                        : absl::UnavailableError("not registered");
      },
      [this](const std::string& job) {
        if (control_) control_->SetCurrentJob(job);
      });
  ActivationServerOptions activation_options;
  activation_options.metrics = &metrics_registry_;
  activation_options.require_peer_certificates = options_.security.tls();
  activation_options.allow_unmarked_worker_certs = options_.security.allow_unmarked_worker_certs();
  activations_ = std::make_unique<ActivationServer>(runtime_.get(), activation_options);

  GrpcServerOptions server_options;
  server_options.listen = options_.listen;
  server_options.security = options_.security;
  server_options.generic_service = activations_.get();
  // Peers' streams buffer at most this much inside gRPC over all
  // connections; the ActivationServer bounds the tensors it reassembles
  // (4 GiB) on top.
  server_options.memory_quota_bytes = size_t{4} << 30;
  server_options.relay.what = "worker gRPC";
  server_options.relay.metrics = &metrics_registry_;
  server_options.relay.metric_prefix = "detour_worker_grpc";
  ASSIGN_OR_RETURN(auto interceptor, metrics::ServerMetricsInterceptorFactory::Create(&m));
  server_options.interceptors.push_back(std::move(interceptor));
  ASSIGN_OR_RETURN(server_, StartGrpcServer(std::move(server_options), "--listen"));

  if (options_.data_port >= 0) {
    DirectServerOptions direct;
    direct.listen = HostPort{options_.listen.host, options_.data_port};
    direct.security = options_.security;
    direct.metrics = &metrics_registry_;
    auto started = DirectServer::Start(activations_.get(), direct);
    if (!started.ok()) {
      server_.server->Shutdown(absl::ToChronoTime(absl::Now()));
      return Annotate(started.status(), "--data_port");
    }
    direct_ = *std::move(started);
  }

  if (options_.metrics_port >= 0) {
    metrics_ = std::make_unique<metrics::MetricsHttpServer>(&metrics_registry_);
    absl::Status started = metrics_->Start(options_.metrics_bind, options_.metrics_port);
    if (!started.ok()) {
      server_.server->Shutdown(absl::ToChronoTime(absl::Now()));
      if (direct_) direct_->Shutdown();
      return Annotate(started, "--metrics_port");
    }
  }

  ControlClient::Options control;
  control.coordinator = options_.coordinator;
  control.security = options_.security;
  control.connect_timeout = options_.connect_timeout;
  v1::RegisterRequest& r = control.registration;
  r.set_worker_id(options_.worker_id);
  r.set_region(options_.region);
  r.set_speed(options_.speed);
  r.set_memory_slots(options_.memory_slots);
  r.set_address(AdvertiseAddress(options_, server_.port));
  if (direct_ != nullptr) {
    r.set_data_address(DataAdvertiseAddress(options_, r.address(), direct_->port()));
  }
  if (metrics_ != nullptr) {
    r.set_metrics_address(MetricsAdvertiseAddress(options_, r.address(), metrics_->port()));
  }
  r.set_device(options_.device);
  r.set_version(kVersion);
  ControlClient::Hooks hooks;
  hooks.on_heartbeat_sent = [this] {
    heartbeats_sent_->Increment();
    runtime_->Tick(absl::Now());
  };
  hooks.on_registered = [this](const std::string& id) {
    registrations_->Increment();
    runtime_->OnRegistered(id);
    SetLogComponent(absl::StrCat("worker ", id));
  };
  hooks.on_connection_change = [this](bool up) {
    connected_->Set(up ? 1 : 0);
    // A session that (re)opens while a job is held: the coordinator learns
    // what this worker holds and gets this iteration's messages again.
    if (up) runtime_->OnSessionOpened();
  };
  hooks.on_message = [this](const v1::CoordinatorMessage& message) {
    runtime_->OnCoordinatorMessage(message);
  };
  control_ = std::make_unique<ControlClient>(std::move(control), std::move(hooks));
  return absl::OkStatus();
}

void Worker::Drain(absl::Duration deadline) {
  absl::MutexLock lock(&drain_mu_);
  if (drained_) return;
  drained_ = true;
  if (server_.server) SetServing(server_.server.get(), false);
  if (control_) control_->Stop();
  if (runtime_) runtime_->Stop();
  if (direct_) direct_->Shutdown();
  if (server_.server) {
    server_.server->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_.server->Wait();
  }
  if (metrics_) metrics_->Stop();
}

}  // namespace detour
