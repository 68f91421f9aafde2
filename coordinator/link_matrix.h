// What a running job knows of the links between its workers beyond the
// cluster's region table: for each ordered pair, the latency and bandwidth
// measured by link probes (LinkReport) or fitted to the job's own transfers,
// with when, and the last probe's error. The planner lays these over the
// region table's figures (RunnerPlanner::BuildCostModel); the table only
// seeds what was never measured (docs/RUNTIME.md §"Measured links").
// No I/O; thread-compatible.
#ifndef DETOUR_COORDINATOR_LINK_MATRIX_H_
#define DETOUR_COORDINATOR_LINK_MATRIX_H_

#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/job_service.pb.h"

namespace detour {

class LinkMatrix {
 public:
  using Link = std::pair<std::string, std::string>;  // (from, to)

  // Bounds on what a report may claim: a round trip in (0, kMaxRttSeconds],
  // a rate in (0, kMaxBytesPerS]. Anything else is ignored (and counted).
  static constexpr double kMaxRttSeconds = 60;
  static constexpr double kMaxBytesPerS = 1e13;

  struct Entry {
    std::optional<double> latency_s;  // one way
    v1::JobLink::Source latency_source = v1::JobLink::SOURCE_REGION_TABLE;
    absl::Time latency_time = absl::InfinitePast();
    std::optional<double> bandwidth;  // bytes/s
    v1::JobLink::Source bandwidth_source = v1::JobLink::SOURCE_REGION_TABLE;
    absl::Time bandwidth_time = absl::InfinitePast();
    // The last fit's time on the wire, in round trips (Fitted).
    std::optional<double> round_trips;
    std::string probe_error;
    absl::Time probe_time = absl::InfinitePast();  // last report about it
  };

  // How many links reports measured, and the ranges of what they measured
  // (one-way latency, bandwidth); the ranges are 0 while their count is.
  struct Ranges {
    int latencies = 0;
    double min_latency_s = 0, max_latency_s = 0;
    int rates = 0;
    double min_rate = 0, max_rate = 0;  // bytes/s

    void AddLatency(double s);
    void AddRate(double bytes_per_s);
    void Merge(const Ranges& other);
  };

  // Applies `from`'s report; measurements about peers not in `peers` (the
  // ones it was asked about) are ignored. Latency is half the round trip.
  // Returns the peers whose link answered (latency measured) this time.
  struct Applied {
    std::vector<std::string> answered;
    std::vector<std::string> failed;  // the probe reported an error
    int rejected = 0;                 // out of bounds or not asked about
    Ranges measured;                  // what this report measured
  };
  Applied AddReport(const std::string& from, const v1::LinkReport& report,
                    const std::set<std::string>& peers, absl::Time now);
  // The bandwidth that makes the job's own transfers last what they took,
  // and what they took on the wire (beyond the way there and the
  // acknowledgement's way back) in the link's round trips: `round_trips`,
  // ignored unless finite, positive and at most kMaxRoundTrips.
  void Fitted(const Link& link, double bytes_per_s, double round_trips, absl::Time now);

  // How long the job's transfers stay on the wire, in round trips: the
  // median over the links whose bandwidth is fitted to the transfers (0
  // with fewer than kMinFitLinks), with how many and their spread. On the
  // WAN test bed a 64 KiB activation took 0.2-2.4 round trips (median 0.5)
  // beyond the first, however fast a probe had measured its link: the
  // windows, not the link's rate, set it. A link known by probes only (its
  // rate, or only its round trip) is planned by it (PlannedProbeRate).
  struct TransferRounds {
    double round_trips = 0;
    int links = 0;
    double low = 0, high = 0;  // the lowest and highest link's
  };
  static constexpr int kMinFitLinks = 3;
  static constexpr double kMaxRoundTrips = 1000;
  TransferRounds TransferRoundTrips() const;
  // The rate to plan a link known by probes only at, for transfers of
  // `bytes`: they take `probed` (the probe's rate, or the region table's for
  // a link whose bulk probe never finished) or `round_trips` of the link's
  // round trip `rtt_s`, whichever is slower. `probed` when either is unknown.
  static double PlannedProbeRate(double probed, double bytes, double rtt_s, double round_trips);
  // `id` left: its links go.
  void Forget(const std::string& id);

  const std::map<Link, Entry>& entries() const { return entries_; }
  const Entry* Find(const Link& link) const;

  // A finished probe round.
  void RoundDone(absl::Time now) {
    ++rounds_;
    last_round_ = now;
  }
  uint64_t rounds() const { return rounds_; }
  absl::Time last_round() const { return last_round_; }

 private:
  std::map<Link, Entry> entries_;
  uint64_t rounds_ = 0;
  absl::Time last_round_ = absl::InfinitePast();
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_LINK_MATRIX_H_
