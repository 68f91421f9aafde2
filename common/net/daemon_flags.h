// What every detour daemon's main() shares: the common flags (--log_level,
// --version, --metrics_port, --drain_timeout, --ready_file), their checks
// after parsing, and waiting for SIGTERM/SIGINT. Main-thread only.
#ifndef DETOUR_COMMON_NET_DAEMON_FLAGS_H_
#define DETOUR_COMMON_NET_DAEMON_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/flags.h"

namespace detour {

struct DaemonFlags {
  std::string log_level = "info";
  bool version = false;
  int64_t metrics_port = 0;  // set the daemon's default before Register
  // Extra words for --metrics_port's help (e.g. how the default is derived).
  std::string metrics_port_note;
  absl::Duration drain_timeout = absl::Seconds(10);
  std::string ready_file;

  // Declares the flags; `ready_fields` lists what the ready file holds.
  void Register(FlagSet* flags, const std::string& ready_fields);

  // Runs after FlagSet::Parse: prints the version, refuses positional
  // arguments, applies --log_level (naming `component` in log lines) and
  // checks --metrics_port. Returns the exit code to stop with, or -1 to go on.
  int Apply(const FlagSet& flags, const absl::StatusOr<std::vector<std::string>>& args,
            const std::string& program, const std::string& component) const;
};

// Blocks until SIGTERM or SIGINT (BlockShutdownSignals must have run first)
// and logs which, with the drain deadline.
void AwaitShutdownSignal(absl::Duration drain_timeout);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_DAEMON_FLAGS_H_
