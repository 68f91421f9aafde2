#include "common/net/daemon_flags.h"

#include <csignal>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/net/shutdown_signal.h"
#include "common/version.h"

namespace detour {

void DaemonFlags::Register(FlagSet* flags, const std::string& ready_fields) {
  flags->Int("metrics_port", &metrics_port,
             absl::StrCat("port for /metrics; 0 picks a free one, -1 disables", metrics_port_note));
  flags->Duration("drain_timeout", &drain_timeout,
                  "on SIGTERM/SIGINT, how long in-flight work may take before being cut");
  flags->String("ready_file", &ready_file,
                absl::StrCat("write ", ready_fields, " as JSON here once serving"));
  flags->String("log_level", &log_level, "debug, info, warning or error");
  flags->Bool("version", &version, "print the version and exit");
}

int DaemonFlags::Apply(const FlagSet& flags, const absl::StatusOr<std::vector<std::string>>& args,
                       const std::string& program, const std::string& component) const {
  if (!args.ok()) return flags.Fail(args.status());
  if (version) {
    std::cout << program << " " << kVersion << " (" << kGitRevision << ")\n";
    return 0;
  }
  if (!args->empty()) {
    return flags.Fail(
        absl::InvalidArgumentError(absl::StrCat("unexpected argument \"", (*args)[0], "\"")));
  }
  LogLevel level;
  if (!ParseLogLevel(log_level, &level)) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--log_level: \"", log_level, "\" is not debug, info, warning or error")));
  }
  if (metrics_port < -1 || metrics_port > 65535) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--metrics_port: ", metrics_port, " is outside -1..65535")));
  }
  SetLogLevel(level);
  SetLogComponent(component);
  return -1;
}

void AwaitShutdownSignal(absl::Duration drain_timeout) {
  int sig = 0;
  while ((sig = WaitForShutdownSignal(absl::Hours(1))) == 0) {}
  LogInfo("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT", "; draining (up to ",
          absl::FormatDuration(drain_timeout), ")");
}

}  // namespace detour
