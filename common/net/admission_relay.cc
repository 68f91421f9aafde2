#include "common/net/admission_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/server_context.h"

namespace detour {

// One admitted connection: the client's socket and the loopback one to the
// server, and a buffer each way.
struct AdmissionRelay::Conn {
  struct Pipe {
    std::unique_ptr<char[]> buffer;  // capacity bytes while bytes are in flight
    size_t begin = 0, end = 0;
    bool eof = false;   // its reader saw the end (or failed)
    bool shut = false;  // the end was passed on (shutdown SHUT_WR)
  };
  uint64_t id = 0;
  int client = -1, backend = -1;
  int backend_port = 0;                                  // our end of the loopback connection
  bool connected = false;                                // the loopback connect finished
  bool client_watched = false, backend_watched = false;  // in the epoll set
  std::string source;
  absl::Time arrived;
  Pipe up;                                         // client -> server
  Pipe down;                                       // server -> client
  uint32_t client_events = 0, backend_events = 0;  // what epoll watches now
};

namespace {

constexpr uint64_t kListenTag = ~uint64_t{0};
constexpr uint64_t kWakeTag = ~uint64_t{0} - 1;
// An epoll tag: the connection's id and which of its sockets.
uint64_t Tag(uint64_t id, bool backend) { return (id << 1) | (backend ? 1 : 0); }

enum class Io { kProgress, kWouldBlock, kEnd, kError };

// Reads from `fd` into `p` while there is room; kEnd at end of stream.
Io Fill(int fd, size_t capacity, std::unique_ptr<char[]>& buffer, size_t& begin, size_t& end) {
  // Not zeroed: only bytes received are ever sent on.
  if (buffer == nullptr) buffer.reset(new char[capacity]);
  if (begin == end) begin = end = 0;
  if (end == capacity) return Io::kWouldBlock;
  const ssize_t n = ::recv(fd, buffer.get() + end, capacity - end, 0);
  if (n > 0) {
    end += static_cast<size_t>(n);
    return Io::kProgress;
  }
  if (n == 0) return Io::kEnd;
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Io::kWouldBlock;
  return Io::kError;
}

Io Drain(int fd, const std::unique_ptr<char[]>& buffer, size_t& begin, size_t& end) {
  if (begin == end) return Io::kWouldBlock;
  const ssize_t n = ::send(fd, buffer.get() + begin, end - begin, MSG_NOSIGNAL);
  if (n > 0) {
    begin += static_cast<size_t>(n);
    return Io::kProgress;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    return Io::kWouldBlock;
  }
  return Io::kError;
}

// Raises the soft limit on open files towards what `connections` relayed
// connections need (two descriptors each, and room for the rest of the
// process); warns when the hard limit stops it short.
void EnsureOpenFiles(int connections, absl::string_view what) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t need = static_cast<rlim_t>(2 * std::max(connections, 0)) + 1024;
  if (limit.rlim_cur >= need) return;
  const rlim_t wanted = limit.rlim_max == RLIM_INFINITY ? need : std::min(need, limit.rlim_max);
  if (wanted > limit.rlim_cur) {
    rlimit raised = limit;
    raised.rlim_cur = wanted;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) limit = raised;
  }
  if (limit.rlim_cur < need) {
    LogWarning(what, ": the limit on open files is ", limit.rlim_cur, " (hard ", limit.rlim_max,
               "), below the ", need, " that ", connections,
               " relayed connections need: raise it (LimitNOFILE= in the systemd unit, "
               "ulimit -n) or expect refused connections when many are open");
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<AdmissionRelay>> AdmissionRelay::Start(
    const HostPort& listen, absl::string_view flag, int backend_port,
    AdmissionRelayOptions options) {
  if (backend_port <= 0 || backend_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": no server port to relay to (", backend_port, ")"));
  }
  EnsureOpenFiles(options.limits.max_connections, options.what);
  int port = 0;
  absl::StatusOr<int> fd = BindTcp(listen, flag, /*listen=*/true, &port);
  if (!fd.ok()) return fd.status();
  const int listen_fd = *fd;
  const int epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  const int wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  int flags = ::fcntl(listen_fd, F_GETFL);
  if (epoll_fd < 0 || wake_fd < 0 || flags < 0 ||
      ::fcntl(listen_fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(listen_fd);
    if (epoll_fd >= 0) ::close(epoll_fd);
    if (wake_fd >= 0) ::close(wake_fd);
    return absl::InternalError(absl::StrCat(flag, ": admission relay: ", std::strerror(err)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenTag;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &ev);
  ev.data.u64 = kWakeTag;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev);
  return std::unique_ptr<AdmissionRelay>(
      new AdmissionRelay(listen_fd, port, epoll_fd, wake_fd, backend_port, std::move(options)));
}

AdmissionRelay::AdmissionRelay(int listen_fd, int port, int epoll_fd, int wake_fd, int backend_port,
                               AdmissionRelayOptions options)
    : options_(std::move(options)),
      listen_fd_(listen_fd),
      port_(port),
      epoll_fd_(epoll_fd),
      wake_fd_(wake_fd),
      backend_port_(backend_port),
      admission_(options_.limits),
      refusals_(options_.refusal_log_interval, options_.what, "connection") {
  refusals_.Export(options_.metrics, options_.metric_prefix + "_connections_refused",
                   absl::StrCat("Connections to the ", options_.what,
                                " port refused or closed before their caller proved itself, by "
                                "reason (per-source and unauthenticated limits, the connection "
                                "limit, the deadline to prove the caller)."));
  if (options_.metrics != nullptr) {
    if (auto family = options_.metrics->AddGauge(
            options_.metric_prefix + "_connections",
            absl::StrCat("Connections to the ", options_.what,
                         " port open now: unauthenticated (the caller not proven yet) or "
                         "authenticated."),
            {"state"});
        family.ok()) {
      if (auto g = (*family)->WithLabels({"unauthenticated"}); g.ok()) unauthenticated_metric_ = *g;
      if (auto g = (*family)->WithLabels({"authenticated"}); g.ok()) authenticated_metric_ = *g;
    }
  }
  thread_ = std::thread([this] { Loop(); });
}

AdmissionRelay::~AdmissionRelay() {
  if (sink_ != nullptr) sink_->Attach(nullptr);
  Stop();
  ::close(epoll_fd_);
  ::close(wake_fd_);
}

void AdmissionRelay::AttachSink(std::shared_ptr<RelayAuthSink> sink) {
  sink->Attach(this);
  sink_ = std::move(sink);
}

void AdmissionRelay::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  // The loop has ended: its connections are this thread's now.
  std::vector<uint64_t> ids;
  for (const auto& [id, c] : conns_) ids.push_back(id);
  for (uint64_t id : ids) CloseConn(id);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
}

void AdmissionRelay::Loop() {
  constexpr int kMaxEvents = 64;
  epoll_event events[kMaxEvents];
  absl::Time last_sweep = absl::Now();
  while (true) {
    const int n = ::epoll_wait(epoll_fd_, events, kMaxEvents, 500);
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
    }
    const absl::Time now = absl::Now();
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kWakeTag) {
        uint64_t drained;
        (void)!::read(wake_fd_, &drained, sizeof(drained));
        continue;
      }
      if (tag == kListenTag) {
        AcceptAll(now);
        continue;
      }
      auto it = conns_.find(tag >> 1);
      if (it == conns_.end()) continue;  // closed earlier in this batch
      Conn& c = *it->second;
      if ((tag & 1) && !c.connected) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(c.backend, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {
          LogWarning(options_.what, ": cannot reach the server on 127.0.0.1:", backend_port_,
                     " for a connection from ", c.source, ": ", std::strerror(err));
          CloseConn(c.id);
          continue;
        }
        c.connected = true;
      }
      // A socket in error (a reset) ends the connection: epoll reports it
      // whatever is watched, so it would otherwise fire on and on. A socket
      // closed both ways (EPOLLHUP) is read to its end by Pump and leaves
      // the epoll set in Watch once it has nothing more to do.
      if ((events[i].events & EPOLLERR) != 0 || !Pump(c)) {
        CloseConn(c.id);
        continue;
      }
      Watch(c);
    }
    if (now - last_sweep >= absl::Milliseconds(500)) {
      last_sweep = now;
      if (accept_paused_until_ != absl::InfinitePast() && now >= accept_paused_until_) {
        accept_paused_until_ = absl::InfinitePast();
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = kListenTag;
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
      }
      CloseOverdue(now);
      std::optional<std::string> summary;
      {
        absl::MutexLock lock(&mu_);
        summary = refusals_.Flush(now);
      }
      if (summary.has_value()) LogWarning(*summary);
    }
  }
}

void AdmissionRelay::AcceptAll(absl::Time now) {
  // Bounded per wake-up, so a flood cannot starve the relayed connections.
  for (int round = 0; round < 64; ++round) {
    sockaddr_storage peer{};
    socklen_t peer_length = sizeof(peer);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &peer_length,
                             SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        LogWarning(options_.what, ": accept: ", std::strerror(errno));
        // The condition persists: stop watching the readable listener for
        // a while rather than spin on it (the sweep watches it again).
        accept_paused_until_ = now + absl::Milliseconds(100);
        epoll_event ev{};
        ev.events = 0;
        ev.data.u64 = kListenTag;
        ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, listen_fd_, &ev);
      }
      return;
    }
    const std::string source = ConnectionSource(reinterpret_cast<const sockaddr*>(&peer));
    std::optional<std::string> line;
    std::optional<uint64_t> evict;
    uint64_t id = 0;
    bool admitted = false;
    {
      absl::MutexLock lock(&mu_);
      id = next_id_++;
      const ConnectionAdmission::Verdict verdict = admission_.Arrive(id, source);
      if (!verdict.admit) {
        line = RefusedLocked(verdict.reason, source,
                             absl::StrCat(admission_.unauthenticated(), " unauthenticated and ",
                                          admission_.authenticated(), " authenticated open"));
      } else {
        admitted = true;
        ++accepted_;
        unproven_.insert(id);
        evict = verdict.evict;
        if (evict.has_value()) {
          line = RefusedLocked(RefusalReason::kUnauthenticatedLimit, source,
                               "closed the oldest unauthenticated connection of the busiest "
                               "source to make room");
        }
      }
    }
    if (line.has_value()) LogWarning(*line);
    if (evict.has_value()) CloseConn(*evict);
    if (!admitted) {
      ::close(fd);
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->id = id;
    c->client = fd;
    c->source = source;
    c->arrived = now;
    c->backend = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    sockaddr_in server{};
    server.sin_family = AF_INET;
    server.sin_port = htons(static_cast<uint16_t>(backend_port_));
    server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int rc = -1;
    if (c->backend >= 0) {
      const int one = 1;
      ::setsockopt(c->backend, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ::setsockopt(c->client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      rc = ::connect(c->backend, reinterpret_cast<sockaddr*>(&server), sizeof(server));
    }
    if (c->backend < 0 || (rc != 0 && errno != EINPROGRESS)) {
      LogWarning(options_.what, ": cannot reach the server on 127.0.0.1:", backend_port_, ": ",
                 std::strerror(errno));
      conns_[id] = std::move(c);
      CloseConn(id);
      continue;
    }
    c->connected = rc == 0;
    c->backend_port = LocalPort(c->backend);
    {
      absl::MutexLock lock(&mu_);
      by_backend_port_[c->backend_port] = id;
      PublishLocked();
    }
    Conn& ref = *c;
    conns_[id] = std::move(c);
    Watch(ref);
  }
}

bool AdmissionRelay::Pump(Conn& c) {
  const size_t capacity = options_.buffer_bytes;
  struct Way {
    int from, to;
    Conn::Pipe& p;
    bool can_write;
  };
  Way ways[2] = {{c.client, c.backend, c.up, c.connected}, {c.backend, c.client, c.down, true}};
  // At most a few buffers' worth per wake-up: a connection that streams
  // without pause must not keep the one thread from every other one (a
  // flood of frames, a checkpoint upload starving heartbeats). The sockets
  // stay ready, so epoll reports them again on the next round.
  const size_t budget = 4 * capacity;
  size_t moved = 0;
  for (bool progress = true; progress && moved < budget;) {
    progress = false;
    for (Way& w : ways) {
      if (w.from == c.backend && !c.connected) continue;
      Conn::Pipe& p = w.p;
      if (w.can_write && p.begin < p.end) {
        const size_t before = p.begin;
        const Io io = Drain(w.to, p.buffer, p.begin, p.end);
        if (io == Io::kError) return false;
        progress |= io == Io::kProgress;
        if (io == Io::kProgress) moved += p.begin - before;
      }
      if (!p.eof) {
        const Io io = Fill(w.from, capacity, p.buffer, p.begin, p.end);
        if (io == Io::kError) return false;
        if (io == Io::kEnd) p.eof = true;
        progress |= io == Io::kProgress || io == Io::kEnd;
      }
      if (p.eof && p.begin == p.end && !p.shut && w.can_write) {
        ::shutdown(w.to, SHUT_WR);
        p.shut = true;
      }
    }
  }
  // An idle way gives its buffer back (most connections are idle).
  for (Way& w : ways) {
    if (w.p.begin == w.p.end && w.p.buffer != nullptr) {
      w.p.buffer.reset();
      w.p.begin = w.p.end = 0;
    }
  }
  return !(c.up.shut && c.down.shut);
}

void AdmissionRelay::Watch(Conn& c) {
  const size_t capacity = options_.buffer_bytes;
  auto room = [capacity](const Conn::Pipe& p) { return !p.eof && p.end - p.begin < capacity; };
  uint32_t client = 0, backend = 0;
  if (room(c.up)) client |= EPOLLIN;
  if (c.down.begin < c.down.end) client |= EPOLLOUT;
  if (!c.connected) {
    backend |= EPOLLOUT;
  } else {
    if (room(c.down)) backend |= EPOLLIN;
    if (c.up.begin < c.up.end) backend |= EPOLLOUT;
  }
  // A socket whose reading has ended and whose end was passed on has
  // nothing more to do: it leaves the set (epoll would report its hang-up
  // on and on), while the other one may still be flushing to its peer.
  const bool client_done = c.up.eof && c.down.shut;
  const bool backend_done = c.connected && c.down.eof && c.up.shut;
  auto apply = [this](int fd, uint64_t tag, bool done, uint32_t want, uint32_t& have,
                      bool& watched) {
    if (done) {
      if (watched) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
      watched = false;
      return;
    }
    if (watched && want == have) return;
    epoll_event ev{};
    ev.events = want;
    ev.data.u64 = tag;
    ::epoll_ctl(epoll_fd_, watched ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, fd, &ev);
    have = want;
    watched = true;
  };
  apply(c.client, Tag(c.id, false), client_done, client, c.client_events, c.client_watched);
  apply(c.backend, Tag(c.id, true), backend_done, backend, c.backend_events, c.backend_watched);
}

void AdmissionRelay::CloseConn(uint64_t id) {
  auto it = conns_.find(id);
  if (it == conns_.end()) return;
  Conn& c = *it->second;
  if (c.client >= 0) ::close(c.client);  // close() also leaves the epoll set
  if (c.backend >= 0) ::close(c.backend);
  {
    absl::MutexLock lock(&mu_);
    admission_.Closed(id);
    unproven_.erase(id);
    if (c.backend_port != 0) by_backend_port_.erase(c.backend_port);
    PublishLocked();
  }
  conns_.erase(it);
}

void AdmissionRelay::CloseOverdue(absl::Time now) {
  std::vector<uint64_t> overdue;
  std::vector<std::string> lines;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, c] : conns_) {
      if (now - c->arrived < options_.prove_within || unproven_.count(id) == 0) continue;
      if (admission_.evicted(id)) continue;  // counted when it was evicted
      overdue.push_back(id);
      std::optional<std::string> line = RefusedLocked(
          RefusalReason::kDeadline, c->source,
          absl::StrCat("no caller proven within ", absl::FormatDuration(options_.prove_within)));
      if (line.has_value()) lines.push_back(*std::move(line));
    }
  }
  for (const std::string& line : lines) LogWarning(line);
  for (uint64_t id : overdue) CloseConn(id);
}

void AdmissionRelay::Authenticated(int backend_client_port) {
  absl::MutexLock lock(&mu_);
  auto it = by_backend_port_.find(backend_client_port);
  if (it == by_backend_port_.end()) return;
  if (unproven_.erase(it->second) == 0) return;  // already authenticated
  admission_.Authenticate(it->second);
  PublishLocked();
}

size_t AdmissionRelay::SetKnownPeers(const std::vector<std::string>& addresses) {
  absl::MutexLock lock(&mu_);
  return admission_.SetKnownPeers(addresses);
}

AdmissionRelay::Stats AdmissionRelay::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.accepted = accepted_;
  refusals_.CopyTo(&s.refused, s.refused_by_reason);
  s.unauthenticated = admission_.unauthenticated();
  s.authenticated = admission_.authenticated();
  s.open = admission_.open();
  return s;
}

std::optional<std::string> AdmissionRelay::RefusedLocked(RefusalReason reason,
                                                         absl::string_view source,
                                                         absl::string_view detail) {
  return refusals_.Count(reason, source, detail, absl::Now());
}

void AdmissionRelay::PublishLocked() {
  if (unauthenticated_metric_ != nullptr) {
    unauthenticated_metric_->Set(admission_.unauthenticated());
  }
  if (authenticated_metric_ != nullptr) authenticated_metric_->Set(admission_.authenticated());
}

void RelayAuthSink::Authenticated(absl::string_view peer) {
  std::optional<int> port = LoopbackPeerPort(peer);
  if (!port.has_value()) return;
  absl::MutexLock lock(&mu_);
  if (relay_ != nullptr) relay_->Authenticated(*port);
}

std::optional<int> LoopbackPeerPort(absl::string_view peer) {
  absl::string_view rest = peer;
  if (!absl::ConsumePrefix(&rest, "ipv4:127.0.0.1:") &&
      !absl::ConsumePrefix(&rest, "ipv6:[::1]:") &&
      !absl::ConsumePrefix(&rest, "ipv6:[::ffff:127.0.0.1]:")) {
    return std::nullopt;
  }
  int port = 0;
  if (!absl::SimpleAtoi(rest, &port) || port <= 0 || port > 65535) return std::nullopt;
  return port;
}

namespace {

// The services that answer anyone: their answers prove nothing.
bool AnswersAnyone(absl::string_view method) {
  return absl::StartsWith(method, "/grpc.health.") || absl::StartsWith(method, "/grpc.reflection.");
}

class RelayAuthInterceptor : public grpc::experimental::Interceptor {
 public:
  RelayAuthInterceptor(grpc::experimental::ServerRpcInfo* info, std::shared_ptr<RelayAuthSink> sink)
      : info_(info),
        sink_(std::move(sink)),
        answer_proves_(info->method() != nullptr && !AnswersAnyone(info->method())) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using Hook = grpc::experimental::InterceptionHookPoints;
    if (!proven_) {
      if (methods->QueryInterceptionHookPoint(Hook::POST_RECV_INITIAL_METADATA)) {
        std::shared_ptr<const grpc::AuthContext> auth = info_->server_context()->auth_context();
        if (auth != nullptr && auth->IsPeerAuthenticated()) Prove();
      }
      // Every service checks the caller's token or certificate before it
      // answers: a message or an OK status means the caller passed.
      if (!proven_ && answer_proves_ &&
          (methods->QueryInterceptionHookPoint(Hook::PRE_SEND_MESSAGE) ||
           (methods->QueryInterceptionHookPoint(Hook::PRE_SEND_STATUS) &&
            methods->GetSendStatus().ok()))) {
        Prove();
      }
    }
    methods->Proceed();
  }

 private:
  void Prove() {
    proven_ = true;
    sink_->Authenticated(info_->server_context()->peer());
  }

  grpc::experimental::ServerRpcInfo* const info_;
  const std::shared_ptr<RelayAuthSink> sink_;
  const bool answer_proves_;
  bool proven_ = false;
};

class RelayAuthFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RelayAuthFactory(std::shared_ptr<RelayAuthSink> sink) : sink_(std::move(sink)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RelayAuthInterceptor(info, sink_);
  }

 private:
  const std::shared_ptr<RelayAuthSink> sink_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> RelayAuthInterceptorFactory(
    std::shared_ptr<RelayAuthSink> sink) {
  return std::make_unique<RelayAuthFactory>(std::move(sink));
}

}  // namespace detour
