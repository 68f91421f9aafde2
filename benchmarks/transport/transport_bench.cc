// ActivationService throughput and latency against raw TCP on loopback,
// measured in the same run. A transfer = the sender hands over N bytes and
// waits for the receiver's acknowledgement (the receiver has copied them into
// its own buffer), for both transports.
//
//   build/benchmarks/transport/transport_bench --benchmark_min_time=1
// BM_DetourTls is the same transfer over mutual TLS, with a throwaway CA made
// by <build>/tools/gen_certs.sh at start. BM_DetourDirect / BM_DetourDirectTls
// send over the direct transport (direct_link.h) instead of the
// ActivationService stream: same frames, sink and acknowledgements.
// DETOUR_BENCH_CHUNK_MIB=N sets the sender's chunk size (default 4 MiB);
// DETOUR_BENCH_NO_BBR (set to anything) leaves the direct transport's sending
// sockets on the system's default congestion control instead of BBR (the
// receiver's keep BBR: it only acknowledges).
// BM_RawTcpAesGcm is the bound for any TLS path on the machine: the raw TCP
// transfer with AES-128-GCM records of TLS's size (16 KiB + tag) encrypted by
// the sender and decrypted by the receiver, written and read 16 records per
// system call, and nothing else (no handshake, no record headers, no library
// around the cipher).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/evp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <functional>
#include <string>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "benchmark/benchmark.h"
#include "benchmarks/common/bench_transport.h"
#include "common/net/server.h"
#include "common/net/tls.h"
#include "worker/transport/activation_server.h"
#include "worker/transport/direct_server.h"
#include "worker/transport/peer_sender.h"

namespace detour {
namespace {

// --- raw TCP baseline ------------------------------------------------------

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// A loopback TCP connection: `serve` runs on the accepted end in its own
// thread until it returns; the client end is the caller's.
class LoopbackConnection {
 public:
  explicit LoopbackConnection(std::function<void(int fd)> serve) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::listen(listen_fd_, 1);
    socklen_t len = sizeof(addr);
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    server_ = std::thread([this, serve = std::move(serve)] {
      const int fd = ::accept(listen_fd_, nullptr, nullptr);
      const int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      serve(fd);
      ::close(fd);
    });
    client_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    ::connect(client_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    const int one = 1;
    ::setsockopt(client_fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  ~LoopbackConnection() {
    ::shutdown(client_fd_, SHUT_RDWR);
    ::close(client_fd_);
    server_.join();
    ::close(listen_fd_);
  }
  int client_fd() const { return client_fd_; }

 private:
  int listen_fd_ = -1, client_fd_ = -1;
  std::thread server_;
};

// Receives length-prefixed messages into its own buffer and acks each.
class RawTcpPeer {
 public:
  bool Transfer(const std::vector<char>& data) {
    const uint64_t n = data.size();
    const int fd = connection_.client_fd();
    if (!WriteAll(fd, &n, sizeof(n)) || !WriteAll(fd, data.data(), n)) return false;
    char ack;
    return ReadAll(fd, &ack, 1);
  }

 private:
  static void Serve(int fd) {
    std::vector<char> buffer;
    while (true) {
      uint64_t n;
      if (!ReadAll(fd, &n, sizeof(n))) break;
      buffer.resize(n);
      if (!ReadAll(fd, buffer.data(), n)) break;
      const char ack = 1;
      if (!WriteAll(fd, &ack, 1)) break;
    }
  }
  LoopbackConnection connection_{Serve};
};

// Transfers range(0) bytes with a raw peer (RawTcpPeer, RawTcpAesGcmPeer).
template <typename Peer>
void RunRaw(benchmark::State& state) {
  Peer peer;
  std::vector<char> data(static_cast<size_t>(state.range(0)), 'x');
  for (auto _ : state) {
    if (!peer.Transfer(data)) state.SkipWithError("raw transfer failed");
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// --- raw TCP with AES-128-GCM records: the bound for TLS ------------------

constexpr size_t kRecord = 16 << 10;  // TLS's largest record
constexpr size_t kTag = 16;
constexpr size_t kRecordsPerCall = 16;

using CipherCtx = std::unique_ptr<EVP_CIPHER_CTX, decltype(&EVP_CIPHER_CTX_free)>;

CipherCtx NewCipher(bool encrypt) {
  CipherCtx ctx(EVP_CIPHER_CTX_new(), EVP_CIPHER_CTX_free);
  static const unsigned char key[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  const int ok = encrypt ? EVP_EncryptInit_ex(ctx.get(), EVP_aes_128_gcm(), nullptr, key, nullptr)
                         : EVP_DecryptInit_ex(ctx.get(), EVP_aes_128_gcm(), nullptr, key, nullptr);
  if (ok != 1) std::abort();
  return ctx;
}

// Seals (or opens, checking the tag) record `seq` of `len` bytes from `in` to
// `out`; the tag follows the sealed bytes.
bool SealRecord(EVP_CIPHER_CTX* ctx, bool encrypt, uint64_t seq, const unsigned char* in,
                size_t len, unsigned char* out, unsigned char* tag) {
  unsigned char iv[12] = {};
  std::memcpy(iv + 4, &seq, sizeof(seq));
  int n = 0;
  if (encrypt) {
    return EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) == 1 &&
           EVP_EncryptUpdate(ctx, out, &n, in, static_cast<int>(len)) == 1 &&
           EVP_EncryptFinal_ex(ctx, out + n, &n) == 1 &&
           EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kTag, tag) == 1;
  }
  return EVP_DecryptInit_ex(ctx, nullptr, nullptr, nullptr, iv) == 1 &&
         EVP_DecryptUpdate(ctx, out, &n, in, static_cast<int>(len)) == 1 &&
         EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kTag, tag) == 1 &&
         EVP_DecryptFinal_ex(ctx, out + n, &n) == 1;
}

class RawTcpAesGcmPeer {
 public:
  bool Transfer(const std::vector<char>& data) {
    const uint64_t n = data.size();
    const int fd = connection_.client_fd();
    if (!WriteAll(fd, &n, sizeof(n))) return false;
    const auto* in = reinterpret_cast<const unsigned char*>(data.data());
    for (size_t done = 0; done < n;) {
      size_t put = 0;
      for (size_t r = 0; r < kRecordsPerCall && done < n; ++r) {
        const size_t len = std::min<size_t>(kRecord, n - done);
        unsigned char* out = staging_.data() + put;
        if (!SealRecord(send_.get(), true, seq_++, in + done, len, out, out + len)) return false;
        put += len + kTag;
        done += len;
      }
      if (!WriteAll(fd, staging_.data(), put)) return false;
    }
    char ack;
    return ReadAll(fd, &ack, 1) && ack == 1;
  }

 private:
  static void Serve(int fd) {
    CipherCtx open = NewCipher(false);
    std::vector<unsigned char> staging(kRecordsPerCall * (kRecord + kTag));
    std::vector<char> buffer;
    uint64_t seq = 0;
    while (true) {
      uint64_t n;
      if (!ReadAll(fd, &n, sizeof(n))) return;
      buffer.resize(n);
      auto* out = reinterpret_cast<unsigned char*>(buffer.data());
      char ack = 1;
      for (size_t done = 0; done < n;) {
        const size_t records =
            std::min<size_t>(kRecordsPerCall, (n - done + kRecord - 1) / kRecord);
        const size_t data = std::min<size_t>(records * kRecord, n - done);
        if (!ReadAll(fd, staging.data(), data + records * kTag)) return;
        size_t at = 0;
        for (size_t r = 0; r < records; ++r) {
          const size_t len = std::min<size_t>(kRecord, n - done);
          if (!SealRecord(open.get(), false, seq++, staging.data() + at, len, out + done,
                          staging.data() + at + len)) {
            ack = 0;  // a tag that does not match
          }
          at += len + kTag;
          done += len;
        }
      }
      if (!WriteAll(fd, &ack, 1)) return;
    }
  }
  CipherCtx send_ = NewCipher(true);
  std::vector<unsigned char> staging_ =
      std::vector<unsigned char>(kRecordsPerCall * (kRecord + kTag));
  uint64_t seq_ = 0;
  LoopbackConnection connection_{Serve};  // last: its thread starts in the constructor
};

void BM_RawTcp(benchmark::State& state) { RunRaw<RawTcpPeer>(state); }
void BM_RawTcpAesGcm(benchmark::State& state) { RunRaw<RawTcpAesGcmPeer>(state); }

// --- detour ActivationService ----------------------------------------------

// Mutual TLS as two workers use it: both sides present "bench" from a
// throwaway CA (made once per run).
const TransportSecurity& BenchTls() {
  static const TransportSecurity* const security = [] {
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
    const std::string script =
        (self.parent_path().parent_path().parent_path() / "tools/gen_certs.sh").string();
    const absl::StatusOr<std::string> dir = MakeBenchCerts(script);
    const absl::StatusOr<TransportSecurity> loaded =
        dir.ok() ? LoadBenchTls(*dir) : absl::StatusOr<TransportSecurity>(dir.status());
    // Loaded into memory: the files are not read again.
    std::error_code ignored;
    if (dir.ok()) std::filesystem::remove_all(*dir, ignored);
    if (!loaded.ok()) {
      std::fprintf(stderr, "transport_bench: %s\n", loaded.status().ToString().c_str());
      std::exit(1);
    }
    return new TransportSecurity(*loaded);
  }();
  return *security;
}

struct DetourPeer {
  explicit DetourPeer(bool tls = false, bool direct = false, bool relay = true) {
    ActivationServerOptions server_options;
    server_options.require_peer_certificates = tls;
    server = std::make_unique<ActivationServer>(&sink, server_options);
    GrpcServerOptions options;
    options.listen = HostPort{"127.0.0.1", 0};
    if (tls) options.security = BenchTls();
    options.generic_service = server.get();
    options.admission = relay;
    running = std::move(*StartGrpcServer(std::move(options), "bench"));
    PeerSenderOptions sender_options;
    if (tls) sender_options.security = BenchTls();
    if (const char* chunk = std::getenv("DETOUR_BENCH_CHUNK_MIB")) {
      sender_options.chunk_bytes = static_cast<size_t>(std::atoi(chunk)) << 20;
    }
    if (std::getenv("DETOUR_BENCH_NO_BBR") != nullptr) sender_options.bbr = false;
    if (direct) {
      DirectServerOptions direct_options;
      direct_options.listen = HostPort{"127.0.0.1", 0};
      if (tls) direct_options.security = BenchTls();
      auto started = DirectServer::Start(server.get(), direct_options);
      if (!started.ok()) {
        std::fprintf(stderr, "transport_bench: %s\n", started.status().ToString().c_str());
        std::exit(1);
      }
      direct_server = *std::move(started);
      sender_options.direct_address = absl::StrCat("127.0.0.1:", direct_server->port());
      sender_options.peer_name = "bench";
    }
    sender = std::make_unique<PeerSender>(absl::StrCat("127.0.0.1:", running.port), sender_options);
  }
  ~DetourPeer() {
    sender.reset();
    if (direct_server != nullptr) direct_server->Shutdown();
    running.server->Shutdown();
  }
  bool Transfer(const std::shared_ptr<std::vector<char>>& data, uint32_t id) {
    v1::FrameHeader h;
    h.set_job_id("bench");
    h.set_iteration(0);
    h.set_microbatch(id);
    h.set_direction(v1::DIRECTION_FORWARD);
    h.set_sender("bench");
    h.add_shape(static_cast<int64_t>(data->size()) / 4);
    h.set_dtype(v1::DTYPE_FP32);
    TensorView view;
    view.data = data->data();
    view.bytes = data->size();
    view.keepalive = data;
    absl::Notification done;
    bool ok = false;
    sender->Send(std::move(h), std::move(view), [&](absl::Status s, double) {
      ok = s.ok();
      if (!ok) std::fprintf(stderr, "transport_bench: %s\n", s.ToString().c_str());
      done.Notify();
    });
    done.WaitForNotification();
    return ok;
  }
  ReusingSink sink;
  std::unique_ptr<ActivationServer> server;
  RunningServer running;
  std::unique_ptr<DirectServer> direct_server;
  std::unique_ptr<PeerSender> sender;
};

void RunDetour(benchmark::State& state, bool tls, bool direct = false, bool relay = true) {
  DetourPeer peer(tls, direct, relay);
  auto data = std::make_shared<std::vector<char>>(static_cast<size_t>(state.range(0)), 'x');
  uint32_t id = 0;
  for (auto _ : state) {
    if (!peer.Transfer(data, id++)) state.SkipWithError("detour transfer failed");
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Detour(benchmark::State& state) { RunDetour(state, false); }
void BM_DetourTls(benchmark::State& state) { RunDetour(state, true); }
// The gRPC stream without the admission relay in front of the server
// (GrpcServerOptions::admission off): what the relay's hop costs.
void BM_DetourUnrelayed(benchmark::State& state) { RunDetour(state, false, false, false); }
void BM_DetourTlsUnrelayed(benchmark::State& state) { RunDetour(state, true, false, false); }
void BM_DetourDirect(benchmark::State& state) { RunDetour(state, false, true); }
void BM_DetourDirectTls(benchmark::State& state) { RunDetour(state, true, true); }

BENCHMARK(BM_RawTcp)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_RawTcpAesGcm)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Detour)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Arg(16 << 20)
    ->Arg(32 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DetourTls)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DetourUnrelayed)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DetourTlsUnrelayed)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DetourDirect)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DetourDirectTls)
    ->Arg(16)
    ->Arg(1 << 20)
    ->Arg(4 << 20)
    ->Arg(16 << 20)
    ->Arg(64 << 20)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace detour

BENCHMARK_MAIN();
