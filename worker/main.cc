// detour-worker: the data-plane daemon. See docs/OPERATIONS.md.
#include <unistd.h>

#include <csignal>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/net/daemon_flags.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/net/address.h"
#include "common/net/shutdown_signal.h"
#include "common/net/tls.h"
#include "common/version.h"
#include "worker/worker.h"

int main(int argc, char** argv) {
  using namespace detour;
  BlockShutdownSignals();

  WorkerOptions o;
  std::string listen = "127.0.0.1:7071";
  int64_t memory_slots = o.memory_slots;
  int64_t torch_threads = o.torch_threads;
  DaemonFlags common;
  common.metrics_port = o.metrics_port;
  TlsFiles tls;

  FlagSet flags("detour-worker",
                "Runs a detour worker: registers with the coordinator, keeps a heartbeat, holds "
                "one model stage of a job, and exports Prometheus metrics.");
  flags.String("listen", &listen, "host:port for gRPC (port 0 picks a free one)");
  flags.String("advertise_address", &o.advertise_address,
               "host:port peers use to reach this worker (default: from --listen)");
  flags.String("coordinator", &o.coordinator, "host:port of the coordinator");
  flags.String("worker_id", &o.worker_id,
               "stable worker id (with TLS: its certificate's CN, the default; without: "
               "assigned by the coordinator when not given)");
  flags.String("region", &o.region, "region name, as in cluster specs (e.g. Oregon)");
  flags.Double("speed", &o.speed, "relative compute speed of this node");
  flags.Int("memory_slots", &memory_slots, "microbatches this node can hold in flight");
  flags.String("device", &o.device, "cpu or cuda");
  flags.Int("torch_threads", &torch_threads,
            "LibTorch intra-op threads (0 = all cores; use 1 when many workers share a machine)");
  flags.String("metrics_bind", &o.metrics_bind,
               "address for the /metrics HTTP endpoint (0.0.0.0 for every interface)");
  RegisterTlsFlags(&flags, &tls);
  flags.String("data_dir", &o.data_dir, "directory for checkpoints (created if missing)");
  flags.Duration("connect_timeout", &o.connect_timeout,
                 "give up when the coordinator stays unreachable this long at start-up "
                 "(0 = retry forever)");
  common.Register(&flags, "{\"grpc_port\", \"metrics_port\", \"worker_id\", \"pid\"}");
  flags.SetEpilog(
      "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 when the worker cannot\n"
      "start (port in use, coordinator refused or unreachable past --connect_timeout),\n"
      "2 for bad flags.");

  if (int code = common.Apply(flags, flags.Parse(argc, argv), "detour-worker", "worker");
      code >= 0) {
    return code;
  }

  auto address = ParseHostPort(listen, "--listen", /*allow_port_zero=*/true);
  if (!address.ok()) return flags.Fail(address.status());
  o.listen = *address;
  if (auto c = ParseHostPort(o.coordinator, "--coordinator", false); !c.ok()) {
    return flags.Fail(c.status());
  }
  if (!o.advertise_address.empty()) {
    if (auto a = ParseHostPort(o.advertise_address, "--advertise_address", false); !a.ok()) {
      return flags.Fail(a.status());
    }
  }
  if (!(o.speed > 0)) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrFormat("--speed: %g must be > 0", o.speed)));
  }
  if (memory_slots < 1 || memory_slots > 1024) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--memory_slots: ", memory_slots, " is outside 1..1024")));
  }
  if (o.device != "cpu" && o.device != "cuda") {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--device: \"", o.device, "\" is not cpu or cuda")));
  }
  o.metrics_port = static_cast<int>(common.metrics_port);
  o.memory_slots = static_cast<int>(memory_slots);
  if (torch_threads < 0 || torch_threads > 1024) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--torch_threads: ", torch_threads, " is outside 0..1024")));
  }
  o.torch_threads = static_cast<int>(torch_threads);
  auto security = LoadDaemonSecurity(tls);
  if (!security.ok()) return flags.Fail(security.status());
  o.security = *security;
  if (o.security.tls()) {
    // The coordinator accepts this worker only under its certificate's name.
    if (!o.worker_id.empty() && o.worker_id != o.security.name()) {
      return flags.Fail(absl::InvalidArgumentError(absl::StrCat(
          "--worker_id: \"", o.worker_id, "\" differs from the name in --tls_cert (\"",
          o.security.name(), "\"); with TLS the certificate names the worker")));
    }
    o.worker_id = o.security.name();
  }

  if (absl::Status dir = EnsureWritableDirectory(o.data_dir, "--data_dir"); !dir.ok()) {
    LogError(dir.message());
    return 1;
  }
  auto worker = Worker::Start(o);
  if (!worker.ok()) {
    LogError("cannot start: ", worker.status().message());
    return 1;
  }
  LogInfo("detour-worker ", kVersion, " serving gRPC on port ", (*worker)->grpc_port(),
          ", metrics on port ", (*worker)->metrics_port(), "; ", o.security.Describe());
  if (!common.ready_file.empty()) {
    absl::Status written = WriteFileAtomically(
        common.ready_file,
        absl::StrFormat("{\"grpc_port\": %d, \"metrics_port\": %d, \"worker_id\": \"%s\", "
                        "\"pid\": %d}\n",
                        (*worker)->grpc_port(), (*worker)->metrics_port(),
                        (*worker)->worker_id(), static_cast<int>(getpid())));
    if (!written.ok()) LogWarning("--ready_file: ", written.message());
  }
  AwaitShutdownSignal(common.drain_timeout);
  (*worker)->Drain(common.drain_timeout);
  LogInfo("stopped cleanly");
  return 0;
}
