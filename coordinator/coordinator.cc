#include "coordinator/coordinator.h"

#include <unistd.h>

#include <set>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/files.h"
#include "common/log.h"
#include "common/metrics/grpc_metrics.h"
#include "common/metrics/process_metrics.h"
#include "common/status.h"
#include "common/version.h"
#include "coordinator/etcd/etcd_job_backend.h"
#include "coordinator/etcd/etcd_worker_directory.h"
#include "coordinator/file_job_backend.h"
#include "coordinator/metered_job_backend.h"
#include "coordinator/service_discovery.h"

namespace detour {
namespace {

ClientAuthorizer MakeAuthorizer(const CoordinatorOptions& options) {
  if (options.tokens.has_value()) {
    return ClientAuthorizer(ClientAuthorizer::Mode::kTokens, *options.tokens);
  }
  return ClientAuthorizer(options.security.tls() ? ClientAuthorizer::Mode::kCertificates
                                                 : ClientAuthorizer::Mode::kOpen,
                          {});
}

// The job store's backend the options ask for: etcd, or files under data_dir.
absl::StatusOr<std::unique_ptr<JobBackend>> MakeJobBackend(const CoordinatorOptions& options) {
  if (options.etcd.endpoints.empty()) {
    return std::make_unique<FileJobBackend>(options.data_dir, WriteFileAtomically);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client, EtcdClient::Create(options.etcd));
  ASSIGN_OR_RETURN(std::unique_ptr<EtcdJobBackend> backend,
                   EtcdJobBackend::Create(std::move(client), options.store_prefix));
  return backend;
}

constexpr char kWorkerStatePrefix[] = "WORKER_STATE_";

std::string WorkerStateLabel(v1::WorkerState state) {
  return absl::AsciiStrToLower(v1::WorkerState_Name(state).substr(sizeof(kWorkerStatePrefix) - 1));
}

constexpr v1::WorkerState kWorkerStates[] = {v1::WORKER_STATE_IDLE, v1::WORKER_STATE_BUSY,
                                             v1::WORKER_STATE_LOST};

}  // namespace

Coordinator::Coordinator(const CoordinatorOptions& options, std::unique_ptr<JobBackend> jobs)
    : options_(options),
      registry_(options.worker_silence, options.heartbeat_interval),
      store_(new MeteredJobBackend(std::move(jobs))),
      jobs_(std::unique_ptr<JobBackend>(store_)),
      auth_(MakeAuthorizer(options)),
      gate_(options.etcd.endpoints.empty() ? std::function<bool()>() : [this] {
        return election_ != nullptr && election_->IsLeader();
      }) {}

Coordinator::~Coordinator() {
  Drain(absl::Seconds(1));
  if (!stop_campaign_.HasBeenNotified()) stop_campaign_.Notify();
  if (campaigner_.joinable()) campaigner_.join();
  election_.reset();  // resigns when leading
  if (job_listener_ != 0) jobs_.RemoveListener(job_listener_);
}

std::string Coordinator::metrics_target() const {
  if (!metrics_) return "";
  if (!options_.metrics_advertise.empty()) return options_.metrics_advertise;
  HostPort address{options_.metrics_bind, metrics_->port()};
  if (address.host == "0.0.0.0" || address.host == "::") {
    char name[256] = {0};
    address.host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
  }
  return address.ToString();
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options) {
  ASSIGN_OR_RETURN(std::unique_ptr<JobBackend> jobs, MakeJobBackend(options));
  std::unique_ptr<Coordinator> coordinator(new Coordinator(options, std::move(jobs)));
  RETURN_IF_ERROR(coordinator->Init());
  return coordinator;
}

absl::Status Coordinator::Init() {
  RETURN_IF_ERROR(store_->AttachMetrics(&metrics_registry_));
  if (gate_.elected()) {
    ASSIGN_OR_RETURN(std::unique_ptr<EtcdClient> client, EtcdClient::Create(options_.etcd));
    // The records' lease lives the silence window, and long enough that a
    // follower, elected a leader_ttl after the leader died at the latest
    // (plus a campaign and the jobs' load), still finds them.
    const absl::Duration ttl =
        std::max({absl::Seconds(1), options_.worker_silence, 3 * options_.leader_ttl});
    ASSIGN_OR_RETURN(directory_, EtcdWorkerDirectory::Create(
                                     std::move(client), options_.store_prefix, ttl,
                                     [this] { return registry_.Records(); },
                                     [this](absl::Time started, const absl::Status& status) {
                                       store_->RecordWorkerRecords(started, status);
                                     }));
  } else {
    directory_ = std::make_unique<NoWorkerDirectory>();
  }
  registry_.SetRecordListener([this] { directory_->Changed(); });
  if (!gate_.elected()) {
    // One coordinator: the jobs are its own from the start.
    ASSIGN_OR_RETURN(int loaded, jobs_.Load());
    if (loaded > 0) LogInfo("loaded ", loaded, " job(s) from ", jobs_.backend().Describe());
  }

  metrics::Registry& m = metrics_registry_;
  RETURN_IF_ERROR(metrics::RegisterProcessMetrics(m));
  RETURN_IF_ERROR(metrics::RegisterBuildInfo(m, "coordinator", kVersion, kGitRevision));
  ASSIGN_OR_RETURN(workers_gauge_, m.AddGauge("detour_coordinator_workers",
                                              "Registered workers by state.", {"state"}));
  ASSIGN_OR_RETURN(jobs_gauge_, m.AddGauge("detour_coordinator_jobs",
                                           "Jobs known to the coordinator by state.", {"state"}));
  ASSIGN_OR_RETURN(auto* heartbeats, m.AddCounter("detour_coordinator_heartbeats",
                                                  "Heartbeats received from workers."));
  ASSIGN_OR_RETURN(heartbeats_, heartbeats->WithLabels({}));
  ASSIGN_OR_RETURN(auto* registrations,
                   m.AddCounter("detour_coordinator_registrations",
                                "Successful worker registrations (including re-registrations)."));
  ASSIGN_OR_RETURN(registrations_, registrations->WithLabels({}));
  ASSIGN_OR_RETURN(auto* lost, m.AddCounter("detour_coordinator_workers_lost",
                                            "Workers marked lost after falling silent."));
  ASSIGN_OR_RETURN(workers_lost_, lost->WithLabels({}));
  ASSIGN_OR_RETURN(auto* sessions,
                   m.AddGauge("detour_coordinator_sessions", "Open worker Session streams."));
  ASSIGN_OR_RETURN(sessions_, sessions->WithLabels({}));
  ASSIGN_OR_RETURN(auto* is_leader,
                   m.AddGauge("detour_coordinator_is_leader",
                              "1 while this coordinator leads (always without an election), 0 "
                              "while it follows."));
  ASSIGN_OR_RETURN(is_leader_, is_leader->WithLabels({}));
  ASSIGN_OR_RETURN(auto* term, m.AddGauge("detour_coordinator_leader_term",
                                          "The term this coordinator leads in (the etcd "
                                          "election's revision); 0 while following or without "
                                          "an election."));
  ASSIGN_OR_RETURN(leader_term_, term->WithLabels({}));
  // Identity for joins (PromQL `* on(worker_id) group_left(region)`) and
  // state per worker; bounded by the registry (kMaxWorkers, lost workers
  // forgotten after 10 x --worker_silence).
  ASSIGN_OR_RETURN(
      worker_info_,
      m.AddGauge("detour_coordinator_worker_info",
                 "Always 1, one series per registered worker, with its identity.",
                 {"worker_id", "region", "device", "version"}, WorkerRegistry::kMaxWorkers));
  ASSIGN_OR_RETURN(worker_state_,
                   m.AddGauge("detour_coordinator_worker_state",
                              "1 for the state each registered worker is in, 0 for the others.",
                              {"worker_id", "state"}, 3 * WorkerRegistry::kMaxWorkers));
  job_metrics_ = std::make_unique<JobMetrics>(&m, options_.job_metrics);
  if (!gate_.elected()) {
    for (const v1::Job& job : jobs_.List(v1::JOB_STATE_UNSPECIFIED)) {
      job_metrics_->Restore(job, absl::Now());
    }
  }
  job_listener_ = jobs_.AddListener(
      "", [this](const v1::Job& job) { job_metrics_->Observe(job, absl::Now()); });
  UpdateGauges();

  JobServiceImpl::Hooks job_hooks;
  job_hooks.on_submitted = [this](const std::string& id) { manager_->Add(id); };
  job_hooks.on_cancelled = [this](const std::string& id) { manager_->Cancel(id); };
  job_hooks.on_links = [this](const std::string& id) { return manager_->Links(id); };
  job_hooks.on_resume = [this](const std::string& id, const std::string& checkpoint,
                               uint32_t replicas_per_stage) {
    return manager_->Resume(id, checkpoint, replicas_per_stage);
  };
  job_service_ = std::make_unique<JobServiceImpl>(&jobs_, &auth_, std::move(job_hooks), &gate_);
  ControlServiceImpl::Hooks hooks;
  hooks.on_register = [this](const v1::WorkerInfo&) { registrations_->Increment(); };
  hooks.on_heartbeat = [this](const std::string& worker, const v1::Heartbeat& beat) {
    heartbeats_->Increment();
    // A worker still busy with a job this coordinator does not run (it
    // restarted, or the job ended while the worker was cut off) is told to
    // drop it, so it does not stay BUSY for ever.
    if (!beat.job_id().empty()) manager_->CheckWorkerJob(worker, beat.job_id());
  };
  hooks.on_message = [this](const std::string& worker, const v1::WorkerMessage& m) {
    manager_->OnWorkerMessage(worker, m);
  };
  control_service_ = std::make_unique<ControlServiceImpl>(
      &registry_, &auth_, /*require_worker_certificates=*/options_.security.tls(), std::move(hooks),
      options_.security.allow_unmarked_worker_certs(), &gate_);
  JobManagerOptions job_options = options_.jobs;
  job_options.metrics = &metrics_registry_;
  if (job_options.checkpoint_root.empty()) {
    job_options.checkpoint_root = options_.data_dir + "/checkpoints";
  }
  manager_ = std::make_unique<JobManager>(&jobs_, &registry_, control_service_.get(),
                                          std::move(job_options));

  GrpcServerOptions server_options;
  server_options.listen = options_.listen;
  server_options.security = options_.security;
  server_options.services = {job_service_.get(), control_service_.get()};
  // Clients and workers send small messages: gRPC's buffers for all of
  // them together stay under 1 GiB.
  server_options.memory_quota_bytes = size_t{1} << 30;
  server_options.relay.what = "coordinator gRPC";
  // Every worker holds a connection, and after a restart they all come
  // back at once: room for thousands, and for a thousand handshakes at a
  // time (a flood still gets 8 per source address).
  server_options.relay.limits.max_connections = 8192;
  server_options.relay.limits.max_unauthenticated = 1024;
  server_options.relay.metrics = &metrics_registry_;
  server_options.relay.metric_prefix = "detour_coordinator_grpc";
  ASSIGN_OR_RETURN(auto interceptor, metrics::ServerMetricsInterceptorFactory::Create(&m));
  server_options.interceptors.push_back(std::move(interceptor));
  ASSIGN_OR_RETURN(server_, StartGrpcServer(std::move(server_options), "--listen"));
  grpc_port_ = server_.port;

  if (options_.metrics_port >= 0) {
    metrics_ = std::make_unique<metrics::MetricsHttpServer>(&metrics_registry_);
    RETURN_IF_ERROR(metrics_->AddHandler(kServiceDiscoveryPath, [this] {
      return metrics::MetricsHttpServer::Response{
          "application/json",
          ServiceDiscoveryJson(metrics_target(), registry_.List(/*include_lost=*/true))};
    }));
    absl::Status started = metrics_->Start(options_.metrics_bind, options_.metrics_port);
    if (!started.ok()) {
      server_.server->Shutdown(absl::ToChronoTime(absl::Now()));
      return Annotate(started, "--metrics_port");
    }
  }
  reaper_ = std::thread([this] { ReaperLoop(); });
  if (gate_.elected()) return StartElection();
  manager_->Recover();
  return absl::OkStatus();
}

absl::Status Coordinator::StartElection() {
  std::string address = options_.advertise_address;
  if (address.empty()) {
    HostPort own{options_.listen.host, grpc_port_};
    if (own.host == "0.0.0.0" || own.host == "::") {
      char name[256] = {0};
      own.host = ::gethostname(name, sizeof(name) - 1) == 0 ? name : "localhost";
    }
    address = own.ToString();
  }
  ASSIGN_OR_RETURN(election_client_, EtcdClient::Create(options_.etcd));
  ElectionOptions election;
  election.key = options_.store_prefix + "leader";
  election.address = address;
  election.ttl = options_.leader_ttl;
  election.on_lost = [this](const absl::Status& why) {
    // The gate closed already (the lease is not surely alive, or the key is
    // gone): stop counting as leader and say so.
    gate_.Follow("");
    directory_->StopLeading();
    is_leader_->Set(0);
    leader_term_->Set(0);
    LogError("lost the leadership: ", why.message(),
             "; no further plans or steps are sent to workers");
    if (options_.on_leadership_lost) options_.on_leadership_lost(why);
  };
  election_ = std::make_unique<LeaderElection>(election_client_.get(), std::move(election));
  // One campaign before serving returns: a lone coordinator leads at once.
  auto won = election_->TryCampaign();
  if (won.ok() && *won) {
    if (absl::Status taken = TakeOver(election_->term()); !taken.ok()) {
      (void)election_->Resign();
      return taken;
    }
    return absl::OkStatus();
  }
  if (!won.ok()) LogWarning("campaigning for leadership: ", won.status().message());
  campaigner_ = std::thread([this] { CampaignLoop(); });
  return absl::OkStatus();
}

void Coordinator::CampaignLoop() {
  const absl::Duration retry =
      std::clamp(options_.leader_ttl / 10, absl::Milliseconds(100), absl::Seconds(1));
  std::string last_leader = "-";
  absl::Time last_error_log = absl::InfinitePast();
  do {
    auto won = election_->TryCampaign();
    if (won.ok() && *won) {
      absl::Status taken = TakeOver(election_->term());
      if (taken.ok()) return;
      LogError("elected, but could not take over the jobs: ", taken.message(),
               "; resigning and campaigning again");
      (void)election_->Resign();
      continue;
    }
    if (!won.ok() && absl::Now() - last_error_log > absl::Seconds(10)) {
      last_error_log = absl::Now();
      LogWarning("campaigning for leadership: ", won.status().message());
    }
    auto leader = ObserveLeader(election_client_.get(), options_.store_prefix + "leader");
    const std::string address = leader.ok() ? leader->address : "";
    gate_.Follow(address);
    if (address != last_leader) {
      last_leader = address;
      LogInfo("following: the leader is ", address.empty() ? "not elected yet" : address,
              leader.ok() ? absl::StrCat(" (term ", leader->term, ")") : "");
    }
  } while (!stop_campaign_.WaitForNotificationWithTimeout(retry));
}

absl::Status Coordinator::TakeOver(int64_t term) {
  // From here on every record this coordinator writes lands only while etcd
  // still holds its election of `term`: once deposed (paused, cut off), its
  // writes are refused by etcd even if they arrive after the new leader's.
  store_->FenceWrites(term);
  ASSIGN_OR_RETURN(int loaded, jobs_.Load());
  LogInfo("leading in term ", term, ": loaded ", loaded, " job(s) from ",
          jobs_.backend().Describe());
  for (const v1::Job& job : jobs_.List(v1::JOB_STATE_UNSPECIFIED)) {
    job_metrics_->Restore(job, absl::Now());
  }
  // The previous leader's workers, awaiting their reconnection: their ids
  // stay theirs, and the records go on under this leader's lease.
  ASSIGN_OR_RETURN(std::vector<v1::WorkerInfo> workers, directory_->Load());
  const int restored = registry_.Restore(workers, absl::Now());
  if (!workers.empty()) {
    LogInfo("leading in term ", term, ": ", restored, " of ", workers.size(),
            " worker record(s) from ", directory_->Describe(), " await their workers");
  }
  directory_->Lead(term);
  manager_->Recover();
  gate_.Lead(term);
  is_leader_->Set(1);
  leader_term_->Set(static_cast<double>(term));
  return absl::OkStatus();
}

void Coordinator::UpdateGauges() {
  const std::vector<v1::WorkerInfo> workers = registry_.List(/*include_lost=*/true);
  std::map<v1::WorkerState, int> per_state;
  for (const v1::WorkerInfo& w : workers) ++per_state[w.state()];
  for (v1::WorkerState state : kWorkerStates) {
    if (auto g = workers_gauge_->WithLabels({WorkerStateLabel(state)}); g.ok()) {
      (*g)->Set(per_state[state]);
    }
  }
  UpdateWorkerSeries(workers);
  job_metrics_->Sweep(absl::Now());
  auto counts = jobs_.CountByState();
  for (int s = v1::JOB_STATE_PENDING; s <= v1::JOB_STATE_CANCELLED; ++s) {
    auto state = static_cast<v1::JobState>(s);
    std::string name = absl::AsciiStrToLower(v1::JobState_Name(state).substr(10));
    if (auto g = jobs_gauge_->WithLabels({name}); g.ok()) (*g)->Set(counts[state]);
  }
  if (control_service_) sessions_->Set(control_service_->open_sessions());
  if (!gate_.elected()) is_leader_->Set(1);
}

void Coordinator::UpdateWorkerSeries(const std::vector<v1::WorkerInfo>& workers) {
  std::set<std::string> present;
  for (const v1::WorkerInfo& w : workers) {
    present.insert(w.worker_id());
    std::vector<std::string> labels = {w.worker_id(), w.region(), w.device(), w.version()};
    auto known = worker_info_labels_.find(w.worker_id());
    if (known != worker_info_labels_.end() && known->second != labels) {
      (void)worker_info_->Remove(known->second);  // re-registered with another identity
      known->second = labels;
    } else if (known == worker_info_labels_.end()) {
      known = worker_info_labels_.emplace(w.worker_id(), labels).first;
    }
    if (auto g = worker_info_->WithLabels(labels); g.ok()) (*g)->Set(1);
    for (v1::WorkerState state : kWorkerStates) {
      if (auto g = worker_state_->WithLabels({w.worker_id(), WorkerStateLabel(state)}); g.ok()) {
        (*g)->Set(w.state() == state ? 1 : 0);
      }
    }
  }
  for (auto it = worker_info_labels_.begin(); it != worker_info_labels_.end();) {
    if (present.count(it->first)) {
      ++it;
      continue;
    }
    // Forgotten by the registry: its series go too.
    (void)worker_info_->Remove(it->second);
    for (v1::WorkerState state : kWorkerStates) {
      (void)worker_state_->Remove({it->first, WorkerStateLabel(state)});
    }
    it = worker_info_labels_.erase(it);
  }
}

void Coordinator::ReaperLoop() {
  // Check often enough that a worker is lost within ~10% of the silence.
  const absl::Duration tick =
      std::max(absl::Milliseconds(50), std::min(absl::Seconds(1), options_.worker_silence / 10));
  absl::Time last = absl::Now();
  while (!stop_reaper_.WaitForNotificationWithTimeout(tick)) {
    const absl::Time now = absl::Now();
    if (now - last > std::max(options_.worker_silence / 2, 4 * tick)) {
      // This process did not run for a while (SIGSTOP, a stalled machine):
      // the workers' heartbeats wait unread in the sockets, and their
      // silence is ours, not theirs.
      LogWarning("the coordinator did not run for ", absl::FormatDuration(now - last),
                 "; not counting that time against the workers' heartbeats");
      registry_.ForgiveSilence(now);
    }
    last = now;
    for (const std::string& id : registry_.MarkSilentWorkersLost(now)) {
      LogWarning("worker ", id, " lost: no heartbeat for ",
                 absl::FormatDuration(options_.worker_silence));
      workers_lost_->Increment();
    }
    UpdateGauges();
  }
}

void Coordinator::Drain(absl::Duration deadline) {
  absl::MutexLock lock(&drain_mu_);
  if (drained_) return;
  drained_ = true;
  // No take-over while stopping.
  if (!stop_campaign_.HasBeenNotified()) stop_campaign_.Notify();
  if (campaigner_.joinable()) campaigner_.join();
  if (server_.server) {
    SetServing(server_.server.get(), false);
    // Stop the jobs first so their workers are told before sessions close.
    manager_->Shutdown();
    control_service_->CloseSessions();
    job_service_->CloseWatches();
    server_.server->Shutdown(absl::ToChronoTime(absl::Now() + deadline));
    server_.server->Wait();
  }
  // A leader hands over at once: revoking the lease deletes the leader key,
  // and a follower's next campaign wins without waiting for the TTL.
  if (election_ != nullptr) {
    // The records stay for the next leader, which takes them over at once.
    directory_->StopLeading();
    if (absl::Status resigned = election_->Resign(); !resigned.ok()) {
      LogWarning("resigning the leadership: ", resigned.message());
    }
  }
  if (!stop_reaper_.HasBeenNotified()) stop_reaper_.Notify();
  if (reaper_.joinable()) reaper_.join();
  if (metrics_) metrics_->Stop();
}

}  // namespace detour
