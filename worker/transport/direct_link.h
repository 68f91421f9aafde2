// A byte stream between two workers that carries tensor frames outside gRPC
// (the direct transport): one TCP connection, mutual TLS with certificates
// from the cluster CA or plaintext (--insecure). Blocking I/O with timeouts;
// the data goes from the sender's tensor memory to the socket and from the
// socket into the receiver's tensor memory, with no copy in between (gRPC
// copies every received message once more, and its TLS several times).
//
// Wire format, all integers little-endian:
//   client preface     8 bytes "DTRDIRv1"
//   frame (c -> s)     u32 header_bytes, u32 0, u64 data_bytes,
//                      FrameHeader (protobuf), data_bytes of tensor data
//   ack   (s -> c)     u32 ack_bytes, u32 0, FrameAck (protobuf)
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

namespace detour {

inline constexpr char kDirectPreface[8] = {'D', 'T', 'R', 'D', 'I', 'R', 'v', '1'};
// Longest FrameHeader / FrameAck a peer may announce.
inline constexpr uint32_t kMaxDirectMessageBytes = 64 << 10;
inline constexpr size_t kDirectFramePrefixBytes = 16;
inline constexpr size_t kDirectAckPrefixBytes = 8;

class DirectLink {
 public:
  // Connects to `address` (host:port) within `timeout`. With TLS (`ctx` not
  // null), handshakes and checks that the peer's certificate names
  // `peer_name` (its worker id); then sends the preface.
  // `wake_fd` (optional): a descriptor that becomes readable when the
  // caller gives up (it aborts the connect and every later wait).
  static absl::StatusOr<std::unique_ptr<DirectLink>> Connect(const std::string& address,
                                                             std::shared_ptr<ssl_ctx_st> ctx,
                                                             const std::string& peer_name,
                                                             absl::Duration timeout,
                                                             int wake_fd = -1);
  // Takes an accepted socket (owns it from here on, also on error). With TLS,
  // handshakes within `timeout`; the client must present a certificate from
  // the CA, whose name becomes peer_name(). Then reads and checks the preface.
  static absl::StatusOr<std::unique_ptr<DirectLink>> Accept(int fd, std::shared_ptr<ssl_ctx_st> ctx,
                                                            absl::Duration timeout,
                                                            int wake_fd = -1);
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

  // Blocked reads and writes give up after this long without progress.
  void SetIoTimeout(absl::Duration timeout);

 private:
  DirectLink(int fd, ssl_st* ssl, int wake_fd);
  absl::Status Wait(short events, absl::Time deadline, absl::string_view what);
  // The TLS handshake (SSL_connect or SSL_accept) by `deadline`.
  absl::Status Handshake(bool client, absl::Time deadline);
  // After the handshake: a buffer BIO in front of the socket gathers TLS
  // records (kWriteBufferBytes at a time) instead of one write() per record.
  absl::Status BufferWrites();
  // Writes out what the buffer BIO holds (the end of every Write()).
  absl::Status Flush(absl::Time deadline);
  static constexpr int kWriteBufferBytes = 256 << 10;

  const int fd_;
  ssl_st* const ssl_;  // owned; null for plaintext
  std::optional<std::string> peer_name_;
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
