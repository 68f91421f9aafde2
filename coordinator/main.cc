// detour-coordinator: the control-plane daemon. See docs/OPERATIONS.md.
#include <csignal>
#include <cstdlib>
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
#include "common/spec.h"
#include "common/status.h"
#include "common/version.h"
#include "coordinator/client_auth.h"
#include "coordinator/coordinator.h"

int main(int argc, char** argv) {
  using namespace detour;
  BlockShutdownSignals();

  std::string listen = "127.0.0.1:7070";
  std::string metrics_bind = "127.0.0.1";
  std::string metrics_advertise;
  absl::Duration job_metrics_retention = absl::Hours(1);
  TlsFiles tls;
  std::string auth_tokens;
  std::string data_dir = "detour-data/coordinator";
  absl::Duration worker_silence = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  std::string cluster_file;
  std::string checkpoint_root;
  bool emulate_network = false;
  absl::Duration iteration_timeout = absl::Seconds(600);
  absl::Duration assign_timeout = absl::Seconds(120);
  int64_t replan_every = 5;
  DaemonFlags common;
  common.metrics_port = 9470;

  FlagSet flags("detour-coordinator",
                "Runs the detour coordinator: accepts jobs (JobService), registers workers and "
                "keeps their heartbeats (ControlService), and exports Prometheus metrics.");
  flags.String("listen", &listen, "host:port for gRPC (port 0 picks a free one)");
  flags.String("metrics_bind", &metrics_bind,
               "address for the /metrics HTTP endpoint (0.0.0.0 for every interface)");
  flags.String("metrics_advertise", &metrics_advertise,
               "host:port Prometheus scrapes this coordinator's metrics at, as its service "
               "discovery (/prometheus/targets) lists it; default: --metrics_bind (the host "
               "name for 0.0.0.0) and the metrics port");
  flags.Duration("job_metrics_retention", &job_metrics_retention,
                 "how long an ended job keeps its per-job series (detour_coordinator_job_*; "
                 "at most 50 ended jobs keep them)");
  RegisterTlsFlags(&flags, &tls);
  flags.String("auth_tokens", &auth_tokens,
               "client tokens, one \"TOKEN ROLE [NAME]\" per line (roles read, submit); "
               "without it, any client certificate from --tls_ca may submit");
  flags.String("data_dir", &data_dir, "directory for the job store (created if missing)");
  flags.Duration("worker_silence", &worker_silence,
                 "a worker with no heartbeat for this long is marked lost");
  flags.Duration("heartbeat_interval", &heartbeat_interval,
                 "heartbeat period asked of workers (must be below --worker_silence)");
  flags.String("cluster", &cluster_file,
               "ClusterSpec JSON whose region links (latency, bandwidth) the planner uses; "
               "regions it does not cover count as one fast network");
  flags.String("checkpoint_root", &checkpoint_root,
               "where jobs' checkpoints go (default <data_dir>/checkpoints); workers write "
               "their stage files there, so on a real cluster use a path all machines share");
  flags.Bool("emulate_network", &emulate_network,
             "make workers delay and rate-limit their frames per --cluster (emulation for "
             "tests and benchmarks on one machine)");
  flags.Duration("iteration_timeout", &iteration_timeout,
                 "fail a job when an iteration takes longer than this");
  flags.Duration("assign_timeout", &assign_timeout,
                 "fail a job when its workers take longer than this to build their stages");
  flags.Int("replan_every", &replan_every,
            "every this many iterations, plan with node speeds measured from the workers' "
            "timing reports (0 = keep the declared speeds)");
  common.Register(&flags, "{\"grpc_port\", \"metrics_port\", \"pid\"}");
  flags.SetEpilog(
      "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 when the daemon cannot\n"
      "start (port in use, unwritable --data_dir), 2 for bad flags (also: no TLS flags\n"
      "and no --insecure, unusable certificate, key or --auth_tokens files).");

  if (int code = common.Apply(flags, flags.Parse(argc, argv), "detour-coordinator", "coordinator");
      code >= 0) {
    return code;
  }

  CoordinatorOptions options;
  auto address = ParseHostPort(listen, "--listen", /*allow_port_zero=*/true);
  if (!address.ok()) return flags.Fail(address.status());
  options.listen = *address;
  if (worker_silence <= absl::ZeroDuration() || heartbeat_interval <= absl::ZeroDuration()) {
    return flags.Fail(
        absl::InvalidArgumentError("--worker_silence and --heartbeat_interval must be positive"));
  }
  if (heartbeat_interval >= worker_silence) {
    return flags.Fail(absl::InvalidArgumentError(absl::StrCat(
        "--heartbeat_interval (", absl::FormatDuration(heartbeat_interval),
        ") must be shorter than --worker_silence (", absl::FormatDuration(worker_silence), ")")));
  }
  options.metrics_bind = metrics_bind;
  if (!metrics_advertise.empty()) {
    auto advertised = ParseHostPort(metrics_advertise, "--metrics_advertise",
                                    /*allow_port_zero=*/false);
    if (!advertised.ok()) return flags.Fail(advertised.status());
    options.metrics_advertise = metrics_advertise;
  }
  if (job_metrics_retention < absl::ZeroDuration()) {
    return flags.Fail(absl::InvalidArgumentError("--job_metrics_retention must not be negative"));
  }
  options.job_metrics.retention = job_metrics_retention;
  options.metrics_port = static_cast<int>(common.metrics_port);
  options.data_dir = data_dir;
  options.worker_silence = worker_silence;
  options.heartbeat_interval = heartbeat_interval;
  if (!cluster_file.empty()) {
    auto network = LoadClusterSpec(cluster_file);
    if (!network.ok()) return flags.Fail(Annotate(network.status(), "--cluster"));
    options.jobs.network = *network;
  } else if (emulate_network) {
    return flags.Fail(absl::InvalidArgumentError("--emulate_network needs --cluster"));
  }
  options.jobs.emulate_network = emulate_network;
  options.jobs.checkpoint_root = checkpoint_root;
  options.jobs.iteration_timeout = iteration_timeout;
  options.jobs.assign_timeout = assign_timeout;
  if (replan_every < 0) {
    return flags.Fail(
        absl::InvalidArgumentError(absl::StrCat("--replan_every: ", replan_every, " is negative")));
  }
  options.jobs.replan_every = static_cast<int>(replan_every);
  auto security = LoadDaemonSecurity(tls);
  if (!security.ok()) return flags.Fail(security.status());
  options.security = *security;
  if (!auth_tokens.empty()) {
    auto tokens = LoadTokensFile(auth_tokens);
    if (!tokens.ok()) return flags.Fail(tokens.status());
    options.tokens = *std::move(tokens);
  }

  if (absl::Status dir = EnsureWritableDirectory(data_dir, "--data_dir"); !dir.ok()) {
    LogError(dir.message());
    return 1;
  }
  auto coordinator = Coordinator::Start(options);
  if (!coordinator.ok()) {
    LogError("cannot start: ", coordinator.status().message());
    return 1;
  }
  LogInfo("detour-coordinator ", kVersion, " serving gRPC on ", options.listen.host, ":",
          (*coordinator)->grpc_port(), ", metrics on port ", (*coordinator)->metrics_port(),
          ", data in ", data_dir, "; ", options.security.Describe(),
          options.tokens ? absl::StrCat(", ", options.tokens->size(), " client token(s)") : "");
  if (!common.ready_file.empty()) {
    absl::Status written = WriteFileAtomically(
        common.ready_file,
        absl::StrFormat("{\"grpc_port\": %d, \"metrics_port\": %d, \"pid\": %d}\n",
                        (*coordinator)->grpc_port(), (*coordinator)->metrics_port(),
                        static_cast<int>(getpid())));
    if (!written.ok()) LogWarning("--ready_file: ", written.message());
  }

  AwaitShutdownSignal(common.drain_timeout);
  (*coordinator)->Drain(common.drain_timeout);
  LogInfo("stopped cleanly");
  return 0;
}
