// Standard metrics every detour binary exposes: the process_* metrics that
// Prometheus' own clients export (read from /proc at scrape time) and a
// build-info gauge naming the binary's version.
#ifndef DETOUR_COMMON_METRICS_PROCESS_METRICS_H_
#define DETOUR_COMMON_METRICS_PROCESS_METRICS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/metrics/metrics.h"

namespace detour::metrics {

// Registers, as callback metrics read from /proc/self at scrape time:
//   process_cpu_seconds_total       user + system CPU time
//   process_resident_memory_bytes   resident set size
//   process_virtual_memory_bytes    virtual memory size
//   process_open_fds                open file descriptors
//   process_max_fds                 the RLIMIT_NOFILE soft limit
//   process_start_time_seconds      start time, seconds since the Unix epoch
// A value that cannot be read is exposed as NaN. Call once per registry:
// a second call returns ALREADY_EXISTS. Linux only.
absl::Status RegisterProcessMetrics(Registry& registry);

// Registers the gauge detour_build_info{component,version,revision} 1, the
// usual way to join a binary's version onto its other series.
absl::Status RegisterBuildInfo(Registry& registry, absl::string_view component,
                               absl::string_view version, absl::string_view revision);

}  // namespace detour::metrics

#endif  // DETOUR_COMMON_METRICS_PROCESS_METRICS_H_
