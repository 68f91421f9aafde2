// The newest leader term a worker has seen from coordinators that elect a
// leader over etcd. A message of an older term comes from a deposed leader
// (paused past its lease, cut off from etcd) and must not be obeyed; term 0
// means no election and is always admitted. Thread-safe, lock-free.
#ifndef DETOUR_WORKER_TERM_FENCE_H_
#define DETOUR_WORKER_TERM_FENCE_H_

#include <atomic>
#include <cstdint>

namespace detour {

class TermFence {
 public:
  // True when a message of `term` may be obeyed; a newer term becomes the
  // newest. False (counted) for a term older than the newest seen, and for
  // a negative one.
  bool Admit(int64_t term) {
    if (term == 0) return true;
    if (term < 0) {
      refused_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    int64_t newest = newest_.load(std::memory_order_acquire);
    while (term > newest) {
      if (newest_.compare_exchange_weak(newest, term, std::memory_order_acq_rel)) return true;
    }
    if (term == newest) return true;
    refused_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }

  int64_t newest() const { return newest_.load(std::memory_order_acquire); }
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> newest_{0};
  std::atomic<uint64_t> refused_{0};
};

}  // namespace detour

#endif  // DETOUR_WORKER_TERM_FENCE_H_
