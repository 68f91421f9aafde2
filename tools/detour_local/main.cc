// detour-local: a whole detour cluster on this machine, for demos and trying
// things out. Starts a coordinator and N workers on loopback (or, with --wan,
// each in a network namespace of the packet-level WAN test bed), submits a
// job, shows a live progress line, writes the loss curve, and stops
// everything cleanly at the end or on Ctrl-C.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/net/daemon_flags.h"
#include "common/net/server.h"
#include "common/net/shutdown_signal.h"
#include "common/net/tls.h"
#include "common/plot.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/subprocess.h"
#include "common/version.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "tools/detour_local/wan_bed.h"

namespace detour {
namespace {

namespace fs = std::filesystem;

// Marks a directory as detour-local's output, which a later run may empty.
constexpr char kOutMarker[] = ".detour-local";

struct Args {
  std::string job = "examples/jobs/tiny_local.json";
  int64_t workers = 0;
  std::string out = "demo-out";
  std::string bin_dir;
  std::string cluster;
  bool emulate_network = false;
  int64_t torch_threads = 1;
  int64_t iterations = 0;
  bool insecure = false;
  std::string certs;  // "" = a fresh throwaway CA in <out>/certs
  bool wan = false;
  double wan_bandwidth_scale = 1.0;
  double wan_coordinator_latency_ms = 2.0;
  std::string wan_prefix;  // "" = dl<pid>
  absl::Duration link_probe_interval = absl::Seconds(60);
  absl::Duration link_probe_bulk_interval = absl::Minutes(5);
};

// A random bearer token: 32 bytes from the kernel, hex.
absl::StatusOr<std::string> RandomToken() {
  FILE* f = std::fopen("/dev/urandom", "rb");
  if (f == nullptr) return absl::UnavailableError("cannot open /dev/urandom");
  char bytes[32];
  const size_t n = std::fread(bytes, 1, sizeof(bytes), f);
  std::fclose(f);
  if (n != sizeof(bytes)) return absl::UnavailableError("short read from /dev/urandom");
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

std::string FormatEta(double s) {
  if (s <= 0) return "-";
  const int t = static_cast<int>(s + 0.5);
  return t >= 60 ? absl::StrFormat("%dm%02ds", t / 60, t % 60) : absl::StrFormat("%ds", t);
}

// The build tree: this binary lives in <build>/tools/detour_local/.
// Installed, the daemons sit next to this binary (bin/); in a build tree,
// under coordinator/ and worker/ of the tree's root.
std::string DefaultBinDir() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "build";
  if (fs::exists(self.parent_path() / "detour-coordinator", ec)) return self.parent_path().string();
  return self.parent_path().parent_path().parent_path().string();
}

// `bin_dir`/NAME when installed there, else the build tree's
// `bin_dir`/COMPONENT/NAME.
std::string DaemonPath(const std::string& bin_dir, const std::string& component,
                       const std::string& name) {
  std::error_code ec;
  const fs::path flat = fs::path(bin_dir) / name;
  if (fs::is_regular_file(flat, ec)) return flat.string();
  return (fs::path(bin_dir) / component / name).string();
}

class Launcher {
 public:
  explicit Launcher(Args args) : args_(std::move(args)) {}

  int Run() {
    auto spec = LoadJobSpec(args_.job);
    if (!spec.ok()) {
      std::cerr << "detour-local: " << spec.status().message() << "\n";
      return 2;
    }
    if (args_.iterations > 0) spec->set_iterations(args_.iterations);
    int workers = 0;
    std::vector<std::string> regions;
    v1::ClusterSpec cluster_spec;
    if (int rc = CheckCluster(*spec, &workers, &regions, &cluster_spec); rc != 0) return rc;
    if (int rc = PrepareOut(); rc != 0) return rc;
    const std::string bin = args_.bin_dir.empty() ? DefaultBinDir() : args_.bin_dir;
    std::string cluster_file = args_.cluster;
    if (args_.wan) {
      if (absl::Status s = StartWan(bin, workers, cluster_spec, &cluster_file); !s.ok()) {
        std::cerr << "detour-local: " << s.message() << "\n";
        return 1;
      }
      if (interrupted_) return 130;
    }
    if (absl::Status s = SetUpSecurity(bin, workers); !s.ok()) {
      std::cerr << "detour-local: " << s.message() << "\n";
      return 1;
    }
    std::string bed_address;
    if (int rc = StartCoordinator(bin, workers, cluster_file, &bed_address); rc != 0) return rc;
    if (int rc = StartWorkers(bin, workers, regions, bed_address); rc != 0) return rc;
    std::cout << "  workers      w1..w" << workers << " registered\n";
    if (!certs_.empty()) {
      std::cout << "  TLS          throwaway CA and certificates in " << certs_
                << "/; try\n               detourctl --coordinator=" << address_
                << " --tls_ca=" << certs_ << "/ca.crt --token_file=" << certs_ << "/token list\n";
    } else {
      std::cout << "  plaintext    --insecure: no TLS, no authentication\n";
    }
    return SubmitAndFollow(*spec);
  }

  // Called from the signal thread.
  void Interrupt() {
    interrupted_ = true;
    absl::MutexLock lock(&mu_);
    if (watch_ != nullptr) watch_->TryCancel();
  }

  // Stops the daemons: workers first, then the coordinator; then takes the
  // test bed down (only the one this run made).
  void StopAll() {
    for (auto& w : workers_) w->Signal(SIGTERM);
    for (auto& w : workers_) w->Stop(absl::Seconds(15));
    coordinator_.Stop(absl::Seconds(15));
    relay_.Stop();
    if (bed_ && bed_->Down()) {
      std::cout << "detour-local: test bed " << prefix_ << " is down (link counters in "
                << args_.out << "/wan/stats.txt)\n";
    }
  }

 private:
  // How many workers, and the cluster's regions; with --wan, that the
  // cluster has a node per worker and this process may build the bed. An
  // exit code, 0 to go on.
  int CheckCluster(const v1::JobSpec& spec, int* workers_out, std::vector<std::string>* regions,
                   v1::ClusterSpec* cluster_spec) {
    const v1::PipelineSpec& p = spec.pipeline();
    const int needed =
        static_cast<int>(p.data_nodes() + (p.num_stages() - 1) * p.replicas_per_stage());
    *workers_out = args_.workers > 0 ? static_cast<int>(args_.workers) : needed;
    const int workers = *workers_out;
    if (workers < needed) {
      std::cerr << "detour-local: --workers " << workers << " is fewer than the " << needed
                << " the job needs (" << p.data_nodes() << " data nodes + " << p.num_stages() - 1
                << " stages x " << p.replicas_per_stage() << " replicas)\n";
      return 2;
    }
    if (!args_.cluster.empty()) {
      auto cluster = LoadClusterSpec(args_.cluster);
      if (!cluster.ok()) {
        std::cerr << "detour-local: --cluster: " << cluster.status().message() << "\n";
        return 2;
      }
      for (const v1::NodeSpec& n : cluster->nodes()) regions->push_back(n.region());
      *cluster_spec = *std::move(cluster);
    }
    if (args_.wan) {
      if (workers > cluster_spec->nodes_size()) {
        std::cerr << "detour-local: --wan runs each worker in the namespace of one --cluster "
                     "node: "
                  << workers << " workers but " << cluster_spec->nodes_size() << " nodes\n";
        return 2;
      }
      if (absl::Status s = CheckWanPrivileges(); !s.ok()) {
        std::cerr << "detour-local: " << s.message() << "\n";
        return 1;
      }
    }
    return 0;
  }

  // --out: emptied only when an earlier run wrote it (it carries the
  // marker), then marked. An exit code, 0 to go on.
  int PrepareOut() {
    // Only an earlier run's output (it carries the marker) is emptied: a
    // user's directory is never deleted.
    std::error_code ec;
    const fs::path marker = fs::path(args_.out) / kOutMarker;
    if (fs::exists(args_.out, ec) && !fs::is_empty(args_.out, ec)) {
      if (!fs::exists(marker, ec)) {
        std::cerr << "detour-local: --out " << args_.out
                  << " exists, is not empty and was not written by detour-local; choose "
                     "another directory or empty it yourself\n";
        return 2;
      }
      fs::remove_all(args_.out, ec);
    }
    if (absl::Status dir = EnsureWritableDirectory(args_.out, "--out"); !dir.ok()) {
      std::cerr << "detour-local: " << dir.message() << "\n";
      return 1;
    }
    if (absl::Status m = WriteFileAtomically(marker.string(), "detour-local output\n"); !m.ok()) {
      std::cerr << "detour-local: --out: " << m.message() << "\n";
      return 1;
    }
    return 0;
  }

  // The coordinator on loopback, or at its node's address inside the test
  // bed (then a relay here reaches it); sets address_ and `bed_address`
  // (where workers reach it). An exit code, 0 to go on.
  int StartCoordinator(const std::string& bin, int workers, const std::string& cluster_file,
                       std::string* bed_address_out) {
    // Loopback, or each daemon at its node's address inside the test bed.
    const std::string coordinator_host = bed_ ? bed_->coordinator().address : "127.0.0.1";
    std::cout << "detour-local: coordinator + " << workers << " workers "
              << (bed_ ? "in the WAN test bed" : "on loopback") << " (logs in " << args_.out
              << "/)\n";
    std::vector<std::string> cargv = {
        DaemonPath(bin, "coordinator", "detour-coordinator"),
        absl::StrCat("--listen=", coordinator_host, ":0"),
        "--metrics_port=0",
        absl::StrCat("--metrics_bind=", coordinator_host),
        absl::StrCat("--data_dir=", args_.out, "/coordinator"),
        absl::StrCat("--ready_file=", args_.out, "/coordinator.ready"),
        "--heartbeat_interval=500ms",
        "--worker_silence=5s"};
    AddSecurityFlags("coordinator", &cargv);
    if (!certs_.empty()) cargv.push_back(absl::StrCat("--auth_tokens=", certs_, "/tokens"));
    if (!cluster_file.empty()) cargv.push_back(absl::StrCat("--cluster=", cluster_file));
    if (args_.emulate_network) cargv.push_back("--emulate_network");
    cargv.push_back(
        absl::StrCat("--link_probe_interval=", absl::FormatDuration(args_.link_probe_interval)));
    cargv.push_back(absl::StrCat("--link_probe_bulk_interval=",
                                 absl::FormatDuration(args_.link_probe_bulk_interval)));
    if (bed_) cargv = bed_->InNamespace(bed_->coordinator(), std::move(cargv));
    if (absl::Status s = coordinator_.Start(cargv, args_.out + "/coordinator.log", true); !s.ok()) {
      std::cerr << "detour-local: " << s.message() << "\n";
      return 1;
    }
    auto port = WaitForReadyField(args_.out + "/coordinator.ready", "grpc_port", absl::Seconds(30));
    auto metrics_port =
        WaitForReadyField(args_.out + "/coordinator.ready", "metrics_port", absl::Seconds(1));
    if (!port.ok()) {
      std::cerr << "detour-local: the coordinator did not start; see " << args_.out
                << "/coordinator.log:\n"
                << coordinator_.Log();
      return 1;
    }
    address_ = absl::StrCat(coordinator_host, ":", *port);
    const std::string metrics = absl::StrCat("http://", coordinator_host, ":",
                                             metrics_port.ok() ? *metrics_port : "?", "/metrics");
    const std::string bed_address = address_;
    if (bed_) {
      // This process (and detourctl) stays outside the bed: a relay on
      // loopback here reaches the coordinator in its namespace.
      int in_port = 0;
      if (!absl::SimpleAtoi(*port, &in_port)) {
        std::cerr << "detour-local: bad grpc_port " << *port << " in coordinator.ready\n";
        return 1;
      }
      auto local = relay_.Start(bed_->coordinator().netns, coordinator_host, in_port);
      if (!local.ok()) {
        std::cerr << "detour-local: relay to the coordinator: " << local.status().message() << "\n";
        return 1;
      }
      address_ = absl::StrCat("127.0.0.1:", *local);
      std::cout << "  coordinator  gRPC " << bed_address << " in the bed, " << address_
                << " from here (a relay); metrics " << metrics << " (in the bed: " << bed_->script()
                << " exec --prefix " << prefix_ << " coordinator -- curl -s " << metrics << ")\n";
    } else {
      std::cout << "  coordinator  gRPC " << address_ << ", metrics " << metrics << "\n";
    }
    *bed_address_out = bed_address;
    return 0;
  }

  // The workers, each in its node's namespace with --wan; waits until every
  // one is ready. An exit code, 0 to go on.
  int StartWorkers(const std::string& bin, int workers, const std::vector<std::string>& regions,
                   const std::string& bed_address) {
    for (int i = 0; i < workers; ++i) {
      const std::string region = regions.empty() ? "local" : regions[i % regions.size()];
      auto w = std::make_unique<ChildProcess>();
      // In the bed, listening on the node's address makes it the address the
      // worker advertises to the coordinator and its peers (gRPC and the
      // direct tensor transport), so all their traffic crosses the emulator.
      const std::string host = bed_ ? bed_->nodes()[static_cast<size_t>(i)].address : "127.0.0.1";
      std::vector<std::string> wargv = {
          DaemonPath(bin, "worker", "detour-worker"),
          absl::StrCat("--listen=", host, ":0"),
          "--metrics_port=-1",
          absl::StrCat("--coordinator=", bed_address),
          absl::StrCat("--worker_id=w", i + 1),
          absl::StrCat("--region=", region),
          absl::StrCat("--data_dir=", args_.out, "/w", i + 1),
          absl::StrCat("--torch_threads=", args_.torch_threads),
          absl::StrCat("--ready_file=", args_.out, "/w", i + 1, ".ready")};
      AddSecurityFlags(absl::StrCat("w", i + 1), &wargv);
      if (bed_) wargv = bed_->InNamespace(bed_->nodes()[static_cast<size_t>(i)], std::move(wargv));
      if (absl::Status s = w->Start(wargv, absl::StrCat(args_.out, "/w", i + 1, ".log"), true);
          !s.ok()) {
        std::cerr << "detour-local: " << s.message() << "\n";
        return 1;
      }
      workers_.push_back(std::move(w));
    }
    for (int i = 0; i < workers; ++i) {
      auto id = WaitForReadyField(absl::StrCat(args_.out, "/w", i + 1, ".ready"), "worker_id",
                                  absl::Seconds(60));
      if (!id.ok()) {
        std::cerr << "detour-local: worker " << i + 1 << " did not start:\n" << workers_[i]->Log();
        return 1;
      }
    }
    return 0;
  }

  // Brings up the bed: one namespace per worker's cluster node plus the
  // coordinator's, and prints the table. With a bandwidth scale, the
  // coordinator plans on the scaled spec, the network it really runs on;
  // `cluster_file` then names that copy.
  absl::Status StartWan(const std::string& bin, int workers, const v1::ClusterSpec& cluster,
                        std::string* cluster_file) {
    prefix_ = args_.wan_prefix.empty() ? absl::StrCat("dl", ::getpid()) : args_.wan_prefix;
    WanBedOptions options;
    options.bin_dir = bin;
    options.out_dir = args_.out + "/wan";
    options.prefix = prefix_;
    options.bandwidth_scale = args_.wan_bandwidth_scale;
    options.coordinator_latency_ms = args_.wan_coordinator_latency_ms;
    options.workers = workers;
    bed_ = std::make_unique<WanBed>(options);
    std::cout << "detour-local: bringing up the WAN test bed " << prefix_ << " (if this process "
              << "is killed: tools/wan_testbed.sh down --prefix " << prefix_ << ")\n"
              << std::flush;
    RETURN_IF_ERROR(bed_->Up(cluster));
    if (args_.wan_bandwidth_scale != 1.0) {
      *cluster_file = args_.out + "/wan/cluster_scaled.json";
      RETURN_IF_ERROR(WriteFileAtomically(
          *cluster_file, ToJson(ScaleClusterBandwidth(cluster, args_.wan_bandwidth_scale))));
    }
    std::cout << absl::StrFormat(
        "  test bed     %s: %d namespaces, detour-wanem between them; %s; coordinator %g ms "
        "one-way from every region\n",
        prefix_, workers + 1,
        args_.wan_bandwidth_scale == 1.0
            ? std::string("bandwidths as in --cluster (not scaled)")
            : absl::StrFormat("bandwidths SCALED by %g (every link's rate x %g; the "
                              "coordinator plans on %s)",
                              args_.wan_bandwidth_scale, args_.wan_bandwidth_scale, *cluster_file),
        args_.wan_coordinator_latency_ms);
    std::cout << absl::StrFormat("  %-12s %-18s %-12s %-26s %s\n", "node", "region", "address",
                                 "namespace", "daemon");
    for (size_t i = 0; i < bed_->nodes().size(); ++i) {
      const WanNodeAddress& n = bed_->nodes()[i];
      const std::string daemon =
          i + 1 == bed_->nodes().size() ? "coordinator" : absl::StrCat("worker w", i + 1);
      std::cout << absl::StrFormat("  %-12s %-18s %-12s %-26s %s\n", n.id, n.region, n.address,
                                   n.netns, daemon);
    }
    std::cout << std::flush;
    return absl::OkStatus();
  }

  // Without --insecure: certificates for the coordinator, every worker (named
  // by its id) and this client, from --certs or a throwaway CA made with
  // tools/gen_certs.sh, and a token file with one submit token.
  absl::Status SetUpSecurity(const std::string& bin, int workers) {
    if (args_.insecure) return absl::OkStatus();
    certs_ = args_.certs.empty() ? args_.out + "/certs" : args_.certs;
    std::vector<std::string> argv = {bin + "/tools/gen_certs.sh", certs_};
    const size_t none = argv.size();
    // In the bed, peers reach a daemon at its node's address, which its
    // certificate must then name too.
    auto with_ip = [&](const std::string& name, int node) {
      if (!bed_ || node < 0) return name;
      return absl::StrCat(name, "=", bed_->nodes()[static_cast<size_t>(node)].address);
    };
    const int coordinator_node = bed_ ? static_cast<int>(bed_->nodes().size()) - 1 : -1;
    // Each certificate marked with its kind: only the workers' may act as
    // workers (docs/OPERATIONS.md §Security).
    struct Identity {
      std::string kind, name;
      int node;
    };
    std::vector<Identity> identities = {{"--coordinator", "coordinator", coordinator_node},
                                        {"--client", "detour-local", -1}};
    for (int i = 1; i <= workers; ++i)
      identities.push_back({"--worker", absl::StrCat("w", i), i - 1});
    for (const Identity& id : identities) {
      if (args_.certs.empty() || !fs::exists(absl::StrCat(certs_, "/", id.name, ".crt"))) {
        argv.push_back(id.kind);
        argv.push_back(with_ip(id.name, id.node));
      }
    }
    if (argv.size() > none) {
      ChildProcess gen;
      RETURN_IF_ERROR(gen.Start(argv, args_.out + "/gen_certs.log"));
      std::optional<int> code = gen.Wait(absl::Seconds(60));
      if (code != 0) {
        return absl::InternalError(
            absl::StrCat("making certificates with ", argv[0], " failed:\n", gen.Log()));
      }
    }
    ASSIGN_OR_RETURN(std::string token, RandomToken());
    RETURN_IF_ERROR(WriteFileAtomically(certs_ + "/token", token + "\n"));
    RETURN_IF_ERROR(
        WriteFileAtomically(certs_ + "/tokens", absl::StrCat(token, " submit detour-local\n")));
    std::error_code ec;
    for (const char* name : {"/token", "/tokens"}) {
      fs::permissions(certs_ + name, fs::perms::owner_read | fs::perms::owner_write,
                      fs::perm_options::replace, ec);
    }
    TlsFiles files;
    files.ca = certs_ + "/ca.crt";
    files.cert = certs_ + "/detour-local.crt";
    files.key = certs_ + "/detour-local.key";
    ASSIGN_OR_RETURN(security_, TransportSecurity::Load(files, /*client=*/true));
    token_ = token;
    return absl::OkStatus();
  }

  void AddSecurityFlags(const std::string& name, std::vector<std::string>* argv) const {
    if (certs_.empty()) {
      argv->push_back("--insecure");
      return;
    }
    argv->push_back(absl::StrCat("--tls_cert=", certs_, "/", name, ".crt"));
    argv->push_back(absl::StrCat("--tls_key=", certs_, "/", name, ".key"));
    argv->push_back(absl::StrCat("--tls_ca=", certs_, "/ca.crt"));
  }

  void Authorize(grpc::ClientContext* context) const {
    if (!token_.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", token_));
  }

  int SubmitAndFollow(const v1::JobSpec& spec) {
    auto stub = v1::JobService::NewStub(MakeChannel(address_, security_));
    v1::Job job;
    {
      grpc::ClientContext context;
      Authorize(&context);
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::SubmitJobRequest request;
      *request.mutable_spec() = spec;
      grpc::Status s = stub->Submit(&context, request, &job);
      if (!s.ok()) {
        std::cerr << "detour-local: submit: " << s.error_message() << "\n";
        return 1;
      }
    }
    std::cout << "  job          " << job.id() << " (" << spec.name()
              << "): " << spec.model().preset() << " model, " << spec.pipeline().num_stages()
              << " stages, skip " << spec.pipeline().skip_ratio() << ", " << spec.iterations()
              << " iterations\n\n";
    const bool tty = ::isatty(STDOUT_FILENO);
    std::string csv =
        "iteration,loss,iteration_time_s,tokens_per_s,predicted_iteration_time_s,"
        "coordinator_overhead_s,utilization,utilization_with_kfac,kfac_refreshes,elapsed_s,kfac_"
        "max_delay_s\n";
    PlotSeries curve{absl::StrCat(spec.name(), " (", spec.pipeline().num_stages(), " stages, skip ",
                                  spec.pipeline().skip_ratio(), ")"),
                     {}};
    grpc::ClientContext context;
    Authorize(&context);
    {
      absl::MutexLock lock(&mu_);
      watch_ = &context;
    }
    if (interrupted_) context.TryCancel();
    v1::WatchJobRequest request;
    request.set_job_id(job.id());
    auto reader = stub->Watch(&context, request);
    v1::JobEvent event;
    uint64_t shown = 0;
    uint64_t last_printed = 0;
    std::string last_state;
    const absl::Time start = absl::Now();
    int link_tries = 3;  // GetLinks, once an iteration until it answers
    while (reader->Read(&event)) {
      job = event.job();
      const v1::JobProgress& pr = job.progress();
      const std::string state = v1::JobState_Name(job.state()).substr(10);
      if (pr.iteration() > shown) {
        shown = pr.iteration();
        if (link_tries > 0) link_tries = SaveLinks(stub.get(), job.id()) ? 0 : link_tries - 1;
        absl::StrAppendFormat(&csv, "%d,%.6f,%.4f,%.1f,%.4f,%.5f,%.4f,%.4f,%d,%.3f,%.4f\n",
                              pr.iteration(), pr.loss(), pr.iteration_time_s(), pr.tokens_per_s(),
                              pr.predicted_iteration_time_s(), pr.coordinator_overhead_s(),
                              pr.utilization(), pr.utilization_with_kfac(), pr.kfac_refreshes(),
                              absl::ToDoubleSeconds(absl::Now() - start), pr.kfac_max_delay_s());
        curve.points.emplace_back(static_cast<double>(pr.iteration()), pr.loss());
      }
      const std::string line =
          absl::StrFormat("%-9s iteration %d/%d  loss %.4f  %.0f tok/s  eta %s  (%.0fs)", state,
                          pr.iteration(), pr.total_iterations(), pr.loss(), pr.tokens_per_s(),
                          FormatEta(pr.eta_s()), absl::ToDoubleSeconds(absl::Now() - start));
      if (tty) {
        std::cout << "\r\033[K" << line << std::flush;
      } else if (state != last_state || (pr.iteration() != last_printed &&
                                         (shown % 10 == 0 || shown == pr.total_iterations()))) {
        std::cout << line << "\n" << std::flush;
        last_printed = pr.iteration();
      }
      last_state = state;
    }
    grpc::Status watched = reader->Finish();
    {
      absl::MutexLock lock(&mu_);
      watch_ = nullptr;
    }
    if (tty) std::cout << "\n";
    if (interrupted_) {
      std::cout << "detour-local: interrupted; cancelling " << job.id() << "\n";
      grpc::ClientContext cancel_context;
      Authorize(&cancel_context);
      cancel_context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      v1::CancelJobRequest cancel;
      cancel.set_job_id(job.id());
      v1::Job cancelled;
      stub->Cancel(&cancel_context, cancel, &cancelled);
    } else if (!watched.ok()) {
      std::cerr << "detour-local: watch: " << watched.error_message() << "\n";
    }
    WriteCurve(csv, curve);
    std::cout << job.id() << " " << v1::JobState_Name(job.state()).substr(10) << ": "
              << job.message() << "\n";
    if (!curve.points.empty()) {
      std::cout << absl::StrFormat("loss %.4f -> %.4f over %d iterations in %.0f s\n",
                                   curve.points.front().second, curve.points.back().second,
                                   curve.points.size(), absl::ToDoubleSeconds(absl::Now() - start));
    }
    std::cout << "loss curve: " << args_.out << "/loss.csv, " << args_.out << "/loss.svg\n";
    if (!job.last_checkpoint().empty()) {
      std::cout << "checkpoint: " << job.last_checkpoint() << "\n";
    }
    if (interrupted_) return 130;
    return job.state() == v1::JOB_STATE_SUCCEEDED ? 0 : 1;
  }

  // The link matrix the job's first plan was made on (measured by the
  // start's probes, or the region table's where they did not answer), as
  // GetLinks shows it, to --out/links.json: what detour-sim can be given to
  // predict the run from (benchmarks/wan/links_to_cluster.py). False when
  // GetLinks failed.
  bool SaveLinks(v1::JobService::Stub* stub, const std::string& job_id) {
    grpc::ClientContext context;
    Authorize(&context);
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::GetLinksRequest request;
    request.set_job_id(job_id);
    v1::GetLinksResponse links;
    if (grpc::Status s = stub->GetLinks(&context, request, &links); !s.ok()) {
      std::cerr << "detour-local: links of " << job_id << ": " << s.error_message() << "\n";
      return false;
    }
    if (absl::Status s = WriteFileAtomically(args_.out + "/links.json", ToJson(links)); !s.ok()) {
      std::cerr << "detour-local: " << s.message() << "\n";
    }
    return true;
  }

  void WriteCurve(const std::string& csv, const PlotSeries& curve) {
    PlotOptions options;
    options.title = "detour-local: training loss";
    const std::string svg = LinePlotSvg({curve}, options);
    for (const auto& [name, content] :
         {std::pair<std::string, std::string>{"loss.csv", csv}, {"loss.svg", svg}}) {
      if (absl::Status s = WriteFileAtomically(args_.out + "/" + name, content); !s.ok()) {
        std::cerr << "detour-local: " << s.message() << "\n";
      }
    }
  }

  const Args args_;
  std::string certs_;  // "" = --insecure
  TransportSecurity security_;
  std::string token_;
  std::string address_;
  ChildProcess coordinator_;
  std::vector<std::unique_ptr<ChildProcess>> workers_;
  // --wan: the bed (destroyed, and so taken down, after the daemons stop) and
  // the relay from loopback here to the coordinator in it.
  std::unique_ptr<WanBed> bed_;
  std::string prefix_;
  NetnsRelay relay_;
  std::atomic<bool> interrupted_{false};
  absl::Mutex mu_;
  grpc::ClientContext* watch_ ABSL_GUARDED_BY(mu_) = nullptr;
};

int Main(int argc, char** argv) {
  BlockShutdownSignals();
  QuietGrpcLogs();  // its calls' failures are reported with their status
  Args a;
  FlagSet flags("detour-local",
                "Runs a coordinator and workers on this machine, trains a job on them with a "
                "live progress line, writes the loss curve, and stops everything at the end "
                "(or on Ctrl-C).");
  flags.String("job", &a.job, "job spec (JSON form of detour.v1.JobSpec)");
  flags.Int("workers", &a.workers, "workers to start (default: exactly what the job needs)");
  flags.String("out", &a.out,
               "directory for logs, data dirs, the loss curve; a non-empty directory is "
               "refused unless an earlier detour-local run wrote it (then it is emptied)");
  flags.String("bin_dir", &a.bin_dir,
               "where the daemons are: an install's bin/ or a build tree (default: this "
               "binary's directory when they are installed next to it, else its build tree)");
  flags.String("cluster", &a.cluster,
               "ClusterSpec JSON: workers take its nodes' regions, the planner its links");
  flags.Bool("emulate_network", &a.emulate_network,
             "workers delay and rate-limit their frames per --cluster (emulation)");
  flags.Bool("wan", &a.wan,
             "run every daemon in a network namespace of the packet-level WAN test bed "
             "(tools/wan_testbed.sh, detour-wanem): worker i in --cluster node i's (one node "
             "per worker), the coordinator in a node of its own; real TCP over the spec's "
             "latencies and bandwidths. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and "
             "/dev/net/tun; excludes --emulate_network");
  flags.Double("wan_bandwidth_scale", &a.wan_bandwidth_scale,
               "--wan: every link's bandwidth times this, in (0, 1000] (the forwarder carries "
               "about 1.8 Gbit/s in all; docs/BENCHMARKS.md §WAN); the coordinator then plans "
               "on the scaled spec");
  flags.Double("wan_coordinator_latency_ms", &a.wan_coordinator_latency_ms,
               "--wan: one-way latency between the coordinator's node and every region");
  flags.String("wan_prefix", &a.wan_prefix,
               "--wan: the namespaces' prefix, <prefix>-<node id> (default dl<pid>)");
  flags.Int("torch_threads", &a.torch_threads, "LibTorch threads per worker");
  flags.Int("iterations", &a.iterations, "override the job's iterations (0 = the job's)");
  flags.Duration("link_probe_interval", &a.link_probe_interval,
                 "the coordinator's --link_probe_interval: while the job runs, a latency round "
                 "this often; 0 = none");
  flags.Duration("link_probe_bulk_interval", &a.link_probe_bulk_interval,
                 "the coordinator's --link_probe_bulk_interval: while the job runs, one slot of "
                 "bulk probes this often; 0 = none");
  flags.Bool("insecure", &a.insecure,
             "plaintext gRPC without authentication (default: TLS with a throwaway CA)");
  flags.String("certs", &a.certs,
               "directory with ca.crt, coordinator.crt/.key, w<N>.crt/.key and "
               "detour-local.crt/.key as tools/gen_certs.sh writes them; missing ones are "
               "made when ca.key is there (default: a fresh throwaway CA in <out>/certs)");
  bool version = false;
  flags.Bool("version", &version, "print the version and exit");
  auto rest = flags.Parse(argc, argv);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (version) {
    std::cout << "detour-local " << kVersion << " (" << kGitRevision << ")\n";
    return 0;
  }
  if (!rest->empty()) return flags.Fail(absl::InvalidArgumentError("unexpected arguments"));
  if (a.insecure && !a.certs.empty()) {
    return flags.Fail(absl::InvalidArgumentError("--insecure contradicts --certs"));
  }
  if (a.emulate_network && a.cluster.empty()) {
    return flags.Fail(absl::InvalidArgumentError("--emulate_network needs --cluster"));
  }
  if (a.wan && a.emulate_network) {
    return flags.Fail(absl::InvalidArgumentError(
        "--wan and --emulate_network exclude each other: --wan's network is the test bed's, "
        "--emulate_network's is inside the workers; choose one"));
  }
  if (a.wan && a.cluster.empty()) {
    return flags.Fail(absl::InvalidArgumentError("--wan needs --cluster (its nodes and links)"));
  }
  if (!(a.wan_bandwidth_scale > 0 && a.wan_bandwidth_scale <= 1000)) {
    return flags.Fail(absl::InvalidArgumentError("--wan_bandwidth_scale must be in (0, 1000]"));
  }
  if (!(a.wan_coordinator_latency_ms >= 0 && a.wan_coordinator_latency_ms <= 60000)) {
    return flags.Fail(
        absl::InvalidArgumentError("--wan_coordinator_latency_ms must be in [0, 60000]"));
  }
  if (!a.wan && (a.wan_bandwidth_scale != 1.0 || !a.wan_prefix.empty())) {
    return flags.Fail(
        absl::InvalidArgumentError("--wan_bandwidth_scale and --wan_prefix only apply with --wan"));
  }
  SetLogComponent("detour-local");
  Launcher launcher(a);
  std::atomic<bool> done{false};
  std::thread signals([&] {
    while (!done) {
      if (WaitForShutdownSignal(absl::Milliseconds(200)) != 0) {
        launcher.Interrupt();
        break;
      }
    }
  });
  const int code = launcher.Run();
  std::cout << "detour-local: stopping the daemons\n" << std::flush;
  launcher.StopAll();
  done = true;
  signals.join();
  return code;
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) { return detour::Main(argc, argv); }
