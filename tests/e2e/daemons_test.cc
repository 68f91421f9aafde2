// End-to-end: real detour-coordinator and detour-worker processes on
// ephemeral loopback ports, driven over gRPC, HTTP and signals.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/json.h"
#include "common/net/server.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

using DaemonsTest = E2eTest;

TEST_F(DaemonsTest, WorkersRegisterHeartbeatAndAreLostWhenKilled) {
  Daemon c = StartCoordinator();
  ASSERT_GT(c.grpc_port, 0);
  Daemon w1 = StartWorker(c.grpc_port, "w1");
  Daemon w2 = StartWorker(c.grpc_port, "w2");
  ASSERT_GT(w1.grpc_port, 0);
  ASSERT_GT(w2.grpc_port, 0);

  v1::ListWorkersResponse listed = ListWorkers(c.grpc_port, false);
  ASSERT_EQ(listed.workers_size(), 2);
  for (const v1::WorkerInfo& w : listed.workers()) {
    EXPECT_EQ(w.state(), v1::WORKER_STATE_IDLE);
    EXPECT_EQ(w.region(), "Oregon");
    EXPECT_THAT(w.address(), HasSubstr("127.0.0.1:"));
  }
  // Heartbeats keep arriving.
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::ListWorkersResponse now = ListWorkers(c.grpc_port, false);
        for (const auto& w : now.workers()) {
          if (w.heartbeats() < 3) return false;
        }
        return true;
      },
      absl::Seconds(5)));

  // Health over gRPC on all three servers.
  EXPECT_EQ(Health(c.grpc_port), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(w1.grpc_port), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_EQ(Health(w2.grpc_port), grpc::health::v1::HealthCheckResponse::SERVING);

  // A killed worker is marked lost after the silence (1.5 s), the other stays.
  w2.process->Signal(SIGKILL);
  ASSERT_TRUE(w2.process->Wait(absl::Seconds(5)).has_value());
  EXPECT_TRUE(Eventually(
      [&] {
        const v1::ListWorkersResponse now = ListWorkers(c.grpc_port, true);
        for (const auto& w : now.workers()) {
          if (w.worker_id() == w2.id) return w.state() == v1::WORKER_STATE_LOST;
        }
        return false;
      },
      absl::Seconds(6)))
      << c.process->Log();
  EXPECT_EQ(ListWorkers(c.grpc_port, false).workers_size(), 1);
  EXPECT_THAT(c.process->Log(), HasSubstr(absl::StrCat("worker ", w2.id, " lost")));

  // SIGTERM drains both remaining daemons cleanly and quickly.
  const absl::Time start = absl::Now();
  w1.process->Signal(SIGTERM);
  c.process->Signal(SIGTERM);
  EXPECT_EQ(w1.process->Wait(absl::Seconds(15)), 0) << w1.process->Log();
  EXPECT_EQ(c.process->Wait(absl::Seconds(15)), 0) << c.process->Log();
  EXPECT_LT(absl::Now() - start, absl::Seconds(12));
  EXPECT_THAT(c.process->Log(), HasSubstr("stopped cleanly"));
  EXPECT_THAT(w1.process->Log(), HasSubstr("stopped cleanly"));
}

TEST_F(DaemonsTest, MetricsScrapePassesPromtool) {
  Daemon c = StartCoordinator();
  ASSERT_GT(c.metrics_port, 0);
  Daemon w = StartWorker(c.grpc_port, "w1");
  ASSERT_GT(w.grpc_port, 0);
  ListWorkers(c.grpc_port, false);  // one RPC for the RPC metrics
  ASSERT_TRUE(Eventually([&] { return ListWorkers(c.grpc_port, false).workers_size() == 1; },
                         absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(1200));  // the registry gauges refresh every ~150 ms
  auto response = HttpGet(c.metrics_port, "/metrics");
  ASSERT_TRUE(response.ok()) << response.status();
  EXPECT_THAT(*response, HasSubstr("200 OK"));
  EXPECT_THAT(*response, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(*response, HasSubstr("detour_coordinator_workers{state=\"idle\"} 1"));
  EXPECT_THAT(*response, HasSubstr("detour_coordinator_registrations_total 1"));
  EXPECT_THAT(*response, HasSubstr("detour_build_info{component=\"coordinator\""));
  EXPECT_THAT(
      *response,
      HasSubstr("detour_rpc_server_handled_total{method=\"/detour.v1.ControlService/ListWorkers\","
                "code=\"OK\"}"));
  EXPECT_THAT(*response, HasSubstr("process_resident_memory_bytes"));

  const std::string body = response->substr(response->find("\r\n\r\n") + 4);
  const std::string file = dir_ + "/scrape.txt";
  std::ofstream(file) << body;
  std::string out;
  const int rc = Run({"/bin/sh", "-c", absl::StrCat("promtool check metrics < ", file)}, &out);
  EXPECT_EQ(rc, 0) << out;
}

TEST_F(DaemonsTest, DetourctlListsWorkersAndManagesJobs) {
  Daemon c = StartCoordinator();
  Daemon w = StartWorker(c.grpc_port, "w1", {"--worker_id=alpha"});
  const std::string target = absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port);
  std::string out;
  ASSERT_EQ(Run({Bin(kCtl), target, "workers", "--json"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("\"worker_id\": \"alpha\""));
  EXPECT_THAT(out, HasSubstr("WORKER_STATE_IDLE"));

  ASSERT_EQ(Run({Bin(kCtl), target, "health"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("SERVING"));

  const std::string spec = SourceDir() + "/examples/jobs/tiny_local.json";
  ASSERT_EQ(Run({Bin(kCtl), target, "--json", "submit", spec}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("\"id\": \"job-000001\""));
  EXPECT_THAT(out, HasSubstr("JOB_STATE_PENDING"));
  ASSERT_EQ(Run({Bin(kCtl), target, "list"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("job-000001"));
  EXPECT_THAT(out, HasSubstr("tiny-local"));
  ASSERT_EQ(Run({Bin(kCtl), target, "cancel", "job-000001"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("cancelled"));
  // Cancelling twice, unknown jobs, bad specs: errors with exit status 1.
  EXPECT_EQ(Run({Bin(kCtl), target, "cancel", "job-000001"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION"));
  EXPECT_EQ(Run({Bin(kCtl), target, "get", "job-999"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("NOT_FOUND"));
  const std::string bad = dir_ + "/bad.json";
  std::ofstream(bad) << R"({"name": "x", "iterations": 5, "model": {"preset": "tiny"},
                       "pipeline": {"skip_ratio": 1.5}})";
  EXPECT_EQ(Run({Bin(kCtl), target, "submit", bad}, &out), 1);
  EXPECT_THAT(out, HasSubstr("pipeline.skip_ratio"));
  // Usage errors: 2; unreachable coordinator: 3.
  EXPECT_EQ(Run({Bin(kCtl), target, "frobnicate"}, &out), 2);
  EXPECT_EQ(Run({Bin(kCtl), "--coordinator=127.0.0.1:1", "workers"}, &out), 3);
  EXPECT_THAT(out, HasSubstr("unreachable"));

  // The job list survives a coordinator restart (same data dir).
  c.process->Signal(SIGTERM);
  ASSERT_EQ(c.process->Wait(absl::Seconds(15)), 0);
  Daemon c2 = StartCoordinator({}, "c2");
  const std::string target2 = absl::StrCat("--coordinator=127.0.0.1:", c2.grpc_port);
  ASSERT_EQ(Run({Bin(kCtl), target2, "get", "job-000001"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("cancelled"));
  // So do its state series, though it ended before the restart (the
  // alerts on ended jobs need them).
  auto scrape = HttpGet(c2.metrics_port, "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_THAT(*scrape, HasSubstr("detour_coordinator_job_state{job_id=\"job-000001\","
                                 "state=\"cancelled\"} 1\n"));
}

// Before its first plan a job's workers probe each other over the tensor
// transport; `detourctl links` shows the matrix the planner uses, each entry
// with its source and age, and --json the GetLinks answer. Jobs that are not
// running have no live links: clear errors.
TEST_F(DaemonsTest, DetourctlLinksShowsTheProbedMatrixOfARunningJob) {
  // A region table whose links no socket limits can carry (100 GB/s over a
  // 2 s round trip): each worker warns about its link to the other.
  const std::string cluster = dir_ + "/cluster.json";
  std::ofstream(cluster) << R"({"name": "far", "nodes": [{"id": "n1", "region": "local"}],
      "intra_region_latency_ms": 1000, "intra_region_bandwidth_gbytes_per_s": 100})";
  Daemon c = StartCoordinator({"--link_probe_mib=4", "--cluster=" + cluster});
  Daemon a = StartWorker(c.grpc_port, "w1", {"--data_port=0"});
  Daemon b = StartWorker(c.grpc_port, "w2", {"--data_port=0"});
  const std::string target = absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port);
  std::string out;
  EXPECT_EQ(Run({Bin(kCtl), target, "links", "job-000001"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("NOT_FOUND"));
  const std::string spec = dir_ + "/links.json";
  std::ofstream(spec) << R"({"name": "links", "model": {"preset": "tiny"},
      "pipeline": {"num_stages": 2, "data_nodes": 1, "replicas_per_stage": 1,
                   "microbatches_per_data_node": 2, "samples_per_microbatch": 1},
      "data": {"source": "DATA_SOURCE_EMBEDDED"}, "iterations": 100000,
      "checkpoint": {"disabled": true}, "seed": 3, "device": "cpu"})";
  ASSERT_EQ(Run({Bin(kCtl), target, "submit", spec}, &out), 0) << out;
  // Until the first plan (probes included) there is nothing to show.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  int rc = 1;
  while (absl::Now() < deadline) {
    rc = Run({Bin(kCtl), target, "links", "job-000001"}, &out);
    if (rc == 0) break;
    EXPECT_THAT(out, HasSubstr("FAILED_PRECONDITION"));
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_EQ(rc, 0) << out << c.process->Log();
  // The start's latency round, then a bulk round each way (no link carries
  // probes both ways at once).
  EXPECT_THAT(out, HasSubstr("job job-000001: 2 links, 3 probe round(s)"));
  // The region table's link, checked against the socket limits, once.
  EXPECT_THAT(a.process->Log(), HasSubstr("job job-000001: link to w2: "));
  EXPECT_THAT(a.process->Log(), HasSubstr("caps one connection"));
  EXPECT_THAT(b.process->Log(), HasSubstr("job job-000001: link to w1: "));
  const std::string log = a.process->Log();
  size_t lines = 0;
  for (size_t at = log.find("link to w2: "); at != std::string::npos;
       at = log.find("link to w2: ", at + 1)) {
    const size_t end = log.find('\n', at);
    if (log.substr(at, end - at).find(" caps one connection") != std::string::npos) ++lines;
  }
  EXPECT_LE(lines, 2u) << log;  // one per direction the limits cap, not per round
  EXPECT_THAT(out, ::testing::ContainsRegex("w1 +w2 +[0-9.]+ ms +probe +(now|[0-9]+s ago)"));
  EXPECT_THAT(out, ::testing::ContainsRegex("w2 +w1 +[0-9.]+ ms +probe"));
  ASSERT_EQ(Run({Bin(kCtl), target, "--json", "links", "job-000001"}, &out), 0) << out;
  EXPECT_THAT(out, HasSubstr("\"latency_source\": \"SOURCE_PROBE\""));
  EXPECT_THAT(out, HasSubstr("\"bandwidth_source\": \"SOURCE_PROBE\""));
  EXPECT_THAT(out, HasSubstr("\"latency_measured\""));
  // What detourctl shows is what the sending worker's gauges say: one-way
  // latency half the probe's round trip, bandwidth the probe's rate.
  auto links = ParseJson(out);
  ASSERT_TRUE(links.ok()) << links.status() << "\n" << out;
  const JsonValue* list = links->Find("links");
  ASSERT_TRUE(list != nullptr && list->is_array()) << out;
  int compared = 0;
  for (const JsonValue& link : list->items()) {
    const JsonValue* from = link.Find("from");
    const JsonValue* to = link.Find("to");
    ASSERT_TRUE(from != nullptr && to != nullptr) << out;
    const Daemon& sender = from->string_value() == "w1" ? a : b;
    auto scrape = HttpGet(sender.metrics_port, "/metrics");
    ASSERT_TRUE(scrape.ok()) << scrape.status();
    const std::string peer = absl::StrCat("{peer=\"", to->string_value(), "\"}");
    const auto gauge = [&](const std::string& name) { return MetricValue(*scrape, name + peer); };
    const auto source = [&](const char* key) {
      const JsonValue* v = link.Find(key);
      return v != nullptr ? v->string_value() : std::string();
    };
    const JsonValue* latency = link.Find("latency_seconds");
    const JsonValue* bandwidth = link.Find("bandwidth_bytes_per_s");
    if (source("latency_source") == "SOURCE_PROBE" && latency != nullptr) {
      const double rtt = gauge("detour_worker_link_probe_rtt_seconds");
      EXPECT_NEAR(2 * latency->number(), rtt, 1e-4 * rtt) << *scrape;
      ++compared;
    }
    if (source("bandwidth_source") == "SOURCE_PROBE" && bandwidth != nullptr) {
      const double rate = gauge("detour_worker_link_probe_bandwidth_bytes_per_second");
      EXPECT_NEAR(bandwidth->number(), rate, 1e-4 * rate) << *scrape;
      ++compared;
    }
  }
  EXPECT_GE(compared, 2) << out;
  EXPECT_EQ(Run({Bin(kCtl), target, "links"}, &out), 2);
  ASSERT_EQ(Run({Bin(kCtl), target, "cancel", "job-000001"}, &out), 0) << out;
  EXPECT_EQ(Run({Bin(kCtl), target, "links", "job-000001"}, &out), 1);
  EXPECT_THAT(out, HasSubstr("not running"));
  // The start round, in the history (and so in the coordinator's log).
  EXPECT_THAT(c.process->Log(), HasSubstr("link probes: 2 of 2 links answered"));
}

// Lists services through gRPC server reflection with a hand-encoded request
// (ServerReflectionRequest.list_services = field 7), returning the raw reply.
std::string ReflectionListServices(std::shared_ptr<grpc::Channel> channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  cq.Next(&tag, &ok);
  const char request[] = {0x3a, 0x01, '*'};  // field 7 (string), length 1
  grpc::Slice slice(request, sizeof(request));
  grpc::ByteBuffer out(&slice, 1);
  call->Write(out, reinterpret_cast<void*>(2));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer reply;
  call->Read(&reply, reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  std::string text;
  grpc::Slice single;
  if (ok && reply.DumpToSingleSlice(&single).ok()) {
    text.assign(reinterpret_cast<const char*>(single.begin()), single.size());
  }
  call->WritesDone(reinterpret_cast<void*>(4));
  cq.Next(&tag, &ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {}
  return text;
}

TEST_F(DaemonsTest, ServersAnswerReflection) {
  Daemon c = StartCoordinator();
  Daemon w = StartWorker(c.grpc_port, "w1");
  const std::string coordinator = ReflectionListServices(Channel(c.grpc_port));
  EXPECT_THAT(coordinator, HasSubstr("detour.v1.JobService"));
  EXPECT_THAT(coordinator, HasSubstr("detour.v1.ControlService"));
  EXPECT_THAT(coordinator, HasSubstr("grpc.reflection.v1alpha.ServerReflection"));
  const std::string worker = ReflectionListServices(Channel(w.grpc_port));
  EXPECT_THAT(worker, HasSubstr("grpc.reflection.v1alpha.ServerReflection"));
}

TEST_F(DaemonsTest, LauncherStopsEverythingOnCtrlC) {
  const std::string job = dir_ + "/job.json";
  std::ofstream(job) << R"({"name": "ctrlc", "model": {"num_layers": 2, "d_model": 32,
      "num_heads": 2, "ffn_dim": 64, "context_length": 16},
    "pipeline": {"num_stages": 2, "microbatches_per_data_node": 2,
                 "samples_per_microbatch": 2, "scheduler": "SCHEDULER_FULL"},
    "iterations": 1000000})";
  const std::string out = dir_ + "/launcher";
  ChildProcess launcher;
  ASSERT_TRUE(launcher
                  .Start({Bin("tools/detour_local/detour-local"), "--job=" + job, "--out=" + out,
                          "--bin_dir=" + BuildDir()},
                         dir_ + "/launcher.log")
                  .ok());
  ASSERT_TRUE(Eventually([&] { return launcher.Log().find("RUNNING") != std::string::npos; },
                         absl::Seconds(60)))
      << launcher.Log();
  launcher.Signal(SIGINT);
  EXPECT_EQ(launcher.Wait(absl::Seconds(30)), 130) << launcher.Log();
  EXPECT_THAT(launcher.Log(), HasSubstr("interrupted; cancelling"));
  // No daemon of this launcher is left running.
  std::string out_text;
  // "launche[r]" matches the daemons' arguments but not this shell's own.
  const std::string pattern = dir_ + "/launche[r]/";
  EXPECT_EQ(Run({"/bin/sh", "-c", "pgrep -f -- '" + pattern + "' || true"}, &out_text), 0);
  EXPECT_EQ(out_text, "") << "left running: " << out_text;
  // The loss curve so far is written even when interrupted.
  EXPECT_TRUE(std::ifstream(out + "/loss.csv").good());
}

// Regression: `detour-local --out DIR` deleted an existing DIR's contents. A
// directory it did not write is refused untouched; its own output is reused.
TEST_F(DaemonsTest, LauncherNeverEmptiesADirectoryItDidNotWrite) {
  const std::string mine = dir_ + "/precious";
  std::filesystem::create_directories(mine);
  std::ofstream(mine + "/thesis.tex") << "years of work";
  std::string out;
  EXPECT_EQ(Run({Bin("tools/detour_local/detour-local"), "--job=/nonexistent.json", "--out=" + mine,
                 "--bin_dir=" + BuildDir()},
                &out),
            2)
      << out;
  EXPECT_THAT(out, ::testing::AnyOf(HasSubstr("was not written by detour-local"),
                                    HasSubstr("nonexistent")));
  EXPECT_TRUE(std::filesystem::exists(mine + "/thesis.tex"));
  // With a valid job the refusal names the directory.
  const std::string job = dir_ + "/job.json";
  std::ofstream(job) << R"({"name": "x", "model": {"preset": "tiny"}, "iterations": 1})";
  EXPECT_EQ(Run({Bin("tools/detour_local/detour-local"), "--job=" + job, "--out=" + mine,
                 "--bin_dir=" + BuildDir()},
                &out),
            2);
  EXPECT_THAT(out, HasSubstr("--out " + mine +
                             " exists, is not empty and was not written by "
                             "detour-local"));
  EXPECT_TRUE(std::filesystem::exists(mine + "/thesis.tex"));
}

TEST_F(DaemonsTest, BusyPortsAreClearErrors) {
  auto [fd, port] = OccupyPort();
  std::string out;
  EXPECT_EQ(Run({Bin(kCoordinator), absl::StrCat("--listen=127.0.0.1:", port), "--metrics_port=-1",
                 absl::StrCat("--data_dir=", dir_, "/c")},
                &out),
            1);
  EXPECT_THAT(out, HasSubstr(absl::StrCat("127.0.0.1:", port, " is already in use")));
  EXPECT_EQ(Run({Bin(kCoordinator), "--listen=127.0.0.1:0", absl::StrCat("--metrics_port=", port),
                 "--metrics_bind=127.0.0.1", absl::StrCat("--data_dir=", dir_, "/c")},
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("already in use"));
  EXPECT_THAT(out, HasSubstr("--metrics_port"));
  EXPECT_EQ(Run({Bin(kWorker), absl::StrCat("--listen=127.0.0.1:", port), "--metrics_port=-1",
                 absl::StrCat("--data_dir=", dir_, "/w"), "--connect_timeout=1s"},
                &out),
            1);
  EXPECT_THAT(out, HasSubstr("already in use"));
  ::close(fd);
}

TEST_F(DaemonsTest, FlagErrorsNameTheFlag) {
  struct Case {
    std::string binary;
    std::string flag;
    std::string expect;
  };
  const Case cases[] = {
      {kCoordinator, "--lisen=1", "unknown flag --lisen (did you mean --listen?)"},
      {kCoordinator, "--listen=nowhere", "--listen: \"nowhere\" is not host:port"},
      {kCoordinator, "--worker_silence=soon", "--worker_silence: \"soon\" is not a duration"},
      {kCoordinator, "--metrics_port=70000", "--metrics_port: 70000 is outside"},
      // 2^32 would wrap to 0 in a cast to int, turning re-planning off.
      {kCoordinator, "--replan_every=4294967296",
       "--replan_every: 4294967296 is not in [0, 1000000]"},
      {kCoordinator, "--replan_every=-1", "--replan_every: -1 is not in [0, 1000000]"},
      {kWorker, "--speed=-1", "--speed: -1 must be > 0"},
      {kWorker, "--device=tpu", "--device: \"tpu\" is not cpu or cuda"},
      {kWorker, "--coordinator=host", "--coordinator: \"host\" is not host:port"},
      {kWorker, "--memory_slots=x", "--memory_slots: \"x\" is not an integer"},
      {kWorker, "--peer_ack_timeout=0s", "--peer_ack_timeout: 0 is not in [1s, 1h]"},
      {kWorker, "--peer_connect_timeout=2h", "--peer_connect_timeout: 2h is not in [1s, 10m]"},
      {kWorker, "--memory_slots=0", "--memory_slots: 0 is not in [1, 1024]"},
      {kWorker, "--torch_threads=1025", "--torch_threads: 1025 is not in [0, 1024]"},
  };
  for (const Case& c : cases) {
    std::string out;
    EXPECT_EQ(Run({Bin(c.binary), c.flag}, &out), 2) << c.flag << ": " << out;
    EXPECT_THAT(out, HasSubstr(c.expect)) << c.flag;
  }
  std::string out;
  EXPECT_EQ(Run({Bin(kCoordinator), "--help"}, &out), 0);
  EXPECT_THAT(out, HasSubstr("--worker_silence"));
}

// --device=cuda on a LibTorch without CUDA (Debian's) used to start and fail
// the first job it was given; it must refuse at once, naming the cause.
TEST_F(DaemonsTest, WorkerRefusesCudaWithoutCuda) {
  std::string libraries;
  ASSERT_EQ(Run({"/bin/sh", "-c", "ldd " + Bin(kWorker)}, &libraries), 0) << libraries;
  if (libraries.find("_cuda") != std::string::npos) {
    GTEST_SKIP() << "this worker links a CUDA-enabled LibTorch: nothing to refuse";
  }
  auto [fd, port] = OccupyPort();
  ::close(fd);  // nothing listens there: a worker that did start would retry
  std::string out;
  EXPECT_EQ(Run({Bin(kWorker), "--device=cuda", "--listen=127.0.0.1:0", "--metrics_port=-1",
                 absl::StrCat("--coordinator=127.0.0.1:", port),
                 absl::StrCat("--data_dir=", dir_, "/w"), "--connect_timeout=1s"},
                &out),
            2);
  EXPECT_THAT(out, HasSubstr("--device=cuda: this worker's LibTorch was built without CUDA"));
  EXPECT_THAT(out, Not(HasSubstr("retrying in")));
}

TEST_F(DaemonsTest, UnreachableCoordinatorIsRetriedThenReported) {
  auto [fd, port] = OccupyPort();
  ::close(fd);  // nothing listens there now
  std::string out;
  const absl::Time start = absl::Now();
  EXPECT_EQ(Run({Bin(kWorker), "--listen=127.0.0.1:0", "--metrics_port=-1",
                 absl::StrCat("--coordinator=127.0.0.1:", port),
                 absl::StrCat("--data_dir=", dir_, "/w"), "--connect_timeout=2s"},
                &out),
            1);
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1500));
  EXPECT_THAT(out, HasSubstr("retrying in"));
  EXPECT_THAT(out, HasSubstr(absl::StrCat("coordinator 127.0.0.1:", port, " unreachable")));
}

TEST_F(DaemonsTest, WorkerRegistersAgainAfterCoordinatorRestart) {
  Daemon c = StartCoordinator();
  const int port = c.grpc_port;
  Daemon w = StartWorker(port, "w1", {"--worker_id=steady"});
  ASSERT_GT(w.grpc_port, 0);
  c.process->Signal(SIGTERM);
  ASSERT_EQ(c.process->Wait(absl::Seconds(15)), 0);
  // Same port again, so the worker's retries can find it.
  Daemon c2 = StartCoordinator({absl::StrCat("--listen=127.0.0.1:", port)}, "c2");
  ASSERT_EQ(c2.grpc_port, port) << c2.process->Log();
  EXPECT_TRUE(Eventually(
      [&] {
        auto listed = ListWorkers(port, false);
        return listed.workers_size() == 1 && listed.workers(0).worker_id() == "steady";
      },
      absl::Seconds(10)))
      << w.process->Log();
}

// Regression: a worker restarted within the silence window (here 60 s), even
// after a clean SIGTERM, was refused with ALREADY_EXISTS and exited. Its
// session ended, so its id registers again at once.
TEST_F(DaemonsTest, RestartedWorkerRegistersAgainUnderItsId) {
  Daemon c = StartCoordinator({"--worker_silence=60s"});
  Daemon w = StartWorker(c.grpc_port, "w1", {"--worker_id=steady"});
  ASSERT_GT(w.grpc_port, 0);
  w.process->Signal(SIGTERM);
  ASSERT_EQ(w.process->Wait(absl::Seconds(15)), 0);
  Daemon again = StartWorker(c.grpc_port, "w1b", {"--worker_id=steady"});
  ASSERT_GT(again.grpc_port, 0) << again.process->Log();
  EXPECT_FALSE(again.process->Wait(absl::Milliseconds(500)).has_value()) << again.process->Log();
  const v1::ListWorkersResponse listed = ListWorkers(c.grpc_port, true);
  ASSERT_EQ(listed.workers_size(), 1);
  EXPECT_EQ(listed.workers(0).worker_id(), "steady");
  EXPECT_EQ(listed.workers(0).address(), absl::StrCat("127.0.0.1:", again.grpc_port));
}

// Regression: after kill -9 and a restart of the coordinator, every worker
// stayed BUSY with the dead job and new jobs stayed PENDING until the workers
// were restarted by hand. Now a worker reporting a job the coordinator does
// not run is told to drop it, and the next job runs. (An elastic job is
// re-attached after a restart instead: TrainingTest.CoordinatorKillKeepsTheJob;
// this one opts out with elastic.disabled.)
TEST_F(DaemonsTest, WorkersDropJobsARestartedCoordinatorNoLongerRuns) {
  Daemon c = StartCoordinator();
  const int port = c.grpc_port;
  std::vector<Daemon> workers = StartWorkers(port, 2, {"--torch_threads=1"});
  v1::JobSpec spec;
  spec.set_name("long");
  spec.mutable_model()->set_num_layers(2);
  spec.mutable_model()->set_d_model(32);
  spec.mutable_model()->set_num_heads(2);
  spec.mutable_model()->set_ffn_dim(64);
  spec.mutable_model()->set_context_length(16);
  spec.mutable_pipeline()->set_num_stages(2);
  spec.mutable_pipeline()->set_microbatches_per_data_node(2);
  spec.mutable_pipeline()->set_scheduler(v1::SCHEDULER_FULL);
  spec.mutable_elastic()->set_disabled(true);
  spec.set_iterations(1000000);
  const v1::Job long_job = Submit(port, spec);
  ASSERT_TRUE(
      Eventually([&] { return GetJob(port, long_job.id()).state() == v1::JOB_STATE_RUNNING; },
                 absl::Seconds(60)));
  c.process->Signal(SIGKILL);
  c.process->Wait(absl::Seconds(10));
  Daemon c2 = StartCoordinator({absl::StrCat("--listen=127.0.0.1:", port)}, "c2");
  ASSERT_EQ(c2.grpc_port, port) << c2.process->Log();
  EXPECT_EQ(GetJob(port, long_job.id()).state(), v1::JOB_STATE_FAILED);
  spec.set_name("next");
  spec.set_iterations(2);
  const v1::Job next = Submit(port, spec);
  EXPECT_TRUE(Eventually([&] { return GetJob(port, next.id()).state() == v1::JOB_STATE_SUCCEEDED; },
                         absl::Seconds(60)))
      << GetJob(port, next.id()).DebugString() << c2.process->Log();
  // The log says what happened to the job the worker still held.
  EXPECT_THAT(c2.process->Log(), HasSubstr(absl::StrCat(long_job.id(), ", which ended (failed")));
}

int ThreadCount(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

// Regression: 2000 pending jobs meant 2015 threads and 42% CPU while idle (one
// polling thread per job), and SIGTERM marked every pending job FAILED,
// taking minutes. Now pending jobs wait in one queue, a drain keeps them
// PENDING for the next start, and finishes within its timeout.
TEST_F(DaemonsTest, PendingJobsCostNoThreadsAndSurviveADrain) {
  Daemon c = StartCoordinator({"--drain_timeout=5s"});
  ASSERT_GT(c.grpc_port, 0);
  const int before = ThreadCount(c.process->pid());
  v1::JobSpec spec;
  spec.set_name("waits");
  spec.mutable_model()->set_preset("tiny");
  spec.set_iterations(1);
  std::vector<std::string> ids;
  for (int i = 0; i < 200; ++i) ids.push_back(Submit(c.grpc_port, spec).id());
  EXPECT_LE(ThreadCount(c.process->pid()), before + 4);
  EXPECT_EQ(GetJob(c.grpc_port, ids.back()).state(), v1::JOB_STATE_PENDING);
  const absl::Time stop = absl::Now();
  c.process->Signal(SIGTERM);
  ASSERT_EQ(c.process->Wait(absl::Seconds(15)), 0) << c.process->Log();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(5));
  Daemon again = StartCoordinator({}, "c2");
  ASSERT_GT(again.grpc_port, 0) << again.process->Log();
  for (const std::string& id : {ids.front(), ids.back()}) {
    const v1::Job j = GetJob(again.grpc_port, id);
    EXPECT_EQ(j.state(), v1::JOB_STATE_PENDING) << j.DebugString();
    EXPECT_THAT(j.message(), HasSubstr("waiting for"));
  }
}

// A stored job whose spec no longer validates (here: 2^32-1 data nodes, the
// spec that used to abort the coordinator on every restart) fails with the
// reason on recovery; the coordinator stays up and serves the others.
TEST_F(DaemonsTest, InvalidStoredJobFailsOnRecoveryInsteadOfCrashing) {
  const std::string jobs = dir_ + "/coordinator/jobs";
  std::filesystem::create_directories(jobs);
  std::ofstream(jobs + "/job-000004.json")
      << R"({"id": "job-000004", "state": "JOB_STATE_PENDING", "spec": {"name": "evil",
           "model": {"preset": "tiny"}, "pipeline": {"data_nodes": 4294967295},
           "iterations": 1}})";
  Daemon c = StartCoordinator();
  ASSERT_GT(c.grpc_port, 0) << c.process->Log();
  const v1::Job j = GetJob(c.grpc_port, "job-000004");
  EXPECT_EQ(j.state(), v1::JOB_STATE_FAILED) << j.DebugString();
  EXPECT_THAT(j.message(), HasSubstr("stored spec is invalid: pipeline.data_nodes: 4294967295"));
  EXPECT_FALSE(c.process->Wait(absl::Milliseconds(200)).has_value()) << c.process->Log();
}

// --log_format=json: every line the coordinator and a worker write (TLS on,
// a worker registering, a plaintext client refused by gRPC core, a stop) is
// one JSON object with the six fields, and gRPC core's line is among them.
TEST_F(DaemonsTest, JsonLogLinesAreJsonObjects) {
  Daemon c = StartCoordinator({"--log_format=json"});
  ASSERT_GT(c.grpc_port, 0) << c.process->Log();
  std::vector<Daemon> workers = StartWorkers(c.grpc_port, 1, {"--log_format=json"});
  ASSERT_TRUE(Eventually(
      [&] {
        return c.process->Log().find("\"message\":\"worker w0 registered") != std::string::npos;
      },
      absl::Seconds(60)))
      << c.process->Log();
  std::string out;
  // Plaintext to the TLS port: gRPC core logs the failed handshake.
  Run({Bin(kCtl), absl::StrCat("--coordinator=127.0.0.1:", c.grpc_port), "--insecure",
       "--timeout=2s", "list"},
      &out, absl::Seconds(30), /*add_security=*/false);
  ASSERT_TRUE(
      Eventually([&] { return c.process->Log().find("\"message\":\"grpc: ") != std::string::npos; },
                 absl::Seconds(30)))
      << c.process->Log();
  workers[0].process->Stop(absl::Seconds(10));
  c.process->Stop(absl::Seconds(10));
  for (const Daemon* d : {&c, &workers[0]}) {
    const std::string log = d->process->Log();
    int lines = 0;
    for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
      ++lines;
      auto parsed = ParseJson(line);
      ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << line;
      ASSERT_TRUE(parsed->is_object()) << line;
      EXPECT_EQ(parsed->keys(), (std::vector<std::string>{"time", "level", "component", "message",
                                                          "job", "worker"}))
          << line;
    }
    EXPECT_GE(lines, 2) << log;
  }
  EXPECT_THAT(c.process->Log(), HasSubstr("\"worker\":\"w0\""));
  EXPECT_THAT(workers[0].process->Log(), HasSubstr("\"component\":\"worker w0\""));
}

}  // namespace
}  // namespace detour::testing
