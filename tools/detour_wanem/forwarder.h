// The packet loop of detour-wanem: one thread, epoll over every node's TUN
// fd, a timerfd armed at the next release time, a signalfd (SIGTERM, SIGINT)
// and the control socket. A packet read from node S's device goes to the
// node that owns its IPv4 destination; the Link S -> D decides whether and
// when (link.h), and the packet waits in a min-heap keyed by release time in
// a preallocated pool (no allocation per packet) until it is written to D's
// device. Not thread-safe: Run on one thread; it owns the TUN fds.
#ifndef DETOUR_TOOLS_DETOUR_WANEM_FORWARDER_H_
#define DETOUR_TOOLS_DETOUR_WANEM_FORWARDER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tools/detour_wanem/link_table.h"

namespace detour::wanem {

struct ForwarderOptions {
  // Packets that may be in flight (delayed or queued) at once, over all
  // links; one more is dropped and counted as "no buffer".
  int pool_packets = 16384;
  int mtu = 1500;
  // Packets read from one device per wakeup before the others get a turn.
  int max_batch = 256;
  std::string socket_path;
  // How often a status line is logged while traffic flows.
  absl::Duration status_interval = absl::Seconds(10);
};

// Counters that belong to no link.
struct ForwarderStats {
  uint64_t dropped_no_buffer = 0;
  uint64_t dropped_not_ipv4 = 0;
  uint64_t dropped_unknown_destination = 0;
  uint64_t write_errors = 0;
};

class Forwarder {
 public:
  // `tun_fds[i]` is node i's device; the forwarder closes them. Does not own
  // `table`, which must outlive it.
  Forwarder(LinkTable* table, std::vector<int> tun_fds, ForwarderOptions options);
  ~Forwarder();
  Forwarder(const Forwarder&) = delete;
  Forwarder& operator=(const Forwarder&) = delete;

  // Creates the epoll set, the timer, the signal fd (blocking SIGTERM and
  // SIGINT) and the control socket. FAILED_PRECONDITION naming the step.
  absl::Status Init();
  // Forwards until SIGTERM, SIGINT or `quit`; returns OK then.
  absl::Status Run();

 private:
  struct Slot {
    int32_t length;
    int32_t src;
    int32_t dst;
  };
  struct Pending {
    int64_t release_ns;
    uint64_t seq;  // equal release times leave in arrival order
    int32_t slot;
  };
  struct Client {
    int fd;
    std::string input;
  };

  void ReadDevice(int node);
  void ReleaseDue();
  void ArmTimer();
  void AcceptClient();
  // False when the client is done (closed, overlong line, quit).
  bool ServeClient(Client* client);
  void LogStatus(bool final_line);
  char* SlotData(int32_t slot) {
    return pool_.data() + static_cast<size_t>(slot) * static_cast<size_t>(slot_bytes_);
  }

  LinkTable* table_;
  std::vector<int> tun_fds_;
  ForwarderOptions options_;
  int slot_bytes_;
  std::vector<char> pool_;
  std::vector<Slot> slots_;
  std::vector<int32_t> free_;
  std::vector<Pending> heap_;  // min-heap on (release_ns, seq)
  std::vector<char> scratch_;  // a packet read when the pool is empty
  uint64_t seq_ = 0;
  int epoll_fd_ = -1;
  int timer_fd_ = -1;
  int signal_fd_ = -1;
  int listen_fd_ = -1;
  std::vector<Client> clients_;
  bool stop_ = false;
  std::string stop_reason_;
  ForwarderStats stats_;
  uint64_t last_logged_packets_ = 0;
};

}  // namespace detour::wanem

#endif  // DETOUR_TOOLS_DETOUR_WANEM_FORWARDER_H_
