// What the transport benchmarks share (transport/transport_bench.cc,
// wan/wan_transfer.cc): a receiving sink that keeps nothing, and mutual TLS
// as two workers use it, both ends presenting the certificate "bench" of a
// throwaway CA (tools/gen_certs.sh DIR --worker bench).
#ifndef DETOUR_BENCHMARKS_COMMON_BENCH_TRANSPORT_H_
#define DETOUR_BENCHMARKS_COMMON_BENCH_TRANSPORT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/net/tls.h"
#include "worker/transport/activation_server.h"

namespace detour {

// Accepts every tensor into one reused buffer, grown to the largest tensor
// seen, and drops it on delivery. Thread-safe: a direct server allocates
// from each connection's thread.
class ReusingSink : public TensorSink {
 public:
  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) override;
  void Deliver(const v1::FrameHeader&, MutableBuffer) override {}

 private:
  absl::Mutex mu_;
  std::shared_ptr<std::vector<char>> buffer_ ABSL_GUARDED_BY(mu_) =
      std::make_shared<std::vector<char>>();
};

// The certificate name both ends present.
inline constexpr char kBenchPeerName[] = "bench";

// Loads DIR/bench.crt, DIR/bench.key and DIR/ca.crt as a worker's
// credentials (server and client side alike).
absl::StatusOr<TransportSecurity> LoadBenchTls(const std::string& dir);

// Makes a throwaway CA and the "bench" certificate in a new temporary
// directory by running `gen_certs` (the path of tools/gen_certs.sh); returns
// the directory (the caller removes it once the files are loaded).
absl::StatusOr<std::string> MakeBenchCerts(const std::string& gen_certs);

}  // namespace detour

#endif  // DETOUR_BENCHMARKS_COMMON_BENCH_TRANSPORT_H_
