#include "common/net/shutdown_signal.h"

#include <signal.h>
#include <time.h>

#include <cerrno>
#include <mutex>

namespace detour {
namespace {

sigset_t ShutdownSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

}  // namespace

void IgnoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] { signal(SIGPIPE, SIG_IGN); });
}

void BlockShutdownSignals() {
  sigset_t set = ShutdownSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A closed peer must surface as an error on write, not kill the process.
  signal(SIGPIPE, SIG_IGN);
}

int WaitForShutdownSignal(absl::Duration timeout) {
  sigset_t set = ShutdownSet();
  timespec ts = absl::ToTimespec(timeout);
  while (true) {
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
    if (errno == EAGAIN) return 0;
    if (errno != EINTR) return 0;
  }
}

}  // namespace detour
