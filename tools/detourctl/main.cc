// detourctl: command-line client for the detour coordinator.
//
// Exit status: 0 success; 1 the coordinator answered with an error (unknown
// job, invalid spec, ...) or a watched job ended unsuccessfully; 2 bad usage;
// 3 the coordinator (or --target) is unreachable; 4 health check says not
// serving.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <cstdlib>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/net/daemon_flags.h"
#include "common/net/address.h"
#include "common/net/grpc_status.h"
#include "common/net/port_probe.h"
#include "common/net/leader_redirect.h"
#include "common/net/server.h"
#include "common/net/tls.h"
#include "common/spec.h"
#include "common/version.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "detour/v1/job_service.grpc.pb.h"
#include "google/protobuf/util/message_differencer.h"
#include "google/protobuf/util/time_util.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace detour {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
constexpr int kExitUnreachable = 3;
constexpr int kExitNotServing = 4;

constexpr char kCommands[] = R"(Commands:
  workers [--all]            list registered workers (--all: include lost ones)
  health [--target=ADDR] [--service=NAME]
                             check gRPC health of the coordinator (or ADDR)
  submit SPEC.json [--watch] submit a job spec (JSON form of detour.v1.JobSpec)
  get JOB_ID                 show one job
  list [--state=STATE] [--owner=NAME]
                             list jobs, newest first (STATE: pending, running, ...;
                             NAME: whose jobs, a token's name or certificate's CN)
  watch JOB_ID               follow a job's progress until it ends (through
                             coordinator restarts: --reconnect_for, default 5m)
  cancel JOB_ID              cancel a job that has not ended
  resume JOB_ID [--checkpoint=DIR] [--replicas_per_stage=N]
                             restart a failed or cancelled job from its newest
                             checkpoint (or DIR), optionally with N replicas
                             per stage
  events JOB_ID [--follow]   the job's elastic-training history (workers lost,
                             rerouted, joined, moved, stragglers, paused,
                             resumed); --follow keeps
                             printing new events until the job ends
  links JOB_ID               the link matrix a running job plans on: latency
                             and bandwidth per pair of workers, where each
                             came from (probe, traffic, region table) and
                             when it was measured
  version                    print the client version

Exit status: 0 success; 1 the coordinator reported an error (or a watched job
did not succeed); 2 bad usage; 3 coordinator unreachable; 4 not serving.

The coordinator address comes from --coordinator, else $DETOUR_COORDINATOR,
else 127.0.0.1:7070. Connections use TLS with --tls_ca (plus --tls_cert and
--tls_key for a client certificate), or plaintext with an explicit --insecure.
The bearer token comes from --token_file, else $DETOUR_TOKEN.)";

struct Globals {
  std::string coordinator;
  TlsFiles tls;
  std::string token_file;
  TransportSecurity security;
  std::string token;  // sent as "authorization: Bearer <token>"; "" = none
  bool json = false;
  absl::Duration timeout = absl::Seconds(10);
  // Every address --coordinator named; with several, a broken stream looks
  // for the leader again.
  std::vector<std::string> coordinators;
  // How long a broken stream (watch, events --follow) tries to reconnect.
  absl::Duration reconnect_for = absl::Minutes(5);
};

// The global flags, declared on the top-level FlagSet and again on every
// command's, so they may come before or after the command, in either form
// (`detourctl workers --coordinator HOST:PORT`).
void AddGlobalFlags(FlagSet* flags, Globals* g) {
  flags->String("coordinator", &g->coordinator,
                "host:port of the coordinator, or several comma-separated (coordinators electing "
                "a leader over etcd: the leader is found, following followers' redirections) "
                "(default $DETOUR_COORDINATOR, else 127.0.0.1:7070)");
  flags->Bool("json", &g->json, "print results as JSON (the proto3 JSON mapping)");
  flags->Duration("timeout", &g->timeout, "deadline for each request");
  RegisterTlsFlags(flags, &g->tls);
  flags->String("token_file", &g->token_file,
                "file holding the bearer token (default: $DETOUR_TOKEN)");
}

// The streaming commands' flag (watch, submit --watch, events --follow).
void AddReconnectFlag(FlagSet* flags, Globals* g) {
  flags->Duration("reconnect_for", &g->reconnect_for,
                  "when the stream breaks (the coordinator restarts, pauses or fails over), "
                  "keep reconnecting for this long before giving up; 0s: never");
}

absl::StatusOr<std::string> ReadToken(const std::string& path);
void PrepareCall(const Globals& g, grpc::ClientContext* context);

// Of several coordinators, the leader: each is asked a cheap question (Get
// of no job) and the first that answers anything but UNAVAILABLE leads; a
// follower's refusal names the leader, asked next. At most 2 rounds over the
// list plus the redirections among them.
absl::StatusOr<std::string> FindLeader(const Globals& g, const std::vector<std::string>& list) {
  std::vector<std::string> errors;
  std::string next = list[0];
  size_t index = 0;
  const size_t max_probes = 2 * list.size() + 2;
  for (size_t probe = 0; probe < max_probes; ++probe) {
    const std::string address = next;
    auto stub = v1::JobService::NewStub(MakeChannel(address, g.security));
    grpc::ClientContext context;
    PrepareCall(g, &context);
    v1::GetJobRequest request;
    v1::Job job;
    const grpc::Status status = stub->Get(&context, request, &job);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
        status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return address;  // it answered: it leads
    }
    errors.push_back(absl::StrCat(address, ": ", status.error_message()));
    if (std::optional<std::string> leader = LeaderFromTrailers(context);
        leader.has_value() && *leader != address) {
      next = *leader;
      continue;
    }
    index = (index + 1) % list.size();
    next = list[index];
  }
  return absl::UnavailableError(absl::StrCat("no leader found among ", absl::StrJoin(list, ","),
                                             " (", absl::StrJoin(errors, "; "), ")"));
}

// A single address whose host is a name, not an IP literal: the name may
// resolve to several coordinators (one DNS name with an A record per
// coordinator), and the one gRPC connects to may follow.
bool IsHostName(const std::string& address) {
  auto parsed = ParseHostPort(address, "--coordinator", /*allow_port_zero=*/false);
  if (!parsed.ok()) return false;
  in6_addr v6;
  in_addr v4;
  return ::inet_pton(AF_INET, parsed->host.c_str(), &v4) != 1 &&
         ::inet_pton(AF_INET6, parsed->host.c_str(), &v6) != 1;
}

// After parsing: the transport security (TLS files or an explicit
// --insecure) and the bearer token.
absl::Status LoadCredentials(Globals* g) {
  const TlsFiles& tls = g->tls;
  if (!tls.insecure && tls.ca.empty() && tls.cert.empty() && tls.key.empty()) {
    return absl::InvalidArgumentError(
        "give --tls_ca (the cluster CA) for TLS, or --insecure for plaintext");
  }
  auto security = TransportSecurity::Load(tls, /*client=*/true);
  if (!security.ok()) return security.status();
  g->security = *security;
  if (!g->token_file.empty()) {
    auto token = ReadToken(g->token_file);
    if (!token.ok()) return token.status();
    g->token = *token;
  } else if (const char* t = std::getenv("DETOUR_TOKEN"); t != nullptr && *t != '\0') {
    g->token = t;
  }
  return absl::OkStatus();
}

// Parses a command's arguments (its own flags and the global ones) and checks
// the coordinator address.
// With `find_leader` false (a command talking to another server), several
// coordinators are not asked which one leads.
absl::StatusOr<std::vector<std::string>> ParseCommand(FlagSet* flags, Globals* g,
                                                      const std::vector<std::string>& args,
                                                      bool find_leader = true) {
  AddGlobalFlags(flags, g);
  auto rest = flags->Parse(args);
  if (!rest.ok()) return rest;
  auto list = ParseCoordinatorList(g->coordinator, "--coordinator");
  if (!list.ok()) return list.status();
  if (absl::Status c = LoadCredentials(g); !c.ok()) return c;
  if (g->reconnect_for < absl::ZeroDuration() || g->reconnect_for > absl::Hours(24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reconnect_for: ", absl::FormatDuration(g->reconnect_for), " is outside 0s..24h"));
  }
  g->coordinators = *list;
  if ((list->size() > 1 || IsHostName(list->front())) && find_leader) {
    auto leader = FindLeader(*g, *list);
    if (!leader.ok()) {
      std::cerr << "detourctl: " << leader.status().message() << "\n";
      std::exit(kExitUnreachable);
    }
    g->coordinator = *leader;
  }
  return rest;
}

bool Ended(const v1::Job& job) {
  return job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED ||
         job.state() == v1::JOB_STATE_CANCELLED;
}

int Usage(const std::string& message) {
  std::cerr << "detourctl: " << message << "\nRun 'detourctl --help' for usage.\n";
  return kExitUsage;
}

// Prints an RPC failure and maps it to an exit status. `target`, when not
// empty, is the server asked instead of the coordinator (health --target):
// the message names it as such.
int RpcFailed(const Globals& g, const grpc::Status& status, absl::string_view what,
              const std::string& target = "") {
  const std::string& address = target.empty() ? g.coordinator : target;
  const auto code = status.error_code();
  if (code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) {
    std::cerr << "detourctl: " << what << ": " << (target.empty() ? "coordinator " : "target ")
              << address << " unreachable: " << status.error_message() << "\n";
    // Something may answer there that is not the coordinator's gRPC port.
    const std::string hint = PortHint(address, g.security.tls(),
                                      ProbePort(address, std::min(g.timeout, absl::Seconds(2))));
    if (!hint.empty()) std::cerr << "detourctl: hint: " << hint << "\n";
    return kExitUnreachable;
  }
  std::cerr << "detourctl: " << what << ": " << (target.empty() ? "" : "target ")
            << (target.empty() ? "" : absl::StrCat(target, ": "))
            << absl::StatusCodeToString(FromGrpcStatus(status).code()) << ": "
            << status.error_message() << "\n";
  return kExitError;
}

// The bearer token of every call, streams included.
void PrepareStream(const Globals& g, grpc::ClientContext* context) {
  if (!g.token.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", g.token));
}

// The deadline and the bearer token of every request.
void PrepareCall(const Globals& g, grpc::ClientContext* context) {
  context->set_deadline(absl::ToChronoTime(absl::Now() + g.timeout));
  PrepareStream(g, context);
}

// The token in a --token_file: the file's only word, at most 512 characters;
// a file others may read is refused (CheckPrivateFile).
absl::StatusOr<std::string> ReadToken(const std::string& path) {
  if (absl::Status s = CheckPrivateFile(path, "--token_file"); !s.ok()) return s;
  auto text = ReadFileToString(path);
  if (!text.ok())
    return absl::NotFoundError(absl::StrCat("--token_file: ", text.status().message()));
  const absl::string_view token = absl::StripAsciiWhitespace(*text);
  if (token.empty() || token.size() > 512 ||
      std::any_of(token.begin(), token.end(), [](char c) { return c <= ' ' || c >= 127; })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--token_file: ", path, " must hold one token of 1..512 printable characters"));
  }
  return std::string(token);
}

std::string Ago(const google::protobuf::Timestamp& t) {
  if (t.seconds() == 0 && t.nanos() == 0) return "-";
  const absl::Time when =
      absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(t));
  const double s = absl::ToDoubleSeconds(absl::Now() - when);
  if (s < 1) return "now";
  if (s < 120) return absl::StrFormat("%.0fs ago", s);
  if (s < 7200) return absl::StrFormat("%.0fm ago", s / 60);
  return absl::StrFormat("%.1fh ago", s / 3600);
}

std::string ShortState(const std::string& full, size_t prefix) {
  std::string s = full.substr(prefix);
  for (char& c : s) c = static_cast<char>(std::tolower(c));
  return s;
}

std::string JobStateName(v1::JobState s) { return ShortState(v1::JobState_Name(s), 10); }

void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      absl::StrAppend(&line, row[i]);
      if (i + 1 < row.size()) line.append(width[i] - row[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

std::string ProgressText(const v1::Job& job) {
  const v1::JobProgress& p = job.progress();
  std::string text = absl::StrFormat("%d/%d", p.iteration(), p.total_iterations());
  if (p.loss() > 0) absl::StrAppendFormat(&text, "  loss %.4f", p.loss());
  if (p.tokens_per_s() > 0) absl::StrAppendFormat(&text, "  %.0f tok/s", p.tokens_per_s());
  // An ended job has no ETA, whatever an older coordinator stored.
  if (p.eta_s() > 0 && !Ended(job)) absl::StrAppendFormat(&text, "  eta %.0fs", p.eta_s());
  if (p.utilization() > 0) {
    absl::StrAppendFormat(&text, "  busy %.0f%%", 100 * p.utilization());
    if (p.utilization_with_kfac() > p.utilization()) {
      absl::StrAppendFormat(&text, " (%.0f%% with K-FAC)", 100 * p.utilization_with_kfac());
    }
  }
  if (p.kfac_refreshes() > 0) {
    absl::StrAppendFormat(&text, "  K-FAC refreshes %d (every %.1f it)", p.kfac_refreshes(),
                          p.kfac_refresh_interval());
  }
  return text;
}

std::string EventKindName(v1::JobHistoryEvent::Kind k) {
  return ShortState(v1::JobHistoryEvent::Kind_Name(k), 5);
}

std::string EventLine(const v1::JobHistoryEvent& e) {
  const absl::Time t =
      absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(e.time()));
  return absl::StrFormat("%s  it %-5d %-22s %s",
                         absl::FormatTime("%H:%M:%S", t, absl::UTCTimeZone()), e.iteration(),
                         EventKindName(e.kind()), e.message());
}

void PrintJob(const Globals& g, const v1::Job& job) {
  if (g.json) {
    std::cout << ToJson(job);
    return;
  }
  std::cout << "id:        " << job.id() << "\n"
            << "name:      " << job.spec().name() << "\n"
            << "owner:     " << (job.owner().empty() ? "-" : job.owner()) << "\n"
            << "state:     " << JobStateName(job.state()) << "\n"
            << "message:   " << job.message() << "\n"
            << "created:   " << Ago(job.create_time()) << "\n"
            << "progress:  " << ProgressText(job) << "\n"
            << "model:     "
            << (job.spec().model().preset().empty() ? "custom" : job.spec().model().preset())
            << ", " << job.spec().model().num_layers() << " layers, d_model "
            << job.spec().model().d_model() << "\n"
            << "pipeline:  " << job.spec().pipeline().num_stages() << " stages, "
            << job.spec().pipeline().data_nodes() << " data nodes, "
            << job.spec().pipeline().replicas_per_stage() << " replicas/stage, skip "
            << job.spec().pipeline().skip_ratio() << "\n";
  // Each worker with the visits the last plan routed through it.
  const auto& visits = job.progress().planned_visits();
  for (int i = 0; i < job.stages_size(); ++i) {
    std::vector<std::string> nodes;
    for (const std::string& id : job.stages(i).nodes()) {
      auto v = visits.find(id);
      nodes.push_back(v == visits.end() ? id : absl::StrCat(id, " (", v->second, " visits)"));
    }
    std::cout << "stage " << i << ":   " << absl::StrJoin(nodes, ", ") << "\n";
  }
  const v1::JobProgress& p = job.progress();
  if (p.recoveries() > 0 || job.history_size() > 0 || job.resumes() > 0) {
    std::cout << "elastic:   " << p.members() << " workers, epoch " << job.epoch() << ", "
              << p.recoveries() << " recoveries, " << p.microbatches_rerun()
              << " microbatches rerun, " << p.microbatches_dropped() << " dropped, "
              << job.resumes() << " resumes\n";
  }
  if (!job.last_checkpoint().empty()) std::cout << "checkpoint: " << job.last_checkpoint() << "\n";
  // The newest few events; `detourctl events` shows them all.
  const int first = std::max(0, job.history_size() - 5);
  for (int i = first; i < job.history_size(); ++i) {
    std::cout << (i == first ? "events:    " : "           ") << EventLine(job.history(i)) << "\n";
  }
}

int CmdWorkers(Globals g, const std::vector<std::string>& args) {
  bool all = false;
  FlagSet flags("detourctl workers", "List registered workers.");
  flags.Bool("all", &all, "include workers marked lost");
  auto rest = ParseCommand(&flags, &g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (!rest->empty()) return Usage("workers takes no arguments");
  auto stub = v1::ControlService::NewStub(MakeChannel(g.coordinator, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  v1::ListWorkersRequest request;
  request.set_include_lost(all);
  v1::ListWorkersResponse response;
  grpc::Status status = stub->ListWorkers(&context, request, &response);
  if (!status.ok()) return RpcFailed(g, status, "workers");
  if (g.json) {
    std::cout << ToJson(response);
    return kExitOk;
  }
  if (response.workers().empty()) {
    std::cout << "no workers registered\n";
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {
      {"ID", "STATE", "REGION", "ADDRESS", "DEVICE", "SPEED", "SLOTS", "LAST HEARTBEAT", "JOB"}};
  for (const v1::WorkerInfo& w : response.workers()) {
    rows.push_back({w.worker_id(), ShortState(v1::WorkerState_Name(w.state()), 13), w.region(),
                    w.address(), w.device(), absl::StrFormat("%g", w.speed()),
                    absl::StrCat(w.memory_slots()), Ago(w.last_heartbeat_time()),
                    w.job_id().empty() ? "-" : w.job_id()});
  }
  PrintTable(rows);
  return kExitOk;
}

int CmdHealth(Globals g, const std::vector<std::string>& args) {
  std::string target;
  std::string service;
  FlagSet flags("detourctl health", "Check gRPC health (grpc.health.v1.Health/Check).");
  flags.String("target", &target, "address to check (default: the coordinator)");
  flags.String("service", &service, "service name to ask about (default: the whole server)");
  auto rest = ParseCommand(&flags, &g, args, /*find_leader=*/false);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (!rest->empty()) return Usage("health takes no arguments");
  // --target is asked whatever the coordinators do; without it, the leader.
  const bool other = !target.empty();
  if (!other && g.coordinators.size() > 1) {
    auto leader = FindLeader(g, g.coordinators);
    if (!leader.ok()) {
      std::cerr << "detourctl: " << leader.status().message() << "\n";
      return kExitUnreachable;
    }
    g.coordinator = *leader;
  }
  if (target.empty()) target = g.coordinator;
  auto stub = grpc::health::v1::Health::NewStub(MakeChannel(target, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return RpcFailed(g, status, "health", other ? target : "");
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  if (g.json) {
    std::cout << absl::StrFormat("{\"target\": \"%s\", \"status\": \"%s\"}\n", target, name);
  } else {
    std::cout << target << ": " << name << "\n";
  }
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk
                                                                             : kExitNotServing;
}

int Watch(const Globals& g, const std::string& job_id);

// One progress line: state and progress, and while the job waits (pending,
// assigning, paused) why.
std::string WatchLine(const v1::Job& job) {
  std::string line =
      absl::StrCat(job.id(), " ", JobStateName(job.state()), "  ", ProgressText(job));
  const bool waiting = job.state() == v1::JOB_STATE_PENDING ||
                       job.state() == v1::JOB_STATE_ASSIGNING ||
                       absl::StartsWith(job.message(), "paused");
  if (waiting && !job.message().empty()) absl::StrAppend(&line, "  (", job.message(), ")");
  return line;
}

int CmdSubmit(Globals g, const std::vector<std::string>& args) {
  bool watch = false;
  FlagSet flags("detourctl submit", "Submit a job from a JSON spec file.");
  flags.Positional("SPEC.json",
                   "the job spec: the JSON form of detour.v1.JobSpec (see examples/jobs)");
  flags.Bool("watch", &watch, "follow the job until it ends");
  AddReconnectFlag(&flags, &g);
  auto rest = ParseCommand(&flags, &g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 1) return Usage("submit needs exactly one spec file");
  // Validate locally first for a fast, precise error; the coordinator
  // validates again.
  auto spec = LoadJobSpec((*rest)[0]);
  if (!spec.ok()) {
    std::cerr << "detourctl: submit: " << spec.status().message() << "\n";
    return spec.status().code() == absl::StatusCode::kNotFound ? kExitUsage : kExitError;
  }
  auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = *spec;
  v1::Job job;
  grpc::Status status = stub->Submit(&context, request, &job);
  if (!status.ok()) return RpcFailed(g, status, "submit");
  if (g.json && !watch) {
    std::cout << ToJson(job);
  } else if (!g.json) {
    std::cout << "submitted " << job.id() << " (" << job.spec().name()
              << "): " << JobStateName(job.state()) << " — " << job.message() << "\n";
  }
  return watch ? Watch(g, job.id()) : kExitOk;
}

// Parses the arguments of a command that takes one JOB_ID and no flags of its
// own; returns the exit code to stop with, or -1 to go on.
int WithJobId(Globals* g, const std::vector<std::string>& args, const char* command,
              const char* summary, std::string* job_id) {
  FlagSet flags(absl::StrCat("detourctl ", command), summary);
  flags.Positional("JOB_ID", "the job's id, as submit and list print it (e.g. j1)");
  auto rest = ParseCommand(&flags, g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 1) return Usage(absl::StrCat(command, " needs exactly one JOB_ID"));
  *job_id = (*rest)[0];
  return -1;
}

int CmdGet(Globals g, const std::vector<std::string>& args) {
  std::string id;
  if (int rc = WithJobId(&g, args, "get", "Show one job.", &id); rc >= 0) return rc;
  auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  v1::GetJobRequest request;
  request.set_job_id(id);
  v1::Job job;
  grpc::Status status = stub->Get(&context, request, &job);
  if (!status.ok()) return RpcFailed(g, status, "get");
  PrintJob(g, job);
  return kExitOk;
}

int CmdCancel(Globals g, const std::vector<std::string>& args) {
  std::string id;
  if (int rc = WithJobId(&g, args, "cancel", "Cancel a job that has not ended.", &id); rc >= 0) {
    return rc;
  }
  auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  v1::CancelJobRequest request;
  request.set_job_id(id);
  v1::Job job;
  grpc::Status status = stub->Cancel(&context, request, &job);
  if (!status.ok()) return RpcFailed(g, status, "cancel");
  if (g.json) {
    std::cout << ToJson(job);
  } else {
    std::cout << job.id() << ": " << JobStateName(job.state()) << "\n";
  }
  return kExitOk;
}

int CmdResume(Globals g, const std::vector<std::string>& args) {
  std::string checkpoint;
  int64_t replicas = 0;
  FlagSet flags("detourctl resume",
                "Restart a FAILED or CANCELLED job from a checkpoint: parameters, optimiser\n"
                "and K-FAC state, learning-rate schedule and data position carry on, on\n"
                "whichever workers are idle. The job keeps its id.");
  flags.String("checkpoint", &checkpoint,
               "checkpoint directory to resume from (default: the job's newest)");
  flags.Int("replicas_per_stage", &replicas,
            "replicas per stage of the resumed job, e.g. fewer when fewer workers are left "
            "(default 0: the job's own)");
  flags.Positional("JOB_ID", "the FAILED or CANCELLED job to restart");
  auto rest = ParseCommand(&flags, &g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 1) return Usage("resume needs exactly one JOB_ID");
  if (replicas < 0 || replicas > 1024) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--replicas_per_stage: ", replicas, " is outside 0..1024")));
  }
  auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  v1::ResumeJobRequest request;
  request.set_job_id((*rest)[0]);
  request.set_checkpoint(checkpoint);
  request.set_replicas_per_stage(static_cast<uint32_t>(replicas));
  v1::Job job;
  grpc::Status status = stub->Resume(&context, request, &job);
  if (!status.ok()) return RpcFailed(g, status, "resume");
  if (g.json) {
    std::cout << ToJson(job);
  } else {
    std::cout << job.id() << ": " << JobStateName(job.state()) << " — " << job.message() << "\n";
  }
  return kExitOk;
}

// Follows a job's Watch stream until the job ends, calling `on_event` for
// every event that differs from the one before (a reconnection's first
// snapshot repeats the last event seen when nothing happened meanwhile). A
// stream that breaks after it delivered an event (UNAVAILABLE or CANCELLED:
// the coordinator restarted, paused past the keep-alive, failed over) is opened
// again with a back-off from 0.2 s doubling to 5 s, each attempt noted on
// stderr, for at most --reconnect_for since the last event; then, or on any
// other error, the exit status of RpcFailed. `before_note` runs before a
// note is written (a terminal's progress line ends first). Returns kExitOk
// once the job ended, `*last` its final state.
int FollowJob(Globals g, const std::string& job_id, absl::string_view what,
              const std::function<void(const v1::JobEvent&)>& on_event,
              const std::function<void()>& before_note, v1::Job* last) {
  bool seen = false;
  std::optional<absl::Time> broken_since;
  absl::Duration backoff = absl::Milliseconds(200);
  for (;;) {
    auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
    grpc::ClientContext context;  // no deadline: jobs run for hours
    PrepareStream(g, &context);
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    auto reader = stub->Watch(&context, request);
    v1::JobEvent event;
    while (reader->Read(&event)) {
      broken_since.reset();
      backoff = absl::Milliseconds(200);
      if (seen && google::protobuf::util::MessageDifferencer::Equals(event.job(), *last)) {
        continue;
      }
      seen = true;
      *last = event.job();
      on_event(event);
    }
    grpc::Status status = reader->Finish();
    if (status.ok() && seen && Ended(*last)) return kExitOk;
    if (status.ok()) {
      status = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            "the coordinator ended the stream before the job ended");
    }
    // Never reached at all: a wrong address or a coordinator that is down
    // is reported at once, with its hint. CANCELLED is the server's doing
    // (this context is never cancelled): a coordinator shutting down cancels
    // a stream it had not yet registered, so it counts as a break too.
    const bool broke = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                       status.error_code() == grpc::StatusCode::CANCELLED;
    if (!broke || !seen || g.reconnect_for <= absl::ZeroDuration()) {
      return RpcFailed(g, status, what);
    }
    const absl::Time now = absl::Now();
    if (!broken_since.has_value()) broken_since = now;
    const absl::Duration left = *broken_since + g.reconnect_for - now;
    before_note();
    if (left <= absl::ZeroDuration()) {
      std::cerr << "detourctl: " << what << ": gave up after "
                << absl::FormatDuration(absl::Trunc(now - *broken_since, absl::Seconds(1)))
                << " reconnecting (--reconnect_for=" << absl::FormatDuration(g.reconnect_for)
                << "): coordinator " << g.coordinator << ": " << status.error_message() << "\n";
      return kExitUnreachable;
    }
    const absl::Duration wait = std::min(backoff, left);
    std::cerr << "detourctl: " << what << ": stream from coordinator " << g.coordinator
              << " broke (" << status.error_message() << "); reconnecting in "
              << absl::FormatDuration(absl::Trunc(wait, absl::Milliseconds(100)))
              << " (gives up in " << absl::FormatDuration(absl::Trunc(left, absl::Seconds(1)))
              << ")\n";
    absl::SleepFor(wait);  // the back-off itself, not a synchronisation
    backoff = std::min(2 * backoff, absl::Seconds(5));
    if (g.coordinators.size() > 1) {
      auto leader = FindLeader(g, g.coordinators);
      if (leader.ok()) g.coordinator = *leader;
    }
  }
}

int CmdEvents(Globals g, const std::vector<std::string>& args) {
  bool follow = false;
  FlagSet flags("detourctl events", "Show a job's elastic-training history.");
  flags.Positional("JOB_ID", "the job whose history to show");
  flags.Bool("follow", &follow, "keep printing new events until the job ends");
  AddReconnectFlag(&flags, &g);
  auto rest = ParseCommand(&flags, &g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 1) return Usage("events needs exactly one JOB_ID");
  std::optional<v1::JobHistoryEvent> shown;  // the newest event printed
  auto print_new = [&](const v1::Job& job) {
    // The record keeps the newest 200: continue after the last event shown,
    // found from the end (its time, kind and text make it unique).
    const int n = job.history_size();
    int start = 0;
    if (shown.has_value()) {
      start = -1;
      for (int i = n - 1; i >= 0 && start < 0; --i) {
        if (google::protobuf::util::MessageDifferencer::Equals(job.history(i), *shown)) {
          start = i + 1;
        }
      }
      if (start < 0) {
        std::cerr << "detourctl: events: the record keeps the newest " << n
                  << " events; some after the last one shown were not kept\n";
        start = 0;
      }
    }
    for (int i = start; i < n; ++i) {
      if (g.json) {
        std::cout << ToJsonLine(job.history(i)) << "\n" << std::flush;
      } else {
        std::cout << EventLine(job.history(i)) << "\n" << std::flush;
      }
    }
    if (n > 0) shown = job.history(n - 1);
  };
  if (!follow) {
    auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
    grpc::ClientContext context;
    PrepareCall(g, &context);
    v1::GetJobRequest request;
    request.set_job_id((*rest)[0]);
    v1::Job job;
    grpc::Status status = stub->Get(&context, request, &job);
    if (!status.ok()) return RpcFailed(g, status, "events");
    if (job.history_size() == 0 && !g.json) std::cout << "no events\n";
    print_new(job);
    return kExitOk;
  }
  v1::Job last;
  return FollowJob(
      g, (*rest)[0], "events", [&](const v1::JobEvent& event) { print_new(event.job()); }, [] {},
      &last);
}

std::string SourceName(v1::JobLink::Source s) {
  switch (s) {
    case v1::JobLink::SOURCE_PROBE: return "probe";
    case v1::JobLink::SOURCE_TRAFFIC: return "traffic";
    case v1::JobLink::SOURCE_REGION_TABLE: return "table";
    default: return "-";
  }
}

int CmdLinks(Globals g, const std::vector<std::string>& args) {
  std::string id;
  if (int rc = WithJobId(&g, args, "links",
                         "Show the link matrix a running job plans on: for every ordered pair\n"
                         "of its workers the one-way latency and the bandwidth, where each\n"
                         "came from (probe: measured by the workers' link probes; traffic:\n"
                         "fitted to the job's own transfers; table: the cluster's region\n"
                         "table, never measured) and when. Once the job's transfers were\n"
                         "fitted on three links or more, links known by probes only are\n"
                         "planned at their probe's rate (the table's where a probe measured\n"
                         "only the round trip) or the transfers' median round trips, whichever\n"
                         "is slower (a header line says how many; NOTE has what the probe\n"
                         "measured or the table says). With --json the GetLinks answer.",
                         &id);
      rc >= 0) {
    return rc;
  }
  auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
  grpc::ClientContext context;
  PrepareCall(g, &context);
  v1::GetLinksRequest request;
  request.set_job_id(id);
  v1::GetLinksResponse response;
  grpc::Status status = stub->GetLinks(&context, request, &response);
  if (!status.ok()) return RpcFailed(g, status, "links");
  if (g.json) {
    std::cout << ToJson(response);
    return kExitOk;
  }
  std::cout << "job " << response.job_id() << ": " << response.links_size() << " links, "
            << response.probe_rounds() << " probe round(s), last " << Ago(response.last_probe())
            << "\n";
  const double rounds = response.transfer_round_trips();
  if (rounds > 0) {
    std::cout << absl::StrFormat(
        "links known by probes only are planned at their probe's rate (the table's where only "
        "their round trip was measured) or %.2f round trips per transfer, whichever is slower "
        "(the median time on the wire of the job's transfers on the %u links fitted to them)\n",
        rounds, response.transfer_round_trip_links());
  }
  std::vector<std::vector<std::string>> rows = {
      {"FROM", "TO", "LATENCY", "SOURCE", "MEASURED", "BANDWIDTH", "SOURCE", "MEASURED", "NOTE"}};
  for (const v1::JobLink& l : response.links()) {
    std::string note = l.cut() ? "cut" : "";
    if (!l.probe_error().empty()) {
      absl::StrAppend(&note, note.empty() ? "" : "; ", "probe: ", l.probe_error());
    }
    if (l.measured_bandwidth_bytes_per_s() != l.bandwidth_bytes_per_s() &&
        l.measured_bandwidth_bytes_per_s() > 0 && !l.cut()) {
      absl::StrAppend(
          &note, note.empty() ? "" : "; ",
          absl::StrFormat(
              "%s %.1f MB/s",
              l.bandwidth_source() == v1::JobLink::SOURCE_REGION_TABLE ? "table" : "measured",
              l.measured_bandwidth_bytes_per_s() / 1e6));
    }
    rows.push_back({l.from(), l.to(), absl::StrFormat("%.1f ms", l.latency_seconds() * 1e3),
                    SourceName(l.latency_source()), Ago(l.latency_measured()),
                    absl::StrFormat("%.1f MB/s", l.bandwidth_bytes_per_s() / 1e6),
                    SourceName(l.bandwidth_source()), Ago(l.bandwidth_measured()),
                    note.empty() ? "-" : note});
  }
  PrintTable(rows);
  return kExitOk;
}

int CmdList(Globals g, const std::vector<std::string>& args) {
  std::string state_text;
  FlagSet flags("detourctl list", "List jobs, newest first.");
  flags.String("state", &state_text,
               "only jobs in this state: pending, assigning, running, succeeded, failed, "
               "cancelled");
  std::string owner;
  flags.String("owner", &owner,
               "only jobs of this owner (who submitted them: a token's name or a client "
               "certificate's CN)");
  auto rest = ParseCommand(&flags, &g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (!rest->empty()) return Usage("list takes no arguments");
  v1::ListJobsRequest request;
  if (!state_text.empty()) {
    std::string upper = absl::StrCat("JOB_STATE_", state_text);
    for (char& c : upper) c = static_cast<char>(std::toupper(c));
    v1::JobState state;
    if (!v1::JobState_Parse(upper, &state) || state == v1::JOB_STATE_UNSPECIFIED) {
      return Usage(absl::StrCat("--state: \"", state_text, "\" is not a job state"));
    }
    request.set_state(state);
  }
  request.set_owner(owner);
  auto stub = v1::JobService::NewStub(MakeChannel(g.coordinator, g.security));
  // The coordinator answers in pages; all of them make one listing. A
  // coordinator that never ends its pages (or repeats a token) is refused.
  constexpr int kMaxPages = 100000;
  v1::ListJobsResponse response;
  std::set<std::string> tokens;
  for (int page = 0;; ++page) {
    grpc::ClientContext context;
    PrepareCall(g, &context);
    v1::ListJobsResponse part;
    grpc::Status status = stub->List(&context, request, &part);
    if (!status.ok()) return RpcFailed(g, status, "list");
    for (v1::Job& job : *part.mutable_jobs()) *response.add_jobs() = std::move(job);
    if (part.next_page_token().empty()) break;
    if (page + 1 >= kMaxPages || !tokens.insert(part.next_page_token()).second) {
      std::cerr << "detourctl: list: the coordinator's pages do not end (page " << page + 1
                << ", token \"" << part.next_page_token() << "\")\n";
      return kExitError;
    }
    request.set_page_token(part.next_page_token());
  }
  if (g.json) {
    std::cout << ToJson(response);
    return kExitOk;
  }
  if (response.jobs().empty()) {
    std::cout << "no jobs\n";
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows = {{"ID", "NAME", "STATE", "CREATED", "PROGRESS"}};
  for (const v1::Job& job : response.jobs()) {
    rows.push_back({job.id(), job.spec().name(), JobStateName(job.state()), Ago(job.create_time()),
                    ProgressText(job)});
  }
  PrintTable(rows);
  return kExitOk;
}

int Watch(const Globals& g, const std::string& job_id) {
  const bool tty = ::isatty(STDOUT_FILENO) && !g.json;
  bool line_open = false;  // a terminal's progress line not ended yet
  std::string shown;       // the last progress line: one that says nothing new is left out
  v1::Job last;
  const int rc = FollowJob(
      g, job_id, "watch",
      [&](const v1::JobEvent& event) {
        if (g.json) {
          std::cout << ToJsonLine(event) << "\n" << std::flush;  // JSON Lines
          return;
        }
        std::string line = WatchLine(event.job());
        if (line == shown) return;
        std::cout << (tty ? "\r\033[K" : "") << line << (tty ? "" : "\n") << std::flush;
        shown = std::move(line);
        line_open = tty;
      },
      [&] {
        if (line_open) std::cout << "\n" << std::flush;
        line_open = false;
      },
      &last);
  if (line_open) std::cout << "\n";
  if (rc != kExitOk) return rc;
  if (!g.json)
    std::cout << last.id() << " ended: " << JobStateName(last.state()) << " — " << last.message()
              << "\n";
  return last.state() == v1::JOB_STATE_SUCCEEDED ? kExitOk : kExitError;
}

int CmdWatch(Globals g, const std::vector<std::string>& args) {
  FlagSet flags("detourctl watch",
                "Follow a job until it ends: one line per progress event (with --json\n"
                "one JSON object per line). Exit status 0 when it succeeded, 1 when not.\n"
                "A stream that breaks (the coordinator restarts, pauses or fails over) is\n"
                "reopened for up to --reconnect_for, each attempt noted on stderr; events\n"
                "already shown are not shown again.");
  flags.Positional("JOB_ID", "the job's id, as submit and list print it (e.g. j1)");
  AddReconnectFlag(&flags, &g);
  auto rest = ParseCommand(&flags, &g, args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 1) return Usage("watch needs exactly one JOB_ID");
  return Watch(g, (*rest)[0]);
}

int Main(int argc, char** argv) {
  QuietGrpcLogs();  // every failed call is reported below, with a hint
  Globals g;
  const char* env = std::getenv("DETOUR_COORDINATOR");
  g.coordinator = env != nullptr && *env != '\0' ? env : "127.0.0.1:7070";
  FlagSet flags("detourctl",
                "Command-line client for the detour coordinator. Flags go before\n"
                "or after the command; `detourctl COMMAND --help` describes one.");
  flags.Positional("COMMAND [command flags] [args]", "one of the commands below");
  AddGlobalFlags(&flags, &g);
  bool version = false;
  flags.Bool("version", &version, "print the client version and exit (as `detourctl version`)");
  flags.SetEpilog(kCommands);
  auto args = flags.Parse(argc, argv, /*stop_at_positional=*/true);
  if (!args.ok()) return flags.Fail(args.status());
  if (version) {
    std::cout << "detourctl " << kVersion << " (" << kGitRevision << ")\n";
    return kExitOk;
  }
  if (args->empty())
    return Usage(
        "missing command (workers, health, submit, get, list, watch, cancel, resume, events, "
        "links)");
  const std::string command = (*args)[0];
  const std::vector<std::string> rest(args->begin() + 1, args->end());
  if (command == "workers") return CmdWorkers(g, rest);
  if (command == "health") return CmdHealth(g, rest);
  if (command == "submit") return CmdSubmit(g, rest);
  if (command == "get") return CmdGet(g, rest);
  if (command == "list") return CmdList(g, rest);
  if (command == "watch") return CmdWatch(g, rest);
  if (command == "cancel") return CmdCancel(g, rest);
  if (command == "resume") return CmdResume(g, rest);
  if (command == "events") return CmdEvents(g, rest);
  if (command == "links") return CmdLinks(g, rest);
  if (command == "version") {
    std::cout << "detourctl " << kVersion << " (" << kGitRevision << ")\n";
    return kExitOk;
  }
  const std::string near =
      ClosestMatch(command, {"workers", "health", "submit", "get", "list", "watch", "cancel",
                             "resume", "events", "links", "version"});
  return Usage(absl::StrCat("unknown command \"", absl::CHexEscape(command.substr(0, 64)), "\"",
                            near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)")));
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) { return detour::Main(argc, argv); }
