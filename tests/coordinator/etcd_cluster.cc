#include "tests/coordinator/etcd_cluster.h"

#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>

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
}

std::vector<std::string> EtcdCluster::MemberArgs(int i) const {
  std::vector<std::string> peers;
  for (size_t j = 0; j < peer_ports_.size(); ++j) {
    peers.push_back(absl::StrCat("m", j, "=http://127.0.0.1:", peer_ports_[j]));
  }
  const std::string client = absl::StrCat("http://127.0.0.1:", client_ports_[i]);
  const std::string peer = absl::StrCat("http://127.0.0.1:", peer_ports_[i]);
  return {FindEtcdBinary(), absl::StrCat("--name=m", i), absl::StrCat("--data-dir=", dir_, "/m", i),
          "--listen-client-urls=" + client, "--advertise-client-urls=" + client,
          "--listen-peer-urls=" + peer, "--initial-advertise-peer-urls=" + peer,
          "--initial-cluster=" + absl::StrJoin(peers, ","), "--initial-cluster-state=new",
          absl::StrCat("--initial-cluster-token=detour-test-", ::getpid()),
          // Elections in well under a second: tests wait less for a leader.
          "--heartbeat-interval=50", "--election-timeout=500", "--logger=zap", "--log-level=warn"};
}

absl::Status EtcdCluster::StartMember(int i) {
  members_[i] = std::make_unique<ChildProcess>();
  return members_[i]->Start(MemberArgs(i), absl::StrCat(dir_, "/m", i, ".log"));
}

absl::Status EtcdCluster::Start(int members) {
  if (FindEtcdBinary().empty()) return absl::FailedPreconditionError(kNoEtcd);
  dir_ = MakeTempDir("etcd");
  for (int i = 0; i < members; ++i) {
    // Held until every port is chosen, so no two are the same.
    auto [client_fd, client_port] = OccupyPort();
    auto [peer_fd, peer_port] = OccupyPort();
    client_ports_.push_back(client_port);
    peer_ports_.push_back(peer_port);
    endpoints_.push_back(absl::StrCat("127.0.0.1:", client_port));
    ::close(client_fd);
    ::close(peer_fd);
  }
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
  return *EtcdClient::Create(options);
}

void EtcdCluster::Kill(int i) {
  members_[i]->Signal(SIGKILL);
  members_[i]->Wait(absl::Seconds(30));
}

absl::Status EtcdCluster::Restart(int i) { return StartMember(i); }

}  // namespace detour::testing
