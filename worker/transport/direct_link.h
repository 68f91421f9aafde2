// A byte stream between two workers that carries tensor frames outside gRPC
// (the direct transport): one TCP connection, mutual TLS with certificates
// from the cluster CA or plaintext (--insecure). A sender may open several
// to one receiver (stripes of one session, see peer_sender.h) so that a
// long, fast link is not capped by one connection's window. Blocking I/O with timeouts;
// the data goes from the sender's tensor memory to the socket and from the
// socket into the receiver's tensor memory, with no copy in between (gRPC
// copies every received message once more, and its TLS several times).
//
// Wire format v2, all integers little-endian:
//   client preface     8 bytes "DTRDIRv2"
//   client hello       u64 session, u32 stripe, u32 stripes
//                      (1 <= stripes <= kMaxDirectStripes, stripe < stripes)
//   server answer      8 bytes "DTRDIRv2": the connection joined its session
//   frame (c -> s)     u32 header_bytes, u32 0, u64 data_bytes,
//                      FrameHeader (protobuf), data_bytes of tensor data
//   ack   (s -> c)     u32 ack_bytes, u32 0, FrameAck (protobuf)
// v1 ("DTRDIRv1": no hello, no answer, one connection) is refused by name on
// the receiver; a v1 receiver closes a v2 connection at its preface, which
// the v2 sender reports as such (it waits for the answer before any frame).
//
// Thread-safety: one thread may read while another writes; Shutdown() may be
// called from any thread and unblocks both.
#ifndef DETOUR_WORKER_TRANSPORT_DIRECT_LINK_H_
#define DETOUR_WORKER_TRANSPORT_DIRECT_LINK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/net/tls.h"
#include "worker/transport/tcp_tuning.h"

namespace detour {

// Whether `status` (from DirectLink::Open, Connect or Greet) says that the
// receiver accepted the TCP connection and then closed or reset it without a
// word: no TLS alert, no answer to the hello. A receiver does that when it
// sheds load (connection admission refuses or evicts an unauthenticated
// connection), while it shuts down, and when it speaks only v1. Trying again
// a little later may succeed; a refusal in words (a TLS alert, a wrong
// answer) or a port nobody listens on is not marked.
bool ClosedByReceiver(const absl::Status& status);

inline constexpr char kDirectPreface[8] = {'D', 'T', 'R', 'D', 'I', 'R', 'v', '2'};
inline constexpr char kDirectPrefaceV1[8] = {'D', 'T', 'R', 'D', 'I', 'R', 'v', '1'};
// The receiver's answer to a hello it refuses for good (a certificate that is
// not a worker's): the sender reports it and does not try again.
inline constexpr char kDirectRefusal[8] = {'D', 'T', 'R', 'D', 'I', 'R', 'n', 'o'};
inline constexpr size_t kDirectHelloBytes = 16;

// Which session a connection belongs to and its place in it. A session is
// the set of connections one sender opened at once; the receiver
// reassembles a tensor from frames on any of them.
struct DirectHello {
  uint64_t session = 0;
  uint32_t stripe = 0;
  uint32_t stripes = 1;
};
void EncodeDirectHello(const DirectHello& hello, char out[kDirectHelloBytes]);
// INVALID_ARGUMENT unless 1 <= stripes <= kMaxDirectStripes and
// stripe < stripes.
absl::StatusOr<DirectHello> DecodeDirectHello(const char in[kDirectHelloBytes]);

// Socket settings of a connection, applied before it connects. Buffer sizes
// of 0 leave the kernel's autotuning on (tcp_tuning.h says when to set them).
struct DirectSocketOptions {
  int64_t sndbuf = 0;
  int64_t rcvbuf = 0;
  bool bbr = false;  // TCP_CONGESTION "bbr"; kept at the default if refused
};
// Applies `options` to a socket; what TCP_CONGESTION then says.
std::string ApplyDirectSocketOptions(int fd, const DirectSocketOptions& options);
// Longest FrameHeader / FrameAck a peer may announce.
inline constexpr uint32_t kMaxDirectMessageBytes = 64 << 10;
inline constexpr size_t kDirectFramePrefixBytes = 16;
inline constexpr size_t kDirectAckPrefixBytes = 8;

class DirectLink {
 public:
  // Connects to `address` (host:port) within `timeout`. With TLS (`ctx` not
  // null), handshakes and checks that the peer's certificate names
  // `peer_name` (its worker id). The caller then greets (Greet).
  // `wake_fd` (optional): a descriptor that becomes readable when the
  // caller gives up (it aborts the connect and every later wait).
  static absl::StatusOr<std::unique_ptr<DirectLink>> Open(const std::string& address,
                                                          std::shared_ptr<ssl_ctx_st> ctx,
                                                          const std::string& peer_name,
                                                          absl::Duration timeout, int wake_fd = -1,
                                                          const DirectSocketOptions& socket = {});
  // Sends the preface and `hello` and waits (up to `timeout`) for the
  // receiver's answer. A receiver that closes instead (a v1 receiver, or one
  // that refused the stripe) gives FAILED_PRECONDITION saying so, marked
  // ClosedByReceiver (as is UNAVAILABLE from a preface the socket would not
  // take); an answer of kDirectRefusal gives PERMISSION_DENIED.
  absl::Status Greet(const DirectHello& hello, absl::Duration timeout);
  // Takes an accepted socket (owns it from here on, also on error). With TLS,
  // handshakes within `timeout`; the client must present a certificate from
  // the CA, whose name becomes peer_name(). Then reads and checks the preface
  // (a v1 one is refused by name) and the hello (hello()). The receiver
  // answers with Welcome() once it admits the connection.
  static absl::StatusOr<std::unique_ptr<DirectLink>> Accept(int fd, std::shared_ptr<ssl_ctx_st> ctx,
                                                            absl::Duration timeout,
                                                            int wake_fd = -1);
  // Answers the hello: accepted (the preface) or refused for good
  // (kDirectRefusal; the caller then closes the link).
  absl::Status Welcome();
  absl::Status Refuse();
  // The hello Accept read.
  const DirectHello& hello() const { return hello_; }
  // The kernel's smoothed round-trip estimate (TCP_INFO); zero if unknown.
  absl::Duration Rtt() const;
  // TCP_NOTSENT_LOWAT: the socket takes more writes only while less than
  // `bytes` of what was written waits unsent (the rest of the send buffer
  // holds data in flight). Best effort.
  void SetNotsentLowat(int64_t bytes);
  // SO_SNDBUF after the connection is up (the send buffer, unlike the
  // receive buffer, does not shape the handshake).
  void SetSendBuffer(int64_t bytes);
  // The congestion control the socket uses ("bbr", "cubic", ...).
  const std::string& congestion_control() const { return congestion_; }
  ~DirectLink();
  DirectLink(const DirectLink&) = delete;
  DirectLink& operator=(const DirectLink&) = delete;

  // Reads exactly n bytes. An error (EOF, reset, timeout, TLS failure) leaves
  // the link unusable. A timeout before the first byte of a read started
  // with `idle_ok` returns DEADLINE_EXCEEDED and leaves it usable.
  absl::Status Read(void* data, size_t n, bool idle_ok = false);
  // Writes `a` then `b` (either may be empty) completely.
  absl::Status Write(const void* a, size_t na, const void* b = nullptr, size_t nb = 0);
  // Half-closes our sending side (plaintext: FIN; TLS: close_notify too).
  void CloseWrite();
  // Makes every blocked and later Read/Write fail. Idempotent, any thread.
  void Shutdown();

  // With TLS, the verified peer certificate's name; nullopt for plaintext.
  const std::optional<std::string>& peer_name() const { return peer_name_; }
  bool tls() const { return ssl_ != nullptr; }
  // The TLS connection (null for plaintext), for checks of the peer's
  // certificate (common/net/identity.h).
  const ssl_st* ssl() const { return ssl_; }

  // Blocked reads and writes give up after this long without progress.
  void SetIoTimeout(absl::Duration timeout);

 private:
  DirectLink(int fd, ssl_st* ssl, int wake_fd);
  absl::Status Wait(short events, absl::Time deadline, absl::string_view what);
  // The TLS handshake (SSL_connect or SSL_accept) by `deadline`.
  absl::Status Handshake(bool client, absl::Time deadline);
  // Whether the client's first bytes (waited for until `deadline`) are a
  // plaintext preface rather than a TLS record: a sender without TLS.
  bool PlaintextPrefaceWaiting(absl::Time deadline);
  // Reads what the sender sent so far, sends `answer` (a refusal the sender
  // understands) and ends the write side; the caller then closes.
  void RefuseInPlace(const void* answer, size_t bytes);
  // After the handshake: a buffer BIO in front of the socket gathers TLS
  // records (kWriteBufferBytes at a time) instead of one write() per record.
  absl::Status BufferWrites();
  // Writes out what the buffer BIO holds (the end of every Write()).
  absl::Status Flush(absl::Time deadline);
  static constexpr int kWriteBufferBytes = 256 << 10;

  const int fd_;
  ssl_st* const ssl_;  // owned; null for plaintext
  std::optional<std::string> peer_name_;
  DirectHello hello_;
  std::string congestion_;
  // OpenSSL's connection object is not safe for a read and a write at once
  // from two threads; the socket is. TLS links serialise the two with this
  // lock held only around each SSL call (never while blocked: the socket is
  // non-blocking under TLS and waits happen in poll() outside the lock).
  absl::Mutex ssl_mu_;
  int shutdown_pipe_[2] = {-1, -1};  // written by Shutdown(): wakes poll()
  const int wake_fd_;                // the owner's, or -1
  absl::Duration io_timeout_ = absl::Seconds(60);
};

// Fills a frame prefix / an ack prefix.
void EncodeDirectFramePrefix(uint32_t header_bytes, uint64_t data_bytes, char out[16]);
void EncodeDirectAckPrefix(uint32_t ack_bytes, char out[8]);
// Parses them; INVALID_ARGUMENT for a length beyond kMaxDirectMessageBytes,
// a zero header, or nonzero reserved bytes.
absl::Status DecodeDirectFramePrefix(const char in[16], uint32_t* header_bytes,
                                     uint64_t* data_bytes);
absl::Status DecodeDirectAckPrefix(const char in[8], uint32_t* ack_bytes);

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_DIRECT_LINK_H_
