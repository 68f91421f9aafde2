// Shared fixture for end-to-end tests: starts real detour daemons as child
// processes on ephemeral loopback ports (each in its own temporary directory),
// runs short commands, and talks to the daemons over gRPC.
//
// Everything runs with TLS by default, as a deployment would: one throwaway
// CA per test binary (tools/gen_certs.sh, certificates made on first use, a
// few milliseconds each), the coordinator's certificate "coordinator", each
// worker's named by its worker id, and the test's own client certificate
// "e2e-client" (the coordinator runs without --auth_tokens, so any
// certificate from the CA may submit). A test sets `tls_ = false` before
// starting daemons to run them with --insecure instead.
#ifndef DETOUR_TESTS_E2E_LOCAL_CLUSTER_H_
#define DETOUR_TESTS_E2E_LOCAL_CLUSTER_H_

#include <stdlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "common/net/tls.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/test_paths.h"

namespace detour::testing {

inline const std::string kCoordinator = "coordinator/detour-coordinator";
inline const std::string kWorker = "worker/detour-worker";
inline const std::string kCtl = "tools/detourctl/detourctl";

// A program of the build under test. The daemons may come from another build
// than the tests and the tools: $DETOUR_E2E_COORDINATOR_BUILD_DIR and
// $DETOUR_E2E_WORKER_BUILD_DIR (tools/checks.sh runs the ASan-built e2e
// tests against a ThreadSanitizer coordinator this way).
inline std::string Bin(const std::string& relative) {
  const char* dir = nullptr;
  if (relative == kCoordinator) dir = std::getenv("DETOUR_E2E_COORDINATOR_BUILD_DIR");
  if (relative == kWorker) dir = std::getenv("DETOUR_E2E_WORKER_BUILD_DIR");
  return (dir != nullptr && *dir != '\0' ? std::string(dir) : BuildDir()) + "/" + relative;
}

// Sanitizer reports of the processes a test starts. When the test runs with
// ASAN_OPTIONS / TSAN_OPTIONS / UBSAN_OPTIONS set (tools/checks.sh), every
// process it starts from now on — daemons, tools and their children —
// writes its reports to `dir`/sanitizer.<pid> instead of its log
// (log_path; a later flag overrides an earlier one), and
// SanitizerReports(dir) collects them for the test to fail on. Changes this
// process's environment: call before starting threads that read it (SetUp;
// ctest runs one test per process).
inline void RouteSanitizerReports(const std::string& dir) {
  for (const char* var : {"ASAN_OPTIONS", "TSAN_OPTIONS", "UBSAN_OPTIONS"}) {
    const char* options = std::getenv(var);
    if (options == nullptr) continue;
    ::setenv(var, absl::StrCat(options, ":log_path=", dir, "/sanitizer").c_str(), 1);
  }
}

inline std::string SanitizerReports(const std::string& dir) {
  std::string reports;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("sanitizer.", 0) != 0) continue;
    std::ifstream in(entry.path());  // the first 16 KiB of each
    std::string text(16384, '\0');
    in.read(text.data(), static_cast<std::streamsize>(text.size()));
    text.resize(static_cast<size_t>(in.gcount()));
    absl::StrAppend(&reports, "==== ", entry.path().string(), "\n", text, "\n");
  }
  return reports;
}

// The test binary's CA and certificates: made once, removed when the binary
// exits (its daemons have stopped by then; the next run makes new ones).
inline const std::string& CertsDir() {
  struct Certs {
    std::string path = MakeTempDir("detour-e2e-certs");
    ~Certs() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Certs certs;
  return certs.path;
}

// The kind tools/gen_certs.sh marks `name`'s certificate with: "coordinator"
// is the coordinator's; "reader" and names ending in "client" (the test's
// own "e2e-client") are clients'; any other name is a worker's.
inline std::string CertKind(const std::string& name) {
  if (name == "coordinator") return "--coordinator";
  if (name == "reader" || absl::EndsWith(name, "client")) return "--client";
  return "--worker";
}

// CertsDir()/<name> (.crt, .key), made with tools/gen_certs.sh if missing,
// of `kind` (--worker, --coordinator, --client; CertKind by default).
inline std::string CertFor(const std::string& name, const std::string& kind = "") {
  const std::string prefix = CertsDir() + "/" + name;
  if (!std::filesystem::exists(prefix + ".crt")) {
    ChildProcess gen;
    EXPECT_TRUE(gen.Start({SourceDir() + "/tools/gen_certs.sh", CertsDir(),
                           kind.empty() ? CertKind(name) : kind, name},
                          CertsDir() + "/gen_certs.log")
                    .ok());
    EXPECT_EQ(gen.Wait(absl::Seconds(30)), 0) << gen.Log();
  }
  return prefix;
}

// Flags presenting `name`'s certificate and trusting the test CA.
inline std::vector<std::string> TlsFlags(const std::string& name) {
  const std::string prefix = CertFor(name);
  return {absl::StrCat("--tls_cert=", prefix, ".crt"), absl::StrCat("--tls_key=", prefix, ".key"),
          absl::StrCat("--tls_ca=", CertsDir(), "/ca.crt")};
}

// The test's own client credentials ("e2e-client").
inline const TransportSecurity& ClientSecurity() {
  static const TransportSecurity* const security = [] {
    const std::string prefix = CertFor("e2e-client");
    TlsFiles files;
    files.cert = prefix + ".crt";
    files.key = prefix + ".key";
    files.ca = CertsDir() + "/ca.crt";
    auto loaded = TransportSecurity::Load(files, /*client=*/true);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return new TransportSecurity(loaded.ok() ? *loaded : TransportSecurity::Insecure());
  }();
  return *security;
}

struct Daemon {
  std::unique_ptr<ChildProcess> process = std::make_unique<ChildProcess>();
  int grpc_port = 0;
  int metrics_port = 0;
  int data_port = -1;  // a worker's direct transport; -1 = none
  std::string id;
};

class E2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("detour-e2e");
    RouteSanitizerReports(dir_);
  }
  // A sanitizer report from any process the test started fails the test.
  void TearDown() override {
    const std::string reports = SanitizerReports(dir_);
    EXPECT_TRUE(reports.empty()) << "sanitizer reports from processes this test started:\n"
                                 << reports;
    // A failed test's logs and data stay for whoever reads the failure, and
    // every test's with DETOUR_E2E_KEEP_DIRS=1.
    if (HasFailure() || KeepTestDirs()) {
      std::cerr << "the test's daemons' logs and data: " << dir_ << "\n";
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  Daemon StartCoordinator(std::vector<std::string> extra = {}, const std::string& name = "c") {
    Daemon d;
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    std::remove(ready.c_str());
    // Loopback links: probes of a few MiB measure them (the default's
    // streams of 32 MiB probes took 20 s of a six-worker test).
    std::vector<std::string> argv = {Bin(kCoordinator),
                                     "--listen=127.0.0.1:0",
                                     "--metrics_port=0",
                                     "--metrics_bind=127.0.0.1",
                                     absl::StrCat("--data_dir=", dir_, "/coordinator"),
                                     "--worker_silence=1500ms",
                                     "--heartbeat_interval=200ms",
                                     "--link_probe_mib=4",
                                     absl::StrCat("--ready_file=", ready)};
    AddSecurityFlags("coordinator", &argv);
    argv.insert(argv.end(), extra.begin(), extra.end());
    EXPECT_TRUE(d.process->Start(argv, absl::StrCat(dir_, "/", name, ".log")).ok());
    auto port = WaitForReadyField(ready, "grpc_port", absl::Seconds(20));
    EXPECT_TRUE(port.ok()) << port.status() << "\n" << d.process->Log();
    if (port.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*port, &d.grpc_port));
    }
    auto metrics = WaitForReadyField(ready, "metrics_port", absl::Seconds(1));
    if (metrics.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*metrics, &d.metrics_port));
    }
    return d;
  }

  Daemon StartWorker(int coordinator_port, const std::string& name,
                     std::vector<std::string> extra = {}) {
    Daemon d = LaunchWorker(coordinator_port, name, std::move(extra));
    AwaitWorker(name, absl::Seconds(20), &d);
    return d;
  }

  // Starts `count` workers named w0..w<count-1> against the coordinator, all
  // at once (each spends about a second starting up), and waits until every
  // one has registered.
  std::vector<Daemon> StartWorkers(int coordinator_port, int count,
                                   const std::vector<std::string>& extra = {}) {
    std::vector<Daemon> workers;
    for (int i = 0; i < count; ++i) {
      workers.push_back(LaunchWorker(coordinator_port, absl::StrCat("w", i), extra));
    }
    // Sanitized workers starting together on two cores may take a while.
    for (int i = 0; i < count; ++i) {
      AwaitWorker(absl::StrCat("w", i), absl::Seconds(60), &workers[i]);
    }
    return workers;
  }

  // A worker's process, started; AwaitWorker waits for its ready file (it
  // writes it once registered) and reads its ports and id.
  Daemon LaunchWorker(int coordinator_port, const std::string& name,
                      std::vector<std::string> extra) {
    Daemon d;
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    std::remove(ready.c_str());  // a restarted worker's, of its last start
    std::vector<std::string> argv = {Bin(kWorker),
                                     "--listen=127.0.0.1:0",
                                     "--metrics_port=0",
                                     "--metrics_bind=127.0.0.1",
                                     absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
                                     absl::StrCat("--data_dir=", dir_, "/", name),
                                     "--region=Oregon",
                                     absl::StrCat("--ready_file=", ready)};
    // With TLS the certificate names the worker: --worker_id when given, else `name`.
    std::string cert_name = name;
    for (const std::string& flag : extra) {
      if (flag.rfind("--worker_id=", 0) == 0) cert_name = flag.substr(12);
    }
    AddSecurityFlags(cert_name, &argv);
    argv.insert(argv.end(), extra.begin(), extra.end());
    EXPECT_TRUE(d.process->Start(argv, absl::StrCat(dir_, "/", name, ".log")).ok());
    return d;
  }

  void AwaitWorker(const std::string& name, absl::Duration timeout, Daemon* d) {
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    auto port = WaitForReadyField(ready, "grpc_port", timeout);
    EXPECT_TRUE(port.ok()) << port.status() << "\n" << d->process->Log();
    if (port.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*port, &d->grpc_port));
    }
    auto metrics = WaitForReadyField(ready, "metrics_port", absl::Seconds(1));
    if (metrics.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*metrics, &d->metrics_port));
    }
    auto data = WaitForReadyField(ready, "data_port", absl::Seconds(1));
    if (data.ok()) {
      EXPECT_TRUE(absl::SimpleAtoi(*data, &d->data_port));
    }
    auto id = WaitForReadyField(ready, "worker_id", absl::Seconds(1));
    if (id.ok()) d->id = *id;
  }

  // --insecure, or TLS flags presenting `name`'s certificate.
  void AddSecurityFlags(const std::string& name, std::vector<std::string>* argv) const {
    if (!tls_) {
      argv->push_back("--insecure");
      return;
    }
    for (std::string& flag : TlsFlags(name)) argv->push_back(std::move(flag));
  }

  // Runs a short-lived command; returns its exit code and fills `output`.
  // detourctl, the coordinator and the worker get the test's security flags
  // (as the first flags, so a test's own --insecure or --tls_* contradict
  // them only on purpose) unless `add_security` is false.
  int Run(std::vector<std::string> argv, std::string* output,
          absl::Duration timeout = absl::Seconds(30), bool add_security = true) {
    static int counter = 0;
    const std::string log = absl::StrCat(dir_, "/cmd", ++counter, ".log");
    if (add_security && !argv.empty()) {
      std::vector<std::string> flags;
      if (argv[0] == Bin(kCtl)) AddSecurityFlags("e2e-client", &flags);
      if (argv[0] == Bin(kCoordinator)) AddSecurityFlags("coordinator", &flags);
      if (argv[0] == Bin(kWorker)) AddSecurityFlags("runner", &flags);
      argv.insert(argv.begin() + 1, flags.begin(), flags.end());
    }
    ChildProcess p;
    EXPECT_TRUE(p.Start(argv, log).ok());
    auto code = p.Wait(timeout);
    *output = p.Log();
    return code.value_or(-1);
  }

  // A channel to a daemon on this machine with the test's client credentials.
  std::shared_ptr<grpc::Channel> Channel(int port) const {
    return MakeChannel(absl::StrCat("127.0.0.1:", port),
                       tls_ ? ClientSecurity() : TransportSecurity::Insecure());
  }

  v1::ListWorkersResponse ListWorkers(int port, bool include_lost) {
    auto stub = v1::ControlService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListWorkersRequest request;
    request.set_include_lost(include_lost);
    v1::ListWorkersResponse response;
    grpc::Status status = stub->ListWorkers(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  grpc::health::v1::HealthCheckResponse::ServingStatus Health(int port) {
    auto stub = grpc::health::v1::Health::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  }

  v1::Job Submit(int port, const v1::JobSpec& spec) {
    auto stub = v1::JobService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::Job job;
    grpc::Status status = stub->Submit(&context, request, &job);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return job;
  }

  v1::Job GetJob(int port, const std::string& id) {
    auto stub = v1::JobService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::Status status = stub->Get(&context, request, &job);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return job;
  }

  // Follows a job until its Watch stream ends (at a final state, or at
  // `timeout`): the loss of every progress update, by the iteration count it
  // reports (a later update of the same count wins, so an iteration redone
  // after a resume replaces the earlier one), and the last job seen in
  // `final_job` when not null; how the stream ended in `status` when not
  // null.
  std::map<uint64_t, double> WatchLossMap(int port, const std::string& id,
                                          v1::Job* final_job = nullptr,
                                          absl::Duration timeout = absl::Seconds(300),
                                          grpc::Status* status = nullptr) {
    auto stub = v1::JobService::NewStub(Channel(port));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::WatchJobRequest request;
    request.set_job_id(id);
    auto reader = stub->Watch(&context, request);
    std::map<uint64_t, double> losses;
    v1::JobEvent event;
    while (reader->Read(&event)) {
      const v1::JobProgress& p = event.job().progress();
      if (p.iteration() > 0) losses[p.iteration()] = p.loss();
      if (final_job != nullptr) *final_job = event.job();
    }
    const grpc::Status finished = reader->Finish();
    if (status != nullptr) *status = finished;
    return losses;
  }

  // WatchLossMap's losses in iteration order, for a job that runs straight
  // through; the stream must end OK.
  std::vector<double> WatchLosses(int port, const std::string& id, v1::Job* final_job,
                                  absl::Duration timeout) {
    grpc::Status status;
    const std::map<uint64_t, double> by_iteration =
        WatchLossMap(port, id, final_job, timeout, &status);
    EXPECT_TRUE(status.ok()) << status.error_message();
    std::vector<double> losses;
    for (const auto& [iteration, loss] : by_iteration) losses.push_back(loss);
    return losses;
  }

  // Polls until `predicate` holds or `timeout` passes.
  template <typename P>
  static bool Eventually(P predicate, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      if (predicate()) return true;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return predicate();
  }

  std::string dir_;
  bool tls_ = true;
};

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_LOCAL_CLUSTER_H_
