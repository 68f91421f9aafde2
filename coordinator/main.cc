// detour-coordinator: the control-plane daemon. See docs/OPERATIONS.md.
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
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
#include "coordinator/etcd/etcd_client.h"
#include "coordinator/etcd/etcd_job_backend.h"

namespace detour {
namespace {

constexpr int kExitLostLeadership = 3;
// The largest --replan_every: a million iterations, far beyond any job's
// useful interval, and well inside an int.
constexpr int64_t kMaxReplanEvery = 1'000'000;

// The flags, with their defaults; CoordinatorOptions gets them only after
// their checks.
struct CoordinatorFlagValues {
  CoordinatorFlagValues() { common.metrics_port = 9470; }

  std::string listen = "127.0.0.1:7070";
  std::string metrics_bind = "127.0.0.1";
  std::string metrics_advertise;
  absl::Duration job_metrics_retention = absl::Hours(1);
  TlsFiles tls;
  std::string auth_tokens;
  std::string data_dir = "detour-data/coordinator";
  std::string store = "file";
  std::string store_prefix = "/detour/";
  TlsFiles etcd_tls;
  absl::Duration etcd_timeout = absl::Seconds(5);
  std::string advertise_address;
  absl::Duration leader_ttl = absl::Seconds(5);
  absl::Duration worker_silence = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::Seconds(2);
  std::string cluster_file;
  std::string checkpoint_root;
  bool emulate_network = false;
  absl::Duration iteration_timeout = absl::Seconds(600);
  absl::Duration assign_timeout = absl::Seconds(120);
  int64_t replan_every = 5;
  bool link_probe = true;
  absl::Duration link_probe_budget = absl::Seconds(20);
  int64_t link_probe_mib = 32;
  absl::Duration link_probe_interval = absl::Seconds(60);
  absl::Duration link_probe_bulk_interval = absl::Minutes(5);
  DaemonFlags common;
};

// Declares every flag, in the order --help lists them.
void RegisterCoordinatorFlags(FlagSet* flags, CoordinatorFlagValues* v) {
  flags->String("listen", &v->listen, "host:port for gRPC (port 0 picks a free one)");
  flags->String("metrics_bind", &v->metrics_bind,
                "address for the /metrics HTTP endpoint (0.0.0.0 for every interface)");
  flags->String("metrics_advertise", &v->metrics_advertise,
                "host:port Prometheus scrapes this coordinator's metrics at, as its service "
                "discovery (/prometheus/targets) lists it; default: --metrics_bind (the host "
                "name for 0.0.0.0) and the metrics port");
  flags->Duration("job_metrics_retention", &v->job_metrics_retention,
                  "how long an ended job keeps its per-job series (detour_coordinator_job_*; "
                  "at most 50 ended jobs keep them)");
  RegisterTlsFlags(flags, &v->tls);
  RegisterWorkerIdentityFlags(flags, &v->tls);
  flags->String("auth_tokens", &v->auth_tokens,
                "client tokens, one \"TOKEN ROLE [NAME]\" per line (roles read, submit); "
                "without it, any client certificate from --tls_ca may submit");
  flags->String("data_dir", &v->data_dir, "directory for the job store (created if missing)");
  flags->String("store", &v->store,
                "where job records live: \"file\" (one JSON file per job under --data_dir) or "
                "etcd://host:port[,host:port...] (an etcd 3.4 cluster; docs/OPERATIONS.md)");
  flags->String("store_prefix", &v->store_prefix,
                "with --store=etcd://...: the key prefix of this coordinator's records (starts "
                "and ends with /)");
  flags->String("etcd_ca", &v->etcd_tls.ca,
                "TLS to etcd: PEM CA bundle etcd's certificate chains to");
  flags->String("etcd_cert", &v->etcd_tls.cert,
                "TLS to etcd: PEM client certificate, when etcd asks for one (with --etcd_key)");
  flags->String("etcd_key", &v->etcd_tls.key, "TLS to etcd: PEM private key of --etcd_cert");
  flags->Duration("etcd_timeout", &v->etcd_timeout,
                  "deadline of each call to etcd, every member tried included");
  flags->String("advertise_address", &v->advertise_address,
                "with --store=etcd://...: host:port clients and workers reach this coordinator "
                "at, as followers name it when it leads (default: --listen's host, the host "
                "name for 0.0.0.0, and the bound port)");
  flags->Duration("leader_ttl", &v->leader_ttl,
                  "with --store=etcd://...: the leader's lease; a leader that cannot renew it "
                  "within this time stops driving jobs and exits (status 3), and a follower "
                  "takes over after it runs out (2s..300s)");
  flags->Duration("worker_silence", &v->worker_silence,
                  "a worker with no heartbeat for this long is marked lost");
  flags->Duration("heartbeat_interval", &v->heartbeat_interval,
                  "heartbeat period asked of workers (must be below --worker_silence)");
  flags->String("cluster", &v->cluster_file,
                "ClusterSpec JSON whose region links (latency, bandwidth) the planner uses; "
                "regions it does not cover count as one fast network");
  flags->String("checkpoint_root", &v->checkpoint_root,
                "where jobs' checkpoints go (default <data_dir>/checkpoints); workers write "
                "their stage files there, so on a real cluster use a path all machines share");
  flags->Bool("emulate_network", &v->emulate_network,
              "make workers delay and rate-limit their frames per --cluster (emulation for "
              "tests and benchmarks on one machine)");
  flags->Duration("iteration_timeout", &v->iteration_timeout,
                  "fail a job when an iteration takes longer than this");
  flags->Duration("assign_timeout", &v->assign_timeout,
                  "fail a job when its workers take longer than this to build their stages");
  flags->Int("replan_every", &v->replan_every,
             "every this many iterations, plan with node speeds measured from the workers' "
             "timing reports (0 = keep the declared speeds; at most 1000000)");
  flags->Bool("link_probe", &v->link_probe,
              "before a job's first plan, workers measure their links to each other over the "
              "tensor transport (latency, then bandwidth link by link) and the planner plans on "
              "what they measured; false = plan on --cluster's region table alone");
  flags->Duration("link_probe_budget", &v->link_probe_budget,
                  "time the workers have for the bandwidth measurements, at least: it grows "
                  "with the measured round trips (1 s + 60 round trips per link, at most 120 s; "
                  "links not measured by then keep the region table's figures)");
  flags->Int("link_probe_mib", &v->link_probe_mib,
             "largest bulk probe per link, in MiB (1..64; a long fat link needs several "
             "bandwidth-delay products)");
  flags->Duration("link_probe_interval", &v->link_probe_interval,
                  "while a job runs, a latency round this often (it also re-probes links found "
                  "cut); 0 = none");
  flags->Duration("link_probe_bulk_interval", &v->link_probe_bulk_interval,
                  "while a job runs, one slot of bulk probes this often (after a latency round; "
                  "none when --link_probe_interval is 0), over the links the job's last "
                  "iteration did not cross, slot after slot in turn: the bandwidth of links the "
                  "plans avoid is measured again; 0 = none");
  v->common.Register(flags, "{\"grpc_port\", \"metrics_port\", \"pid\"}");
  flags->SetEpilog(
      "Exit status: 0 after a clean shutdown (SIGTERM/SIGINT), 1 when the daemon cannot\n"
      "start (port in use, unwritable --data_dir), 2 for bad flags (also: no TLS flags\n"
      "and no --insecure, unusable certificate, key or --auth_tokens files), 3 when it\n"
      "led over etcd and lost its lease (restart it: it comes back as a follower).");
}

absl::Status CheckHeartbeatTiming(absl::Duration worker_silence,
                                  absl::Duration heartbeat_interval) {
  if (worker_silence <= absl::ZeroDuration() || heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--worker_silence and --heartbeat_interval must be positive");
  }
  if (heartbeat_interval >= worker_silence) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--heartbeat_interval (", absl::FormatDuration(heartbeat_interval),
        ") must be shorter than --worker_silence (", absl::FormatDuration(worker_silence), ")"));
  }
  return absl::OkStatus();
}

// Where the metrics are served and advertised, and how long ended jobs keep
// their series.
absl::Status ApplyMetricsFlags(const CoordinatorFlagValues& v, CoordinatorOptions* options) {
  options->metrics_bind = v.metrics_bind;
  if (!v.metrics_advertise.empty()) {
    RETURN_IF_ERROR(ParseHostPort(v.metrics_advertise, "--metrics_advertise",
                                  /*allow_port_zero=*/false)
                        .status());
    options->metrics_advertise = v.metrics_advertise;
  }
  RETURN_IF_ERROR(CheckFlagNotNegative("job_metrics_retention", v.job_metrics_retention));
  options->job_metrics.retention = v.job_metrics_retention;
  options->metrics_port = static_cast<int>(v.common.metrics_port);
  return absl::OkStatus();
}

// How jobs run: the network the planner assumes (and may emulate), where
// checkpoints go, the timeouts and how often to replan.
absl::Status ApplyJobFlags(const CoordinatorFlagValues& v, JobManagerOptions* jobs) {
  if (!v.cluster_file.empty()) {
    auto network = LoadClusterSpec(v.cluster_file);
    if (!network.ok()) return Annotate(network.status(), "--cluster");
    jobs->network = *network;
  } else if (v.emulate_network) {
    return absl::InvalidArgumentError("--emulate_network needs --cluster");
  }
  jobs->emulate_network = v.emulate_network;
  jobs->checkpoint_root = v.checkpoint_root;
  jobs->iteration_timeout = v.iteration_timeout;
  jobs->assign_timeout = v.assign_timeout;
  // Bounded before the cast to int, which would wrap (2^32 to 0: re-planning
  // silently off).
  RETURN_IF_ERROR(CheckFlagRange("replan_every", v.replan_every, 0, kMaxReplanEvery));
  jobs->replan_every = static_cast<int>(v.replan_every);
  RETURN_IF_ERROR(CheckFlagRange("link_probe_mib", v.link_probe_mib, 1, 64));
  RETURN_IF_ERROR(CheckFlagRange("link_probe_budget", v.link_probe_budget, absl::Seconds(1),
                                 absl::Seconds(600)));
  RETURN_IF_ERROR(CheckFlagNotNegative("link_probe_interval", v.link_probe_interval));
  RETURN_IF_ERROR(CheckFlagNotNegative("link_probe_bulk_interval", v.link_probe_bulk_interval));
  jobs->link_probe = v.link_probe;
  jobs->link_probe_budget = v.link_probe_budget;
  jobs->link_probe_bytes = static_cast<uint64_t>(v.link_probe_mib) << 20;
  jobs->link_probe_interval = v.link_probe_interval;
  jobs->link_probe_bulk_interval = v.link_probe_bulk_interval;
  return absl::OkStatus();
}

// The TLS identity, and the client tokens of --auth_tokens.
absl::Status ApplyCredentials(const CoordinatorFlagValues& v, CoordinatorOptions* options) {
  ASSIGN_OR_RETURN(options->security, LoadDaemonSecurity(v.tls));
  if (!v.auth_tokens.empty()) {
    ASSIGN_OR_RETURN(options->tokens, LoadTokensFile(v.auth_tokens));
  }
  return absl::OkStatus();
}

// Where the job records live: files under --data_dir, or etcd.
absl::Status ApplyStoreFlags(const CoordinatorFlagValues& v, CoordinatorOptions* options) {
  const bool tls = !v.etcd_tls.ca.empty() || !v.etcd_tls.cert.empty() || !v.etcd_tls.key.empty();
  if (v.store == "file") {
    if (tls || v.store_prefix != "/detour/" || !v.advertise_address.empty() ||
        v.leader_ttl != absl::Seconds(5)) {
      return absl::InvalidArgumentError(
          "--store_prefix, --etcd_*, --advertise_address and --leader_ttl need "
          "--store=etcd://host:port[,...]");
    }
    return absl::OkStatus();
  }
  if (!v.advertise_address.empty()) {
    RETURN_IF_ERROR(ParseHostPort(v.advertise_address, "--advertise_address",
                                  /*allow_port_zero=*/false)
                        .status());
    options->advertise_address = v.advertise_address;
  }
  if (v.leader_ttl < absl::Seconds(2) || v.leader_ttl > absl::Seconds(300)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--leader_ttl: ", absl::FormatDuration(v.leader_ttl), " is not in [2s, 300s]"));
  }
  options->leader_ttl = v.leader_ttl;
  ASSIGN_OR_RETURN(options->etcd.endpoints, ParseEtcdUrl(v.store, "--store"));
  RETURN_IF_ERROR(EtcdJobBackend::CheckPrefix(v.store_prefix));
  options->store_prefix = v.store_prefix;
  RETURN_IF_ERROR(
      CheckFlagRange("etcd_timeout", v.etcd_timeout, absl::Milliseconds(100), absl::Seconds(120)));
  options->etcd.call_timeout = v.etcd_timeout;
  if (tls) {
    if (v.etcd_tls.ca.empty()) {
      return absl::InvalidArgumentError("--etcd_cert/--etcd_key need --etcd_ca");
    }
    if (v.etcd_tls.cert.empty() != v.etcd_tls.key.empty()) {
      return absl::InvalidArgumentError("--etcd_cert and --etcd_key go together");
    }
    auto security = TransportSecurity::Load(v.etcd_tls, /*client=*/true);
    if (!security.ok()) return Annotate(security.status(), "TLS to etcd (--etcd_*)");
    options->etcd.security = *security;
  }
  return absl::OkStatus();
}

// Checks the parsed flags and fills `options` from them. The checks run in a
// fixed order, so that of several bad flags the same one is reported.
absl::Status BuildCoordinatorOptions(const CoordinatorFlagValues& v, CoordinatorOptions* options) {
  ASSIGN_OR_RETURN(options->listen, ParseHostPort(v.listen, "--listen", /*allow_port_zero=*/true));
  RETURN_IF_ERROR(CheckHeartbeatTiming(v.worker_silence, v.heartbeat_interval));
  RETURN_IF_ERROR(ApplyMetricsFlags(v, options));
  options->data_dir = v.data_dir;
  RETURN_IF_ERROR(ApplyStoreFlags(v, options));
  options->worker_silence = v.worker_silence;
  options->heartbeat_interval = v.heartbeat_interval;
  RETURN_IF_ERROR(ApplyJobFlags(v, &options->jobs));
  return ApplyCredentials(v, options);
}

// The start-up banner, and --ready_file for whoever waits on the coordinator.
void AnnounceServing(const Coordinator& coordinator, const CoordinatorOptions& options,
                     const std::string& ready_file) {
  LogInfo("detour-coordinator ", kVersion, " serving gRPC on ", options.listen.host, ":",
          coordinator.grpc_port(), ", metrics on port ", coordinator.metrics_port(), ", data in ",
          options.data_dir,
          options.etcd.endpoints.empty()
              ? ""
              : absl::StrCat(", job records in etcd://", absl::StrJoin(options.etcd.endpoints, ","),
                             " under ", options.store_prefix),
          "; ", options.security.Describe(),
          options.tokens ? absl::StrCat(", ", options.tokens->size(), " client token(s)") : "");
  if (ready_file.empty()) return;
  absl::Status written = WriteFileAtomically(
      ready_file, absl::StrFormat("{\"grpc_port\": %d, \"metrics_port\": %d, \"pid\": %d}\n",
                                  coordinator.grpc_port(), coordinator.metrics_port(),
                                  static_cast<int>(getpid())));
  if (!written.ok()) LogWarning("--ready_file: ", written.message());
}

// Starts the coordinator and serves until SIGTERM/SIGINT. Returns the exit
// status.
int RunCoordinator(CoordinatorOptions options, const DaemonFlags& common) {
  // A leader that lost its lease has stale jobs in memory: it exits at once
  // (its gate is closed, nothing more reached the workers) and comes back as
  // a follower under its supervisor, loading the jobs afresh if elected.
  options.on_leadership_lost = [](const absl::Status&) {
    LogError("exiting: a coordinator that lost its lease restarts as a follower");
    std::_Exit(kExitLostLeadership);
  };
  if (absl::Status dir = EnsureWritableDirectory(options.data_dir, "--data_dir"); !dir.ok()) {
    LogError(dir.message());
    return 1;
  }
  auto coordinator = Coordinator::Start(options);
  if (!coordinator.ok()) {
    LogError("cannot start: ", coordinator.status().message());
    return 1;
  }
  AnnounceServing(**coordinator, options, common.ready_file);

  AwaitShutdownSignal(common.drain_timeout);
  (*coordinator)->Drain(common.drain_timeout);
  LogInfo("stopped cleanly");
  return 0;
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) {
  using namespace detour;
  BlockShutdownSignals();

  CoordinatorFlagValues v;
  FlagSet flags("detour-coordinator",
                "Runs the detour coordinator: accepts jobs (JobService), registers workers and "
                "keeps their heartbeats (ControlService), and exports Prometheus metrics.");
  RegisterCoordinatorFlags(&flags, &v);
  if (int code =
          v.common.Apply(flags, flags.Parse(argc, argv), "detour-coordinator", "coordinator");
      code >= 0) {
    return code;
  }
  CoordinatorOptions options;
  if (absl::Status built = BuildCoordinatorOptions(v, &options); !built.ok()) {
    return flags.Fail(built);
  }
  return RunCoordinator(options, v.common);
}
