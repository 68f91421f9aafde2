// Happens-before edges that ThreadSanitizer cannot see because they run
// through uninstrumented libraries (gRPC's completion queues and slice
// reference counts): a reactor's serial reactions on different gRPC threads,
// a slice's release callback. Marking them keeps the TSan build quiet without
// suppressing reports in our code. No-ops (and no cost) in other builds.
#ifndef DETOUR_COMMON_TSAN_H_
#define DETOUR_COMMON_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#define DETOUR_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DETOUR_TSAN 1
#endif
#endif

#ifdef DETOUR_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
// What this thread did so far happens before a later DETOUR_HAPPENS_AFTER on
// the same address.
#define DETOUR_HAPPENS_BEFORE(addr) \
  __tsan_release(const_cast<void*>(static_cast<const volatile void*>(addr)))
#define DETOUR_HAPPENS_AFTER(addr) \
  __tsan_acquire(const_cast<void*>(static_cast<const volatile void*>(addr)))
#else
#define DETOUR_HAPPENS_BEFORE(addr) ((void)(addr))
#define DETOUR_HAPPENS_AFTER(addr) ((void)(addr))
#endif

namespace detour {

// Marks the end of a gRPC reaction: everything it did happens before a
// DETOUR_HAPPENS_AFTER(addr) — OnDone's, which gRPC runs only after every
// reaction has returned. Put it first in the reaction: it releases on every
// way out.
class ReactionEnd {
 public:
  explicit ReactionEnd(const void* addr) : addr_(addr) {}
  ~ReactionEnd() { DETOUR_HAPPENS_BEFORE(addr_); }
  ReactionEnd(const ReactionEnd&) = delete;
  ReactionEnd& operator=(const ReactionEnd&) = delete;

 private:
  const void* addr_;
};

}  // namespace detour

#endif  // DETOUR_COMMON_TSAN_H_
