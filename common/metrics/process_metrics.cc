#include "common/metrics/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace detour::metrics {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::optional<std::string> ReadFile(const char* path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Fields of /proc/self/stat after the command name, so that fields()[0] is
// field 3 (state) of proc(5). The name is skipped by its closing parenthesis
// because it may itself contain spaces and parentheses.
std::optional<std::vector<std::string>> ReadStatFields() {
  std::optional<std::string> stat = ReadFile("/proc/self/stat");
  if (!stat) return std::nullopt;
  const size_t close = stat->rfind(')');
  if (close == std::string::npos) return std::nullopt;
  return absl::StrSplit(absl::string_view(*stat).substr(close + 1), ' ', absl::SkipWhitespace());
}

// Field `number` (1-based, as numbered in proc(5)) of /proc/self/stat.
double StatField(int number) {
  std::optional<std::vector<std::string>> fields = ReadStatFields();
  const size_t index = static_cast<size_t>(number - 3);
  if (!fields || index >= fields->size()) return kNaN;
  double value;
  if (!absl::SimpleAtod((*fields)[index], &value)) return kNaN;
  return value;
}

double ClockTicksPerSecond() {
  const long ticks = sysconf(_SC_CLK_TCK);
  return ticks > 0 ? static_cast<double>(ticks) : kNaN;
}

double CpuSeconds() {
  std::optional<std::vector<std::string>> fields = ReadStatFields();
  double utime, stime;
  if (!fields || fields->size() < 13 || !absl::SimpleAtod((*fields)[14 - 3], &utime) ||
      !absl::SimpleAtod((*fields)[15 - 3], &stime)) {
    return kNaN;
  }
  return (utime + stime) / ClockTicksPerSecond();
}

double ResidentBytes() {
  const long page_size = sysconf(_SC_PAGESIZE);
  return StatField(24) * static_cast<double>(page_size);
}

double OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return kNaN;
  double count = 0;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] != '.') ++count;
  }
  closedir(dir);
  return count - 1;  // the descriptor opendir itself used
}

double MaxFds() {
  rlimit limit;
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0) return kNaN;
  if (limit.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<double>::infinity();
  }
  return static_cast<double>(limit.rlim_cur);
}

// Boot time (btime in /proc/stat) plus the process's start in ticks since
// boot (field 22 of /proc/self/stat).
double StartTimeSeconds() {
  std::optional<std::string> stat = ReadFile("/proc/stat");
  if (!stat) return kNaN;
  double boot_time = kNaN;
  for (absl::string_view line : absl::StrSplit(*stat, '\n')) {
    if (absl::ConsumePrefix(&line, "btime ")) {
      if (!absl::SimpleAtod(line, &boot_time)) boot_time = kNaN;
      break;
    }
  }
  return boot_time + StatField(22) / ClockTicksPerSecond();
}

}  // namespace

absl::Status RegisterProcessMetrics(Registry& registry) {
  struct Spec {
    const char* name;
    const char* help;
    bool is_counter;
    double (*fn)();
  };
  static const double start_time = StartTimeSeconds();  // never changes
  const Spec specs[] = {
      {"process_cpu_seconds", "Total user and system CPU time spent in seconds.", true,
       &CpuSeconds},
      {"process_resident_memory_bytes", "Resident memory size in bytes.", false, &ResidentBytes},
      {"process_virtual_memory_bytes", "Virtual memory size in bytes.", false,
       [] { return StatField(23); }},
      {"process_open_fds", "Number of open file descriptors.", false, &OpenFds},
      {"process_max_fds", "Maximum number of open file descriptors.", false, &MaxFds},
      {"process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
       false, [] { return start_time; }},
  };
  for (const Spec& spec : specs) {
    absl::Status status = spec.is_counter
                              ? registry.AddCallbackCounter(spec.name, spec.help, spec.fn)
                              : registry.AddCallbackGauge(spec.name, spec.help, spec.fn);
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

absl::Status RegisterBuildInfo(Registry& registry, absl::string_view component,
                               absl::string_view version, absl::string_view revision) {
  absl::StatusOr<GaugeFamily*> family =
      registry.AddGauge("detour_build_info",
                        "A metric with a constant value 1, labelled by the component, version "
                        "and source revision of this binary.",
                        {"component", "version", "revision"});
  if (!family.ok()) return family.status();
  absl::StatusOr<Gauge*> gauge =
      (*family)->WithLabels({std::string(component), std::string(version), std::string(revision)});
  if (!gauge.ok()) return gauge.status();
  (*gauge)->Set(1);
  return absl::OkStatus();
}

}  // namespace detour::metrics
