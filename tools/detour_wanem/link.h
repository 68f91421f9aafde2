// The model of one direction of one emulated WAN link (src -> dst): a cut
// switch, a serialization queue with drop-tail, random loss, and a delay with
// bounded jitter. Pure arithmetic on a caller-supplied clock, no I/O, so it is
// tested without TUN devices (tests/wanem/link_test.cc). Thread-compatible.
#ifndef DETOUR_TOOLS_DETOUR_WANEM_LINK_H_
#define DETOUR_TOOLS_DETOUR_WANEM_LINK_H_

#include <cstdint>

namespace detour::wanem {

// Small deterministic generator (SplitMix64). One per link: a link's loss and
// jitter draws then depend only on the seed and that link's own traffic, not
// on what other links carry.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double NextUnit() { return static_cast<double>(Next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_;
};

// What a link does to the packets it carries. The ranges are enforced by the
// control parser (control.h) and by LinkTable.
struct LinkParams {
  // One-way propagation delay, as the cluster spec's latency_ms.
  double delay_ms = 0;
  // Extra delay drawn uniformly from [0, jitter_ms] per packet; delay_ms is
  // therefore the floor. Packets keep their order unless `reorder`.
  double jitter_ms = 0;
  // Serialization rate in bytes per second; 0 means unlimited (no queue).
  double rate_bytes_per_s = 0;
  // Probability that a packet is lost after it was serialized.
  double loss = 0;
  // Drop-tail limit of the serialization queue in bytes; 0 means automatic:
  // max(bandwidth-delay product over the round trip, queue_floor_bytes).
  int64_t queue_bytes = 0;
  // Lets jitter reorder packets (a later packet may overtake an earlier one).
  bool reorder = false;
  // Drops everything while set.
  bool cut = false;
};

struct LinkStats {
  uint64_t admitted_packets = 0;
  uint64_t admitted_bytes = 0;
  // Counted by the forwarder when the packet was written to the destination.
  uint64_t delivered_packets = 0;
  uint64_t delivered_bytes = 0;
  uint64_t dropped_loss = 0;
  uint64_t dropped_cut = 0;
  uint64_t dropped_queue = 0;
};

class Link {
 public:
  enum class Outcome { kForward, kDropCut, kDropQueue, kDropLoss };
  struct Verdict {
    Outcome outcome;
    // When the packet reaches the destination; set for kForward only.
    int64_t release_ns;
  };

  Link(uint64_t seed, int64_t queue_floor_bytes)
      : rng_(seed), queue_floor_bytes_(queue_floor_bytes) {}

  // Takes effect for the next packet; packets already admitted keep their
  // release times, and with !reorder no later packet is released before them.
  void SetParams(const LinkParams& params) { params_ = params; }
  const LinkParams& params() const { return params_; }

  // The drop-tail limit in force (queue_bytes, or the automatic one).
  int64_t QueueLimitBytes() const;
  // Bytes admitted but not yet serialized at `now_ns`.
  int64_t BacklogBytes(int64_t now_ns) const;

  // Decides the fate of a packet of `bytes` arriving at `now_ns` (a monotonic
  // clock in nanoseconds, non-decreasing across calls) and updates the stats.
  // Order: cut, then the queue limit, then serialization (the packet occupies
  // the link from max(now, link free) for bytes / rate), then loss (a lost
  // packet still used the link, as on a real wire), then delay and jitter.
  Verdict Admit(int64_t now_ns, int64_t bytes);

  LinkStats& stats() { return stats_; }
  const LinkStats& stats() const { return stats_; }

 private:
  LinkParams params_;
  LinkStats stats_;
  SplitMix64 rng_;
  int64_t queue_floor_bytes_;
  // When the last admitted packet finishes serializing.
  int64_t link_free_ns_ = 0;
  int64_t last_release_ns_ = 0;
};

}  // namespace detour::wanem

#endif  // DETOUR_TOOLS_DETOUR_WANEM_LINK_H_
