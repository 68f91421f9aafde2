// detour-local --wan: the packet-level WAN test bed (tools/wan_testbed.sh and
// detour-wanem) under a local cluster. One network namespace per worker, with
// its cluster node's region, and one for the coordinator; the kernel's TCP
// between them sees the spec's delays and bandwidths, which the in-process
// --emulate_network cannot show (docs/OPERATIONS.md §"The WAN test bed").
#ifndef DETOUR_TOOLS_DETOUR_LOCAL_WAN_BED_H_
#define DETOUR_TOOLS_DETOUR_LOCAL_WAN_BED_H_

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "detour/v1/spec.pb.h"

namespace detour {

// The node the coordinator runs in: its own region, this close to every
// worker region.
inline constexpr char kWanCoordinatorNode[] = "coordinator";

struct WanBedOptions {
  std::string bin_dir;  // build tree or install bin/ (finds the script, detour-wanem)
  std::string out_dir;  // <out>/wan/ holds the bed's spec, logs and stats
  std::string prefix;   // namespaces <prefix>-<node id>
  double bandwidth_scale = 1.0;
  double coordinator_latency_ms = 2.0;
  int workers = 0;  // the first `workers` nodes of the cluster get one each
};

struct WanNodeAddress {
  std::string id;
  std::string region;
  std::string address;  // inside the bed
  std::string netns;
};

// Names what this process lacks to build a bed (CAP_NET_ADMIN, CAP_SYS_ADMIN,
// /dev/net/tun, the ip command); OK when nothing.
absl::Status CheckWanPrivileges();

// `cluster` with every link's bandwidth (and the intra-region one) times
// `scale`: what the planner should see when the bed runs the links scaled.
v1::ClusterSpec ScaleClusterBandwidth(const v1::ClusterSpec& cluster, double scale);

// The absolute path of the `ip` command, or "".
std::string FindIpCommand();

// Brings the bed up on Up() and takes down exactly that bed (its prefix) on
// Down() or destruction. Not thread-safe.
class WanBed {
 public:
  explicit WanBed(WanBedOptions options) : options_(std::move(options)) {}
  ~WanBed() { Down(); }
  WanBed(const WanBed&) = delete;
  WanBed& operator=(const WanBed&) = delete;

  // Writes the bed's spec (the first options.workers nodes of `cluster` plus
  // the coordinator node), runs `wan_testbed.sh up` and reads the node table.
  absl::Status Up(const v1::ClusterSpec& cluster);
  // Saves the forwarder's per-link counters to <out>/wan/stats.txt, then
  // `wan_testbed.sh down`. Idempotent; true when it took the bed down now
  // (false when it was not up, or `down` failed, which it says on stderr).
  bool Down();

  // Worker nodes in cluster order, then the coordinator's.
  const std::vector<WanNodeAddress>& nodes() const { return nodes_; }
  const WanNodeAddress& coordinator() const { return nodes_.back(); }
  const std::string& script() const { return script_; }
  // argv that runs `argv` inside `node`'s namespace.
  std::vector<std::string> InNamespace(const WanNodeAddress& node,
                                       std::vector<std::string> argv) const;

 private:
  absl::StatusOr<std::string> RunScript(const std::vector<std::string>& args,
                                        const std::string& log_name);

  const WanBedOptions options_;
  std::string script_;
  std::string wanem_;
  std::string ip_;
  bool up_ = false;
  std::vector<WanNodeAddress> nodes_;
};

// Forwards TCP connections made to 127.0.0.1:<port> in this process's network
// namespace to host:port inside another namespace, so that detour-local (and
// detourctl while it runs) reach the coordinator in its namespace. A thread
// that has entered the target namespace opens the outgoing sockets; sockets
// stay in the namespace they were made in.
class NetnsRelay {
 public:
  NetnsRelay() = default;
  ~NetnsRelay() { Stop(); }
  NetnsRelay(const NetnsRelay&) = delete;
  NetnsRelay& operator=(const NetnsRelay&) = delete;

  // Returns the local port.
  absl::StatusOr<int> Start(const std::string& netns, const std::string& host, int port);
  void Stop();

 private:
  void Loop();

  int listen_fd_ = -1;
  int wake_fd_ = -1;
  int ns_fd_ = -1;
  std::string host_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace detour

#endif  // DETOUR_TOOLS_DETOUR_LOCAL_WAN_BED_H_
