// detour-checkpoint: converts a detour-checkpoint-v1 checkpoint (stage files
// were LibTorch archives) into a v2 one, and verifies checkpoints.
//
// LibTorch's archive reader can crash on a corrupt file, so `convert` reads
// each v1 stage file in a child process (this program, run as
// `detour-checkpoint read-v1-stage ...`): a crash kills only the child, and
// the parent names the file, removes what it built and exits 1.
//
// Exit status: 0 success; 1 an error (named on stderr); 2 bad usage.
#include <limits.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/subprocess.h"
#include "common/version.h"
#include "worker/model/checkpoint_convert.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/checkpoint_v1.h"

namespace detour {
namespace {

namespace fs = std::filesystem;
using model::StageFileEntry;

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;
// The child's own verdicts; any other status, or a signal, is a crash.
constexpr int kChildCorrupt = 10;  // the file is not a readable v1 stage file
constexpr int kChildFailed = 11;   // anything else (e.g. the output not writable)

constexpr char kCommands[] = R"(Commands:
  convert OLD_DIR NEW_DIR   converts the detour-checkpoint-v1 checkpoint OLD_DIR
                            into a new detour-checkpoint-v2 checkpoint NEW_DIR
                            (which must not exist); OLD_DIR is left as it is
  verify DIR                checks a v2 checkpoint: the manifest, every stage
                            file's size, checksum and container
  version                   prints the version

convert checks the v1 manifest and every v1 file's size and checksum first,
then reads each stage file with LibTorch's archive reader in a child process
(the reader crashes on some corrupt files: the crash is reported with the
file's name), writes NEW_DIR.tmp.<pid> beside NEW_DIR (each file fsynced,
the manifest last), verifies it and renames it to NEW_DIR. On any error
nothing is left behind. A job resumes from NEW_DIR like from any checkpoint
(checkpoint.resume_from, `detourctl resume JOB --checkpoint NEW_DIR`).

Examples:
  detour-checkpoint convert /var/lib/detour/checkpoints/JOB/40 /var/lib/detour/checkpoints/JOB/40-v2
  detour-checkpoint verify /var/lib/detour/checkpoints/JOB/40-v2

Exit status: 0 success, 1 an error (named on stderr), 2 bad usage.
)";

int Usage(const std::string& message) {
  std::cerr << "detour-checkpoint: " << message << " (see detour-checkpoint --help)\n";
  return kExitUsage;
}

int Error(const absl::Status& status) {
  std::cerr << "detour-checkpoint: " << status.message() << "\n";
  return kExitError;
}

absl::StatusOr<std::string> SelfPath() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return absl::InternalError("cannot find this program (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

// The last lines of a child's output, for an error message.
std::string Tail(const std::string& log, size_t max_lines) {
  std::vector<absl::string_view> lines =
      absl::StrSplit(absl::StripTrailingAsciiWhitespace(log), '\n');
  const size_t first = lines.size() > max_lines ? lines.size() - max_lines : 0;
  std::string out;
  for (size_t i = first; i < lines.size(); ++i) absl::StrAppend(&out, "\n  | ", lines[i]);
  return out;
}

// Runs `read-v1-stage` in a child and turns its fate into a Status.
absl::Status ConvertInChild(const std::string& self, const std::string& v1_path,
                            const StageFileEntry& entry, const std::string& out_path,
                            absl::Duration timeout) {
  const std::string log = out_path + ".log";
  ChildProcess child;
  absl::Status started = child.Start(
      {self, "read-v1-stage", v1_path, out_path, absl::StrCat(entry.bytes), entry.checksum}, log);
  if (!started.ok()) return started;
  std::optional<int> code = child.Wait(timeout);
  if (!code.has_value()) {
    child.Stop(absl::Seconds(2));
    return absl::DeadlineExceededError(
        absl::StrCat("LibTorch's archive reader did not finish within ",
                     absl::FormatDuration(timeout), " (--stage_timeout); killed"));
  }
  const std::string output = child.Log();
  std::error_code ec;
  fs::remove(log, ec);
  if (*code == kExitOk) return absl::OkStatus();
  const std::string message(absl::StripTrailingAsciiWhitespace(output));
  if (*code == kChildCorrupt) return absl::DataLossError(message);
  if (*code == kChildFailed) return absl::UnavailableError(message);
  const std::string last =
      output.empty() ? std::string() : absl::StrCat("; its last output:", Tail(output, 8));
  // Not one of the child's own codes: an exit status is a sanitizer's exit
  // after a fault, and a fault signal is the file's doing. Any other signal
  // came from outside (the OOM killer, a resource limit, an operator) and
  // says nothing about the file, which may well convert on a retry.
  const int sig = *code > 128 ? *code - 128 : 0;
  const std::string named =
      sig > 0 ? absl::StrCat("signal ", sig, " (", ::strsignal(sig), ")") : std::string();
  if (sig == 0 || sig == SIGSEGV || sig == SIGBUS || sig == SIGABRT || sig == SIGILL ||
      sig == SIGFPE || sig == SIGTRAP || sig == SIGSYS) {
    const std::string fate = sig == 0 ? absl::StrCat("exited with status ", *code)
                                      : absl::StrCat("was killed by ", named);
    return absl::DataLossError(absl::StrCat("LibTorch's archive reader crashed on this file (its ",
                                            "process ", fate, "): the file is corrupt", last));
  }
  return absl::UnavailableError(absl::StrCat(
      "LibTorch's archive reader was stopped by ", named,
      " while reading this file, not by a fault of its own (out of memory, a resource limit or "
      "a kill from outside): the file was not judged; retry once the cause is gone",
      last));
}

int CmdConvert(const std::vector<std::string>& args) {
  FlagSet flags("detour-checkpoint convert",
                "Converts a detour-checkpoint-v1 checkpoint into a new v2 one:\n"
                "  detour-checkpoint convert [flags] OLD_DIR NEW_DIR");
  absl::Duration stage_timeout = absl::Minutes(30);
  bool quiet = false;
  flags.Duration("stage_timeout", &stage_timeout,
                 "how long the reader of one stage file may take before it is killed");
  flags.Bool("quiet", &quiet, "no progress lines");
  auto rest = flags.Parse(args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 2) {
    return Usage(
        absl::StrCat("convert needs OLD_DIR and NEW_DIR, got ", rest->size(), " arguments"));
  }
  if (stage_timeout <= absl::ZeroDuration()) return Usage("--stage_timeout must be positive");
  auto self = SelfPath();
  if (!self.ok()) return Error(self.status());
  model::V1ConvertOptions options;
  options.convert_stage = [&](const std::string& v1_path, const StageFileEntry& entry,
                              const std::string& out_path) {
    return ConvertInChild(*self, v1_path, entry, out_path, stage_timeout);
  };
  if (!quiet) {
    options.progress = [](absl::string_view line) {
      std::cerr << "detour-checkpoint: " << line << "\n";
    };
  }
  auto manifest = model::ConvertV1Checkpoint((*rest)[0], (*rest)[1], options);
  if (!manifest.ok()) return Error(manifest.status());
  if (!quiet) {
    std::cerr << "detour-checkpoint: wrote " << (*rest)[1] << " (detour-checkpoint-v2, iteration "
              << manifest->iteration << ", " << manifest->stages.size() << " stage files)\n";
  }
  return kExitOk;
}

int CmdVerify(const std::vector<std::string>& args) {
  FlagSet flags("detour-checkpoint verify",
                "Checks a v2 checkpoint's manifest and stage files:\n"
                "  detour-checkpoint verify DIR");
  auto rest = flags.Parse(args);
  if (!rest.ok()) return flags.Fail(rest.status());
  if (rest->size() != 1) return Usage("verify needs exactly one DIR");
  auto manifest = model::VerifyCheckpoint((*rest)[0]);
  if (!manifest.ok()) return Error(manifest.status());
  std::cout << (*rest)[0] << ": ok (" << manifest->format << ", iteration " << manifest->iteration
            << ", " << manifest->num_stages << " stages, " << manifest->stages.size()
            << " stage files)\n";
  return kExitOk;
}

// The child of `convert`: V1_FILE (size and checksum checked again: the file
// may have changed since the parent looked) → OUT_FILE, written durably.
// Exit kChildCorrupt or kChildFailed with one line on stderr; a crash in
// LibTorch's reader is the parent's to report.
int CmdReadV1Stage(const std::vector<std::string>& args) {
  if (args.size() != 4) {
    std::cerr << "read-v1-stage V1_FILE OUT_FILE BYTES CHECKSUM (used by convert)\n";
    return kExitUsage;
  }
  StageFileEntry entry;
  const fs::path v1_path(args[0]);
  entry.file = v1_path.filename().string();
  entry.checksum = args[3];
  if (!absl::SimpleAtoi(args[2], &entry.bytes)) {
    std::cerr << "BYTES \"" << args[2] << "\" is not a byte count\n";
    return kExitUsage;
  }
  const std::string dir = v1_path.has_parent_path() ? v1_path.parent_path().string() : ".";
  auto bytes = model::ReadStageFileBytes(dir, entry);
  if (!bytes.ok()) {
    std::cerr << bytes.status().message() << "\n";
    return kChildCorrupt;
  }
  auto converted = model::ConvertV1StageFile(*bytes, v1_path.string());
  if (!converted.ok()) {
    std::cerr << converted.status().message() << "\n";
    return converted.status().code() == absl::StatusCode::kDataLoss ? kChildCorrupt : kChildFailed;
  }
  absl::Status written = WriteFileAtomically(args[1], *converted);
  if (!written.ok()) {
    std::cerr << written.message() << "\n";
    return kChildFailed;
  }
  return kExitOk;
}

int Main(int argc, char** argv) {
  FlagSet flags("detour-checkpoint",
                "Converts v1 checkpoints to v2 and verifies checkpoints.\n"
                "`detour-checkpoint COMMAND --help` describes one.");
  flags.Positional("COMMAND [command flags] [args]", "one of the commands below");
  bool version = false;
  flags.Bool("version", &version, "print the version and exit");
  flags.SetEpilog(kCommands);
  auto args = flags.Parse(argc, argv, /*stop_at_positional=*/true);
  if (!args.ok()) return flags.Fail(args.status());
  if (version || (!args->empty() && (*args)[0] == "version")) {
    std::cout << "detour-checkpoint " << kVersion << " (" << kGitRevision << ")\n";
    return kExitOk;
  }
  if (args->empty()) return Usage("missing command (convert, verify)");
  const std::string command = (*args)[0];
  const std::vector<std::string> rest(args->begin() + 1, args->end());
  if (command == "convert") return CmdConvert(rest);
  if (command == "verify") return CmdVerify(rest);
  if (command == "read-v1-stage") return CmdReadV1Stage(rest);
  return Usage(absl::StrCat("unknown command \"", command, "\""));
}

}  // namespace
}  // namespace detour

int main(int argc, char** argv) { return detour::Main(argc, argv); }
