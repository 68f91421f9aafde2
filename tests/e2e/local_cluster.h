// Shared fixture for end-to-end tests: starts real detour daemons as child
// processes on ephemeral loopback ports (each in its own temporary directory),
// runs short commands, and talks to the daemons over gRPC.
#ifndef DETOUR_TESTS_E2E_LOCAL_CLUSTER_H_
#define DETOUR_TESTS_E2E_LOCAL_CLUSTER_H_

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net/server.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/test_paths.h"

namespace detour::testing {

inline std::string Bin(const std::string& relative) { return BuildDir() + "/" + relative; }
inline const std::string kCoordinator = "coordinator/detour-coordinator";
inline const std::string kWorker = "worker/detour-worker";
inline const std::string kCtl = "tools/detourctl/detourctl";

struct Daemon {
  std::unique_ptr<ChildProcess> process = std::make_unique<ChildProcess>();
  int grpc_port = 0;
  int metrics_port = 0;
  std::string id;
};

class E2eTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTempDir("detour-e2e"); }

  Daemon StartCoordinator(std::vector<std::string> extra = {}, const std::string& name = "c") {
    Daemon d;
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    std::remove(ready.c_str());
    std::vector<std::string> argv = {Bin(kCoordinator), "--listen=127.0.0.1:0",
                                     "--metrics_port=0", "--metrics_bind=127.0.0.1",
                                     absl::StrCat("--data_dir=", dir_, "/coordinator"),
                                     "--worker_silence=1500ms", "--heartbeat_interval=200ms",
                                     absl::StrCat("--ready_file=", ready)};
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
    Daemon d;
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    std::vector<std::string> argv = {Bin(kWorker), "--listen=127.0.0.1:0", "--metrics_port=0",
                                     "--metrics_bind=127.0.0.1",
                                     absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
                                     absl::StrCat("--data_dir=", dir_, "/", name),
                                     "--region=Oregon", absl::StrCat("--ready_file=", ready)};
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
    auto id = WaitForReadyField(ready, "worker_id", absl::Seconds(1));
    if (id.ok()) d.id = *id;
    return d;
  }

  // Starts `count` workers named w0..w<count-1> against the coordinator.
  std::vector<Daemon> StartWorkers(int coordinator_port, int count,
                                   const std::vector<std::string>& extra = {}) {
    std::vector<Daemon> workers;
    for (int i = 0; i < count; ++i) {
      workers.push_back(StartWorker(coordinator_port, absl::StrCat("w", i), extra));
    }
    return workers;
  }

  // Runs a short-lived command; returns its exit code and fills `output`.
  int Run(const std::vector<std::string>& argv, std::string* output,
          absl::Duration timeout = absl::Seconds(30)) {
    static int counter = 0;
    const std::string log = absl::StrCat(dir_, "/cmd", ++counter, ".log");
    ChildProcess p;
    EXPECT_TRUE(p.Start(argv, log).ok());
    auto code = p.Wait(timeout);
    *output = p.Log();
    return code.value_or(-1);
  }

  static v1::ListWorkersResponse ListWorkers(int port, bool include_lost) {
    auto stub = v1::ControlService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListWorkersRequest request;
    request.set_include_lost(include_lost);
    v1::ListWorkersResponse response;
    grpc::Status status = stub->ListWorkers(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  static grpc::health::v1::HealthCheckResponse::ServingStatus Health(int port) {
    auto stub =
        grpc::health::v1::Health::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    grpc::Status status = stub->Check(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.status();
  }

  static v1::Job Submit(int port, const v1::JobSpec& spec) {
    auto stub = v1::JobService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::SubmitJobRequest request;
    *request.mutable_spec() = spec;
    v1::Job job;
    grpc::Status status = stub->Submit(&context, request, &job);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return job;
  }

  static v1::Job GetJob(int port, const std::string& id) {
    auto stub = v1::JobService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::Status status = stub->Get(&context, request, &job);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return job;
  }

  // Follows a job until it ends; returns the loss of every iteration (from
  // the progress events) and the final job in `final_job`.
  static std::vector<double> WatchLosses(int port, const std::string& id, v1::Job* final_job,
                                         absl::Duration timeout) {
    auto stub = v1::JobService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::WatchJobRequest request;
    request.set_job_id(id);
    auto reader = stub->Watch(&context, request);
    std::vector<double> losses;
    v1::JobEvent event;
    while (reader->Read(&event)) {
      const v1::JobProgress& p = event.job().progress();
      if (p.iteration() > losses.size()) losses.push_back(p.loss());
      *final_job = event.job();
    }
    grpc::Status status = reader->Finish();
    EXPECT_TRUE(status.ok()) << status.error_message();
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
};

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_LOCAL_CLUSTER_H_
