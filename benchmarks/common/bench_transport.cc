#include "benchmarks/common/bench_transport.h"

#include <stdlib.h>

#include <cstdlib>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace detour {

absl::StatusOr<MutableBuffer> ReusingSink::Allocate(const v1::FrameHeader& h) {
  absl::MutexLock lock(&mu_);
  if (buffer_->size() < h.total_bytes()) buffer_->resize(h.total_bytes());
  MutableBuffer b;
  b.data = buffer_->data();
  b.bytes = buffer_->size();
  b.keepalive = buffer_;
  return b;
}

absl::StatusOr<TransportSecurity> LoadBenchTls(const std::string& dir) {
  TlsFiles files{dir + "/" + kBenchPeerName + ".crt", dir + "/" + kBenchPeerName + ".key",
                 dir + "/ca.crt"};
  return TransportSecurity::Load(files, /*client=*/false);
}

absl::StatusOr<std::string> MakeBenchCerts(const std::string& gen_certs) {
  char pattern[] = "/tmp/detour-bench-certs.XXXXXX";
  if (::mkdtemp(pattern) == nullptr) {
    return absl::InternalError("cannot make a temporary directory for the certificates");
  }
  const std::string dir = pattern;
  const std::string command = absl::StrCat(gen_certs, " ", dir, " --worker ", kBenchPeerName);
  if (std::system(command.c_str()) != 0) {
    return absl::InternalError(absl::StrCat(command, " failed"));
  }
  return dir;
}

}  // namespace detour
