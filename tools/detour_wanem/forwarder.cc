#include "tools/detour_wanem/forwarder.h"

#include <arpa/inet.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <ctime>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "tools/detour_wanem/control.h"

namespace detour::wanem {
namespace {

// epoll tags: the kind in the high bits, an index in the low ones.
constexpr uint64_t kTagDevice = 1ULL << 32;
constexpr uint64_t kTagTimer = 2ULL << 32;
constexpr uint64_t kTagSignal = 3ULL << 32;
constexpr uint64_t kTagListen = 4ULL << 32;
constexpr uint64_t kTagClient = 5ULL << 32;
constexpr uint64_t kTagMask = 0xffffffffULL << 32;

constexpr size_t kMaxClients = 8;

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

template <typename T>
bool Later(const T& a, const T& b) {
  return a.release_ns != b.release_ns ? a.release_ns > b.release_ns : a.seq > b.seq;
}

absl::Status ErrnoStatus(const std::string& step) {
  return absl::FailedPreconditionError(absl::StrCat(step, ": ", std::strerror(errno)));
}

absl::Status Watch(int epoll_fd, int fd, uint64_t tag) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = tag;
  if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) < 0) return ErrnoStatus("epoll_ctl");
  return absl::OkStatus();
}

void SendAll(int fd, const std::string& text) {
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::send(fd, text.data() + off, text.size() - off, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    // A client that stops reading for the send timeout loses its reply: the
    // packet loop must not wait on it longer.
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

}  // namespace

Forwarder::Forwarder(LinkTable* table, std::vector<int> tun_fds, ForwarderOptions options)
    : table_(table), tun_fds_(std::move(tun_fds)), options_(std::move(options)) {
  slot_bytes_ = options_.mtu;
  pool_.resize(static_cast<size_t>(options_.pool_packets) * static_cast<size_t>(slot_bytes_));
  slots_.resize(static_cast<size_t>(options_.pool_packets));
  free_.reserve(static_cast<size_t>(options_.pool_packets));
  for (int32_t i = options_.pool_packets - 1; i >= 0; --i) free_.push_back(i);
  heap_.reserve(static_cast<size_t>(options_.pool_packets));
  // A read into a buffer shorter than the packet truncates it; the device's
  // MTU bounds what the kernel hands over, this bounds what we accept.
  scratch_.resize(static_cast<size_t>(slot_bytes_));
}

Forwarder::~Forwarder() {
  for (int fd : tun_fds_) ::close(fd);
  for (const Client& c : clients_) ::close(c.fd);
  for (int fd : {epoll_fd_, timer_fd_, signal_fd_}) {
    if (fd >= 0) ::close(fd);
  }
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    ::unlink(options_.socket_path.c_str());
  }
}

absl::Status Forwarder::Init() {
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return ErrnoStatus("epoll_create1");
  for (size_t i = 0; i < tun_fds_.size(); ++i) {
    absl::Status s = Watch(epoll_fd_, tun_fds_[i], kTagDevice | i);
    if (!s.ok()) return s;
  }
  timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (timer_fd_ < 0) return ErrnoStatus("timerfd_create");
  if (absl::Status s = Watch(epoll_fd_, timer_fd_, kTagTimer); !s.ok()) return s;

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  if (sigprocmask(SIG_BLOCK, &mask, nullptr) < 0) return ErrnoStatus("sigprocmask");
  signal_fd_ = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
  if (signal_fd_ < 0) return ErrnoStatus("signalfd");
  if (absl::Status s = Watch(epoll_fd_, signal_fd_, kTagSignal); !s.ok()) return s;
  std::signal(SIGPIPE, SIG_IGN);

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (options_.socket_path.empty() || options_.socket_path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--socket: '%s' must have 1 to %d bytes", options_.socket_path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, options_.socket_path.data(), options_.socket_path.size());
  const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe < 0) return ErrnoStatus("socket");
  const bool in_use = ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(probe);
  if (in_use) {
    return absl::FailedPreconditionError(
        absl::StrCat("--socket ", options_.socket_path, ": another process listens there"));
  }
  struct stat st;
  if (::lstat(options_.socket_path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat("--socket ", options_.socket_path, ": exists and is not a socket"));
    }
    ::unlink(options_.socket_path.c_str());  // stale, nobody answers on it
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("socket");
  const mode_t old_umask = ::umask(077);  // the socket reconfigures the network: owner only
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_umask);
  if (rc < 0) {
    ::close(fd);
    return ErrnoStatus(absl::StrCat("bind ", options_.socket_path));
  }
  listen_fd_ = fd;
  if (::listen(listen_fd_, 8) < 0) return ErrnoStatus("listen");
  return Watch(epoll_fd_, listen_fd_, kTagListen);
}

void Forwarder::ReadDevice(int node) {
  const int fd = tun_fds_[static_cast<size_t>(node)];
  for (int i = 0; i < options_.max_batch; ++i) {
    const bool have_slot = !free_.empty();
    const int32_t slot = have_slot ? free_.back() : -1;
    char* buf = have_slot ? SlotData(slot) : scratch_.data();
    const ssize_t n = ::read(fd, buf, static_cast<size_t>(slot_bytes_));
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN) {
        LogWarning("read from ", table_->node(node).id, "'s device: ", std::strerror(errno));
      }
      return;
    }
    if (!have_slot) {
      ++stats_.dropped_no_buffer;
      continue;
    }
    if (n < 20 || (static_cast<unsigned char>(buf[0]) >> 4) != 4) {
      ++stats_.dropped_not_ipv4;
      continue;
    }
    uint32_t dst_be;
    std::memcpy(&dst_be, buf + 16, sizeof(dst_be));
    const int dst = table_->NodeForAddress(ntohl(dst_be));
    if (dst < 0 || dst == node) {
      ++stats_.dropped_unknown_destination;
      continue;
    }
    const Link::Verdict v = table_->link(node, dst).Admit(NowNs(), n);
    if (v.outcome != Link::Outcome::kForward) continue;
    free_.pop_back();
    slots_[static_cast<size_t>(slot)] = {static_cast<int32_t>(n), node, dst};
    heap_.push_back({v.release_ns, seq_++, slot});
    std::push_heap(heap_.begin(), heap_.end(),
                   [](const Pending& a, const Pending& b) { return Later(a, b); });
  }
}

void Forwarder::ReleaseDue() {
  const int64_t now = NowNs();
  const auto later = [](const Pending& a, const Pending& b) { return Later(a, b); };
  while (!heap_.empty() && heap_.front().release_ns <= now) {
    std::pop_heap(heap_.begin(), heap_.end(), later);
    const int32_t slot = heap_.back().slot;
    heap_.pop_back();
    const Slot& s = slots_[static_cast<size_t>(slot)];
    const ssize_t n = ::write(tun_fds_[static_cast<size_t>(s.dst)], SlotData(slot),
                              static_cast<size_t>(s.length));
    if (n == s.length) {
      LinkStats& st = table_->link(s.src, s.dst).stats();
      ++st.delivered_packets;
      st.delivered_bytes += static_cast<uint64_t>(n);
    } else {
      ++stats_.write_errors;
    }
    free_.push_back(slot);
  }
  ArmTimer();
}

void Forwarder::ArmTimer() {
  itimerspec spec{};
  if (!heap_.empty()) {
    const int64_t t = std::max<int64_t>(heap_.front().release_ns, 1);
    spec.it_value.tv_sec = t / 1000000000;
    spec.it_value.tv_nsec = t % 1000000000;
  }
  // it_value zero disarms: nothing is waiting.
  timerfd_settime(timer_fd_, TFD_TIMER_ABSTIME, &spec, nullptr);
}

void Forwarder::AcceptClient() {
  while (true) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    // Replies are sent blocking with a short timeout (SendAll); reads are
    // non-blocking through epoll.
    timeval tv{1, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (clients_.size() >= kMaxClients) {
      SendAll(fd, absl::StrFormat("error: too many control connections (limit %d)\n", kMaxClients));
      ::close(fd);
      continue;
    }
    if (!Watch(epoll_fd_, fd, kTagClient | static_cast<uint64_t>(fd)).ok()) {
      ::close(fd);
      continue;
    }
    clients_.push_back({fd, {}});
  }
}

bool Forwarder::ServeClient(Client* c) {
  char buf[4096];
  const ssize_t n = ::recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
  if (n < 0) return errno == EAGAIN || errno == EINTR;
  if (n == 0) return false;
  c->input.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t nl; (nl = c->input.find('\n', start)) != std::string::npos; start = nl + 1) {
    const std::string line = c->input.substr(start, nl - start);
    const ControlReply reply = HandleControlLine(line, table_);
    if (reply.text.rfind("error: ", 0) != 0 && line.rfind("stats", 0) != 0 &&
        line.rfind("show", 0) != 0 && line.rfind("ping", 0) != 0 && line.rfind("nodes", 0) != 0) {
      LogInfo("control: ", line);
    }
    SendAll(c->fd, reply.text);
    if (reply.quit) {
      stop_ = true;
      stop_reason_ = "quit on the control socket";
      return false;
    }
  }
  c->input.erase(0, start);
  if (c->input.size() > kMaxControlLineBytes) {
    SendAll(c->fd, absl::StrFormat("error: line over %d bytes\n", kMaxControlLineBytes));
    return false;
  }
  return true;
}

void Forwarder::LogStatus(bool final_line) {
  LinkStats sum;
  for (int s = 0; s < table_->size(); ++s) {
    for (int d = 0; d < table_->size(); ++d) {
      if (s == d) continue;
      const LinkStats& st = table_->link(s, d).stats();
      sum.delivered_packets += st.delivered_packets;
      sum.delivered_bytes += st.delivered_bytes;
      sum.dropped_loss += st.dropped_loss;
      sum.dropped_cut += st.dropped_cut;
      sum.dropped_queue += st.dropped_queue;
    }
  }
  const uint64_t seen = sum.delivered_packets + sum.dropped_loss + sum.dropped_cut +
                        sum.dropped_queue + stats_.dropped_no_buffer;
  if (!final_line && seen == last_logged_packets_) return;
  last_logged_packets_ = seen;
  LogInfo(absl::StrFormat(
      "%sdelivered %d packets (%.1f MB); dropped: loss %d, cut %d, queue %d, no buffer %d, "
      "not IPv4 %d, unknown destination %d; write errors %d; in flight %d",
      final_line ? "totals: " : "", sum.delivered_packets, sum.delivered_bytes / 1e6,
      sum.dropped_loss, sum.dropped_cut, sum.dropped_queue, stats_.dropped_no_buffer,
      stats_.dropped_not_ipv4, stats_.dropped_unknown_destination, stats_.write_errors,
      heap_.size()));
}

absl::Status Forwarder::Run() {
  epoll_event events[64];
  absl::Time next_status = absl::Now() + options_.status_interval;
  while (!stop_) {
    const int64_t wait_ms =
        std::clamp<int64_t>(absl::ToInt64Milliseconds(next_status - absl::Now()), 0, 60000);
    const int n = epoll_wait(epoll_fd_, events, 64, static_cast<int>(wait_ms));
    if (n < 0 && errno != EINTR) return ErrnoStatus("epoll_wait");
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      const uint64_t index = tag & ~kTagMask;
      switch (tag & kTagMask) {
        case kTagDevice: ReadDevice(static_cast<int>(index)); break;
        case kTagTimer: {
          uint64_t expirations;
          [[maybe_unused]] ssize_t r = ::read(timer_fd_, &expirations, sizeof(expirations));
          break;
        }
        case kTagSignal: {
          signalfd_siginfo si;
          if (::read(signal_fd_, &si, sizeof(si)) == sizeof(si)) {
            stop_ = true;
            stop_reason_ = si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT";
          }
          break;
        }
        case kTagListen: AcceptClient(); break;
        case kTagClient: {
          const int fd = static_cast<int>(index);
          auto it = std::find_if(clients_.begin(), clients_.end(),
                                 [fd](const Client& c) { return c.fd == fd; });
          if (it != clients_.end() && !ServeClient(&*it)) {
            ::close(it->fd);
            clients_.erase(it);
          }
          break;
        }
        default: break;
      }
    }
    ReleaseDue();
    if (absl::Now() >= next_status) {
      LogStatus(false);
      next_status = absl::Now() + options_.status_interval;
    }
  }
  LogInfo("stopping (", stop_reason_, "); ", heap_.size(), " packets in flight are dropped");
  LogStatus(true);
  return absl::OkStatus();
}

}  // namespace detour::wanem
