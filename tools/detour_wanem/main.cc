// detour-wanem: a userspace WAN emulator for the packet-level test bed. It
// joins one network namespace per node of a detour ClusterSpec through a TUN
// device each and forwards IPv4 packets between them with the spec's delay
// and bandwidth, plus jitter, loss, queue limits and cuts changed at run time
// over a Unix socket (docs/OPERATIONS.md §"The WAN test bed").
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/flags.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/version.h"
#include "tools/detour_wanem/control.h"
#include "tools/detour_wanem/forwarder.h"
#include "tools/detour_wanem/link_table.h"
#include "tools/detour_wanem/tun.h"

namespace detour::wanem {
namespace {

constexpr char kProgram[] = "detour-wanem";
constexpr int kExitOk = 0;
constexpr int kExitError = 1;

constexpr char kEpilog[] = R"(Commands:
  (none)    run the forwarder (needs root: CAP_NET_ADMIN and CAP_SYS_ADMIN)
  ctl       send one control command: detour-wanem ctl --socket PATH CMD...
  nodes     print "id region address" of every node of --cluster and exit

The namespaces must exist (tools/wan_testbed.sh makes them: `up`, `down`,
`exec`). Node i of the cluster gets the address i+1 of --subnet on a TUN
device in namespace <netns_prefix>-<node id>, with the subnet routed through
it. Every ordered pair of nodes is a link with the cluster's one-way latency
and bandwidth (times --bandwidth_scale); packets to other addresses, and
packets other than IPv4, are dropped.

Control commands (socket or ctl; `ok` or `error: <reason>` ends each reply):
  set SRC DST [both] key=value...   delay_ms, jitter_ms, rate_mbytes (1e6 B/s,
                                    0 = unlimited), loss (0..1), queue_kb (0 =
                                    max(BDP, floor)), reorder (0|1)
  cut SRC DST [both]                drop everything on the link(s)
  restore SRC DST [both]            undo cut
  show [SRC DST [both]]             parameters
  stats [SRC DST [both]]            counters of links that saw traffic
  nodes | ping | quit
SRC and DST are node ids or *; both adds the reverse direction.

Example:
  detour-wanem --cluster examples/clusters/geo12.json --netns_prefix wan \
      --socket /run/detour-wanem/wan/ctl.sock --bandwidth_scale 0.01 \
      --set 'w0 w1 both loss=0.01; * w3 jitter_ms=5'
  detour-wanem ctl --socket /run/detour-wanem/wan/ctl.sock cut w0 w1 both

Exit codes: 0 stopped by SIGTERM, SIGINT or quit (ctl: ok); 1 error (ctl: the
forwarder answered error); 2 usage.)";

int Fail(const absl::Status& status) {
  std::cerr << kProgram << ": " << status.message() << "\n";
  return kExitError;
}

absl::StatusOr<LinkTable> LoadTable(const std::string& cluster_path, const std::string& subnet,
                                    double bandwidth_scale, int64_t queue_floor_kb, int64_t seed) {
  if (cluster_path.empty()) return absl::InvalidArgumentError("--cluster is required");
  auto cluster = LoadClusterSpec(cluster_path);
  if (!cluster.ok()) return cluster.status();
  auto net = ParseSubnet(subnet);
  if (!net.ok()) return net.status();
  LinkTableOptions options;
  options.bandwidth_scale = bandwidth_scale;
  options.queue_floor_bytes = queue_floor_kb * 1024;
  options.seed = static_cast<uint64_t>(seed);
  options.subnet = *net;
  return LinkTable::FromCluster(*cluster, options);
}

int Ctl(const std::vector<std::string>& args) {
  FlagSet flags("detour-wanem ctl", "Sends one control command to a running detour-wanem.");
  std::string socket_path;
  absl::Duration timeout = absl::Seconds(5);
  flags.String("socket", &socket_path, "the forwarder's control socket (required)");
  flags.Duration("timeout", &timeout, "how long to wait for the reply");
  flags.Positional("CMD...", "the command and its arguments, e.g. `cut w0 w1 both`");
  auto words = flags.Parse(args);
  if (!words.ok()) return flags.Fail(words.status());
  if (socket_path.empty()) return flags.Fail(absl::InvalidArgumentError("--socket is required"));
  if (words->empty()) return flags.Fail(absl::InvalidArgumentError("missing command"));
  if (timeout <= absl::ZeroDuration() || timeout > absl::Minutes(10)) {
    return flags.Fail(absl::InvalidArgumentError("--timeout must be in (0, 10m]"));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof(addr.sun_path)) {
    return flags.Fail(absl::InvalidArgumentError("--socket: path too long"));
  }
  std::memcpy(addr.sun_path, socket_path.data(), socket_path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Fail(absl::InternalError(std::strerror(errno)));
  const timeval tv = absl::ToTimeval(timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return Fail(absl::UnavailableError(
        absl::StrCat("cannot reach the forwarder at ", socket_path, ": ", why)));
  }
  const std::string line = absl::StrCat(absl::StrJoin(*words, " "), "\n");
  if (::send(fd, line.data(), line.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(line.size())) {
    ::close(fd);
    return Fail(absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno))));
  }
  // The reply ends with its status line; read until one arrives.
  std::string reply;
  char buf[4096];
  while (true) {
    const size_t last_start = reply.rfind('\n', reply.size() >= 2 ? reply.size() - 2 : 0);
    const absl::string_view last =
        absl::string_view(reply).substr(last_start == std::string::npos ? 0 : last_start + 1);
    if (!reply.empty() && reply.back() == '\n' &&
        (last == "ok\n" || absl::StartsWith(last, "error: "))) {
      break;
    }
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      ::close(fd);
      return Fail(absl::UnavailableError(
          n == 0 ? "the forwarder closed the connection without a reply"
                 : absl::StrCat("no reply within ", absl::FormatDuration(timeout))));
    }
    reply.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const size_t status_start = reply.rfind('\n', reply.size() - 2);
  const size_t split = status_start == std::string::npos ? 0 : status_start + 1;
  std::cout << reply.substr(0, split);
  const std::string status = reply.substr(split);
  if (status == "ok\n") {
    std::cout << status;
    return kExitOk;
  }
  std::cerr << kProgram << ": " << status;
  return kExitError;
}

int Nodes(const std::vector<std::string>& args) {
  FlagSet flags("detour-wanem nodes",
                "Prints `id region address` for every node of a cluster spec, one per line.");
  std::string cluster_path, subnet = "10.77.0.0/16";
  flags.String("cluster", &cluster_path, "the ClusterSpec JSON file (required)");
  flags.String("subnet", &subnet, "the test bed's IPv4 subnet");
  auto rest = flags.Parse(args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (!rest->empty()) return flags.Fail(absl::InvalidArgumentError("unexpected argument"));
  auto table = LoadTable(cluster_path, subnet, 1.0, 64, 1);
  if (!table.ok()) return Fail(table.status());
  ControlCommand cmd;
  cmd.kind = ControlCommand::Kind::kNodes;
  std::cout << ExecuteControl(cmd, &*table);
  return kExitOk;
}

int Main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && args[0] == "ctl") return Ctl({args.begin() + 1, args.end()});
  if (!args.empty() && args[0] == "nodes") return Nodes({args.begin() + 1, args.end()});

  FlagSet flags(kProgram,
                "Emulates a WAN between network namespaces: forwards IPv4 packets between one\n"
                "TUN device per node with each link's delay, jitter, rate, loss and cuts.");
  std::string cluster_path, netns_prefix, socket_path, subnet = "10.77.0.0/16";
  std::string tun_name = "wan0", initial_set, log_level = "info";
  double bandwidth_scale = 1.0;
  int64_t seed = 1, mtu = 1500, pool_packets = 16384, queue_floor_kb = 64;
  absl::Duration status_interval = absl::Seconds(10);
  flags.String("cluster", &cluster_path, "the ClusterSpec JSON file (required)");
  flags.String("netns_prefix", &netns_prefix,
               "node i lives in network namespace <prefix>-<node id> (required)");
  flags.String("socket", &socket_path, "Unix socket for control commands (required)");
  flags.String("subnet", &subnet, "the test bed's IPv4 subnet; node i gets address i+1");
  flags.Double("bandwidth_scale", &bandwidth_scale,
               "multiplies every link's bandwidth, in (0, 1000]; the forwarder's own ceiling "
               "is far below a real WAN spec's GB/s (docs/OPERATIONS.md)");
  flags.String("set", &initial_set,
               "link overrides applied at start: `set` commands without the word set, "
               "separated by ';', e.g. 'w0 w1 both delay_ms=20 rate_mbytes=2; * w2 loss=0.01'");
  flags.Int("seed", &seed, "seed of the loss and jitter draws (deterministic per link)");
  flags.String("tun_name", &tun_name, "the TUN device's name inside each namespace");
  flags.Int("mtu", &mtu, "MTU of the TUN devices, in [576, 9000]");
  flags.Int("pool_packets", &pool_packets,
            "packets in flight at once over all links, in [64, 1048576]; more are dropped");
  flags.Int("queue_floor_kb", &queue_floor_kb,
            "smallest automatic queue limit per link (KiB), in [2, 1048576]");
  flags.Duration("status_interval", &status_interval, "how often to log counters");
  flags.String("log_level", &log_level, "debug, info, warning or error");
  bool version = false;
  flags.Bool("version", &version, "print the version and exit");
  flags.SetEpilog(kEpilog);
  auto rest = flags.Parse(argc, argv);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (version) {
    std::cout << kProgram << " " << kVersion << " (" << kGitRevision << ")\n";
    return kExitOk;
  }
  if (!rest->empty()) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("unknown command '", (*rest)[0], "' (expected ctl or nodes, or none)")));
  }
  const auto usage = [&](const std::string& m) {
    return flags.Fail(absl::InvalidArgumentError(m));
  };
  if (netns_prefix.empty()) return usage("--netns_prefix is required");
  if (socket_path.empty()) return usage("--socket is required");
  if (mtu < 576 || mtu > 9000) return usage("--mtu must be in [576, 9000]");
  if (pool_packets < 64 || pool_packets > 1048576) {
    return usage("--pool_packets must be in [64, 1048576]");
  }
  if (queue_floor_kb < 2 || queue_floor_kb > 1048576) {
    return usage("--queue_floor_kb must be in [2, 1048576]");
  }
  if (status_interval < absl::Seconds(1)) return usage("--status_interval must be at least 1s");
  LogLevel level;
  if (!ParseLogLevel(log_level, &level)) return usage("--log_level: expected debug, info, ...");
  SetLogLevel(level);
  SetLogComponent("wanem");

  auto table = LoadTable(cluster_path, subnet, bandwidth_scale, queue_floor_kb, seed);
  if (!table.ok()) return Fail(table.status());
  for (absl::string_view part : absl::StrSplit(initial_set, ';', absl::SkipWhitespace())) {
    const std::string line = absl::StrCat("set ", absl::StripAsciiWhitespace(part));
    const ControlReply reply = HandleControlLine(line, &*table);
    if (reply.text != "ok\n") {
      return usage(absl::StrCat("--set '", absl::StripAsciiWhitespace(part), "': ",
                                absl::StripSuffix(absl::StripPrefix(reply.text, "error: "), "\n")));
    }
  }

  std::vector<int> fds;
  const auto close_all = [&fds] {
    for (int fd : fds) ::close(fd);
  };
  for (int i = 0; i < table->size(); ++i) {
    TunConfig c;
    c.netns = absl::StrCat(netns_prefix, "-", table->node(i).id);
    c.device = tun_name;
    c.address = table->node(i).address;
    c.prefix_len = table->subnet().prefix_len;
    c.mtu = static_cast<int>(mtu);
    auto fd = OpenTunInNetns(c);
    if (!fd.ok()) {
      close_all();
      return Fail(fd.status());
    }
    fds.push_back(*fd);
    LogInfo("node ", table->node(i).id, " (", table->node(i).region, "): ", c.netns, " ", tun_name,
            " ", FormatIpv4(c.address), "/", c.prefix_len);
  }

  ForwarderOptions options;
  options.pool_packets = static_cast<int>(pool_packets);
  options.mtu = static_cast<int>(mtu);
  options.socket_path = socket_path;
  options.status_interval = status_interval;
  Forwarder forwarder(&*table, std::move(fds), options);
  if (absl::Status s = forwarder.Init(); !s.ok()) return Fail(s);
  LogInfo("forwarding between ", table->size(), " nodes (", table->size() * (table->size() - 1),
          " links, bandwidth scale ", bandwidth_scale, ", seed ", seed, "); control socket ",
          socket_path);
  if (absl::Status s = forwarder.Run(); !s.ok()) return Fail(s);
  return kExitOk;
}

}  // namespace
}  // namespace detour::wanem

int main(int argc, char** argv) { return detour::wanem::Main(argc, argv); }
