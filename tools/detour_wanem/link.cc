#include "tools/detour_wanem/link.h"

#include <algorithm>
#include <cmath>

namespace detour::wanem {
namespace {

constexpr double kNsPerMs = 1e6;
constexpr double kNsPerS = 1e9;

}  // namespace

int64_t Link::QueueLimitBytes() const {
  if (params_.queue_bytes > 0) return params_.queue_bytes;
  // A queue of one round trip's worth of bytes lets a single TCP flow keep
  // the link busy; the floor keeps short links from dropping small bursts.
  const double bdp = params_.rate_bytes_per_s * 2.0 * params_.delay_ms / 1e3;
  return std::max(queue_floor_bytes_, static_cast<int64_t>(bdp));
}

int64_t Link::BacklogBytes(int64_t now_ns) const {
  if (params_.rate_bytes_per_s <= 0 || link_free_ns_ <= now_ns) return 0;
  return static_cast<int64_t>(
      std::ceil(static_cast<double>(link_free_ns_ - now_ns) * params_.rate_bytes_per_s / kNsPerS));
}

Link::Verdict Link::Admit(int64_t now_ns, int64_t bytes) {
  if (params_.cut) {
    ++stats_.dropped_cut;
    return {Outcome::kDropCut, 0};
  }
  int64_t sent_ns = now_ns;
  if (params_.rate_bytes_per_s > 0) {
    if (BacklogBytes(now_ns) + bytes > QueueLimitBytes()) {
      ++stats_.dropped_queue;
      return {Outcome::kDropQueue, 0};
    }
    const int64_t start = std::max(now_ns, link_free_ns_);
    const auto serialize_ns = static_cast<int64_t>(
        std::ceil(static_cast<double>(bytes) * kNsPerS / params_.rate_bytes_per_s));
    link_free_ns_ = start + serialize_ns;
    sent_ns = link_free_ns_;
  }
  if (params_.loss > 0 && rng_.NextUnit() < params_.loss) {
    ++stats_.dropped_loss;
    return {Outcome::kDropLoss, 0};
  }
  double delay_ns = params_.delay_ms * kNsPerMs;
  if (params_.jitter_ms > 0) delay_ns += rng_.NextUnit() * params_.jitter_ms * kNsPerMs;
  int64_t release = sent_ns + static_cast<int64_t>(delay_ns);
  if (!params_.reorder) release = std::max(release, last_release_ns_);
  last_release_ns_ = std::max(last_release_ns_, release);
  ++stats_.admitted_packets;
  stats_.admitted_bytes += static_cast<uint64_t>(bytes);
  return {Outcome::kForward, release};
}

}  // namespace detour::wanem
