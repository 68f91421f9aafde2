// Real etcd members for tests: the Debian `etcd` binary, started on loopback
// ports of the test's own with data in a temporary directory, killed when
// the cluster object goes. Tests skip when the binary is missing
// (tools/install_deps.sh installs it). Thread-compatible.
#ifndef DETOUR_TESTS_COORDINATOR_ETCD_CLUSTER_H_
#define DETOUR_TESTS_COORDINATOR_ETCD_CLUSTER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/subprocess.h"
#include "coordinator/etcd/etcd_client.h"
#include "tests/e2e/process.h"

namespace detour::testing {

// $DETOUR_ETCD, else etcd on the PATH or in /usr/bin; "" when none is found.
std::string FindEtcdBinary();

// The message a test skips with when FindEtcdBinary() finds none.
inline constexpr char kNoEtcd[] =
    "no etcd binary (apt-get install etcd-server, or tools/install_deps.sh; or set DETOUR_ETCD)";

class EtcdCluster {
 public:
  ~EtcdCluster();

  // Starts `members` members as one new cluster and waits (at most 60 s)
  // until it takes a write. With `tls`, clients must speak TLS and present a
  // certificate from a throwaway CA made here (tls_files()).
  absl::Status Start(int members, bool tls = false);
  // The CA, and a client certificate and key, etcd trusts (with tls).
  const TlsFiles& tls_files() const { return client_files_; }
  // host:port of every member, in order.
  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // A client of every member, with `timeout` per call.
  std::unique_ptr<EtcdClient> Client(absl::Duration timeout = absl::Seconds(3)) const;

  // SIGKILL to member `i`, and waits for its exit.
  void Kill(int i);
  // Starts member `i` again on its data and ports.
  absl::Status Restart(int i);

 private:
  absl::Status StartMember(int i);
  std::vector<std::string> MemberArgs(int i) const;

  absl::Status MakeCertificates();

  std::optional<TempDir> temp_;  // the members' logs stay when the test failed
  std::string dir_;
  bool tls_ = false;
  TlsFiles client_files_;
  TransportSecurity security_ = TransportSecurity::Insecure();
  std::vector<int> client_ports_, peer_ports_;
  std::vector<std::string> endpoints_;
  std::vector<std::unique_ptr<ChildProcess>> members_;
};

}  // namespace detour::testing

#endif  // DETOUR_TESTS_COORDINATOR_ETCD_CLUSTER_H_
