#include "common/net/connection_admission.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_join.h"
#include "common/net/address.h"

namespace detour {

const char* RefusalReasonLabel(RefusalReason reason) {
  switch (reason) {
    case RefusalReason::kSourceLimit: return "source_limit";
    case RefusalReason::kUnauthenticatedLimit: return "unauthenticated_limit";
    case RefusalReason::kConnectionLimit: return "connection_limit";
    case RefusalReason::kDeadline: return "deadline";
    case RefusalReason::kHandshake: return "handshake";
    case RefusalReason::kIdentity: return "identity";
    case RefusalReason::kPreface: return "preface";
    case RefusalReason::kSession: return "session";
  }
  return "unknown";
}

std::string ConnectionSource(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address == nullptr) return "unknown";
  if (address->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(address);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text)) == nullptr) return "unknown";
    return text;
  }
  if (address->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(address);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      in_addr v4;
      std::memcpy(&v4, &in6->sin6_addr.s6_addr[12], sizeof(v4));
      if (::inet_ntop(AF_INET, &v4, text, sizeof(text)) == nullptr) return "unknown";
      return text;
    }
    // One host usually holds a whole /64: count them together.
    in6_addr prefix = in6->sin6_addr;
    std::memset(&prefix.s6_addr[8], 0, 8);
    if (::inet_ntop(AF_INET6, &prefix, text, sizeof(text)) == nullptr) return "unknown";
    return absl::StrCat(text, "/64");
  }
  return "unknown";
}

std::optional<std::string> HostSource(absl::string_view host) {
  if (absl::ConsumePrefix(&host, "[") && !absl::ConsumeSuffix(&host, "]")) return std::nullopt;
  const std::string text(host);
  sockaddr_in v4{};
  if (::inet_pton(AF_INET, text.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    return ConnectionSource(reinterpret_cast<const sockaddr*>(&v4));
  }
  sockaddr_in6 v6{};
  if (::inet_pton(AF_INET6, text.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    return ConnectionSource(reinterpret_cast<const sockaddr*>(&v6));
  }
  return std::nullopt;
}

std::set<std::string> SourcesOfAddresses(const std::vector<std::string>& addresses) {
  std::set<std::string> sources;
  for (const std::string& address : addresses) {
    auto parsed = ParseHostPort(address, "peer address", /*allow_port_zero=*/false);
    if (!parsed.ok()) continue;
    if (std::optional<std::string> source = HostSource(parsed->host)) sources.insert(*source);
  }
  return sources;
}

ConnectionAdmission::ConnectionAdmission(AdmissionLimits limits) : limits_(limits) {}

ConnectionAdmission::Verdict ConnectionAdmission::Arrive(uint64_t id, const std::string& source) {
  Verdict verdict;
  const bool trusted_source = trusted(source);
  auto from_source = per_source_.find(source);
  if (!trusted_source && from_source != per_source_.end() &&
      from_source->second >= limits_.max_unauthenticated_per_source) {
    verdict.reason = RefusalReason::kSourceLimit;
    return verdict;
  }
  if (known(source) && reserved() < limits_.max_unauthenticated_known &&
      open() < limits_.max_connections) {
    reserve_.insert(id);
    pending_[id] = source;
    ++per_source_[source];
    verdict.admit = true;
    return verdict;
  }
  const bool full = unauthenticated() - reserved() >= limits_.max_unauthenticated ||
                    open() >= limits_.max_connections;
  if (full) {
    // Room is made only from unauthenticated connections outside the
    // reserve, and only while the evicted ones (whose threads are ending)
    // stay bounded.
    if (pending_.size() == reserve_.size()) {
      verdict.reason = RefusalReason::kConnectionLimit;
      return verdict;
    }
    const std::optional<uint64_t> victim = Victim(trusted_source);
    if (!victim.has_value() || closing() >= limits_.max_unauthenticated) {
      verdict.reason = RefusalReason::kUnauthenticatedLimit;
      return verdict;
    }
    auto it = pending_.find(*victim);
    if (--per_source_[it->second] == 0) per_source_.erase(it->second);
    pending_.erase(it);
    closing_.insert(*victim);
    verdict.evict = *victim;
  }
  pending_[id] = source;
  ++per_source_[source];
  verdict.admit = true;
  return verdict;
}

std::optional<uint64_t> ConnectionAdmission::Busiest(bool trusted_sources) const {
  // Counted outside the reserve, whose connections are never evicted.
  std::map<std::string, int> evictable;
  int most = 0;
  for (const auto& [id, source] : pending_) {
    if (reserve_.count(id) || trusted(source) != trusted_sources) continue;
    most = std::max(most, ++evictable[source]);
  }
  if (most == 0) return std::nullopt;
  for (const auto& [id, source] : pending_) {  // oldest first
    if (reserve_.count(id) || trusted(source) != trusted_sources) continue;
    if (evictable[source] == most) return id;
  }
  return std::nullopt;
}

std::optional<uint64_t> ConnectionAdmission::Victim(bool newcomer_trusted) const {
  if (std::optional<uint64_t> stranger = Busiest(/*trusted_sources=*/false)) return stranger;
  // Only trusted sources handshake: a stranger waits, a trusted newcomer
  // takes the oldest slot of the busiest of them.
  if (!newcomer_trusted) return std::nullopt;
  return Busiest(/*trusted_sources=*/true);
}

bool ConnectionAdmission::Authenticate(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return false;
  const std::string source = it->second;
  if (--per_source_[source] == 0) per_source_.erase(source);
  pending_.erase(it);
  reserve_.erase(id);
  ++authenticated_per_source_[source];
  authenticated_ids_[id] = source;
  ++authenticated_;
  return true;
}

bool ConnectionAdmission::Closed(uint64_t id) {
  if (closing_.erase(id) > 0) return true;
  if (auto it = authenticated_ids_.find(id); it != authenticated_ids_.end()) {
    if (--authenticated_per_source_[it->second] == 0) authenticated_per_source_.erase(it->second);
    authenticated_ids_.erase(it);
    --authenticated_;
    return false;
  }
  auto it = pending_.find(id);
  if (it != pending_.end()) {
    if (--per_source_[it->second] == 0) per_source_.erase(it->second);
    pending_.erase(it);
    reserve_.erase(id);
  }
  return false;
}

std::optional<std::string> RefusalLog::Note(RefusalReason reason, absl::string_view source,
                                            absl::string_view detail, absl::Time now) {
  const bool quiet = total_ == 0 && now - last_line_ >= interval_;
  if (quiet) {
    last_line_ = now;
    return absl::StrCat(
        what_, ": refused a ", noun_, " from ", source, " (", RefusalReasonLabel(reason),
        "): ", detail, "; further refusals are summarised every ", absl::FormatDuration(interval_));
  }
  ++counts_[static_cast<int>(reason)];
  ++total_;
  std::string key(source);
  if (sources_.count(key) == 0 && sources_.size() >= kMaxSources) key = "other";
  ++sources_[key];
  last_detail_ = absl::StrCat(source, " (", RefusalReasonLabel(reason), "): ", detail);
  return Flush(now);
}

std::optional<std::string> RefusalLog::Flush(absl::Time now) {
  if (total_ == 0 || now - last_line_ < interval_) return std::nullopt;
  std::vector<std::string> reasons;
  for (int r = 0; r < kRefusalReasons; ++r) {
    if (counts_[r] == 0) continue;
    reasons.push_back(
        absl::StrCat(RefusalReasonLabel(static_cast<RefusalReason>(r)), " ", counts_[r]));
  }
  std::vector<std::pair<uint64_t, std::string>> by_count;
  for (const auto& [source, count] : sources_) by_count.emplace_back(count, source);
  std::sort(by_count.begin(), by_count.end(), std::greater<>());
  if (by_count.size() > 3) by_count.resize(3);
  std::vector<std::string> top;
  for (const auto& [count, source] : by_count) top.push_back(absl::StrCat(source, " ", count));
  std::string line =
      absl::StrCat(what_, ": refused ", total_, " ", noun_, total_ == 1 ? "" : "s", " in the last ",
                   absl::FormatDuration(now - last_line_), " (", absl::StrJoin(reasons, ", "),
                   "); most from ", absl::StrJoin(top, ", "), "; the last: ", last_detail_);
  last_line_ = now;
  total_ = 0;
  std::fill(std::begin(counts_), std::end(counts_), 0);
  sources_.clear();
  last_detail_.clear();
  return line;
}

void RefusalCounter::Export(metrics::Registry* registry, const std::string& metric,
                            const std::string& help) {
  if (registry == nullptr) return;
  auto family = registry->AddCounter(metric, help, {"reason"});
  if (!family.ok()) return;
  for (int r = 0; r < kRefusalReasons; ++r) {
    auto counter = (*family)->WithLabels({RefusalReasonLabel(static_cast<RefusalReason>(r))});
    if (counter.ok()) metric_[r] = *counter;
  }
}

void RefusalCounter::CopyTo(uint64_t* total, uint64_t (&by_reason)[kRefusalReasons]) const {
  *total = 0;
  for (int r = 0; r < kRefusalReasons; ++r) {
    by_reason[r] = by_reason_[r];
    *total += by_reason_[r];
  }
}

std::optional<std::string> RefusalCounter::Count(RefusalReason reason, absl::string_view source,
                                                 absl::string_view detail, absl::Time now) {
  ++by_reason_[static_cast<int>(reason)];
  if (metric_[static_cast<int>(reason)] != nullptr) metric_[static_cast<int>(reason)]->Increment();
  return log_.Note(reason, source, detail, now);
}

}  // namespace detour
