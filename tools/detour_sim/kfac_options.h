// The flags of `detour-sim kfac` (kfac.h): declared on a FlagSet, parsed,
// and checked one by one and in combination into KfacArgs.
#ifndef DETOUR_TOOLS_DETOUR_SIM_KFAC_OPTIONS_H_
#define DETOUR_TOOLS_DETOUR_SIM_KFAC_OPTIONS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/flags.h"
#include "common/kfac_workload.h"

namespace detour::sim_tool {

// Per-block times (ms) of a transformer block, the number of blocks and
// their width: a synthetic pipeline's workload.
struct BlockProfile {
  double forward_ms, backward_ms, curvature_ms, inversion_ms, precondition_ms;
  int blocks;
  int d_model;
};

// The profiles --profile names (pipefisher.md §5: per transformer block on
// a P100).
const std::map<std::string, BlockProfile>& BlockProfiles();

struct KfacArgs {
  // Synthetic.
  std::string schedule, profile;
  int stages = 0, microbatches = 0, blocks = 0;
  std::optional<double> forward_ms, backward_ms, curvature_ms, inversion_ms, precondition_ms;
  // Real.
  std::string cluster, job, scheduler;
  double tflops = 0;
  bool has_seed = false;
  uint64_t seed = 0;
  // Both.
  int iterations = 0;
  int refreshes = 3;
  int curvature_microbatches = 1;
  double slack = 0.05;
  double max_granule_ms = 5;  // the job default (NormalizeJobSpec)
  int refresh_interval = 0;
  bool serial = false;
  // Replica synchronisation; unset or auto_sync: chosen like a job's
  // KFAC_REPLICA_SYNC_AUTO (planner::ChooseReplicaSync) when a stage has
  // replicas, none otherwise.
  std::optional<kfac::ReplicaSync> sync;
  bool auto_sync = false;
  bool json = false;
  std::string svg;
};

// A usage error (exit 2), also one found after parsing: INVALID_ARGUMENT
// with the prefix "usage: ", which RunKfac strips.
absl::Status KfacUsageError(absl::string_view what);

// Declares the flags of `detour-sim kfac` on `flags`, parses `args` and
// checks the values and their combinations. CANCELLED after --help.
absl::StatusOr<KfacArgs> ParseKfacArgs(FlagSet& flags, const std::vector<std::string>& args);

}  // namespace detour::sim_tool

#endif  // DETOUR_TOOLS_DETOUR_SIM_KFAC_OPTIONS_H_
