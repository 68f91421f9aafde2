// Coordinator under load: starts a real detour-coordinator as a
// process, registers N workers that each keep a real Session stream with
// heartbeats (light in-process callback clients, one timer for all), stores
// pending jobs, then runs C concurrent client threads doing Get and List
// (alternating) for a while, and reports p50/p90/p99/max latency of each,
// their rate, errors, and the coordinator's RSS (now and peak) from /proc.
//
//   coordinator_load --coordinator_bin=build/coordinator/detour-coordinator
//       [--workers=1000] [--clients=200] [--jobs=100] [--seconds=20]
//
// Jobs are pinned to worker ids nobody has, so they stay PENDING and the
// load is the API, the registry and the heartbeats, not training.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/net/server.h"
#include "common/spec.h"
#include "common/subprocess.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "detour/v1/job_service.grpc.pb.h"

namespace detour {
namespace {

// One fake worker's Session: writes a heartbeat when told, one write at a
// time, reads (and ignores) what the coordinator sends. Owned by gRPC
// until OnDone, which only counts it down.
class FakeSession : public grpc::ClientBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  FakeSession(v1::ControlService::Stub* stub, std::string token, std::atomic<int>* live)
      : token_(std::move(token)), live_(live) {
    stub->async()->Session(&context_, this);
    StartRead(&incoming_);
    StartCall();
  }
  // From the timer thread: a heartbeat, unless one is still being written.
  void Beat() {
    {
      absl::MutexLock lock(&mu_);
      if (writing_ || done_) return;
      writing_ = true;
      out_.set_session_token(token_);
      out_.mutable_heartbeat()->set_seq(++seq_);
    }
    StartWrite(&out_);
  }
  void Cancel() { context_.TryCancel(); }
  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (ok) beats_ok.fetch_add(1, std::memory_order_relaxed);
  }
  void OnReadDone(bool ok) override {
    if (ok) StartRead(&incoming_);
  }
  void OnDone(const grpc::Status&) override {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    live_->fetch_sub(1);
  }

  static std::atomic<uint64_t> beats_ok;

 private:
  grpc::ClientContext context_;
  const std::string token_;
  std::atomic<int>* const live_;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t seq_ ABSL_GUARDED_BY(mu_) = 0;
  v1::WorkerMessage out_;
  v1::CoordinatorMessage incoming_;
};
std::atomic<uint64_t> FakeSession::beats_ok{0};

struct Latencies {
  absl::Mutex mu;
  std::vector<double> get_ms ABSL_GUARDED_BY(mu), list_ms ABSL_GUARDED_BY(mu);
  uint64_t errors ABSL_GUARDED_BY(mu) = 0;
};

double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

// kB from /proc/<pid>/status ("VmRSS", "VmHWM").
int64_t ProcStatusKb(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      std::istringstream fields(line.substr(key.size() + 1));
      int64_t kb = 0;
      fields >> kb;
      return kb;
    }
  }
  return -1;
}

std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return absl::StrCat(a, " ", b, " ", c);
}

int Main(int argc, char** argv) {
  std::string bin = "build/coordinator/detour-coordinator";
  int64_t workers = 1000, clients = 200, jobs = 100, seconds = 20;
  FlagSet flags("coordinator_load",
                "Coordinator under load: N workers with heartbeats, C clients doing Get/List.");
  flags.String("coordinator_bin", &bin, "the detour-coordinator binary");
  flags.Int("workers", &workers, "registered workers, each with a Session and heartbeats");
  flags.Int("clients", &clients, "concurrent client threads doing Get and List");
  flags.Int("jobs", &jobs, "pending jobs in the store (List pages show them)");
  flags.Int("seconds", &seconds, "how long the clients run");
  auto rest = flags.Parse(argc, argv);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (workers < 1 || workers > 10000 || clients < 1 || clients > 2000 || jobs < 1 ||
      jobs > 100000 || seconds < 1 || seconds > 3600) {
    std::fprintf(stderr,
                 "coordinator_load: --workers 1..10000, --clients 1..2000, --jobs "
                 "1..100000, --seconds 1..3600\n");
    return 2;
  }

  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("detour-load-", ::getpid())).string();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ChildProcess coordinator;
  const std::string ready = dir + "/ready.json";
  absl::Status started =
      coordinator.Start({bin, "--listen=127.0.0.1:0", "--insecure", "--metrics_port=-1",
                         absl::StrCat("--data_dir=", dir, "/data"),
                         absl::StrCat("--ready_file=", ready), "--log_level=warning"},
                        dir + "/coordinator.log");
  auto port = started.ok() ? WaitForReadyField(ready, "grpc_port", absl::Seconds(30))
                           : absl::StatusOr<std::string>(started);
  if (!port.ok()) {
    std::fprintf(stderr, "coordinator_load: coordinator did not start: %s\n%s\n",
                 std::string(port.status().message()).c_str(), coordinator.Log().c_str());
    return 1;
  }
  const std::string address = absl::StrCat("127.0.0.1:", *port);
  const pid_t pid = coordinator.pid();
  std::printf("machine: %u cores; load average before: %s\n", std::thread::hardware_concurrency(),
              LoadAverage().c_str());
  std::printf("coordinator pid %d at %s; RSS idle %lld kB\n", pid, address.c_str(),
              static_cast<long long>(ProcStatusKb(pid, "VmRSS")));

  // Workers: Register, then a Session each; heartbeats every interval.
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < 8; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("detour.load.channel", i);  // distinct connections
    channels.push_back(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  std::vector<std::unique_ptr<v1::ControlService::Stub>> control;
  for (auto& c : channels) control.push_back(v1::ControlService::NewStub(c));
  std::atomic<int> live{0};
  std::vector<FakeSession*> sessions;
  uint32_t interval_ms = 2000;
  const absl::Time reg_start = absl::Now();
  for (int64_t w = 0; w < workers; ++w) {
    v1::RegisterRequest request;
    request.set_worker_id(absl::StrCat("load-", w));
    request.set_region("load");
    request.set_speed(1);
    request.set_memory_slots(3);
    request.set_address(absl::StrCat("127.0.0.1:", 20000 + w));
    request.set_device("cpu");
    v1::RegisterResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    grpc::Status s = control[w % control.size()]->Register(&context, request, &response);
    if (!s.ok()) {
      std::fprintf(stderr, "coordinator_load: Register %lld: %s\n", static_cast<long long>(w),
                   s.error_message().c_str());
      return 1;
    }
    interval_ms = response.heartbeat_interval_ms();
    live.fetch_add(1);
    sessions.push_back(
        new FakeSession(control[w % control.size()].get(), response.session_token(), &live));
  }
  std::printf("registered %lld workers in %.1f s (heartbeat every %u ms)\n",
              static_cast<long long>(workers), absl::ToDoubleSeconds(absl::Now() - reg_start),
              interval_ms);
  absl::Notification stop_beats;
  std::thread beater([&] {
    while (!stop_beats.WaitForNotificationWithTimeout(absl::Milliseconds(interval_ms))) {
      for (FakeSession* s : sessions) s->Beat();
    }
  });

  // Pending jobs pinned to workers nobody has.
  auto jobs_stub = v1::JobService::NewStub(channels[0]);
  std::vector<std::string> ids;
  for (int64_t j = 0; j < jobs; ++j) {
    v1::SubmitJobRequest request;
    v1::JobSpec* spec = request.mutable_spec();
    spec->set_name(absl::StrCat("load-", j));
    spec->mutable_model()->set_preset("tiny");
    spec->set_iterations(10);
    spec->mutable_pipeline()->set_num_stages(2);
    spec->mutable_pipeline()->set_data_nodes(1);
    spec->mutable_pipeline()->set_replicas_per_stage(1);
    spec->mutable_pipeline()->add_assignment()->add_nodes(absl::StrCat("absent-", j, "-a"));
    spec->mutable_pipeline()->add_assignment()->add_nodes(absl::StrCat("absent-", j, "-b"));
    v1::Job job;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    grpc::Status s = jobs_stub->Submit(&context, request, &job);
    if (!s.ok()) {
      std::fprintf(stderr, "coordinator_load: Submit: %s\n", s.error_message().c_str());
      return 1;
    }
    ids.push_back(job.id());
  }
  absl::SleepFor(absl::Milliseconds(2 * interval_ms));  // heartbeats in full swing

  // Clients: Get and List alternating, each call with its own deadline.
  Latencies lat;
  std::vector<std::thread> threads;
  const absl::Time end = absl::Now() + absl::Seconds(seconds);
  const std::string load_during = LoadAverage();
  for (int64_t c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      auto stub = v1::JobService::NewStub(channels[c % channels.size()]);
      std::mt19937 rng(static_cast<uint32_t>(c));
      std::vector<double> get_ms, list_ms;
      uint64_t errors = 0;
      for (uint64_t n = 0; absl::Now() < end; ++n) {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
        const absl::Time t0 = absl::Now();
        grpc::Status s;
        if (n % 2 == 0) {
          v1::GetJobRequest request;
          request.set_job_id(ids[rng() % ids.size()]);
          v1::Job job;
          s = stub->Get(&context, request, &job);
          get_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
        } else {
          v1::ListJobsRequest request;
          v1::ListJobsResponse response;
          s = stub->List(&context, request, &response);
          list_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
        }
        if (!s.ok()) ++errors;
      }
      absl::MutexLock lock(&lat.mu);
      lat.get_ms.insert(lat.get_ms.end(), get_ms.begin(), get_ms.end());
      lat.list_ms.insert(lat.list_ms.end(), list_ms.begin(), list_ms.end());
      lat.errors += errors;
    });
  }
  for (auto& t : threads) t.join();
  const int64_t rss = ProcStatusKb(pid, "VmRSS");
  const int64_t hwm = ProcStatusKb(pid, "VmHWM");
  const int alive = live.load();
  const uint64_t beats = FakeSession::beats_ok.load();

  // Are the workers still alive in the registry (heartbeats got through)?
  int listed_alive = -1;
  {
    v1::ListWorkersRequest request;
    v1::ListWorkersResponse response;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    if (control[0]->ListWorkers(&context, request, &response).ok()) {
      listed_alive = response.workers_size();
    }
  }
  stop_beats.Notify();
  beater.join();

  absl::MutexLock lock(&lat.mu);
  std::printf("load average while the clients started: %s; after: %s\n", load_during.c_str(),
              LoadAverage().c_str());
  std::printf(
      "%lld clients for %lld s against %d live sessions (%llu heartbeats written, "
      "%d workers not lost)\n",
      static_cast<long long>(clients), static_cast<long long>(seconds), alive,
      static_cast<unsigned long long>(beats), listed_alive);
  for (auto [name, v] :
       {std::pair<const char*, std::vector<double>*>{"Get", &lat.get_ms}, {"List", &lat.list_ms}}) {
    const size_t n = v->size();
    std::printf("%-4s %8zu calls %8.0f/s  p50 %7.2f ms  p90 %7.2f ms  p99 %7.2f ms  max %7.2f ms\n",
                name, n, n / static_cast<double>(seconds), Percentile(*v, 0.5), Percentile(*v, 0.9),
                Percentile(*v, 0.99), Percentile(*v, 1.0));
  }
  std::printf("errors %llu\n", static_cast<unsigned long long>(lat.errors));
  std::printf("coordinator RSS %lld kB now, %lld kB peak\n", static_cast<long long>(rss),
              static_cast<long long>(hwm));

  for (FakeSession* s : sessions) s->Cancel();
  for (int i = 0; i < 1000 && live.load() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  if (live.load() == 0) {  // every OnDone ran: safe to free
    for (FakeSession* s : sessions) delete s;
  }
  coordinator.Stop(absl::Seconds(10));
  std::filesystem::remove_all(dir);
  return lat.errors == 0 ? 0 : 1;
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) { return detour::Main(argc, argv); }
