// detour-worker: the data-plane daemon. See docs/OPERATIONS.md.
#include <unistd.h>

#include <csignal>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "common/net/daemon_flags.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/net/address.h"
#include "common/net/grpc_lifetime.h"
#include "common/net/leader_redirect.h"
#include "common/net/shutdown_signal.h"
#include "common/net/tls.h"
#include "common/status.h"
#include "common/version.h"
#include "worker/model/device.h"
#include "worker/worker.h"

namespace detour {
namespace {

// --metrics_port defaults to the gRPC port plus this (7071 -> 9471).
constexpr int kMetricsPortOffset = 2400;
// --data_port defaults to the gRPC port plus this (7071 -> 8271).
constexpr int kDataPortOffset = 1200;

// The flags that reach WorkerOptions only after a check or a conversion; the
// rest bind to WorkerOptions' fields directly.
struct WorkerFlagValues {
  explicit WorkerFlagValues(const WorkerOptions& defaults)
      : memory_slots(defaults.memory_slots), torch_threads(defaults.torch_threads) {
    common.metrics_port = defaults.metrics_port;
    common.metrics_port_note =
        "; default: the --listen port + 2400 (7071 -> 9471, 7072 -> 9472), so workers on one "
        "host differ; a free one when --listen's port is 0";
  }

  std::string listen = "127.0.0.1:7071";
  int64_t memory_slots;
  int64_t torch_threads;
  int64_t port_offset = 0;
  std::string data_port;
  std::string inject_fault;
  DaemonFlags common;
  TlsFiles tls;
};

// Declares every flag, in the order --help lists them.
void RegisterWorkerFlags(FlagSet* flags, WorkerOptions* o, WorkerFlagValues* v) {
  flags->String("listen", &v->listen, "host:port for gRPC (port 0 picks a free one)");
  flags->String("advertise_address", &o->advertise_address,
                "host:port peers use to reach this worker (default: from --listen)");
  flags->String("data_port", &v->data_port,
                "port of the direct tensor transport (peers send activations and gradients "
                "there, TLS like --listen); default: the --listen port + 1200 (7071 -> 8271), a "
                "free one when --listen's port is 0; \"off\" = tensors only over the gRPC port");
  flags->String("data_advertise", &o->data_advertise,
                "host:port peers use for the direct transport (default: the host of "
                "--advertise_address and the data port)");
  flags->String("coordinator", &o->coordinator,
                "host:port of the coordinator, or several comma-separated (coordinators "
                "electing a leader over etcd: the worker registers with the leader, following "
                "followers' redirections, and moves to a new one after a failover)");
  flags->String("worker_id", &o->worker_id,
                "stable worker id (with TLS: its certificate's CN, the default; without: "
                "assigned by the coordinator when not given)");
  flags->String("region", &o->region, "region name, as in cluster specs (e.g. Oregon)");
  flags->Double("speed", &o->speed, "relative compute speed of this node");
  flags->Int("memory_slots", &v->memory_slots, "microbatches this node can hold in flight");
  flags->String("device", &o->device, "cpu or cuda");
  flags->Int("torch_threads", &v->torch_threads,
             "LibTorch intra-op threads (0 = all cores; use 1 when many workers share a machine)");
  flags->Double("compute_slowdown", &o->compute_slowdown,
                "testing and emulation aid (like the coordinator's --emulate_network): every "
                "compute task takes this many times its measured time (the worker sleeps the "
                "difference), to emulate a slow node; 1 = off, at most 100");
  flags->String("inject_fault", &v->inject_fault,
                "testing aid, KIND@N: at iteration N (from 0) misbehave in a way the "
                "coordinator must catch — diverge (nudge a parameter after the step, so this "
                "replica differs from its peers), duplicate_microbatch or missing_microbatch (a "
                "data node reports its first microbatch twice / leaves its last out): the job "
                "fails naming it; nan_activations (the forward activations sent from then on "
                "hold NaN): the worker is excluded and the job goes on; frame_flood (with each "
                "forward activation from iteration N on, copies labelled as the next "
                "iteration's, every microbatch in each of the next 4 epochs): the receivers' "
                "quotas take it and the job goes on; broken_transfer (its first all-reduce "
                "tensor of iteration N is reported failed, as a connection reset would, though "
                "it arrived): the coordinator probes the link, finds it answering and nobody "
                "leaves; default none");
  flags->String("metrics_bind", &o->metrics_bind,
                "address for the /metrics HTTP endpoint (0.0.0.0 for every interface)");
  flags->String("metrics_advertise", &o->metrics_advertise,
                "host:port Prometheus scrapes this worker's metrics at, as the coordinator's "
                "service discovery lists it (default: --metrics_bind, or for 0.0.0.0 the host "
                "of --advertise_address, and the metrics port)");
  RegisterTlsFlags(flags, &v->tls);
  RegisterWorkerIdentityFlags(flags, &v->tls);
  flags->String("data_dir", &o->data_dir, "directory for checkpoints (created if missing)");
  flags->Int("port_offset", &v->port_offset,
             "added to the --listen port (and so to the default --metrics_port): the systemd "
             "template detour-worker@N passes its GPU index N, so workers on one host differ");
  flags->Duration("connect_timeout", &o->connect_timeout,
                  "give up when the coordinator stays unreachable this long at start-up "
                  "(0 = retry forever)");
  flags->Duration("peer_ack_timeout", &o->peer_ack_timeout,
                  "a tensor a peer has not acknowledged within this time fails and the peer is "
                  "reported unreachable; raise it for long, lossy links (1s to 1h)");
  flags->Duration("peer_connect_timeout", &o->peer_connect_timeout,
                  "opening a connection to a peer, TLS handshake included, gives up after this "
                  "(1s to 10m)");
  v->common.Register(flags,
                     "{\"grpc_port\", \"metrics_port\", \"data_port\", \"worker_id\", \"pid\"}");
  flags->SetEpilog(
      "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 when the worker cannot\n"
      "start (port in use, coordinator refused or unreachable past --connect_timeout),\n"
      "2 for bad flags.");
}

// --listen shifted by --port_offset, and the other addresses checked for form.
absl::Status ApplyAddresses(const WorkerFlagValues& v, WorkerOptions* o) {
  ASSIGN_OR_RETURN(o->listen, ParseHostPort(v.listen, "--listen", /*allow_port_zero=*/true));
  RETURN_IF_ERROR(CheckFlagRange("port_offset", v.port_offset, 0, 1024));
  if (o->listen.port != 0 && o->listen.port + v.port_offset > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port_offset: ", v.port_offset,
                                                   " takes --listen's port ", o->listen.port,
                                                   " past 65535"));
  }
  if (o->listen.port != 0) o->listen.port += static_cast<int>(v.port_offset);
  RETURN_IF_ERROR(ParseCoordinatorList(o->coordinator, "--coordinator").status());
  if (!o->advertise_address.empty()) {
    RETURN_IF_ERROR(ParseHostPort(o->advertise_address, "--advertise_address", false).status());
  }
  if (!o->metrics_advertise.empty()) {
    RETURN_IF_ERROR(ParseHostPort(o->metrics_advertise, "--metrics_advertise", false).status());
  }
  return absl::OkStatus();
}

// --inject_fault's KIND@ITERATION.
absl::Status ParseFaultInjection(const std::string& text,
                                 JobRuntimeOptions::FaultInjection* fault) {
  using Kind = JobRuntimeOptions::FaultInjection::Kind;
  const std::vector<std::string> parts = absl::StrSplit(text, '@');
  const std::map<std::string, Kind> kinds = {{"diverge", Kind::kDiverge},
                                             {"duplicate_microbatch", Kind::kDuplicateMicrobatch},
                                             {"missing_microbatch", Kind::kMissingMicrobatch},
                                             {"nan_activations", Kind::kNanActivations},
                                             {"frame_flood", Kind::kFrameFlood},
                                             {"broken_transfer", Kind::kBrokenTransfer}};
  uint64_t iteration = 0;
  if (parts.size() != 2 || !kinds.count(parts[0]) || !absl::SimpleAtoi(parts[1], &iteration)) {
    return absl::InvalidArgumentError(absl::StrCat("--inject_fault: \"", text,
                                                   "\" is not KIND@ITERATION with KIND diverge, "
                                                   "duplicate_microbatch, missing_microbatch, "
                                                   "nan_activations, frame_flood or "
                                                   "broken_transfer"));
  }
  fault->kind = kinds.at(parts[0]);
  fault->iteration = iteration;
  return absl::OkStatus();
}

// What the node computes with: speed, slowdown, injected fault, memory
// slots and device; and the peer transfers' timeouts.
absl::Status ApplyComputeFlags(const WorkerFlagValues& v, WorkerOptions* o) {
  if (!(o->speed > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat("--speed: %g must be > 0", o->speed));
  }
  if (!(o->compute_slowdown >= 1) || !(o->compute_slowdown <= 100)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--compute_slowdown: %g is outside 1..100", o->compute_slowdown));
  }
  if (!v.inject_fault.empty()) RETURN_IF_ERROR(ParseFaultInjection(v.inject_fault, &o->fault));
  RETURN_IF_ERROR(CheckFlagRange("memory_slots", v.memory_slots, 1, 1024));
  RETURN_IF_ERROR(
      CheckFlagRange("peer_ack_timeout", o->peer_ack_timeout, absl::Seconds(1), absl::Hours(1)));
  RETURN_IF_ERROR(CheckFlagRange("peer_connect_timeout", o->peer_connect_timeout, absl::Seconds(1),
                                 absl::Minutes(10)));
  if (o->device != "cpu" && o->device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: \"", o->device, "\" is not cpu or cuda"));
  }
  o->memory_slots = static_cast<int>(v.memory_slots);
  return absl::OkStatus();
}

// The metrics and direct-transport ports, derived from the (offset) --listen
// port unless given, and --data_advertise, which needs the transport on.
absl::Status ApplyDerivedPorts(const FlagSet& flags, const WorkerFlagValues& v, WorkerOptions* o) {
  o->metrics_port = static_cast<int>(v.common.metrics_port);
  if (!flags.WasSet("metrics_port")) {
    o->metrics_port = o->listen.port == 0 || o->listen.port + kMetricsPortOffset > 65535
                          ? 0
                          : o->listen.port + kMetricsPortOffset;
  }
  if (v.data_port == "off") {
    o->data_port = -1;
  } else if (v.data_port.empty()) {
    o->data_port = o->listen.port == 0 || o->listen.port + kDataPortOffset > 65535
                       ? 0
                       : o->listen.port + kDataPortOffset;
  } else {
    int port = -1;
    if (!absl::SimpleAtoi(v.data_port, &port) || port < 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("--data_port: \"", v.data_port, "\" is not a port (0..65535) or \"off\""));
    }
    o->data_port = port;
  }
  if (!o->data_advertise.empty()) {
    if (o->data_port < 0) {
      return absl::InvalidArgumentError(
          "--data_advertise: the direct transport is off (--data_port=off)");
    }
    RETURN_IF_ERROR(ParseHostPort(o->data_advertise, "--data_advertise", false).status());
  }
  return absl::OkStatus();
}

// Loads the TLS files; with TLS the certificate's name is the worker id.
absl::Status ApplySecurity(const TlsFiles& tls, WorkerOptions* o) {
  ASSIGN_OR_RETURN(o->security, LoadDaemonSecurity(tls));
  if (o->security.tls()) {
    // The coordinator accepts this worker only under its certificate's name.
    if (!o->worker_id.empty() && o->worker_id != o->security.name()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--worker_id: \"", o->worker_id, "\" differs from the name in --tls_cert (\"",
          o->security.name(), "\"); with TLS the certificate names the worker"));
    }
    // Peers and the coordinator refuse a certificate that is not a worker's:
    // say so now rather than at every registration attempt.
    if (absl::Status kind = o->security.CheckOwnWorkerCertificate(); !kind.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--tls_cert: ", kind.message()));
    }
    o->worker_id = o->security.name();
  }
  return absl::OkStatus();
}

// Checks the parsed flags and completes `o` from them. The checks run in a
// fixed order, so that of several bad flags the same one is reported.
absl::Status BuildWorkerOptions(const FlagSet& flags, const WorkerFlagValues& v, WorkerOptions* o) {
  RETURN_IF_ERROR(ApplyAddresses(v, o));
  RETURN_IF_ERROR(ApplyComputeFlags(v, o));
  RETURN_IF_ERROR(ApplyDerivedPorts(flags, v, o));
  RETURN_IF_ERROR(CheckFlagRange("torch_threads", v.torch_threads, 0, 1024));
  o->torch_threads = static_cast<int>(v.torch_threads);
  return ApplySecurity(v.tls, o);
}

const char* SignalName(int signal_number) {
  return signal_number == SIGTERM ? "SIGTERM" : "SIGINT";
}

// Registers with the coordinator. Registration retries while the coordinator
// is unreachable (forever by default): on its own thread, so SIGTERM/SIGINT
// stop the worker meanwhile. Returns the exit code when the worker is to stop
// instead of serving.
std::optional<int> RegisterUnlessStopped(Worker* worker, absl::Duration drain_timeout) {
  absl::Status registered;
  absl::Notification registration_ended;
  std::thread registering([&] {
    registered = worker->Register();
    registration_ended.Notify();
  });
  int signal_number = 0;
  while (!registration_ended.HasBeenNotified() && signal_number == 0) {
    signal_number = WaitForShutdownSignal(absl::Milliseconds(100));
  }
  if (signal_number != 0 && !registration_ended.HasBeenNotified()) {
    LogInfo("received ", SignalName(signal_number),
            " while registering with the coordinator; stopping");
    worker->Drain(drain_timeout);
    registering.join();
    LogInfo("stopped cleanly");
    return 0;
  }
  registering.join();
  if (!registered.ok()) {
    LogError("cannot start: ", registered.message());
    return 1;
  }
  if (signal_number != 0) {  // came with the registration: drain at once
    LogInfo("received ", SignalName(signal_number), "; draining");
    worker->Drain(drain_timeout);
    LogInfo("stopped cleanly");
    return 0;
  }
  return std::nullopt;
}

// The start-up banner, and --ready_file for whoever waits on this worker.
void AnnounceServing(const Worker& worker, const WorkerOptions& o, const std::string& ready_file) {
  LogInfo("detour-worker ", kVersion, " serving gRPC on port ", worker.grpc_port(),
          worker.data_port() >= 0
              ? absl::StrCat(", the direct transport on port ", worker.data_port())
              : std::string(", no direct transport"),
          ", metrics on port ", worker.metrics_port(), "; ", o.security.Describe());
  if (ready_file.empty()) return;
  absl::Status written = WriteFileAtomically(
      ready_file, absl::StrFormat("{\"grpc_port\": %d, \"metrics_port\": %d, \"data_port\": %d, "
                                  "\"worker_id\": \"%s\", \"pid\": %d}\n",
                                  worker.grpc_port(), worker.metrics_port(), worker.data_port(),
                                  worker.worker_id(), static_cast<int>(getpid())));
  if (!written.ok()) LogWarning("--ready_file: ", written.message());
}

// Starts the worker, registers it and serves until SIGTERM/SIGINT. Returns
// the exit status.
int RunWorker(const WorkerOptions& o, const DaemonFlags& common) {
  // Outlives the worker: gRPC's last shutdown runs before this returns.
  const GrpcLifetime grpc;
  if (absl::Status dir = EnsureWritableDirectory(o.data_dir, "--data_dir"); !dir.ok()) {
    LogError(dir.message());
    return 1;
  }
  auto worker = Worker::Create(o);
  if (!worker.ok()) {
    LogError("cannot start: ", worker.status().message());
    return 1;
  }
  if (std::optional<int> code = RegisterUnlessStopped(worker->get(), common.drain_timeout)) {
    return *code;
  }
  AnnounceServing(**worker, o, common.ready_file);
  AwaitShutdownSignal(common.drain_timeout);
  (*worker)->Drain(common.drain_timeout);
  LogInfo("stopped cleanly");
  return 0;
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) {
  using namespace detour;
  BlockShutdownSignals();

  WorkerOptions o;
  WorkerFlagValues v(o);
  FlagSet flags("detour-worker",
                "Runs a detour worker: registers with the coordinator, keeps a heartbeat, holds "
                "one model stage of a job, and exports Prometheus metrics.");
  RegisterWorkerFlags(&flags, &o, &v);
  if (int code = v.common.Apply(flags, flags.Parse(argc, argv), "detour-worker", "worker");
      code >= 0) {
    return code;
  }
  if (absl::Status built = BuildWorkerOptions(flags, v, &o); !built.ok()) {
    return flags.Fail(built);
  }
  // A LibTorch without CUDA is a setting (exit 2, not restarted); a GPU not
  // visible yet may be one a restart finds (exit 1).
  if (absl::Status device = model::CheckDevice(o.device); !device.ok()) {
    LogError("cannot start: ", device.message());
    return absl::IsUnavailable(device) ? 1 : 2;
  }
  return RunWorker(o, v.common);
}
