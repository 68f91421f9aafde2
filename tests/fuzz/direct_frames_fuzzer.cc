// Fuzzes what a worker does with the bytes a peer sends on a (plaintext)
// direct-transport connection after the preface: frame prefixes, headers,
// data, the header validation, reassembly against the ActivationServer's
// limits, and the acknowledgements it writes back. The input goes through a
// real socket pair into the same ReadDirectFrames a DirectServer runs.
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "worker/transport/activation_server.h"
#include "worker/transport/direct_link.h"
#include "worker/transport/direct_server.h"

namespace {

// Takes every tensor (of at most the server's 1 MiB limit) and drops it.
class DiscardingSink : public detour::TensorSink {
 public:
  absl::StatusOr<detour::MutableBuffer> Allocate(const detour::v1::FrameHeader& h) override {
    if (h.job_id() == "refused") return absl::FailedPreconditionError("refused job");
    auto storage = std::make_shared<std::vector<char>>(h.total_bytes());
    detour::MutableBuffer b;
    b.data = storage->data();
    b.bytes = storage->size();
    b.keepalive = storage;
    return b;
  }
  void Deliver(const detour::v1::FrameHeader&, detour::MutableBuffer) override {}
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) return 0;
  // The peer: the preface and hello, the input, then it reads (and drops)
  // the acks.
  std::thread peer([&] {
    const char* p = reinterpret_cast<const char*>(data);
    char start[sizeof(detour::kDirectPreface) + detour::kDirectHelloBytes];
    std::memcpy(start, detour::kDirectPreface, sizeof(detour::kDirectPreface));
    detour::EncodeDirectHello(detour::DirectHello{}, start + sizeof(detour::kDirectPreface));
    bool ok =
        ::send(fds[1], start, sizeof(start), MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof(start));
    for (size_t left = size; ok && left > 0;) {
      const ssize_t n = ::send(fds[1], p, left, MSG_NOSIGNAL);
      if (n <= 0) break;
      p += n;
      left -= static_cast<size_t>(n);
    }
    ::shutdown(fds[1], SHUT_WR);
    char sink[4096];
    while (::recv(fds[1], sink, sizeof(sink), 0) > 0) {}
    ::close(fds[1]);
  });
  DiscardingSink sink;
  detour::ActivationServerOptions options;
  options.max_tensor_bytes = 1 << 20;  // a worker's is 1 GiB; 1 MiB keeps the fuzzer fast
  options.max_partial_bytes = 4 << 20;
  detour::ActivationServer server(&sink, options);
  auto link = detour::DirectLink::Accept(fds[0], nullptr, absl::Seconds(5));
  if (link.ok()) {
    (*link)->SetIoTimeout(absl::Seconds(5));
    detour::TensorAssembler assembler(&server, std::nullopt);
    (void)detour::ReadDirectFrames(link->get(), &assembler, options.max_tensor_bytes,
                                   [] { return true; });
    link->reset();  // closes our end: the peer's reads end
  }
  peer.join();
  return 0;
}
