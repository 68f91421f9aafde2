#include "coordinator/link_matrix.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace detour {

void LinkMatrix::Ranges::AddLatency(double s) {
  min_latency_s = latencies == 0 ? s : std::min(min_latency_s, s);
  max_latency_s = latencies == 0 ? s : std::max(max_latency_s, s);
  ++latencies;
}

void LinkMatrix::Ranges::AddRate(double bytes_per_s) {
  min_rate = rates == 0 ? bytes_per_s : std::min(min_rate, bytes_per_s);
  max_rate = rates == 0 ? bytes_per_s : std::max(max_rate, bytes_per_s);
  ++rates;
}

void LinkMatrix::Ranges::Merge(const Ranges& other) {
  if (other.latencies > 0) {
    min_latency_s =
        latencies == 0 ? other.min_latency_s : std::min(min_latency_s, other.min_latency_s);
    max_latency_s =
        latencies == 0 ? other.max_latency_s : std::max(max_latency_s, other.max_latency_s);
    latencies += other.latencies;
  }
  if (other.rates > 0) {
    min_rate = rates == 0 ? other.min_rate : std::min(min_rate, other.min_rate);
    max_rate = rates == 0 ? other.max_rate : std::max(max_rate, other.max_rate);
    rates += other.rates;
  }
}

LinkMatrix::Applied LinkMatrix::AddReport(const std::string& from, const v1::LinkReport& report,
                                          const std::set<std::string>& peers, absl::Time now) {
  Applied applied;
  std::set<std::string> seen;
  for (const v1::LinkMeasurement& m : report.links()) {
    if (m.peer() == from || !peers.count(m.peer()) || !seen.insert(m.peer()).second) {
      ++applied.rejected;
      continue;
    }
    Entry& e = entries_[{from, m.peer()}];
    e.probe_time = now;
    const double rtt = m.rtt_seconds();
    const double rate = m.bandwidth_bytes_per_s();
    const bool rtt_ok = std::isfinite(rtt) && rtt > 0 && rtt <= kMaxRttSeconds;
    const bool rate_ok = std::isfinite(rate) && rate > 0 && rate <= kMaxBytesPerS;
    if ((rtt != 0 && !rtt_ok) || (rate != 0 && !rate_ok)) ++applied.rejected;
    if (rtt_ok) {
      e.latency_s = rtt / 2;
      e.latency_source = v1::JobLink::SOURCE_PROBE;
      e.latency_time = now;
      applied.answered.push_back(m.peer());
      applied.measured.AddLatency(*e.latency_s);
    }
    if (rate_ok) {
      e.bandwidth = rate;
      e.probed_bandwidth = rate;
      e.bandwidth_source = v1::JobLink::SOURCE_PROBE;
      e.bandwidth_time = now;
      applied.measured.AddRate(rate);
    }
    // Bounded like any string a peer sends.
    e.probe_error = m.error().substr(0, 512);
    if (!m.error().empty() && !rtt_ok) applied.failed.push_back(m.peer());
  }
  return applied;
}

void LinkMatrix::Fitted(const Link& link, double bytes_per_s, absl::Time now) {
  if (!std::isfinite(bytes_per_s) || bytes_per_s <= 0 || bytes_per_s > kMaxBytesPerS) return;
  Entry& e = entries_[link];
  e.bandwidth = bytes_per_s;
  e.bandwidth_source = v1::JobLink::SOURCE_TRAFFIC;
  e.bandwidth_time = now;
}

LinkMatrix::TrafficShare LinkMatrix::ProbeTrafficShare() const {
  std::vector<double> shares;
  for (const auto& [link, e] : entries_) {
    if (e.bandwidth_source != v1::JobLink::SOURCE_TRAFFIC || !e.bandwidth || !e.probed_bandwidth ||
        !(*e.probed_bandwidth > 0)) {
      continue;
    }
    shares.push_back(*e.bandwidth / *e.probed_bandwidth);
  }
  TrafficShare out;
  out.links = static_cast<int>(shares.size());
  if (shares.empty()) return out;
  std::sort(shares.begin(), shares.end());
  out.low = shares.front();
  out.high = shares.back();
  if (out.links < kMinShareLinks) return out;
  out.share = std::clamp(shares[shares.size() / 2], kMinTrafficShare, 1.0);
  return out;
}

void LinkMatrix::Forget(const std::string& id) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    it = it->first.first == id || it->first.second == id ? entries_.erase(it) : std::next(it);
  }
}

const LinkMatrix::Entry* LinkMatrix::Find(const Link& link) const {
  auto it = entries_.find(link);
  return it == entries_.end() ? nullptr : &it->second;
}

}  // namespace detour
