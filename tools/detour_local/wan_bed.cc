#include "tools/detour_local/wan_bed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/subprocess.h"

namespace detour {
namespace {

namespace fs = std::filesystem;

bool HaveCapability(int bit) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const unsigned long long caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return ((caps >> bit) & 1) != 0;
    }
  }
  return false;
}

bool IsExecutable(const std::string& path) {
  return !path.empty() && ::access(path.c_str(), X_OK) == 0 && !fs::is_directory(path);
}

// The first of `candidates` that is an executable file, or "".
std::string FirstExecutable(const std::vector<std::string>& candidates) {
  for (const std::string& c : candidates) {
    if (IsExecutable(c)) return c;
  }
  return "";
}

}  // namespace

std::string FindIpCommand() {
  std::vector<std::string> candidates;
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      candidates.push_back(absl::StrCat(dir, "/ip"));
    }
  }
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    candidates.push_back(absl::StrCat(dir, "/ip"));
  }
  return FirstExecutable(candidates);
}

absl::Status CheckWanPrivileges() {
  std::vector<std::string> missing;
  if (!HaveCapability(12)) missing.push_back("CAP_NET_ADMIN (network namespaces, TUN devices)");
  if (!HaveCapability(21)) {
    missing.push_back("CAP_SYS_ADMIN (the forwarder and this launcher enter the namespaces)");
  }
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) {
    missing.push_back("/dev/net/tun (load the tun module: modprobe tun)");
  }
  if (FindIpCommand().empty()) missing.push_back("the ip command (Debian: iproute2)");
  if (missing.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("--wan needs ", absl::StrJoin(missing, ", "),
                   "; run as root on Linux, or use --emulate_network instead"));
}

v1::ClusterSpec ScaleClusterBandwidth(const v1::ClusterSpec& cluster, double scale) {
  v1::ClusterSpec scaled = cluster;
  for (v1::RegionLink& link : *scaled.mutable_links()) {
    link.set_bandwidth_gbytes_per_s(link.bandwidth_gbytes_per_s() * scale);
  }
  scaled.set_intra_region_bandwidth_gbytes_per_s(cluster.intra_region_bandwidth_gbytes_per_s() *
                                                 scale);
  return scaled;
}

std::vector<std::string> WanBed::InNamespace(const WanNodeAddress& node,
                                             std::vector<std::string> argv) const {
  std::vector<std::string> full = {ip_, "netns", "exec", node.netns};
  full.insert(full.end(), std::make_move_iterator(argv.begin()),
              std::make_move_iterator(argv.end()));
  return full;
}

absl::StatusOr<std::string> WanBed::RunScript(const std::vector<std::string>& args,
                                              const std::string& log_name) {
  const std::string log = absl::StrCat(options_.out_dir, "/", log_name);
  std::error_code ec;
  fs::remove(log, ec);
  std::vector<std::string> argv = {"/bin/bash", script_};
  argv.insert(argv.end(), args.begin(), args.end());
  ChildProcess child;
  // Its own process group: a terminal's Ctrl-C reaches detour-local, which
  // then takes the bed down itself, not a half-done `up`.
  RETURN_IF_ERROR(child.Start(argv, log, /*own_group=*/true));
  std::optional<int> code = child.Wait(absl::Seconds(60));
  if (!code.has_value()) {
    child.Stop(absl::Seconds(5));
    return absl::DeadlineExceededError(
        absl::StrCat(script_, " ", args.front(), " took over 60 s; see ", log));
  }
  if (*code != 0) {
    return absl::InternalError(
        absl::StrCat(script_, " ", args.front(), " failed (exit ", *code, "):\n", child.Log()));
  }
  return child.Log();
}

absl::Status WanBed::Up(const v1::ClusterSpec& cluster) {
  RETURN_IF_ERROR(CheckWanPrivileges());
  ip_ = FindIpCommand();
  const std::string& bin = options_.bin_dir;
  const char* script_env = std::getenv("DETOUR_WAN_TESTBED");
  script_ = FirstExecutable({script_env != nullptr ? script_env : "", bin + "/tools/wan_testbed.sh",
                             bin + "/detour-wan-testbed"});
  if (script_.empty() && script_env == nullptr &&
      fs::is_regular_file(bin + "/tools/wan_testbed.sh")) {
    script_ = bin + "/tools/wan_testbed.sh";
  }
  if (script_.empty()) {
    return absl::NotFoundError(
        absl::StrCat("--wan: tools/wan_testbed.sh not found under ", bin,
                     " (reconfigure the build tree, or set DETOUR_WAN_TESTBED to the script)"));
  }
  wanem_ = FirstExecutable({bin + "/tools/detour_wanem/detour-wanem", bin + "/detour-wanem"});
  if (wanem_.empty()) {
    return absl::NotFoundError(absl::StrCat("--wan: detour-wanem not found under ", bin,
                                            " (cmake --build <build> --target detour_wanem)"));
  }
  if (options_.workers > cluster.nodes_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--wan runs one worker per --cluster node: ", options_.workers,
                     " workers but ", cluster.nodes_size(), " nodes"));
  }

  // The bed's spec: the nodes that get a worker, then the coordinator in a
  // region of its own, options.coordinator_latency_ms from every other one.
  // Its links take the fastest bandwidth of the spec: the control traffic is
  // small and should not be what a run measures.
  v1::ClusterSpec bed = cluster;
  bed.clear_nodes();
  absl::flat_hash_set<std::string> regions, ids;
  for (int i = 0; i < options_.workers; ++i) {
    *bed.add_nodes() = cluster.nodes(i);
    regions.insert(cluster.nodes(i).region());
  }
  for (const v1::NodeSpec& n : cluster.nodes()) ids.insert(n.id());
  if (ids.contains(kWanCoordinatorNode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--wan: the cluster already has a node named \"", kWanCoordinatorNode,
                     "\", the name of the coordinator's namespace; rename it"));
  }
  std::string coordinator_region = "detour-local-coordinator";
  while (regions.contains(coordinator_region)) coordinator_region += "_";
  double fastest = cluster.intra_region_bandwidth_gbytes_per_s();
  for (const v1::RegionLink& l : cluster.links()) {
    fastest = std::max(fastest, l.bandwidth_gbytes_per_s());
  }
  v1::NodeSpec* c = bed.add_nodes();
  c->set_id(kWanCoordinatorNode);
  c->set_region(coordinator_region);
  for (const std::string& r : regions) {
    v1::RegionLink* l = bed.add_links();
    l->set_region_a(coordinator_region);
    l->set_region_b(r);
    l->set_latency_ms(options_.coordinator_latency_ms);
    l->set_bandwidth_gbytes_per_s(fastest);
  }
  // With a single worker region the spec had no links and may have needed
  // none; the coordinator's region needs them now, which the above added.
  RETURN_IF_ERROR(EnsureWritableDirectory(options_.out_dir, "--out"));
  const std::string bed_path = options_.out_dir + "/bed_cluster.json";
  RETURN_IF_ERROR(WriteFileAtomically(bed_path, ToJson(bed)));

  // The node table, as the forwarder will number the nodes.
  {
    ChildProcess nodes;
    const std::string log = options_.out_dir + "/nodes.txt";
    std::error_code ec;
    fs::remove(log, ec);
    RETURN_IF_ERROR(nodes.Start({wanem_, "nodes", "--cluster", bed_path}, log));
    if (nodes.Wait(absl::Seconds(20)) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("--wan: detour-wanem rejected the bed's spec ",
                                                     bed_path, ":\n", nodes.Log()));
    }
    for (absl::string_view line : absl::StrSplit(nodes.Log(), '\n', absl::SkipEmpty())) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() != 3) continue;
      nodes_.push_back({f[0], f[1], f[2], absl::StrCat(options_.prefix, "-", f[0])});
    }
  }
  if (nodes_.size() != static_cast<size_t>(options_.workers) + 1 ||
      nodes_.back().id != kWanCoordinatorNode) {
    return absl::InternalError(
        absl::StrCat("--wan: unexpected node table from detour-wanem nodes (", nodes_.size(),
                     " nodes for ", options_.workers, " workers + coordinator)"));
  }

  up_ = true;  // from here on, Down() runs (`up` cleans a failed start itself)
  auto out =
      RunScript({"up", "--cluster", bed_path, "--prefix", options_.prefix, "--bandwidth_scale",
                 absl::StrCat(options_.bandwidth_scale), "--binary", wanem_},
                "up.log");
  if (!out.ok()) return out.status();
  return absl::OkStatus();
}

bool WanBed::Down() {
  if (!up_) return false;
  up_ = false;
  // The counters prove which links carried the run's traffic.
  auto stats = RunScript({"ctl", "--prefix", options_.prefix, "stats"}, "stats.txt");
  if (!stats.ok()) LogWarning("--wan: reading the link counters: ", stats.status().message());
  auto down = RunScript({"down", "--prefix", options_.prefix}, "down.log");
  if (!down.ok()) {
    std::cerr << "detour-local: taking the test bed down failed: " << down.status().message()
              << "\n  run: " << script_ << " down --prefix " << options_.prefix << "\n";
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------
// NetnsRelay

absl::StatusOr<int> NetnsRelay::Start(const std::string& netns, const std::string& host, int port) {
  host_ = host;
  port_ = port;
  const std::string ns_path = absl::StrCat("/run/netns/", netns);
  ns_fd_ = ::open(ns_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (ns_fd_ < 0) {
    return absl::UnavailableError(absl::StrCat("open ", ns_path, ": ", std::strerror(errno)));
  }
  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0 ||
      ::listen(listen_fd_, 64) < 0 ||
      ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) < 0) {
    return absl::InternalError(absl::StrCat("relay listen: ", std::strerror(errno)));
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  thread_ = std::thread([this] { Loop(); });
  return static_cast<int>(ntohs(addr.sin_port));
}

void NetnsRelay::Stop() {
  if (thread_.joinable()) {
    stop_ = true;
    const uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  for (int* fd : {&listen_fd_, &wake_fd_, &ns_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void NetnsRelay::Loop() {
  // Only this thread moves into the namespace: every socket it creates from
  // now on lives there, while the listening one (made before) stays here.
  if (::setns(ns_fd_, CLONE_NEWNET) != 0) {
    LogError("relay: setns: ", std::strerror(errno));
    return;
  }
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_port = htons(static_cast<uint16_t>(port_));
  if (::inet_pton(AF_INET, host_.c_str(), &target.sin_addr) != 1) {
    LogError("relay: bad address ", host_);
    return;
  }
  // One accepted connection and its counterpart; buf[i] holds what was read
  // from fd[i] and not yet written to the other.
  struct Pair {
    int fd[2];
    std::string buf[2];
  };
  std::vector<std::unique_ptr<Pair>> pairs;
  auto close_pair = [](Pair& p) {
    for (int& fd : p.fd) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  };
  constexpr size_t kChunk = 64 * 1024;
  std::vector<char> chunk(kChunk);
  while (!stop_) {
    std::vector<pollfd> fds = {{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (auto& p : pairs) {
      for (int i = 0; i < 2; ++i) {
        short events = 0;
        if (p->buf[i].size() < kChunk) events |= POLLIN;
        if (!p->buf[1 - i].empty()) events |= POLLOUT;
        fds.push_back({p->fd[i], events, 0});
      }
    }
    if (::poll(fds.data(), fds.size(), 1000) < 0) {
      if (errno == EINTR) continue;
      LogError("relay: poll: ", std::strerror(errno));
      break;
    }
    if (fds[1].revents & POLLIN) {
      const int in = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (in >= 0) {
        const int out = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        // The coordinator is up and one short link away: a blocking connect
        // is brief, and a failure only drops this client connection.
        if (out < 0 || ::connect(out, reinterpret_cast<sockaddr*>(&target), sizeof(target)) != 0) {
          if (out >= 0) ::close(out);
          ::close(in);
        } else {
          const int one = 1;
          for (int fd : {in, out}) {
            ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
            ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
          }
          pairs.push_back(std::make_unique<Pair>(Pair{{in, out}, {}}));
        }
      }
    }
    size_t k = 2;
    for (auto& p : pairs) {
      bool broken = false;
      for (int i = 0; i < 2; ++i, ++k) {
        if (broken || k >= fds.size()) continue;
        const short re = fds[k].revents;
        if ((re & (POLLHUP | POLLERR)) && p->buf[i].size() >= kChunk) {
          broken = true;  // no room to read what is left, and no more will come
        } else if (re & (POLLIN | POLLHUP | POLLERR)) {
          const ssize_t n = ::read(p->fd[i], chunk.data(), kChunk - p->buf[i].size());
          if (n > 0) {
            p->buf[i].append(chunk.data(), static_cast<size_t>(n));
          } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
            broken = true;
          }
        }
        if (!broken && (re & POLLOUT) && !p->buf[1 - i].empty()) {
          const ssize_t n =
              ::send(p->fd[i], p->buf[1 - i].data(), p->buf[1 - i].size(), MSG_NOSIGNAL);
          if (n > 0) {
            p->buf[1 - i].erase(0, static_cast<size_t>(n));
          } else if (errno != EAGAIN && errno != EINTR) {
            broken = true;
          }
        }
      }
      if (broken) close_pair(*p);
    }
    pairs.erase(std::remove_if(pairs.begin(), pairs.end(),
                               [](const std::unique_ptr<Pair>& p) { return p->fd[0] < 0; }),
                pairs.end());
  }
  for (auto& p : pairs) close_pair(*p);
}

}  // namespace detour
