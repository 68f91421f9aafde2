#include "worker/transport/direct_link.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net/address.h"
#include "common/status.h"

namespace detour {

namespace {

constexpr absl::string_view kClosedByReceiverUrl = "detour.direct/closed_by_receiver";

absl::Status MarkClosedByReceiver(absl::Status status) {
  status.SetPayload(kClosedByReceiverUrl, absl::Cord("1"));
  return status;
}

// Whether an SSL call that failed with `ssl_error` saw the peer close or
// reset the connection (rather than refuse it with an alert). Reads the
// calling thread's OpenSSL error queue.
bool SslPeerHungUp(int ssl_error) {
  if (ssl_error == SSL_ERROR_ZERO_RETURN || ssl_error == SSL_ERROR_SYSCALL) return true;
  return ssl_error == SSL_ERROR_SSL &&
         ERR_GET_REASON(ERR_peek_last_error()) == SSL_R_UNEXPECTED_EOF_WHILE_READING;
}

std::string OpenSslErrors() {
  std::string text;
  while (unsigned long code = ERR_get_error()) {
    char buffer[256];
    ERR_error_string_n(code, buffer, sizeof(buffer));
    if (!text.empty()) text += "; ";
    text += buffer;
  }
  return text.empty() ? "no detail" : text;
}

// An SSL object on `fd` for `ctx`, or nullptr when `ctx` is (plaintext).
// Closes `fd` when it cannot make one.
absl::StatusOr<ssl_st*> NewSsl(const std::shared_ptr<ssl_ctx_st>& ctx, int fd) {
  if (ctx == nullptr) return nullptr;
  ssl_st* ssl = SSL_new(ctx.get());
  if (ssl == nullptr) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("SSL_new: ", OpenSslErrors()));
  }
  SSL_set_fd(ssl, fd);
  return ssl;
}

void SetSocketOptions(int fd, const DirectSocketOptions& options = {}) {
  (void)ApplyDirectSocketOptions(fd, options);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // A peer that vanished without a FIN (power loss, cut cable) is noticed
  // within about 25 s even on an idle connection.
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  const int idle = 10, interval = 5, count = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  // And a busy connection whose data stays unacknowledged as long: a cut
  // link drops packets without a reset, and the sender would otherwise wait
  // for the transfer's ack timeout (60 s) when no idle connection to the
  // same peer breaks first.
  const unsigned int user_timeout_ms = 25000;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void PutU32(uint32_t v, char* out) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void PutU64(uint64_t v, char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(const char* in) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(in[i]);
  return v;
}
uint64_t GetU64(const char* in) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(in[i]);
  return v;
}

// Waits until `fd` is ready for `events`, a wake descriptor is readable, or
// the deadline passes. OK when ready.
absl::Status WaitFor(int fd, int wake_a, int wake_b, short events, absl::Time deadline,
                     absl::string_view what) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
    }
    pollfd fds[3] = {{fd, events, 0}, {wake_a, POLLIN, 0}, {wake_b, POLLIN, 0}};
    const int timeout_ms =
        static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, int64_t{1} << 30));
    const int n = ::poll(fds, 3, timeout_ms);  // negative descriptors are ignored
    if (n < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
    }
    if (n == 0) continue;  // the loop checks the deadline
    if ((fds[1].revents | fds[2].revents) & POLLIN) {
      return absl::CancelledError(absl::StrCat(what, ": connection shut down"));
    }
    if (fds[0].revents & (events | POLLERR | POLLHUP)) return absl::OkStatus();
  }
}

// What an SSL call that did not complete waits for before it is retried:
// POLLIN or POLLOUT (TLS may need to read while writing, and to write while
// reading or handshaking), or 0 when the error is not a retry (the caller
// reports it).
short RetryEvent(int ssl_error) {
  if (ssl_error == SSL_ERROR_WANT_READ) return POLLIN;
  if (ssl_error == SSL_ERROR_WANT_WRITE) return POLLOUT;
  return 0;
}

}  // namespace

bool ClosedByReceiver(const absl::Status& status) {
  return status.GetPayload(kClosedByReceiverUrl).has_value();
}

std::string ApplyDirectSocketOptions(int fd, const DirectSocketOptions& options) {
  // Buffers before connect(): the receive buffer fixes the window scale
  // offered in the handshake.
  if (options.sndbuf > 0) {
    const int v = static_cast<int>(std::min<int64_t>(options.sndbuf, INT32_MAX / 2));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof(v));
  }
  if (options.rcvbuf > 0) {
    const int v = static_cast<int>(std::min<int64_t>(options.rcvbuf, INT32_MAX / 2));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof(v));
  }
  // BBR keeps a long, fast path full where loss-based control (cubic) backs
  // off at every random loss; refused (not built, not allowed) = the default.
  if (options.bbr) (void)::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, "bbr", 3);
  char name[32] = {};
  socklen_t len = sizeof(name) - 1;
  if (::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return "unknown";
  return std::string(name, ::strnlen(name, len));
}

void EncodeDirectHello(const DirectHello& hello, char out[kDirectHelloBytes]) {
  PutU64(hello.session, out);
  PutU32(hello.stripe, out + 8);
  PutU32(hello.stripes, out + 12);
}

absl::StatusOr<DirectHello> DecodeDirectHello(const char in[kDirectHelloBytes]) {
  DirectHello hello;
  hello.session = GetU64(in);
  hello.stripe = GetU32(in + 8);
  hello.stripes = GetU32(in + 12);
  if (hello.stripes == 0 || hello.stripes > static_cast<uint32_t>(kMaxDirectStripes) ||
      hello.stripe >= hello.stripes) {
    return absl::InvalidArgumentError(absl::StrCat("hello: stripe ", hello.stripe, " of ",
                                                   hello.stripes, " (at most ", kMaxDirectStripes,
                                                   " stripes)"));
  }
  return hello;
}

void EncodeDirectFramePrefix(uint32_t header_bytes, uint64_t data_bytes, char out[16]) {
  PutU32(header_bytes, out);
  PutU32(0, out + 4);
  PutU64(data_bytes, out + 8);
}

void EncodeDirectAckPrefix(uint32_t ack_bytes, char out[8]) {
  PutU32(ack_bytes, out);
  PutU32(0, out + 4);
}

absl::Status DecodeDirectFramePrefix(const char in[16], uint32_t* header_bytes,
                                     uint64_t* data_bytes) {
  *header_bytes = GetU32(in);
  *data_bytes = GetU64(in + 8);
  if (GetU32(in + 4) != 0) return absl::InvalidArgumentError("frame prefix: reserved bytes set");
  if (*header_bytes == 0 || *header_bytes > kMaxDirectMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("frame prefix: a header of ", *header_bytes,
                                                   " bytes (1..", kMaxDirectMessageBytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status DecodeDirectAckPrefix(const char in[8], uint32_t* ack_bytes) {
  *ack_bytes = GetU32(in);
  if (GetU32(in + 4) != 0) return absl::InvalidArgumentError("ack prefix: reserved bytes set");
  if (*ack_bytes > kMaxDirectMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ack prefix: an ack of ", *ack_bytes, " bytes (at most ", kMaxDirectMessageBytes, ")"));
  }
  return absl::OkStatus();
}

DirectLink::DirectLink(int fd, ssl_st* ssl, int wake_fd) : fd_(fd), ssl_(ssl), wake_fd_(wake_fd) {
  if (::pipe2(shutdown_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) {
    shutdown_pipe_[0] = shutdown_pipe_[1] = -1;
  }
}

DirectLink::~DirectLink() {
  if (ssl_ != nullptr) SSL_free(ssl_);
  ::close(fd_);
  if (shutdown_pipe_[0] >= 0) ::close(shutdown_pipe_[0]);
  if (shutdown_pipe_[1] >= 0) ::close(shutdown_pipe_[1]);
}

void DirectLink::SetIoTimeout(absl::Duration timeout) { io_timeout_ = timeout; }

absl::Status DirectLink::Wait(short events, absl::Time deadline, absl::string_view what) {
  return WaitFor(fd_, shutdown_pipe_[0], wake_fd_, events, deadline, what);
}

absl::Status DirectLink::Handshake(bool client, absl::Time deadline) {
  while (true) {
    ERR_clear_error();
    const int rc = client ? SSL_connect(ssl_) : SSL_accept(ssl_);
    if (rc == 1) return BufferWrites();
    const int error = SSL_get_error(ssl_, rc);
    const short event = RetryEvent(error);
    if (event == 0) {
      const long verify = SSL_get_verify_result(ssl_);
      if (client && verify == X509_V_OK && SslPeerHungUp(error)) {
        // Closed before it said anything: not a TLS failure of ours.
        return MarkClosedByReceiver(absl::UnavailableError(absl::StrCat(
            "the receiver closed the connection during the handshake (", OpenSslErrors(), ")")));
      }
      return absl::UnauthenticatedError(
          absl::StrCat("failed: ", verify != X509_V_OK ? X509_verify_cert_error_string(verify)
                                                       : OpenSslErrors()));
    }
    absl::Status waited = Wait(event, deadline, "TLS handshake");
    if (!waited.ok()) {
      return waited.code() == absl::StatusCode::kCancelled
                 ? waited
                 : absl::UnavailableError(waited.message());
    }
  }
}

absl::Status DirectLink::BufferWrites() {
  // TLS writes one record of at most 16 KiB per write() on a plain socket
  // BIO: 64 system calls per MiB. A buffer BIO in front of the socket gathers
  // the records of a frame and writes them in kWriteBufferBytes pieces;
  // Write() flushes it at the end of every frame.
  // The write side gets a socket BIO of its own: retry flags live in the BIO,
  // and a flush must not clear those a read just set (SSL_get_error reads
  // them).
  BIO* socket_bio = BIO_new_socket(fd_, BIO_NOCLOSE);
  BIO* buffer = BIO_new(BIO_f_buffer());
  if (socket_bio == nullptr || buffer == nullptr ||
      BIO_set_write_buffer_size(buffer, kWriteBufferBytes) != 1) {
    if (buffer != nullptr) BIO_free(buffer);
    if (socket_bio != nullptr) BIO_free(socket_bio);
    return absl::InternalError(absl::StrCat("TLS write buffer: ", OpenSslErrors()));
  }
  SSL_set0_wbio(ssl_, BIO_push(buffer, socket_bio));  // the SSL owns the chain
  return absl::OkStatus();
}

absl::Status DirectLink::Flush(absl::Time deadline) {
  while (true) {
    int rc;
    bool retry;
    {
      absl::MutexLock lock(&ssl_mu_);
      ERR_clear_error();
      BIO* wbio = SSL_get_wbio(ssl_);
      rc = BIO_flush(wbio);
      retry = rc <= 0 && BIO_should_retry(wbio);
    }
    if (rc > 0) return absl::OkStatus();
    if (!retry) return absl::UnavailableError(absl::StrCat("TLS write: ", OpenSslErrors()));
    absl::Status waited = Wait(POLLOUT, deadline, "write");
    if (!waited.ok()) return waited;
  }
}

absl::StatusOr<std::unique_ptr<DirectLink>> DirectLink::Open(const std::string& address,
                                                             std::shared_ptr<ssl_ctx_st> ctx,
                                                             const std::string& peer_name,
                                                             absl::Duration timeout, int wake_fd,
                                                             const DirectSocketOptions& socket) {
  const absl::Time deadline = absl::Now() + timeout;
  auto hp = ParseHostPort(address, "direct transport address", /*allow_port_zero=*/false);
  if (!hp.ok()) return hp.status();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(hp->port);
  if (int rc = ::getaddrinfo(hp->host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("direct transport: cannot resolve ", address, ": ", gai_strerror(rc)));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> addresses(found, ::freeaddrinfo);
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    int s = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (s < 0) {
      last_error = std::strerror(errno);
      continue;
    }
    SetSocketOptions(s, socket);
    if (::connect(s, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      last_error = std::strerror(errno);
      ::close(s);
      continue;
    }
    absl::Status ready = WaitFor(s, wake_fd, -1, POLLOUT, deadline, "connect");
    int error = 0;
    socklen_t len = sizeof(error);
    if (ready.ok()) ::getsockopt(s, SOL_SOCKET, SO_ERROR, &error, &len);
    if (!ready.ok() || error != 0) {
      last_error = ready.ok() ? std::strerror(error) : std::string(ready.message());
      ::close(s);
      continue;
    }
    fd = s;
  }
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("direct transport: cannot connect to ", address, ": ", last_error));
  }
  auto new_ssl = NewSsl(ctx, fd);
  if (!new_ssl.ok()) return new_ssl.status();
  ssl_st* ssl = *new_ssl;
  if (ssl != nullptr) {
    SSL_set_hostflags(ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
    if (SSL_set1_host(ssl, peer_name.c_str()) != 1) {
      SSL_free(ssl);
      ::close(fd);
      return absl::InternalError(absl::StrCat("SSL_set1_host: ", OpenSslErrors()));
    }
  }
  std::unique_ptr<DirectLink> link(new DirectLink(fd, ssl, wake_fd));
  if (ssl != nullptr) {
    if (absl::Status s = link->Handshake(/*client=*/true, deadline); !s.ok()) {
      return Annotate(s, absl::StrCat("direct transport: TLS handshake with ", address,
                                      " (expecting ", peer_name, ")"));
    }
    link->peer_name_ = VerifiedPeerName(ssl);
    if (!link->peer_name_.has_value()) {
      return absl::UnauthenticatedError(
          absl::StrCat("direct transport: ", address, " presented no verified worker certificate"));
    }
  }
  char name[32] = {};
  socklen_t len = sizeof(name) - 1;
  link->congestion_ = ::getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, &len) == 0
                          ? std::string(name, ::strnlen(name, len))
                          : "unknown";
  return link;
}

absl::Status DirectLink::Greet(const DirectHello& hello, absl::Duration timeout) {
  SetIoTimeout(std::max(absl::Seconds(1), timeout));
  char out[sizeof(kDirectPreface) + kDirectHelloBytes];
  std::memcpy(out, kDirectPreface, sizeof(kDirectPreface));
  EncodeDirectHello(hello, out + sizeof(kDirectPreface));
  if (absl::Status s = Write(out, sizeof(out)); !s.ok()) {
    absl::Status failed =
        absl::UnavailableError(absl::StrCat("sending the preface: ", s.message()));
    // The first bytes of a new connection fail only when the receiver
    // already closed or reset it (or the wait for room ran out).
    return s.code() == absl::StatusCode::kUnavailable ? MarkClosedByReceiver(std::move(failed))
                                                      : failed;
  }
  char answer[sizeof(kDirectPreface)];
  if (absl::Status s = Read(answer, sizeof(answer)); !s.ok()) {
    if (ClosedByReceiver(s)) {
      return MarkClosedByReceiver(absl::FailedPreconditionError(absl::StrCat(
          "the receiver closed the connection instead of accepting direct-transport v2 (",
          s.message(), "): it runs an older detour that speaks only v1, or it refused stripe ",
          hello.stripe, " of ", hello.stripes, " (see its log)")));
    }
    return absl::Status(s.code(), absl::StrCat("waiting for the receiver's answer: ", s.message()));
  }
  if (std::memcmp(answer, kDirectRefusal, sizeof(answer)) == 0) {
    return absl::PermissionDeniedError(
        ssl_ == nullptr
            ? "the receiver refused this plaintext sender: it requires TLS (give this worker "
              "the cluster's certificates)"
            : "the receiver refused this sender after its hello (its log says why: a "
              "certificate that is not a worker's)");
  }
  if (std::memcmp(answer, kDirectPreface, sizeof(answer)) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the receiver answered \"", absl::CHexEscape(absl::string_view(answer, sizeof(answer))),
        "\", not direct-transport v2"));
  }
  SetIoTimeout(absl::Seconds(60));
  return absl::OkStatus();
}

absl::Status DirectLink::Welcome() { return Write(kDirectPreface, sizeof(kDirectPreface)); }

absl::Status DirectLink::Refuse() { return Write(kDirectRefusal, sizeof(kDirectRefusal)); }

void DirectLink::SetSendBuffer(int64_t bytes) {
  DirectSocketOptions options;
  options.sndbuf = bytes;
  (void)ApplyDirectSocketOptions(fd_, options);
}

void DirectLink::SetNotsentLowat(int64_t bytes) {
  const int v = static_cast<int>(std::clamp<int64_t>(bytes, 1, INT32_MAX));
  (void)::setsockopt(fd_, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &v, sizeof(v));
}

absl::Duration DirectLink::Rtt() const {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (::getsockopt(fd_, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 || info.tcpi_rtt == 0) {
    return absl::ZeroDuration();
  }
  return absl::Microseconds(info.tcpi_rtt);
}

absl::StatusOr<std::unique_ptr<DirectLink>> DirectLink::Accept(int fd,
                                                               std::shared_ptr<ssl_ctx_st> ctx,
                                                               absl::Duration timeout,
                                                               int wake_fd) {
  const absl::Time deadline = absl::Now() + timeout;
  SetSocketOptions(fd);
  auto new_ssl = NewSsl(ctx, fd);
  if (!new_ssl.ok()) return new_ssl.status();
  ssl_st* ssl = *new_ssl;
  std::unique_ptr<DirectLink> link(new DirectLink(fd, ssl, wake_fd));
  if (ssl != nullptr) {
    if (link->PlaintextPrefaceWaiting(deadline)) {
      // A sender without TLS: told in its own terms, so that it reports the
      // refusal instead of trying again.
      link->RefuseInPlace(kDirectRefusal, sizeof(kDirectRefusal));
      return absl::UnauthenticatedError(
          "TLS handshake: the sender speaks plaintext; this worker requires TLS");
    }
    if (absl::Status s = link->Handshake(/*client=*/false, deadline); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("TLS handshake: ", s.message()));
    }
    link->peer_name_ = VerifiedPeerName(ssl);
    if (!link->peer_name_.has_value()) {
      return absl::UnauthenticatedError("the peer presented no verified worker certificate");
    }
  }
  link->SetIoTimeout(std::max(absl::Milliseconds(1), deadline - absl::Now()));
  char preface[sizeof(kDirectPreface)];
  if (absl::Status s = link->Read(preface, sizeof(preface)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("reading the preface: ", s.message()));
  }
  if (ssl == nullptr && static_cast<uint8_t>(preface[0]) == 0x16) {
    // A TLS ClientHello at a plaintext worker: a fatal protocol_version
    // alert, so that the sender reports it instead of trying again.
    static constexpr char kAlert[7] = {0x15, 0x03, 0x01, 0x00, 0x02, 0x02, 0x46};
    link->RefuseInPlace(kAlert, sizeof(kAlert));
    return absl::UnauthenticatedError(
        "TLS handshake: the sender speaks TLS; this worker runs without it");
  }
  if (std::memcmp(preface, kDirectPrefaceV1, sizeof(preface)) == 0) {
    return absl::FailedPreconditionError(
        "the sender speaks direct-transport v1 (\"DTRDIRv1\"); this worker speaks v2 "
        "(striped connections): upgrade the sender's detour");
  }
  if (std::memcmp(preface, kDirectPreface, sizeof(preface)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a detour direct-transport client (preface \"",
                     absl::CHexEscape(absl::string_view(preface, sizeof(preface))), "\")"));
  }
  char hello[kDirectHelloBytes];
  if (absl::Status s = link->Read(hello, sizeof(hello)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("reading the hello: ", s.message()));
  }
  absl::StatusOr<DirectHello> decoded = DecodeDirectHello(hello);
  if (!decoded.ok()) return decoded.status();
  link->hello_ = *decoded;
  link->SetIoTimeout(absl::Seconds(60));
  return link;
}

bool DirectLink::PlaintextPrefaceWaiting(absl::Time deadline) {
  // The first byte tells: a TLS record starts with its type (0x14-0x17, a
  // ClientHello 0x16), a preface with 'D'.
  while (true) {
    char first = 0;
    const ssize_t n = ::recv(fd_, &first, 1, MSG_PEEK);
    if (n == 1) return first == kDirectPreface[0];
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      return false;  // closed or failed: the handshake reports it
    }
    // Nothing yet: the wait ends on data, the deadline, an eviction's
    // shutdown (readable, then recv gives 0) or the server's shutdown.
    if (!Wait(POLLIN, deadline, "the sender's first bytes").ok()) return false;
  }
}

void DirectLink::RefuseInPlace(const void* answer, size_t bytes) {
  // What the sender already sent is read first: closing a socket with
  // unread data resets the connection, and the reset could overtake the
  // answer.
  char sink[4096];
  while (::recv(fd_, sink, sizeof(sink), MSG_DONTWAIT) > 0) {}
  (void)!::send(fd_, answer, bytes, MSG_NOSIGNAL);
  ::shutdown(fd_, SHUT_WR);
}

absl::Status DirectLink::Read(void* data, size_t n, bool idle_ok) {
  char* p = static_cast<char*>(data);
  size_t done = 0;
  absl::Time deadline = absl::Now() + io_timeout_;
  while (done < n) {
    ssize_t got;
    short wait_for = POLLIN;
    if (ssl_ != nullptr) {
      absl::MutexLock lock(&ssl_mu_);
      ERR_clear_error();
      const int want = static_cast<int>(std::min<size_t>(n - done, size_t{1} << 30));
      const int rc = SSL_read(ssl_, p + done, want);
      const int error = rc > 0 ? SSL_ERROR_NONE : SSL_get_error(ssl_, rc);
      // What reading made OpenSSL answer (a TLS 1.3 key update) sits in the
      // write buffer: send it now rather than with the next frame.
      if (BIO* wbio = SSL_get_wbio(ssl_); BIO_wpending(wbio) > 0) (void)BIO_flush(wbio);
      if (rc > 0) {
        got = rc;
      } else {
        if (error == SSL_ERROR_ZERO_RETURN) {
          return MarkClosedByReceiver(absl::UnavailableError("connection closed by the peer"));
        }
        wait_for = RetryEvent(error);
        if (wait_for == 0) {
          const bool hung_up = SslPeerHungUp(error);  // before the queue is read out
          absl::Status failed = absl::UnavailableError(absl::StrCat("TLS read: ", OpenSslErrors()));
          return hung_up ? MarkClosedByReceiver(std::move(failed)) : failed;
        }
        got = -1;
      }
    } else {
      got = ::recv(fd_, p + done, n - done, 0);
      if (got == 0) {
        return MarkClosedByReceiver(absl::UnavailableError("connection closed by the peer"));
      }
      if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        const int error = errno;
        absl::Status failed = absl::UnavailableError(absl::StrCat("read: ", std::strerror(error)));
        return error == ECONNRESET ? MarkClosedByReceiver(std::move(failed)) : failed;
      }
    }
    if (got > 0) {
      done += static_cast<size_t>(got);
      deadline = absl::Now() + io_timeout_;  // progress: the timeout starts again
      continue;
    }
    absl::Status waited = Wait(wait_for, deadline, "read");
    if (!waited.ok()) {
      if (waited.code() == absl::StatusCode::kDeadlineExceeded && idle_ok && done == 0) {
        return waited;
      }
      return waited.code() == absl::StatusCode::kDeadlineExceeded
                 ? absl::DeadlineExceededError(absl::StrCat("read: no progress for ",
                                                            absl::FormatDuration(io_timeout_), " (",
                                                            done, " of ", n, " bytes)"))
                 : waited;
    }
  }
  return absl::OkStatus();
}

absl::Status DirectLink::Write(const void* a, size_t na, const void* b, size_t nb) {
  const char* parts[2] = {static_cast<const char*>(a), static_cast<const char*>(b)};
  size_t left[2] = {na, nb};
  absl::Time deadline = absl::Now() + io_timeout_;
  while (left[0] + left[1] > 0) {
    ssize_t put;
    short wait_for = POLLOUT;
    if (ssl_ != nullptr) {
      const int i = left[0] > 0 ? 0 : 1;
      absl::MutexLock lock(&ssl_mu_);
      ERR_clear_error();
      const int want = static_cast<int>(std::min<size_t>(left[i], size_t{1} << 30));
      const int rc = SSL_write(ssl_, parts[i], want);
      if (rc > 0) {
        put = rc;
      } else {
        wait_for = RetryEvent(SSL_get_error(ssl_, rc));
        if (wait_for == 0) {
          return absl::UnavailableError(absl::StrCat("TLS write: ", OpenSslErrors()));
        }
        put = -1;
      }
    } else {
      iovec iov[2];
      int count = 0;
      for (int i = 0; i < 2; ++i) {
        if (left[i] > 0) iov[count++] = {const_cast<char*>(parts[i]), left[i]};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = count;
      put = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (put < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return absl::UnavailableError(absl::StrCat("write: ", std::strerror(errno)));
      }
    }
    if (put > 0) {
      size_t n = static_cast<size_t>(put);
      for (int i = 0; i < 2 && n > 0; ++i) {
        const size_t take = std::min(n, left[i]);
        parts[i] += take;
        left[i] -= take;
        n -= take;
      }
      deadline = absl::Now() + io_timeout_;
      continue;
    }
    absl::Status waited = Wait(wait_for, deadline, "write");
    if (!waited.ok()) return waited;
  }
  return ssl_ != nullptr ? Flush(deadline) : absl::OkStatus();
}

void DirectLink::CloseWrite() {
  if (ssl_ != nullptr) {
    absl::MutexLock lock(&ssl_mu_);
    ERR_clear_error();
    SSL_shutdown(ssl_);  // sends close_notify (non-blocking: best effort)
    (void)BIO_flush(SSL_get_wbio(ssl_));
  }
  ::shutdown(fd_, SHUT_WR);
}

void DirectLink::Shutdown() {
  if (shutdown_pipe_[1] >= 0) {
    const char byte = 1;
    (void)!::write(shutdown_pipe_[1], &byte, 1);
  }
  ::shutdown(fd_, SHUT_RDWR);
}

}  // namespace detour
