#include "common/net/daemon_flags.h"

#include <csignal>
#include <cstdlib>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/log_format.h"
#include "common/net/shutdown_signal.h"
#include "common/version.h"
#include "grpc/support/log.h"

namespace detour {

void DaemonFlags::Register(FlagSet* flags, const std::string& ready_fields) {
  flags->Int("metrics_port", &metrics_port,
             absl::StrCat("port for /metrics; 0 picks a free one, -1 disables", metrics_port_note));
  flags->Duration("drain_timeout", &drain_timeout,
                  "on SIGTERM/SIGINT, how long in-flight work may take before being cut");
  flags->String("ready_file", &ready_file,
                absl::StrCat("write ", ready_fields, " as JSON here once serving"));
  flags->String("log_level", &log_level, "debug, info, warning or error");
  flags->String("log_format", &log_format,
                "text (time level component: message) or json (one object per line: time, "
                "level, component, message, job, worker)");
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
  LogFormat format;
  if (!ParseLogFormat(log_format, &format)) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--log_format: \"", log_format, "\" is not text or json")));
  }
  if (metrics_port < -1 || metrics_port > 65535) {
    return flags.Fail(absl::InvalidArgumentError(
        absl::StrCat("--metrics_port: ", metrics_port, " is outside -1..65535")));
  }
  SetLogLevel(level);
  SetLogFormat(format);
  SetLogComponent(component);
  RouteGrpcLogs();
  return -1;
}

namespace {

void GrpcLogLine(gpr_log_func_args* args) {
  LogLevel level = LogLevel::kError;
  if (args->severity == GPR_LOG_SEVERITY_DEBUG) level = LogLevel::kDebug;
  if (args->severity == GPR_LOG_SEVERITY_INFO) level = LogLevel::kInfo;
  const absl::string_view file = args->file != nullptr ? args->file : "?";
  const size_t slash = file.rfind('/');
  LogLine(level, absl::StrCat("grpc: ", args->message != nullptr ? args->message : "", " (",
                              slash == absl::string_view::npos ? file : file.substr(slash + 1), ":",
                              args->line, ")"));
}

void DropGrpcLogLine(gpr_log_func_args* /*args*/) {}

}  // namespace

void QuietGrpcLogs() {
  const char* verbosity = std::getenv("GRPC_VERBOSITY");
  if (verbosity != nullptr && *verbosity != '\0') {
    RouteGrpcLogs();
    return;
  }
  gpr_set_log_function(&DropGrpcLogLine);
}

void RouteGrpcLogs() {
  gpr_set_log_function(&GrpcLogLine);
  // $GRPC_VERBOSITY now rather than at gRPC's first use: until then gRPC
  // writes nothing at all.
  gpr_log_verbosity_init();
}

void AwaitShutdownSignal(absl::Duration drain_timeout) {
  int sig = 0;
  while ((sig = WaitForShutdownSignal(absl::Hours(1))) == 0) {}
  LogInfo("received ", sig == SIGTERM ? "SIGTERM" : "SIGINT", "; draining (up to ",
          absl::FormatDuration(drain_timeout), ")");
}

}  // namespace detour
