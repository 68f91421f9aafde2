// What every detour daemon's main() shares: the common flags (--log_level,
// --log_format, --version, --metrics_port, --drain_timeout, --ready_file),
// their checks after parsing, gRPC core's log lines sent through ours, and
// waiting for SIGTERM/SIGINT. Main-thread only.
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
  std::string log_format = "text";
  bool version = false;
  int64_t metrics_port = 0;  // set the daemon's default before Register
  // Extra words for --metrics_port's help (e.g. how the default is derived).
  std::string metrics_port_note;
  absl::Duration drain_timeout = absl::Seconds(10);
  std::string ready_file;

  // Declares the flags; `ready_fields` lists what the ready file holds.
  void Register(FlagSet* flags, const std::string& ready_fields);

  // Runs after FlagSet::Parse: prints the version, refuses positional
  // arguments, applies --log_level and --log_format (naming `component` in
  // log lines), routes gRPC core's lines through ours (RouteGrpcLogs) and
  // checks --metrics_port. Returns the exit code to stop with, or -1 to go on.
  int Apply(const FlagSet& flags, const absl::StatusOr<std::vector<std::string>>& args,
            const std::string& program, const std::string& component) const;
};

// gRPC core's own log lines (handshake failures, ...) go through LogLine, in
// the daemon's format and at the matching level, their message prefixed
// "grpc: " and ending with gRPC's source file and line; gRPC's verbosity
// ($GRPC_VERBOSITY, default ERROR) still decides which it writes.
void RouteGrpcLogs();

// For command-line clients (detourctl, detour-local): gRPC core's lines are
// dropped, since every failed call is reported with its status and a hint
// (a raw "E1204 ... ssl_transport_security.cc:1501] Handshake failed" line
// before it only repeats it, in gRPC's words); with $GRPC_VERBOSITY set they
// go through LogLine as RouteGrpcLogs does.
void QuietGrpcLogs();

// Blocks until SIGTERM or SIGINT (BlockShutdownSignals must have run first)
// and logs which, with the drain deadline.
void AwaitShutdownSignal(absl::Duration drain_timeout);

}  // namespace detour

#endif  // DETOUR_COMMON_NET_DAEMON_FLAGS_H_
