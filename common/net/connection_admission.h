// Which connections the direct transport's server (worker/transport/
// direct_server.h) and the gRPC ports' relay (admission_relay.h) let in, and
// how they report the ones they refuse. Pure book-keeping, no sockets: the
// servers call it under their locks, and tests drive it directly.
//
// A connection is *unauthenticated* from accept until it has completed its
// TLS handshake (a verified worker certificate), the preface and the hello;
// then it is *authenticated*. Unauthenticated connections are bounded in
// total (well below the overall limit, so authenticated peers always find
// room) and per source address (an IPv4 address, an IPv6 /64), so that one
// host flooding the port holds a few slots at most and many hosts flooding
// it displace each other, oldest first, rather than the peers that finish
// their handshake. A source with an authenticated connection open is
// *trusted*: a sender opens at most half the per-source limit of stripes
// before one has authenticated, then the rest at once (peer_sender.h), and
// several workers may share a host, so
// a trusted source's handshakes are not held to the per-source limit, and
// they make room for newcomers only when no stranger's handshake is left.
//
// The job's *known* peers (their addresses, from the peer lists the
// coordinator sends: SetKnownSources) are trusted before they ever
// authenticated, and their handshakes first take a reserve of their own
// (max_unauthenticated_known) that no stranger can fill: a flood from
// anywhere else, however many sources it comes from, cannot keep a peer of
// the job from connecting. Known is an address, not an identity: a known
// source still has to present a worker's certificate.
#ifndef DETOUR_COMMON_NET_CONNECTION_ADMISSION_H_
#define DETOUR_COMMON_NET_CONNECTION_ADMISSION_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"

struct sockaddr;

namespace detour {

// Why a connection was refused or closed before it carried frames: the
// `reason` label of detour_worker_direct_connections_refused_total.
enum class RefusalReason {
  kSourceLimit,           // its source already had the most unauthenticated ones allowed
  kUnauthenticatedLimit,  // closed (the oldest of the busiest source) to make room
  kConnectionLimit,       // every slot is held by authenticated connections
  kDeadline,              // TLS handshake, preface and hello not done within the deadline
  kHandshake,             // TLS failed: no certificate, another CA, plaintext against TLS
  kIdentity,              // a verified certificate that is not a worker's
  kPreface,               // not the detour preface or hello (another protocol, v1)
  kSession,               // a stripe that conflicts with its session
};
inline constexpr int kRefusalReasons = 8;
// "source_limit", "unauthenticated_limit", ...
const char* RefusalReasonLabel(RefusalReason reason);

struct AdmissionLimits {
  // Connections open at once, unauthenticated ones included (each holds a
  // thread).
  int max_connections = 512;
  // Unauthenticated connections at once; the rest of max_connections is kept
  // for authenticated ones.
  int max_unauthenticated = 64;
  // Unauthenticated connections from one source address at once.
  int max_unauthenticated_per_source = 8;
  // Unauthenticated connections of known sources (SetKnownSources) held
  // apart from max_unauthenticated, which they use only once these are
  // taken.
  int max_unauthenticated_known = 32;
};

// The source a connection is counted against: the IPv4 address ("10.0.0.7"),
// the /64 of an IPv6 one ("2001:db8:1:2::/64"; an IPv4-mapped address counts
// as IPv4), "unknown" for anything else.
std::string ConnectionSource(const sockaddr* address);
// The same for a host written as an IP literal ("10.0.0.7", "::1",
// "[2001:db8::5]"); nullopt for a name (not resolved here) or anything else.
std::optional<std::string> HostSource(absl::string_view host);

// The sources of peers' "host:port" addresses (HostSource of each host);
// names and malformed addresses are skipped.
std::set<std::string> SourcesOfAddresses(const std::vector<std::string>& addresses);

// Not thread-safe.
class ConnectionAdmission {
 public:
  explicit ConnectionAdmission(AdmissionLimits limits);

  struct Verdict {
    bool admit = false;
    RefusalReason reason = RefusalReason::kConnectionLimit;  // when !admit
    // A connection to close now to make room for this one (counted as
    // kUnauthenticatedLimit); it stays counted until Closed.
    std::optional<uint64_t> evict;
  };
  // A new connection `id` (ids increase with time) from `source`.
  Verdict Arrive(uint64_t id, const std::string& source);
  // `id` completed its handshake, preface and hello. False when it was
  // evicted meanwhile (the caller closes it).
  bool Authenticate(uint64_t id);
  // `id` ended. True when it had been evicted (already counted as refused).
  bool Closed(uint64_t id);
  // Whether `id` was evicted and has not ended yet.
  bool evicted(uint64_t id) const { return closing_.count(id) > 0; }

  int open() const {
    return unauthenticated() + authenticated_ + static_cast<int>(closing_.size());
  }
  int unauthenticated() const { return static_cast<int>(pending_.size()); }
  int authenticated() const { return authenticated_; }
  // Whether `source` has an authenticated connection open, or is known.
  bool trusted(const std::string& source) const {
    return authenticated_per_source_.count(source) > 0 || known_.count(source) > 0;
  }
  // The job's peers' sources (ConnectionSource form), replacing the last
  // set. Connections already admitted keep their place.
  void SetKnownSources(std::set<std::string> sources) { known_ = std::move(sources); }
  // The same from peers' "host:port" addresses (SourcesOfAddresses);
  // returns how many sources are known.
  size_t SetKnownPeers(const std::vector<std::string>& addresses) {
    SetKnownSources(SourcesOfAddresses(addresses));
    return known_.size();
  }
  bool known(const std::string& source) const { return known_.count(source) > 0; }
  // Unauthenticated connections in the known sources' reserve.
  int reserved() const { return static_cast<int>(reserve_.size()); }
  int closing() const { return static_cast<int>(closing_.size()); }
  const AdmissionLimits& limits() const { return limits_; }

 private:
  // What makes room for a newcomer: the oldest unauthenticated connection
  // of the untrusted source with the most of them; when only trusted ones
  // handshake, and the newcomer is trusted too, the same among them.
  std::optional<uint64_t> Victim(bool newcomer_trusted) const;
  // The oldest pending connection of the source with the most pending among
  // those `trusted` or not.
  std::optional<uint64_t> Busiest(bool trusted) const;

  const AdmissionLimits limits_;
  std::map<uint64_t, std::string> pending_;            // id -> source, oldest first
  std::map<std::string, int> per_source_;              // unauthenticated connections by source
  std::map<uint64_t, std::string> authenticated_ids_;  // id -> source
  std::map<std::string, int> authenticated_per_source_;
  int authenticated_ = 0;
  // Evicted, not yet closed by their threads; at most max_unauthenticated.
  std::set<uint64_t> closing_;
  std::set<std::string> known_;
  // Pending connections in the known sources' reserve (never evicted); the
  // rest of pending_ is the shared pool.
  std::set<uint64_t> reserve_;
};

// Refusals as a few log lines: the first one after a quiet interval is
// logged at once with its detail (a misconfigured peer shows up right away);
// the rest are counted and summarised once per `interval` with counts by
// reason and the sources refused most. Lines read "<what>: refused a <noun>
// from ..." and "<what>: refused N <noun>s in the last ...". Not thread-safe.
class RefusalLog {
 public:
  explicit RefusalLog(absl::Duration interval, std::string what = "direct transport",
                      std::string noun = "connection")
      : interval_(interval), what_(std::move(what)), noun_(std::move(noun)) {}
  // Counts a refusal; the line to log now, if any: the first after a quiet
  // interval, or the summary when an interval has passed since the last
  // line (for callers that do not call Flush on a timer).
  std::optional<std::string> Note(RefusalReason reason, absl::string_view source,
                                  absl::string_view detail, absl::Time now);
  // The summary of what was counted since the last line, once `interval` has
  // passed since it.
  std::optional<std::string> Flush(absl::Time now);

 private:
  const absl::Duration interval_;
  const std::string what_, noun_;
  absl::Time last_line_ = absl::InfinitePast();
  uint64_t counts_[kRefusalReasons] = {};
  uint64_t total_ = 0;
  std::map<std::string, uint64_t> sources_;  // at most kMaxSources, then "other"
  std::string last_detail_;
  static constexpr size_t kMaxSources = 64;
};

// The refusals of one port, for the server that owns it: counted by reason
// (its stats), in a counter family labelled by reason when it has a
// registry, and logged through a RefusalLog. Not thread-safe: the server
// calls it under its own lock.
class RefusalCounter {
 public:
  explicit RefusalCounter(absl::Duration log_interval, std::string what = "direct transport",
                          std::string noun = "connection")
      : log_(log_interval, std::move(what), std::move(noun)) {}
  // Registers `metric` (a counter family with the label "reason", one
  // series per RefusalReason) on `registry`; a null registry, none.
  void Export(metrics::Registry* registry, const std::string& metric, const std::string& help);
  // Counts a refusal; the line to log now, if any (RefusalLog::Note). The
  // caller logs it after its lock.
  std::optional<std::string> Count(RefusalReason reason, absl::string_view source,
                                   absl::string_view detail, absl::Time now);
  std::optional<std::string> Flush(absl::Time now) { return log_.Flush(now); }
  uint64_t of(RefusalReason reason) const { return by_reason_[static_cast<int>(reason)]; }
  // The counts, into a server's stats: the total and by reason.
  void CopyTo(uint64_t* total, uint64_t (&by_reason)[kRefusalReasons]) const;

 private:
  RefusalLog log_;
  uint64_t by_reason_[kRefusalReasons] = {};
  metrics::Counter* metric_[kRefusalReasons] = {};
};

}  // namespace detour

#endif  // DETOUR_COMMON_NET_CONNECTION_ADMISSION_H_
