// What one link's bulk probes may take, known to both sides of a probe
// round: the coordinator sizes the bulk round's budget by the neediest
// worker's links, and a worker splits that budget among its links by the
// same measure. A TCP window opens over round trips, so a link needs
// kLinkProbeRoundTrips of them beyond kLinkProbeBase; and the probes that
// measure it as a stream (kLinkProbeStreamProbes of the round's largest
// size) take their bytes' time at the rate the link is expected to carry.
#ifndef DETOUR_COMMON_LINK_PROBE_NEED_H_
#define DETOUR_COMMON_LINK_PROBE_NEED_H_

#include <algorithm>
#include <cstdint>
#include <optional>

#include "absl/time/time.h"

namespace detour {

inline constexpr absl::Duration kLinkProbeBase = absl::Seconds(1);
inline constexpr int kLinkProbeRoundTrips = 60;
// The striped probe that opens the windows and the stream's five.
inline constexpr int kLinkProbeStreamProbes = 6;
// No link needs more (a rate expected near zero would otherwise take every
// other link's share).
inline constexpr absl::Duration kMaxLinkProbeNeed = absl::Seconds(120);

// The need of a link whose round trip is `rtt_s` seconds and whose expected
// rate is `rate` bytes/s (none: unknown), probed with probes of up to
// `bulk_bytes`. A link whose round trip is unknown (it did not answer a
// ping) needs the base only: its bulk probes end at the first failure.
inline absl::Duration LinkProbeNeed(std::optional<double> rtt_s,
                                    std::optional<double> rate = std::nullopt,
                                    uint64_t bulk_bytes = 0) {
  if (!rtt_s.has_value() || !(*rtt_s > 0)) return kLinkProbeBase;
  absl::Duration need = kLinkProbeBase + kLinkProbeRoundTrips * absl::Seconds(*rtt_s);
  if (rate.has_value() && *rate > 0 && bulk_bytes > 0) {
    need +=
        absl::Seconds(std::min(absl::ToDoubleSeconds(kMaxLinkProbeNeed),
                               kLinkProbeStreamProbes * static_cast<double>(bulk_bytes) / *rate));
  }
  return std::min(need, kMaxLinkProbeNeed);
}

}  // namespace detour

#endif  // DETOUR_COMMON_LINK_PROBE_NEED_H_
