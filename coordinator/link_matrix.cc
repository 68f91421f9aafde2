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

void LinkMatrix::Fitted(const Link& link, double bytes_per_s, double round_trips, absl::Time now) {
  if (!std::isfinite(bytes_per_s) || bytes_per_s <= 0 || bytes_per_s > kMaxBytesPerS) return;
  Entry& e = entries_[link];
  e.bandwidth = bytes_per_s;
  e.bandwidth_source = v1::JobLink::SOURCE_TRAFFIC;
  e.bandwidth_time = now;
  if (std::isfinite(round_trips) && round_trips > 0 && round_trips <= kMaxRoundTrips) {
    e.round_trips = round_trips;
  } else {
    e.round_trips.reset();
  }
}

LinkMatrix::TransferRounds LinkMatrix::TransferRoundTrips() const {
  std::vector<double> rounds;
  for (const auto& [link, e] : entries_) {
    if (e.bandwidth_source == v1::JobLink::SOURCE_TRAFFIC && e.round_trips) {
      rounds.push_back(*e.round_trips);
    }
  }
  TransferRounds out;
  out.links = static_cast<int>(rounds.size());
  if (rounds.empty()) return out;
  std::sort(rounds.begin(), rounds.end());
  out.low = rounds.front();
  out.high = rounds.back();
  if (out.links >= kMinFitLinks) out.round_trips = rounds[rounds.size() / 2];
  return out;
}

double LinkMatrix::PlannedProbeRate(double probed, double bytes, double rtt_s, double round_trips) {
  if (!(probed > 0) || !(bytes > 0) || !(rtt_s > 0) || !(round_trips > 0)) return probed;
  return bytes / std::max(bytes / probed, round_trips * rtt_s);
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
