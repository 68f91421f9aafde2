// The job store on etcd at scale (a driver; docs/BENCHMARKS.md §"The job
// store on etcd"): stores --jobs ended jobs under a prefix of their own
// through JobStore (a create and a cancel each, as Submit and Cancel write
// them), loads them all into fresh stores as a new leader does, starts a real
// detour-coordinator on them and times its start-up (process start to its
// ready file: campaign, load, serving) and List of every job through
// JobService, in pages of 1000. etcd is the caller's (benchmarks/coordinator/
// etcd_store.sh starts one).
//
//   etcd_store_bench --etcd=127.0.0.1:2379 --coordinator_bin=build/coordinator/detour-coordinator
//       [--jobs=10000] [--prefix=/bench/]
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/net/server.h"
#include "common/spec.h"
#include "common/subprocess.h"
#include "coordinator/etcd/etcd_client.h"
#include "coordinator/etcd/etcd_job_backend.h"
#include "coordinator/job_store.h"
#include "detour/v1/job_service.grpc.pb.h"

namespace detour {
namespace {

std::unique_ptr<JobStore> NewStore(const std::vector<std::string>& endpoints,
                                   const std::string& prefix) {
  EtcdOptions options;
  options.endpoints = endpoints;
  options.call_timeout = absl::Seconds(30);
  auto client = EtcdClient::Create(options);
  if (!client.ok()) return nullptr;
  auto backend = EtcdJobBackend::Create(std::move(*client), prefix);
  if (!backend.ok()) return nullptr;
  return std::make_unique<JobStore>(std::move(*backend));
}

v1::JobSpec PendingSpec(int64_t j) {
  v1::JobSpec spec;
  spec.set_name(absl::StrCat("bench-", j));
  spec.mutable_model()->set_preset("tiny");
  spec.set_iterations(10);
  spec.mutable_pipeline()->set_num_stages(2);
  spec.mutable_pipeline()->set_data_nodes(1);
  spec.mutable_pipeline()->set_replicas_per_stage(1);
  spec.mutable_pipeline()->add_assignment()->add_nodes(absl::StrCat("absent-", j, "-a"));
  spec.mutable_pipeline()->add_assignment()->add_nodes(absl::StrCat("absent-", j, "-b"));
  auto normalized = NormalizeJobSpec(spec);
  return normalized.ok() ? *normalized : spec;
}

int Main(int argc, char** argv) {
  std::string etcd, bin = "build/coordinator/detour-coordinator", prefix = "/bench/";
  int64_t jobs = 10000;
  FlagSet flags("etcd_store_bench", "The job store on etcd with many jobs: load, start-up, List.");
  flags.String("etcd", &etcd, "host:port[,host:port...] of the etcd members");
  flags.String("coordinator_bin", &bin, "the detour-coordinator binary");
  flags.String("prefix", &prefix, "the key prefix of the benchmark's records");
  flags.Int("jobs", &jobs, "jobs in the store (ended ones)");
  auto rest = flags.Parse(argc, argv);
  if (!rest.ok()) return flags.Fail(rest.status());
  auto endpoints = ParseEtcdUrl(absl::StrCat("etcd://", etcd), "--etcd");
  if (!endpoints.ok() || jobs < 1 || jobs > 100000) {
    std::fprintf(stderr, "etcd_store_bench: --etcd=host:port[,...] and --jobs 1..100000\n");
    return 2;
  }

  auto store = NewStore(*endpoints, prefix);
  if (store == nullptr || !store->Load().ok()) {
    std::fprintf(stderr, "etcd_store_bench: cannot reach etcd at %s\n", etcd.c_str());
    return 1;
  }
  const int64_t present = static_cast<int64_t>(store->List(v1::JOB_STATE_UNSPECIFIED).size());
  absl::Time t = absl::Now();
  for (int64_t j = present; j < jobs; ++j) {
    auto job = store->Create(PendingSpec(j), absl::Now(), "stored");
    if (!job.ok() || !store->Cancel(job->id(), absl::Now(), "benchmark").ok()) {
      std::fprintf(stderr, "etcd_store_bench: storing job %lld failed\n",
                   static_cast<long long>(j));
      return 1;
    }
  }
  if (present < jobs) {
    const double s = absl::ToDoubleSeconds(absl::Now() - t);
    std::printf(
        "stored %lld jobs (create + cancel, 2 etcd transactions each): %.2f s, %.0f jobs/s\n",
        static_cast<long long>(jobs - present), s, (jobs - present) / s);
  }

  for (int round = 0; round < 3; ++round) {
    auto fresh = NewStore(*endpoints, prefix);
    t = absl::Now();
    auto loaded = fresh->Load();
    const double s = absl::ToDoubleSeconds(absl::Now() - t);
    if (!loaded.ok()) {
      std::fprintf(stderr, "etcd_store_bench: load: %s\n",
                   std::string(loaded.status().message()).c_str());
      return 1;
    }
    std::printf("load %d jobs from etcd into a fresh store (a new leader's load): %.3f s\n",
                *loaded, s);
  }

  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("detour-etcd-bench-", ::getpid()))
          .string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ChildProcess coordinator;
  const std::string ready = dir + "/ready.json";
  t = absl::Now();
  absl::Status started = coordinator.Start(
      {bin, "--listen=127.0.0.1:0", "--insecure", "--metrics_port=-1",
       absl::StrCat("--data_dir=", dir, "/data"), absl::StrCat("--ready_file=", ready),
       absl::StrCat("--store=etcd://", etcd), absl::StrCat("--store_prefix=", prefix)},
      dir + "/coordinator.log");
  auto port = started.ok() ? WaitForReadyField(ready, "grpc_port", absl::Seconds(120))
                           : absl::StatusOr<std::string>(started);
  const double startup = absl::ToDoubleSeconds(absl::Now() - t);
  if (!port.ok()) {
    std::fprintf(stderr, "etcd_store_bench: the coordinator did not start: %s\n%s\n",
                 std::string(port.status().message()).c_str(), coordinator.Log().c_str());
    return 1;
  }
  std::printf(
      "coordinator start-up with %lld jobs in etcd (process start to ready, leading): "
      "%.3f s\n",
      static_cast<long long>(jobs), startup);

  auto stub = v1::JobService::NewStub(
      MakeChannel(absl::StrCat("127.0.0.1:", *port), TransportSecurity::Insecure()));
  for (int round = 0; round < 3; ++round) {
    t = absl::Now();
    size_t listed = 0, pages = 0;
    std::string token;
    do {
      v1::ListJobsRequest request;
      request.set_page_size(1000);
      request.set_page_token(token);
      v1::ListJobsResponse response;
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
      grpc::Status s = stub->List(&context, request, &response);
      if (!s.ok()) {
        std::fprintf(stderr, "etcd_store_bench: List: %s\n", s.error_message().c_str());
        return 1;
      }
      listed += response.jobs_size();
      ++pages;
      token = response.next_page_token();
    } while (!token.empty() && pages < 1000);
    std::printf("List of every job through JobService (%zu jobs, %zu pages of <= 1000): %.3f s\n",
                listed, pages, absl::ToDoubleSeconds(absl::Now() - t));
  }
  coordinator.Signal(SIGTERM);
  coordinator.Wait(absl::Seconds(30));
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) { return detour::Main(argc, argv); }
