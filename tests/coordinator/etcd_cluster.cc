#include "tests/coordinator/etcd_cluster.h"

#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/e2e/process.h"

namespace detour::testing {

std::string FindEtcdBinary() {
  if (const char* env = std::getenv("DETOUR_ETCD"); env != nullptr && *env != '\0') {
    return ::access(env, X_OK) == 0 ? env : "";
  }
  std::vector<std::string> dirs;
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    dirs = absl::StrSplit(path, ':', absl::SkipEmpty());
  }
  dirs.push_back("/usr/bin");
  for (const std::string& dir : dirs) {
    const std::string candidate = dir + "/etcd";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

EtcdCluster::~EtcdCluster() {
  for (auto& member : members_) {
    if (member != nullptr && member->running()) member->Stop(absl::Seconds(5));
  }
  // The members' data (etcd preallocates 64 MiB of log each) goes; their
  // logs stay for a failed test.
  for (size_t i = 0; i < members_.size(); ++i) {
    std::error_code ignored;
    std::filesystem::remove_all(absl::StrCat(dir_, "/m", i), ignored);
  }
}

std::vector<std::string> EtcdCluster::MemberArgs(int i) const {
  std::vector<std::string> peers;
  for (size_t j = 0; j < peer_ports_.size(); ++j) {
    peers.push_back(absl::StrCat("m", j, "=http://127.0.0.1:", peer_ports_[j]));
  }
  const std::string client =
      absl::StrCat(tls_ ? "https" : "http", "://127.0.0.1:", client_ports_[i]);
  const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports_[i]);
  std::vector<std::string> args = {
      FindEtcdBinary(), absl::StrCat("--name=m", i), absl::StrCat("--data-dir=", dir_, "/m", i),
      "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
      "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
      "--initial-cluster=" + absl::StrJoin(peers, ","), "--initial-cluster-state=new",
      absl::StrCat("--initial-cluster-token=detour-test-", ::getpid()),
      // Elections in well under a second: tests wait less for a leader.
      "--heartbeat-interval=50", "--election-timeout=500", "--logger=zap", "--log-level=warn"};
  if (tls_) {
    for (const std::string& arg :
         {"--cert-file=" + dir_ + "/server.pem", "--key-file=" + dir_ + "/server.key",
          "--trusted-ca-file=" + client_files_.ca, std::string("--client-cert-auth")}) {
      args.push_back(arg);
    }
  }
  return args;
}

// openssl, run to its end (at most 60 s).
absl::Status RunOpenssl(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> argv = {"/usr/bin/openssl"};
  argv.insert(argv.end(), args.begin(), args.end());
  ChildProcess child;
  if (absl::Status started = child.Start(argv, log); !started.ok()) return started;
  std::optional<int> code = child.Wait(absl::Seconds(60));
  if (code != 0) {
    return absl::InternalError(absl::StrCat("openssl ", args[0], " failed: ", child.Log()));
  }
  return absl::OkStatus();
}

// A CA, a server certificate for 127.0.0.1 and a client certificate.
absl::Status EtcdCluster::MakeCertificates() {
  const std::string log = dir_ + "/openssl.log";
  const std::string ext = dir_ + "/server.ext";
  std::ofstream(ext) << "subjectAltName=IP:127.0.0.1\n";
  std::vector<std::vector<std::string>> steps = {
      {"req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", dir_ + "/ca.key", "-out",
       dir_ + "/ca.pem", "-days", "2", "-subj", "/CN=detour-test-etcd-ca"}};
  for (const std::string name : {"server", "client"}) {
    steps.push_back({"req", "-newkey", "rsa:2048", "-nodes", "-keyout", dir_ + "/" + name + ".key",
                     "-out", dir_ + "/" + name + ".csr", "-subj", "/CN=detour-test-" + name});
    std::vector<std::string> sign = {"x509",
                                     "-req",
                                     "-in",
                                     dir_ + "/" + name + ".csr",
                                     "-CA",
                                     dir_ + "/ca.pem",
                                     "-CAkey",
                                     dir_ + "/ca.key",
                                     "-CAcreateserial",
                                     "-days",
                                     "2",
                                     "-out",
                                     dir_ + "/" + name + ".pem"};
    if (name == "server") {
      sign.push_back("-extfile");
      sign.push_back(ext);
    }
    steps.push_back(sign);
  }
  for (const auto& step : steps) {
    if (absl::Status ran = RunOpenssl(step, log); !ran.ok()) return ran;
  }
  client_files_ = TlsFiles{dir_ + "/client.pem", dir_ + "/client.key", dir_ + "/ca.pem", false};
  auto security = TransportSecurity::Load(client_files_, /*client=*/true);
  if (!security.ok()) return security.status();
  security_ = *security;
  return absl::OkStatus();
}

absl::Status EtcdCluster::StartMember(int i) {
  members_[i] = std::make_unique<ChildProcess>();
  return members_[i]->Start(MemberArgs(i), absl::StrCat(dir_, "/m", i, ".log"));
}

absl::Status EtcdCluster::Start(int members, bool tls) {
  if (FindEtcdBinary().empty()) return absl::FailedPreconditionError(kNoEtcd);
  temp_.emplace("etcd");
  dir_ = temp_->path();
  tls_ = tls;
  if (tls_) {
    if (absl::Status made = MakeCertificates(); !made.ok()) return made;
  }
  // Every port is held until all are chosen, so no two are the same (one
  // closed at once could be handed out again: two members on one port, the
  // second of which never starts, left a 3-member cluster one kill away from
  // losing its quorum).
  std::vector<int> held;
  for (int i = 0; i < members; ++i) {
    auto [client_fd, client_port] = OccupyPort();
    auto [peer_fd, peer_port] = OccupyPort();
    held.push_back(client_fd);
    held.push_back(peer_fd);
    client_ports_.push_back(client_port);
    peer_ports_.push_back(peer_port);
    endpoints_.push_back(absl::StrCat("127.0.0.1:", client_port));
  }
  for (int fd : held) ::close(fd);
  members_.resize(members);
  for (int i = 0; i < members; ++i) {
    if (absl::Status started = StartMember(i); !started.ok()) return started;
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::Status last;
  while (absl::Now() < deadline) {
    // A new client each time: a connection made before the members serve
    // would wait out gRPC's connect timeout.
    auto put = Client(absl::Seconds(1))->Put("/detour-test/ready", "1");
    if (put.ok()) return absl::OkStatus();
    last = put.status();
    absl::SleepFor(absl::Milliseconds(100));
  }
  std::string logs;
  for (auto& member : members_) logs += member->Log();
  return absl::DeadlineExceededError(absl::StrCat(
      "etcd did not take a write within 60 s: ", last.message(), "\n", logs.substr(0, 4000)));
}

std::unique_ptr<EtcdClient> EtcdCluster::Client(absl::Duration timeout) const {
  EtcdOptions options;
  options.endpoints = endpoints_;
  options.call_timeout = timeout;
  options.security = security_;
  return *EtcdClient::Create(options);
}

void EtcdCluster::Kill(int i) {
  members_[i]->Signal(SIGKILL);
  members_[i]->Wait(absl::Seconds(30));
}

absl::Status EtcdCluster::Restart(int i) { return StartMember(i); }

}  // namespace detour::testing
