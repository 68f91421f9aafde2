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

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
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

// Edit distance (insertions, deletions, substitutions) between a and b.
size_t EditDistance(absl::string_view a, absl::string_view b);
// The candidate nearest `word` within `max_distance` edits ("" when none,
// when `word` is one of them, or when it is longer than kMaxMatchBytes),
// for did-you-mean messages.
inline constexpr size_t kMaxMatchBytes = 256;
std::string ClosestMatch(absl::string_view word, const std::vector<std::string>& candidates,
                         size_t max_distance = 2);

// Range checks on parsed flag values, for the checks a program makes after
// Parse: OK, or INVALID_ARGUMENT "--NAME: VALUE is not in [LO, HI]" (the
// duration form prints durations like "1m30s").
absl::Status CheckFlagRange(absl::string_view name, int64_t value, int64_t lo, int64_t hi);
absl::Status CheckFlagRange(absl::string_view name, absl::Duration value, absl::Duration lo,
                            absl::Duration hi);
// OK, or INVALID_ARGUMENT "--NAME: VALUE is negative".
absl::Status CheckFlagNotNegative(absl::string_view name, int64_t value);
absl::Status CheckFlagNotNegative(absl::string_view name, absl::Duration value);

}  // namespace detour

#endif  // DETOUR_COMMON_FLAGS_H_
