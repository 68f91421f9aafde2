// ThreadSanitizer builds only (tools/checks.sh tsan): makes abseil's
// synchronisation visible to TSan. Debian's abseil is not built with
// -fsanitize=thread, so absl::Mutex, CondVar and Notification do their work
// in uninstrumented code and TSan sees no happens-before through them: every
// access guarded by an absl::Mutex looked like a race (hundreds per run),
// which is why broad suppressions hid them all, our own races included.
//
// This file, linked into each test executable of the TSan build, defines the
// exported entry points of those classes. Calls from our code and from the
// other shared libraries (gRPC locks absl::Mutex too) bind to these
// definitions before the library's; each calls the library's own function
// (dlsym RTLD_NEXT) and tells TSan what it means: releasing a mutex
// publishes, acquiring it observes (__tsan_release / __tsan_acquire on the
// mutex's address); a wait releases and re-acquires; Notify publishes and a
// completed wait observes. Only happens-before is modelled (no lock-order
// checking), which is all TSan needs to stop reporting correct code.
//
// Not covered: Notification::HasBeenNotified() (inline in the header, it
// reads an atomic the uninstrumented Notify() wrote), so data published by
// Notify() and read after a true HasBeenNotified() would still be reported.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);

namespace {

template <typename F>
F Real(const char* symbol) {
  void* p = dlsym(RTLD_NEXT, symbol);
  if (p == nullptr) {
    std::fprintf(stderr, "absl_sync_annotations: %s not found\n", symbol);
    std::abort();
  }
  return reinterpret_cast<F>(p);
}

// The library's function behind one of ours, looked up once.
#define DETOUR_REAL(type, symbol)              \
  static const auto real = Real<type>(symbol); \
  (void)0

void* Key(const void* p) { return const_cast<void*>(p); }

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

void Mutex::Lock() {
  DETOUR_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex4LockEv");
  real(this);
  __tsan_acquire(this);
}

void Mutex::ReaderLock() {
  DETOUR_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex10ReaderLockEv");
  real(this);
  __tsan_acquire(this);
}

bool Mutex::TryLock() {
  DETOUR_REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex7TryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

bool Mutex::ReaderTryLock() {
  DETOUR_REAL(bool (*)(Mutex*), "_ZN4absl7debian35Mutex13ReaderTryLockEv");
  const bool locked = real(this);
  if (locked) __tsan_acquire(this);
  return locked;
}

void Mutex::Unlock() {
  DETOUR_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex6UnlockEv");
  __tsan_release(this);
  real(this);
}

void Mutex::ReaderUnlock() {
  DETOUR_REAL(void (*)(Mutex*), "_ZN4absl7debian35Mutex12ReaderUnlockEv");
  __tsan_release(this);
  real(this);
}

void Mutex::LockWhen(const Condition& cond) {
  DETOUR_REAL(void (*)(Mutex*, const Condition&),
              "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  real(this, cond);
  __tsan_acquire(this);
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  DETOUR_REAL(void (*)(Mutex*, const Condition&),
              "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  real(this, cond);
  __tsan_acquire(this);
}

bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  DETOUR_REAL(bool (*)(Mutex*, const Condition&, Duration),
              "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const bool met = real(this, cond, timeout);
  __tsan_acquire(this);  // held either way
  return met;
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  DETOUR_REAL(bool (*)(Mutex*, const Condition&, Time),
              "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const bool met = real(this, cond, deadline);
  __tsan_acquire(this);
  return met;
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  DETOUR_REAL(bool (*)(Mutex*, const Condition&, Duration),
              "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  const bool met = real(this, cond, timeout);
  __tsan_acquire(this);
  return met;
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  DETOUR_REAL(bool (*)(Mutex*, const Condition&, Time),
              "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  const bool met = real(this, cond, deadline);
  __tsan_acquire(this);
  return met;
}

// Await releases the mutex while it waits and holds it again on return.
void Mutex::Await(const Condition& cond) {
  DETOUR_REAL(void (*)(Mutex*, const Condition&), "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  __tsan_release(this);
  real(this, cond);
  __tsan_acquire(this);
}

bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  DETOUR_REAL(bool (*)(Mutex*, const Condition&, Duration),
              "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  __tsan_release(this);
  const bool met = real(this, cond, timeout);
  __tsan_acquire(this);
  return met;
}

bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  DETOUR_REAL(bool (*)(Mutex*, const Condition&, Time),
              "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  __tsan_release(this);
  const bool met = real(this, cond, deadline);
  __tsan_acquire(this);
  return met;
}

void CondVar::Wait(Mutex* mu) {
  DETOUR_REAL(void (*)(CondVar*, Mutex*), "_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  __tsan_release(mu);
  real(this, mu);
  __tsan_acquire(mu);
}

bool CondVar::WaitWithTimeout(Mutex* mu, Duration timeout) {
  DETOUR_REAL(bool (*)(CondVar*, Mutex*, Duration),
              "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, timeout);
  __tsan_acquire(mu);
  return timed_out;
}

bool CondVar::WaitWithDeadline(Mutex* mu, Time deadline) {
  DETOUR_REAL(bool (*)(CondVar*, Mutex*, Time),
              "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  __tsan_release(mu);
  const bool timed_out = real(this, mu, deadline);
  __tsan_acquire(mu);
  return timed_out;
}

void Notification::Notify() {
  DETOUR_REAL(void (*)(Notification*), "_ZN4absl7debian312Notification6NotifyEv");
  __tsan_release(this);
  real(this);
}

void Notification::WaitForNotification() const {
  DETOUR_REAL(void (*)(const Notification*),
              "_ZNK4absl7debian312Notification19WaitForNotificationEv");
  real(this);
  __tsan_acquire(Key(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  DETOUR_REAL(bool (*)(const Notification*, Duration),
              "_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified) __tsan_acquire(Key(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  DETOUR_REAL(bool (*)(const Notification*, Time),
              "_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified) __tsan_acquire(Key(this));
  return notified;
}

ABSL_NAMESPACE_END
}  // namespace absl
