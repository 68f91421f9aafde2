// What one link's bulk probes may take, known to both sides of a probe
// round: the coordinator sizes the bulk round's budget by the neediest
// worker's links, and a worker splits that budget among its links by the
// same measure. A TCP window opens over round trips, so a link needs
// kLinkProbeRoundTrips of them beyond kLinkProbeBase.
#ifndef DETOUR_COMMON_LINK_PROBE_NEED_H_
#define DETOUR_COMMON_LINK_PROBE_NEED_H_

#include <optional>

#include "absl/time/time.h"

namespace detour {

inline constexpr absl::Duration kLinkProbeBase = absl::Seconds(1);
inline constexpr int kLinkProbeRoundTrips = 60;

// The need of a link whose round trip is `rtt_s` seconds; one whose round
// trip is unknown (it did not answer a ping) needs the base only: its bulk
// probes end at the first failure.
inline absl::Duration LinkProbeNeed(std::optional<double> rtt_s) {
  if (!rtt_s.has_value() || !(*rtt_s > 0)) return kLinkProbeBase;
  return kLinkProbeBase + kLinkProbeRoundTrips * absl::Seconds(*rtt_s);
}

}  // namespace detour

#endif  // DETOUR_COMMON_LINK_PROBE_NEED_H_
