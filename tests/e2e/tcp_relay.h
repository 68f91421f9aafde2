// A TCP relay for partition tests: listens on a loopback port of its own and
// forwards every connection it accepts to a loopback target port, both ways,
// byte for byte (TLS passes through untouched). Cut() closes every relayed
// connection and refuses new ones (each is accepted and closed at once) until
// Restore(): a network partition between whoever dials the relay and the
// target, as both ends see it. Thread-safe; one thread for the listener and
// one per relayed connection, all joined by the destructor.
#ifndef DETOUR_TESTS_E2E_TCP_RELAY_H_
#define DETOUR_TESTS_E2E_TCP_RELAY_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace detour::testing {

class TcpRelay {
 public:
  TcpRelay() = default;
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;
  ~TcpRelay() {
    stop_ = true;
    Cut();
    if (listener_.joinable()) listener_.join();
    std::vector<std::thread> pumps;
    {
      absl::MutexLock lock(&mu_);
      pumps.swap(pumps_);
    }
    for (std::thread& t : pumps) t.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
  }

  // Binds 127.0.0.1:0 and listens; port() is known from here on, before the
  // target is (a daemon may be told the relay's address before it starts).
  absl::Status Listen() {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return absl::ErrnoToStatus(errno, "relay: socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return absl::ErrnoToStatus(errno, "relay: bind");
    }
    socklen_t len = sizeof(addr);
    if (::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return absl::ErrnoToStatus(errno, "relay: getsockname");
    }
    port_ = ntohs(addr.sin_port);
    if (::listen(listen_fd_, 64) != 0) return absl::ErrnoToStatus(errno, "relay: listen");
    return absl::OkStatus();
  }

  // Starts forwarding accepted connections to 127.0.0.1:`target_port`.
  void Start(int target_port) {
    target_port_ = target_port;
    listener_ = std::thread([this] { AcceptLoop(); });
  }

  int port() const { return port_; }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Closes every relayed connection (both ends see it end) and refuses new
  // ones until Restore().
  void Cut() {
    absl::MutexLock lock(&mu_);
    cut_ = true;
    for (int fd : open_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  void Restore() {
    absl::MutexLock lock(&mu_);
    cut_ = false;
  }

  // Connections relayed since Start (refused ones not counted).
  int relayed() const { return relayed_; }

 private:
  void AcceptLoop() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      bool cut;
      {
        absl::MutexLock lock(&mu_);
        cut = cut_;
      }
      const int upstream = cut ? -1 : Connect();
      if (upstream < 0) {
        ::close(client);
        continue;
      }
      absl::MutexLock lock(&mu_);
      if (cut_) {  // cut between the check and the connect
        ::close(client);
        ::close(upstream);
        continue;
      }
      open_fds_.insert(client);
      open_fds_.insert(upstream);
      ++relayed_;
      pumps_.emplace_back([this, client, upstream] { Pump(client, upstream); });
    }
  }

  int Connect() const {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(target_port_));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::close(fd);
      return -1;
    }
    return fd;
  }

  // Copies both ways until either side ends (or Cut shut both down).
  void Pump(int a, int b) {
    char buffer[16384];
    bool open = true;
    while (open && !stop_) {
      pollfd p[2] = {{a, POLLIN, 0}, {b, POLLIN, 0}};
      if (::poll(p, 2, 200) < 0 && errno != EINTR) break;
      for (int i = 0; i < 2 && open; ++i) {
        if (p[i].revents == 0) continue;
        const int from = i == 0 ? a : b;
        const int to = i == 0 ? b : a;
        const ssize_t n = ::read(from, buffer, sizeof(buffer));
        if (n <= 0) {
          open = false;
          break;
        }
        for (ssize_t sent = 0; sent < n;) {
          const ssize_t w = ::send(to, buffer + sent, static_cast<size_t>(n - sent), MSG_NOSIGNAL);
          if (w <= 0) {
            open = false;
            break;
          }
          sent += w;
        }
      }
    }
    absl::MutexLock lock(&mu_);
    open_fds_.erase(a);
    open_fds_.erase(b);
    ::close(a);
    ::close(b);
  }

  int listen_fd_ = -1;
  int port_ = 0;
  int target_port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread listener_;
  mutable absl::Mutex mu_;
  bool cut_ ABSL_GUARDED_BY(mu_) = false;
  std::set<int> open_fds_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> relayed_{0};
};

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_TCP_RELAY_H_
