// SIGTERM/SIGINT handling for daemons, and SIGPIPE ignored (IgnoreSigpipe).
// Block the signals in every thread by calling BlockShutdownSignals() first
// thing in main (threads inherit the mask), then wait for one on the main
// thread with WaitForShutdownSignal.
// No async-signal handler runs, so nothing unsafe happens in signal context.
#ifndef DETOUR_COMMON_NET_SHUTDOWN_SIGNAL_H_
#define DETOUR_COMMON_NET_SHUTDOWN_SIGNAL_H_

#include "absl/time/time.h"

namespace detour {

void BlockShutdownSignals();

// A peer that went away must fail a write to its socket, not kill the
// process with SIGPIPE: OpenSSL writes to a direct connection's socket with
// write(2), handshakes included (both ends of the direct transport call this
// before they open a connection). Sets SIGPIPE to be ignored, once per
// process; BlockShutdownSignals does so too.
void IgnoreSigpipe();

// Returns the signal number received (SIGTERM, SIGINT), or 0 when `timeout`
// passed without one.
int WaitForShutdownSignal(absl::Duration timeout);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_SHUTDOWN_SIGNAL_H_
