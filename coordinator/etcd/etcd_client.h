// A small client of etcd's v3 gRPC API (proto/etcd/rpc.proto): key ranges,
// puts, transactions with compares, deletes and leases. Every call has a
// deadline; a member that cannot be reached (UNAVAILABLE) makes the call try
// the next endpoint within the same deadline. Errors name the call and the
// endpoint. Thread-safe; calls block their caller.
#ifndef DETOUR_COORDINATOR_ETCD_ETCD_CLIENT_H_
#define DETOUR_COORDINATOR_ETCD_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/net/tls.h"
#include "etcd/rpc.grpc.pb.h"
#include "etcd/rpc.pb.h"

namespace detour {

struct EtcdOptions {
  // host:port of each member, tried in turn.
  std::vector<std::string> endpoints;
  // TLS to etcd (a CA, and a client certificate and key when etcd asks for
  // one), or plaintext.
  TransportSecurity security = TransportSecurity::Insecure();
  // Each call, all endpoints tried included.
  absl::Duration call_timeout = absl::Seconds(5);
  // etcd's default --max-request-bytes: larger requests are refused here,
  // before they are sent.
  size_t max_request_bytes = 1572864;
  // The largest response taken (gRPC's receive limit); a range whose answer
  // is larger fails with RESOURCE_EXHAUSTED.
  int max_response_bytes = 64 << 20;
  // The most keys one Range returns (its limit when the caller gives none).
  int64_t max_range_keys = 10000;
};

// "etcd://h1:2379,h2:2379" -> {"h1:2379", "h2:2379"}; each must be host:port.
// At most 16 endpoints. `flag` names the source in errors.
absl::StatusOr<std::vector<std::string>> ParseEtcdUrl(absl::string_view url,
                                                      absl::string_view flag);

// A member's answer as a status. etcd answers a request that ran out of
// time inside the server (its raft proposal did not commit: no quorum) with
// gRPC's UNKNOWN code and Go's context error text; those are
// DEADLINE_EXCEEDED and UNAVAILABLE here, like the same outcome seen from
// this side, so that the call tries the next member and its caller knows
// the outcome is unknown.
absl::Status EtcdAnswerStatus(const grpc::Status& status);

// The end of the range of every key that starts with `prefix`.
std::string EtcdPrefixEnd(absl::string_view prefix);

// One stored key as etcd reports it.
struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

// Compares and operations of a transaction.
etcdserverpb::Compare EtcdModRevisionIs(const std::string& key, int64_t revision);
// 0 = the key does not exist.
etcdserverpb::Compare EtcdCreateRevisionIs(const std::string& key, int64_t revision);
etcdserverpb::RequestOp EtcdPutOp(const std::string& key, const std::string& value,
                                  int64_t lease = 0);
etcdserverpb::RequestOp EtcdGetOp(const std::string& key);
etcdserverpb::RequestOp EtcdDeleteOp(const std::string& key);

class EtcdClient {
 public:
  // Checks the options and makes one channel per endpoint; connects lazily.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdOptions options);

  const EtcdOptions& options() const { return options_; }
  // "etcd://h1:2379,h2:2379".
  std::string Describe() const;

  struct RangeResult {
    std::vector<EtcdKeyValue> kvs;
    // More keys lie in the range beyond `limit`.
    bool more = false;
    // The store's revision the range was read at.
    int64_t revision = 0;
  };
  // Keys in [key, range_end) (range_end "" = `key` alone), in key order, at
  // most `limit` (0 = options().max_range_keys) of them, read at `revision`
  // (0 = now). Linearizable.
  absl::StatusOr<RangeResult> Range(const std::string& key, const std::string& range_end,
                                    int64_t limit = 0, int64_t revision = 0);
  // One key; nullopt when it does not exist.
  absl::StatusOr<std::optional<EtcdKeyValue>> Get(const std::string& key);
  // Returns the revision of the write.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Returns how many keys were deleted.
  absl::StatusOr<int64_t> DeleteRange(const std::string& key, const std::string& range_end);
  // The response's ranges are checked like Range's.
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& request);

  struct Lease {
    int64_t id = 0;
    absl::Duration ttl;
  };
  absl::StatusOr<Lease> LeaseGrant(absl::Duration ttl);
  // One keep-alive; returns the time the lease has left. NOT_FOUND when the
  // lease expired or was revoked.
  absl::StatusOr<absl::Duration> LeaseKeepAliveOnce(int64_t id);
  absl::Status LeaseRevoke(int64_t id);

 private:
  struct Member {
    std::string endpoint;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  };
  using Attempt = std::function<grpc::Status(Member& member, grpc::ClientContext* context)>;

  explicit EtcdClient(EtcdOptions options);
  // Runs `attempt` on the members in turn, from the one that last answered,
  // until one answers or the deadline passes. `request_bytes` is checked
  // against the request limit first.
  absl::Status Invoke(absl::string_view op, size_t request_bytes, const Attempt& attempt);
  absl::Status CheckRange(absl::string_view op, const etcdserverpb::RangeResponse& response,
                          int64_t limit) const;

  const EtcdOptions options_;
  std::vector<Member> members_;
  std::atomic<size_t> preferred_{0};
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_ETCD_ETCD_CLIENT_H_
