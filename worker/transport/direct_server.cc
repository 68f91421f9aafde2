#include "worker/transport/direct_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <set>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/net/address.h"
#include "common/net/identity.h"
#include "common/net/shutdown_signal.h"

namespace detour {

absl::StatusOr<std::unique_ptr<DirectServer>> DirectServer::Start(ActivationServer* activations,
                                                                  DirectServerOptions options) {
  // A flooder or a peer that hangs up mid-handshake must not kill the worker.
  IgnoreSigpipe();
  std::shared_ptr<ssl_ctx_st> ctx;
  if (options.security.tls()) {
    auto made = options.security.NewSslContext(/*server=*/true);
    if (!made.ok()) return made.status();
    ctx = *std::move(made);
  }
  int port = 0;
  absl::StatusOr<int> fd = BindTcp(options.listen, "--data_port", /*listen=*/true, &port);
  if (!fd.ok()) return fd.status();
  // Accepted connections inherit the listener's buffers and congestion
  // control; the receive buffer must be set before the handshake, which
  // fixes the window scale.
  LinkHint expected = options.expected_link;
  if (!(expected.rate_bytes_per_s > 0)) expected.rate_bytes_per_s = kDefaultLinkRateBytesPerS;
  if (expected.rtt <= absl::ZeroDuration()) expected.rtt = kDefaultReportRtt;
  DirectSocketOptions socket;
  socket.rcvbuf = PlanStripes(expected, ReadTcpLimits()).rcvbuf_request;
  socket.bbr = options.bbr && BbrUsable();
  (void)ApplyDirectSocketOptions(*fd, socket);
  LogDirectTransportTuning(expected, options.bbr);
  return std::unique_ptr<DirectServer>(
      new DirectServer(activations, std::move(options), *fd, port, std::move(ctx)));
}

DirectServer::DirectServer(ActivationServer* activations, DirectServerOptions options,
                           int listen_fd, int port, std::shared_ptr<ssl_ctx_st> ctx)
    : activations_(activations),
      options_(std::move(options)),
      listen_fd_(listen_fd),
      port_(port),
      ctx_(std::move(ctx)),
      admission_(options_.admission),
      refusals_(options_.refusal_log_interval) {
  if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) wake_pipe_[0] = wake_pipe_[1] = -1;
  if (options_.metrics != nullptr) {
    accepted_metric_ = metrics::OptionalCounter(
        options_.metrics, "detour_worker_direct_connections_accepted",
        "Direct-transport connections accepted (TLS handshake and preface done).");
    refusals_.Export(
        options_.metrics, "detour_worker_direct_connections_refused",
        "Direct-transport connections refused or closed before carrying frames, by reason "
        "(limits on unauthenticated connections, the connection limit, the handshake "
        "deadline, a failed TLS handshake, a certificate that is not a worker's, a wrong "
        "preface, a conflicting stripe).");
    if (auto family = options_.metrics->AddGauge(
            "detour_worker_direct_connections",
            "Direct-transport connections open now (peers sending tensors to this worker).");
        family.ok()) {
      auto gauge = (*family)->WithLabels({});
      if (gauge.ok()) open_metric_ = *gauge;
    }
  }
  acceptor_ = std::thread([this] { AcceptLoop(); });
}

DirectServer::~DirectServer() {
  Shutdown();
  if (wake_pipe_[0] >= 0) ::close(wake_pipe_[0]);
  if (wake_pipe_[1] >= 0) ::close(wake_pipe_[1]);
}

void DirectServer::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !acceptor_.joinable()) return;
    stopping_ = true;
  }
  if (wake_pipe_[1] >= 0) {
    const char byte = 1;
    (void)!::write(wake_pipe_[1], &byte, 1);
  }
  if (acceptor_.joinable()) acceptor_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  std::map<uint64_t, std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, link] : links_) link->Shutdown();
    threads.swap(threads_);
  }
  for (auto& [id, t] : threads) t.join();
}

DirectServer::Stats DirectServer::stats() const {
  absl::MutexLock lock(&mu_);
  Stats s;
  s.accepted = accepted_;
  refusals_.CopyTo(&s.refused, s.refused_by_reason);
  s.open = open_;
  s.unauthenticated = admission_.unauthenticated();
  s.sessions = static_cast<int>(sessions_.size());
  return s;
}

void DirectServer::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    const int n = ::poll(fds, 2, 1000);
    std::vector<std::thread> done;
    std::optional<std::string> summary;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      for (uint64_t id : finished_) {
        auto it = threads_.find(id);
        if (it != threads_.end()) {
          done.push_back(std::move(it->second));
          threads_.erase(it);
        }
      }
      finished_.clear();
      summary = refusals_.Flush(absl::Now());
    }
    if (summary.has_value()) LogWarning(*summary);
    for (std::thread& t : done) t.join();
    if (n <= 0 || !(fds[0].revents & POLLIN)) continue;
    AcceptOne();
  }
}

size_t DirectServer::SetKnownPeers(const std::vector<std::string>& addresses) {
  absl::MutexLock lock(&mu_);
  return admission_.SetKnownPeers(addresses);
}

void DirectServer::AcceptOne() {
  sockaddr_storage peer{};
  socklen_t peer_length = sizeof(peer);
  const int fd =
      ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &peer_length, SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE) {
      LogWarning("direct transport: accept: ", std::strerror(errno));
      ::usleep(100000);  // the condition persists; do not spin
    }
    return;
  }
  const std::string source = ConnectionSource(reinterpret_cast<const sockaddr*>(&peer));
  std::optional<std::string> line;
  {
    absl::MutexLock lock(&mu_);
    const uint64_t id = next_id_++;
    const ConnectionAdmission::Verdict verdict = admission_.Arrive(id, source);
    if (!verdict.admit) {
      ::close(fd);
      line = RefusedLocked(verdict.reason, source,
                           absl::StrCat(admission_.unauthenticated(), " unauthenticated and ",
                                        admission_.authenticated(), " authenticated open"));
    } else {
      if (verdict.evict.has_value()) {
        // Its thread sees the socket fail and ends; the slot is this one's.
        auto victim = unauthenticated_fds_.find(*verdict.evict);
        if (victim != unauthenticated_fds_.end()) ::shutdown(victim->second, SHUT_RDWR);
        line = RefusedLocked(RefusalReason::kUnauthenticatedLimit, source,
                             "closed the oldest unauthenticated connection of the busiest "
                             "source to make room");
      }
      const int watch = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (watch < 0) {
        admission_.Closed(id);
        ::close(fd);
      } else {
        unauthenticated_fds_[id] = watch;
        ++open_;
        if (open_metric_ != nullptr) open_metric_->Set(open_);
        threads_[id] = std::thread([this, id, fd, source] { Serve(id, fd, source); });
      }
    }
  }
  if (line.has_value()) LogWarning(*line);
}

std::optional<std::string> DirectServer::RefusedLocked(RefusalReason reason,
                                                       absl::string_view source,
                                                       absl::string_view detail) {
  return refusals_.Count(reason, source, detail, absl::Now());
}

namespace {

RefusalReason ReasonOf(const absl::Status& status) {
  if (status.code() == absl::StatusCode::kDeadlineExceeded ||
      absl::StrContains(status.message(), "timed out")) {
    return RefusalReason::kDeadline;
  }
  if (status.code() == absl::StatusCode::kPermissionDenied) return RefusalReason::kIdentity;
  if (status.code() == absl::StatusCode::kUnauthenticated ||
      absl::StartsWith(status.message(), "TLS handshake")) {
    return RefusalReason::kHandshake;
  }
  return RefusalReason::kPreface;
}

}  // namespace

std::unique_ptr<DirectLink> DirectServer::Handshake(uint64_t id, int fd,
                                                    const std::string& source) {
  auto accepted = DirectLink::Accept(fd, ctx_, options_.handshake_timeout, wake_pipe_[0]);
  if (accepted.ok() && (*accepted)->tls()) {
    // A verified certificate from the cluster CA, but it must be a worker's.
    absl::Status kind =
        CheckWorkerPeer((*accepted)->ssl(), options_.security.allow_unmarked_worker_certs());
    if (!kind.ok()) {
      (void)(*accepted)->Refuse();  // the sender gives up rather than try again
      accepted = absl::PermissionDeniedError(
          absl::StrCat((*accepted)->peer_name().value_or("?"), ": ", kind.message()));
    }
  }
  std::unique_ptr<DirectLink> link;
  std::optional<std::string> line;
  bool unauthorized = false;
  {
    absl::MutexLock lock(&mu_);
    auto watch = unauthenticated_fds_.find(id);
    if (watch != unauthenticated_fds_.end()) {
      ::close(watch->second);
      unauthenticated_fds_.erase(watch);
    }
    if (stopping_) {
      // Shutting down: nothing to count.
    } else if (!accepted.ok()) {
      // An evicted connection was counted when it was closed.
      if (!admission_.evicted(id)) {
        line = RefusedLocked(ReasonOf(accepted.status()), source, accepted.status().message());
        unauthorized = accepted.status().code() == absl::StatusCode::kUnauthenticated ||
                       accepted.status().code() == absl::StatusCode::kPermissionDenied;
      }
    } else if (admission_.Authenticate(id)) {
      link = *std::move(accepted);
      ++accepted_;
      if (accepted_metric_ != nullptr) accepted_metric_->Increment();
      links_[id] = link.get();
    }
  }
  if (line.has_value()) LogWarning(*line);
  if (unauthorized) activations_->CountUnauthorizedStream();
  return link;
}

void DirectServer::Serve(uint64_t id, int fd, const std::string& source) {
  std::unique_ptr<DirectLink> link = Handshake(id, fd, source);
  std::shared_ptr<Session> session;
  if (link != nullptr) {
    std::string why;
    session = Join(id, link.get(), &why);
    if (session == nullptr) {
      std::optional<std::string> line;
      {
        absl::MutexLock lock(&mu_);
        line =
            RefusedLocked(RefusalReason::kSession, source,
                          absl::StrCat(link->peer_name().value_or("a plaintext peer"), ": ", why));
      }
      if (line.has_value()) LogWarning(*line);
    } else if (absl::Status s = link->Welcome(); !s.ok()) {
      Leave(id, link.get(), session);
      session.reset();
    }
  }
  if (session != nullptr) {
    link->SetIoTimeout(options_.io_timeout);
    absl::Status ended = ReadDirectFrames(link.get(), &session->shared,
                                          activations_->options().max_tensor_bytes, [this] {
                                            absl::MutexLock lock(&mu_);
                                            return stopping_;
                                          });
    if (!ended.ok() && ended.code() != absl::StatusCode::kUnavailable &&
        ended.code() != absl::StatusCode::kCancelled) {
      LogWarning("direct transport: ended a connection from ",
                 link->peer_name().value_or("a plaintext peer"), ": ", ended.message());
    }
    Leave(id, link.get(), session);
    session.reset();  // the last connection of a session frees its partial tensors
  }
  if (link != nullptr) {
    absl::MutexLock lock(&mu_);
    links_.erase(id);
  }
  link.reset();  // closes the socket before the slot is given back
  absl::MutexLock lock(&mu_);
  admission_.Closed(id);
  --open_;
  if (open_metric_ != nullptr) open_metric_->Set(open_);
  finished_.push_back(id);
}

std::shared_ptr<DirectServer::Session> DirectServer::Join(uint64_t id, DirectLink* link,
                                                          std::string* why) {
  const DirectHello& hello = link->hello();
  // Sessions are per identity: a connection cannot join (and feed frames
  // into) another certificate's session, whatever session id it names.
  SessionKey key(link->peer_name().has_value() ? "tls:" + *link->peer_name() : "plaintext",
                 hello.session);
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Session>& session = sessions_[key];
  if (session == nullptr) {
    session = std::make_shared<Session>(activations_, link->peer_name(), hello.stripes);
  }
  const uint32_t bit = uint32_t{1} << hello.stripe;
  if (session->ended || session->stripes != hello.stripes || (session->joined & bit) != 0) {
    *why = session->ended
               ? absl::StrCat("session ", hello.session, " already ended")
               : absl::StrCat("stripe ", hello.stripe, " of ", hello.stripes, " of session ",
                              hello.session, " conflicts (", session->stripes,
                              " stripes, joined mask ", session->joined, ")");
    if (session->links.empty() && session->joined == 0) sessions_.erase(key);
    return nullptr;
  }
  session->joined |= bit;
  session->links[id] = link;
  return session;
}

void DirectServer::Leave(uint64_t id, DirectLink* link, const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&mu_);
  session->links.erase(id);
  if (!session->ended) {
    session->ended = true;
    for (auto& [other, other_link] : session->links) other_link->Shutdown();
  }
  if (session->links.empty()) {
    const DirectHello& hello = link->hello();
    SessionKey key(link->peer_name().has_value() ? "tls:" + *link->peer_name() : "plaintext",
                   hello.session);
    auto it = sessions_.find(key);
    if (it != sessions_.end() && it->second == session) sessions_.erase(it);
  }
}

namespace {

// Where ReadFrames sends frames: one connection's own assembler, or a
// session's shared one.
class FrameTarget {
 public:
  virtual ~FrameTarget() = default;
  virtual TensorAssembler::Verdict Begin(const v1::FrameHeader& header, size_t data_bytes,
                                         TensorAssembler::Claim* claim,
                                         std::vector<v1::FrameAck>* acks, absl::Status* end) = 0;
  virtual void Finish(const TensorAssembler::Claim& claim, std::vector<v1::FrameAck>* acks) = 0;
  virtual void Malformed(absl::string_view why, std::vector<v1::FrameAck>* acks) = 0;
};

class OwnTarget : public FrameTarget {
 public:
  explicit OwnTarget(TensorAssembler* assembler) : assembler_(assembler) {}
  TensorAssembler::Verdict Begin(const v1::FrameHeader& header, size_t data_bytes,
                                 TensorAssembler::Claim* claim, std::vector<v1::FrameAck>* acks,
                                 absl::Status* end) override {
    return assembler_->Begin(header, data_bytes, claim, acks, end);
  }
  void Finish(const TensorAssembler::Claim& claim, std::vector<v1::FrameAck>* acks) override {
    assembler_->Finish(claim, acks);
  }
  void Malformed(absl::string_view why, std::vector<v1::FrameAck>* acks) override {
    assembler_->Malformed(why, acks);
  }

 private:
  TensorAssembler* const assembler_;
};

class SharedTarget : public FrameTarget {
 public:
  explicit SharedTarget(SharedTensorAssembler* shared) : shared_(shared) {}
  TensorAssembler::Verdict Begin(const v1::FrameHeader& header, size_t data_bytes,
                                 TensorAssembler::Claim* claim, std::vector<v1::FrameAck>* acks,
                                 absl::Status* end) override {
    absl::MutexLock lock(&shared_->mu);
    return shared_->assembler.Begin(header, data_bytes, claim, acks, end);
  }
  void Finish(const TensorAssembler::Claim& claim, std::vector<v1::FrameAck>* acks) override {
    absl::MutexLock lock(&shared_->mu);
    shared_->assembler.Finish(claim, acks);
  }
  void Malformed(absl::string_view why, std::vector<v1::FrameAck>* acks) override {
    absl::MutexLock lock(&shared_->mu);
    shared_->assembler.Malformed(why, acks);
  }

 private:
  SharedTensorAssembler* const shared_;
};

absl::Status ReadFrames(DirectLink* link, FrameTarget* assembler, uint64_t max_tensor,
                        const std::function<bool()>& stopping) {
  std::string header_bytes;
  std::string ack_bytes;
  std::vector<v1::FrameAck> acks;
  std::vector<char> scratch;
  auto send_acks = [&]() -> absl::Status {
    for (const v1::FrameAck& ack : acks) {
      ack_bytes.clear();
      ack.SerializeToString(&ack_bytes);
      char prefix[kDirectAckPrefixBytes];
      EncodeDirectAckPrefix(static_cast<uint32_t>(ack_bytes.size()), prefix);
      if (absl::Status s = link->Write(prefix, sizeof(prefix), ack_bytes.data(), ack_bytes.size());
          !s.ok()) {
        return s;
      }
    }
    acks.clear();
    return absl::OkStatus();
  };
  while (true) {
    char prefix[kDirectFramePrefixBytes];
    absl::Status read = link->Read(prefix, sizeof(prefix), /*idle_ok=*/true);
    if (read.code() == absl::StatusCode::kDeadlineExceeded) {
      if (stopping()) return absl::CancelledError("server shutting down");
      continue;  // an idle connection between iterations
    }
    if (!read.ok()) return read;
    uint32_t header_size = 0;
    uint64_t data_bytes = 0;
    if (absl::Status s = DecodeDirectFramePrefix(prefix, &header_size, &data_bytes); !s.ok()) {
      assembler->Malformed(s.message(), &acks);
      (void)send_acks();
      return s;
    }
    header_bytes.resize(header_size);
    if (absl::Status s = link->Read(header_bytes.data(), header_size); !s.ok()) return s;
    v1::FrameHeader header;
    if (!header.ParseFromString(header_bytes)) {
      assembler->Malformed("unparseable frame header", &acks);
      (void)send_acks();
      return absl::InvalidArgumentError("unparseable frame header");
    }
    TensorAssembler::Claim claim;
    absl::Status end;
    switch (assembler->Begin(header, data_bytes, &claim, &acks, &end)) {
      case TensorAssembler::Verdict::kAccept:
        if (absl::Status s = link->Read(claim.dest, data_bytes); !s.ok()) return s;
        assembler->Finish(claim, &acks);
        break;
      case TensorAssembler::Verdict::kDrop: {
        // Data of a refused or duplicate chunk is read and dropped, as long
        // as it is no larger than a tensor may be; beyond that the framing
        // itself is not credible.
        if (data_bytes > max_tensor) {
          (void)send_acks();
          return absl::InvalidArgumentError(
              absl::StrCat("a frame of ", data_bytes, " data bytes (limit ", max_tensor, ")"));
        }
        scratch.resize(std::min<uint64_t>(data_bytes, uint64_t{256} << 10));
        for (uint64_t left = data_bytes; left > 0;) {
          const size_t take = static_cast<size_t>(std::min<uint64_t>(left, scratch.size()));
          if (absl::Status s = link->Read(scratch.data(), take); !s.ok()) return s;
          left -= take;
        }
        break;
      }
      case TensorAssembler::Verdict::kEndStream: return end;
    }
    if (absl::Status s = send_acks(); !s.ok()) return s;
  }
}

}  // namespace

absl::Status ReadDirectFrames(DirectLink* link, TensorAssembler* assembler, uint64_t max_tensor,
                              const std::function<bool()>& stopping) {
  OwnTarget target(assembler);
  return ReadFrames(link, &target, max_tensor, stopping);
}

absl::Status ReadDirectFrames(DirectLink* link, SharedTensorAssembler* shared, uint64_t max_tensor,
                              const std::function<bool()>& stopping) {
  SharedTarget target(shared);
  return ReadFrames(link, &target, max_tensor, stopping);
}

}  // namespace detour
