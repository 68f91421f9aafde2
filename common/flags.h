// Command-line flags for detour's programs: `--name=value` or `--name value`,
// `--flag`/`--noflag` for booleans, `--` ends flags. Unknown flags and bad
// values are errors that name the flag (with a did-you-mean for typos);
// `--help` prints a usage text built from the declarations. Not thread-safe:
// declare and parse on the main thread before starting others.
//
//   FlagSet flags("detour-coordinator", "Runs the coordinator daemon.");
//   std::string listen = "127.0.0.1:7070";
//   flags.String("listen", &listen, "host:port for gRPC");
//   auto args = flags.Parse(argc, argv);  // positional arguments
//   if (!args.ok()) { ... flags.ExitCode(args.status()) ... }
#ifndef DETOUR_COMMON_FLAGS_H_
#define DETOUR_COMMON_FLAGS_H_

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace detour {

class FlagSet {
 public:
  FlagSet(std::string program, std::string summary);

  // Each binds a flag to a variable that holds its default; the variable must
  // outlive Parse.
  void String(const std::string& name, std::string* value, const std::string& help);
  void Int(const std::string& name, int64_t* value, const std::string& help);
  void Double(const std::string& name, double* value, const std::string& help);
  void Bool(const std::string& name, bool* value, const std::string& help);
  // Durations like "500ms", "10s", "2m", "1h30m".
  void Duration(const std::string& name, absl::Duration* value, const std::string& help);

  // Extra text after the flag list (subcommands, examples, exit codes).
  void SetEpilog(std::string epilog) { epilog_ = std::move(epilog); }

  // Names a positional argument for Usage() ("Usage: detourctl get [flags]
  // JOB_ID" and a line under "Arguments:"); `name` may say "[NAME]" or
  // "NAME..." for optional or repeated ones. Parse does not check them: the
  // program counts what it got.
  void Positional(const std::string& name, const std::string& help);

  // Parses argv[1..]. Returns the positional arguments, or INVALID_ARGUMENT
  // naming the flag. `--help`/`-h` returns CANCELLED after Usage() was
  // printed to stdout (exit 0). With `stop_at_positional`, parsing ends at
  // the first positional argument (for subcommands with their own flags).
  absl::StatusOr<std::vector<std::string>> Parse(int argc, char** argv,
                                                 bool stop_at_positional = false);
  absl::StatusOr<std::vector<std::string>> Parse(const std::vector<std::string>& args,
                                                 bool stop_at_positional = false);

  std::string Usage() const;
  // Whether the flag was given on the command line.
  bool WasSet(const std::string& name) const;

  // Exit code for a Parse result: 0 for --help, 2 for usage errors.
  static int ExitCode(const absl::Status& status);
  // Prints "<program>: <message>" (and a --help hint) to stderr for a Parse
  // error and returns ExitCode(status).
  int Fail(const absl::Status& status) const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string type;  // shown in usage
    std::string default_text;
    bool is_bool = false;
    bool set = false;
    std::function<absl::Status(const std::string&)> assign;
  };
  Flag* Find(const std::string& name);
  std::string Suggest(const std::string& name) const;

  std::string program_;
  std::string summary_;
  std::string epilog_;
  std::vector<Flag> flags_;
  std::vector<std::pair<std::string, std::string>> positional_;  // name, help
};

}  // namespace detour

#endif  // DETOUR_COMMON_FLAGS_H_
