// The time a component reads, so that tests can move it: Clock::Real() is
// absl::Now(); FakeClock stands still until the test advances it. Code that
// decides by time (deadlines, back-off, suspicion) reads a Clock; waiting
// itself still happens in real time slices, so a FakeClock shortens a
// timeout to the next slice, not to nothing. Thread-safe.
#ifndef DETOUR_COMMON_CLOCK_H_
#define DETOUR_COMMON_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace detour {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // absl::Now(); lives for the whole program.
  static const Clock& Real();
};

class FakeClock : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'800'000'000)) : now_(start) {}
  absl::Time Now() const override;
  void Advance(absl::Duration d);

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detour

#endif  // DETOUR_COMMON_CLOCK_H_
