#include "tools/detour_sim/kfac_options.h"

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace detour::sim_tool {

const std::map<std::string, BlockProfile>& BlockProfiles() {
  static const auto* p = new std::map<std::string, BlockProfile>{
      {"bert-large-bs8", {4.50, 7.65, 11.93, 126.74, 14.88, 24, 1024}},
      {"bert-large-bs32", {16.10, 26.95, 43.50, 126.70, 14.73, 24, 1024}},
      {"bert-base-bs8", {2.73, 4.65, 6.80, 71.64, 6.85, 12, 768}},
      {"bert-base-bs32", {9.75, 16.45, 25.55, 71.67, 6.81, 12, 768}},
  };
  return *p;
}

absl::Status KfacUsageError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("usage: ", what));
}

namespace {

// The flags that are checked before they reach KfacArgs: counts as int64_t
// (a value beyond int is refused, not truncated), the per-block times as
// plain numbers (KfacArgs keeps only those set), --seed as text, and the
// words of --placement and --replica-sync.
struct RawFlags {
  int64_t stages = 0, microbatches = 0, blocks = 0, iterations = 0, refreshes = 0,
          curvature_microbatches = 0, refresh_interval = 0;
  double forward_ms = 0, backward_ms = 0, curvature_ms = 0, inversion_ms = 0, precondition_ms = 0;
  std::string seed, placement = "bubbles", replica_sync;
  bool sync = false, no_sync = false;
};

// Declares the flags of `detour-sim kfac` on `flags`, bound to `a` or `raw`,
// in the order --help lists them. A flag's default is its variable's value
// now, so the counts in `raw` start at KfacArgs's defaults.
void DeclareFlags(FlagSet& flags, KfacArgs& a, RawFlags& raw) {
  raw.refreshes = a.refreshes;
  raw.curvature_microbatches = a.curvature_microbatches;
  raw.refresh_interval = a.refresh_interval;
  flags.String("schedule", &a.schedule, "synthetic pipeline: gpipe, 1f1b or chimera");
  flags.String("profile", &a.profile,
               "per-block times: bert-large-bs32, bert-large-bs8, bert-base-bs32, bert-base-bs8");
  flags.Int("stages", &raw.stages, "D, synthetic stages (required with --schedule)");
  flags.Int("microbatches", &raw.microbatches, "N, microbatches (required with --schedule)");
  flags.Int("blocks", &raw.blocks, "transformer blocks (required without --profile)");
  flags.Double("forward-ms", &raw.forward_ms, "forward ms per block and microbatch");
  flags.Double("backward-ms", &raw.backward_ms, "backward ms per block and microbatch");
  flags.Double("curvature-ms", &raw.curvature_ms, "curvature (A+B) ms per block and microbatch");
  flags.Double("inversion-ms", &raw.inversion_ms, "inversion ms per block (all factors)");
  flags.Double("precondition-ms", &raw.precondition_ms, "preconditioning ms per block and step");
  flags.String("cluster", &a.cluster, "cluster spec (real plan)");
  flags.String("job", &a.job, "job spec (real plan)");
  flags.String("scheduler", &a.scheduler,
               "real plan: skippipe, full, random, skip-no-collision (default: the job's)");
  flags.Double("tflops", &a.tflops,
               "real plan: TFLOP/s of a speed-1.0 node (default: the cluster's)");
  flags.String("seed", &raw.seed, "real plan: seed, an unsigned integer (default: the job's)");
  flags.Int("iterations", &raw.iterations,
            "plan K iterations (default 0: until --refreshes refreshes complete)");
  flags.Int("refreshes", &raw.refreshes, "refreshes to complete when --iterations is 0");
  flags.Int("curvature-microbatches", &raw.curvature_microbatches,
            "curvature microbatches per node and refresh");
  flags.Double("slack", &a.slack, "placement margin, in [0, 1)");
  flags.Double("max-granule-ms", &a.max_granule_ms,
               "longest K-FAC task placed in a gap, ms: longer items are split into parts "
               "(docs/KFAC.md \"Granules\"); 0 = never split");
  flags.Int("refresh-interval", &raw.refresh_interval,
            "fixed refresh interval (0: as the bubbles allow)");
  flags.String("placement", &raw.placement, "bubbles or serial");
  flags.String("replica-sync", &raw.replica_sync,
               "how replicas stay identical: auto (the default when a stage has replicas, "
               "chimera's have 2: factors when the modelled iteration is within 5% of "
               "preconditioned's, as for a job), preconditioned (each preconditions its own "
               "gradient), factors (all-reduce the factors) or none");
  flags.Bool("sync", &raw.sync, "the same as --replica-sync factors");
  flags.Bool("no-sync", &raw.no_sync, "the same as --replica-sync none");
  flags.Bool("json", &a.json, "machine-readable output");
  flags.String("svg", &a.svg, "timeline of the first iteration with K-FAC work");
}

// Copies the counts into `a`, refusing one set below its minimum or beyond
// int.
absl::Status CheckCounts(const FlagSet& flags, const RawFlags& raw, KfacArgs& a) {
  auto count = [&](const char* name, int64_t v, int min, int* out) -> absl::Status {
    if (flags.WasSet(name) && (v < min || v > std::numeric_limits<int>::max())) {
      return KfacUsageError(
          absl::StrCat("--", name, ": needs a whole number >= ", min, ", got ", v));
    }
    *out = static_cast<int>(v);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(count("stages", raw.stages, 1, &a.stages));
  RETURN_IF_ERROR(count("microbatches", raw.microbatches, 1, &a.microbatches));
  RETURN_IF_ERROR(count("blocks", raw.blocks, 1, &a.blocks));
  RETURN_IF_ERROR(count("iterations", raw.iterations, 1, &a.iterations));
  RETURN_IF_ERROR(count("refreshes", raw.refreshes, 1, &a.refreshes));
  RETURN_IF_ERROR(
      count("curvature-microbatches", raw.curvature_microbatches, 1, &a.curvature_microbatches));
  return count("refresh-interval", raw.refresh_interval, 0, &a.refresh_interval);
}

// Copies the per-block times that were set into `a` (they override the
// profile's), refusing negative and non-finite ones.
absl::Status CheckBlockTimes(const FlagSet& flags, const RawFlags& raw, KfacArgs& a) {
  for (const auto& [name, v, out] :
       std::vector<std::tuple<const char*, double, std::optional<double>*>>{
           {"forward-ms", raw.forward_ms, &a.forward_ms},
           {"backward-ms", raw.backward_ms, &a.backward_ms},
           {"curvature-ms", raw.curvature_ms, &a.curvature_ms},
           {"inversion-ms", raw.inversion_ms, &a.inversion_ms},
           {"precondition-ms", raw.precondition_ms, &a.precondition_ms}}) {
    if (!flags.WasSet(name)) continue;
    if (!(v >= 0) || !std::isfinite(v)) {
      return KfacUsageError(absl::StrCat("--", name, ": needs a number >= 0, got ", v));
    }
    *out = v;
  }
  return absl::OkStatus();
}

// Checks the flags that stand alone (schedule, profile, TFLOP/s, granule,
// slack) and reads --seed and --placement into `a`.
absl::Status CheckValues(const FlagSet& flags, const RawFlags& raw, KfacArgs& a) {
  if (flags.WasSet("schedule") && a.schedule != "gpipe" && a.schedule != "1f1b" &&
      a.schedule != "chimera") {
    return KfacUsageError(absl::StrCat("--schedule: gpipe, 1f1b or chimera, got ", a.schedule));
  }
  if (flags.WasSet("profile") && !BlockProfiles().count(a.profile)) {
    return KfacUsageError(absl::StrCat("--profile: unknown profile \"", a.profile,
                                       "\" (bert-large-bs32, bert-large-bs8, bert-base-bs32, "
                                       "bert-base-bs8)"));
  }
  if (flags.WasSet("tflops") && !(a.tflops > 0)) {
    return KfacUsageError(absl::StrCat("--tflops: needs a positive number, got ", a.tflops));
  }
  if (flags.WasSet("seed")) {
    if (!absl::SimpleAtoi(raw.seed, &a.seed))
      return KfacUsageError(absl::StrCat("--seed: bad number ", raw.seed));
    a.has_seed = true;
  }
  if (!(a.max_granule_ms == 0 || (a.max_granule_ms >= 0.01 && a.max_granule_ms <= 60000))) {
    return KfacUsageError(absl::StrCat(
        "--max-granule-ms: needs 0 or a number in [0.01, 60000], got ", a.max_granule_ms));
  }
  if (!(a.slack >= 0 && a.slack < 1)) {
    return KfacUsageError(absl::StrCat("--slack: needs a number in [0, 1), got ", a.slack));
  }
  if (raw.placement != "bubbles" && raw.placement != "serial") {
    return KfacUsageError(absl::StrCat("--placement: bubbles or serial, got ", raw.placement));
  }
  a.serial = raw.placement == "serial";
  return absl::OkStatus();
}

// Reads --sync, --no-sync and --replica-sync into `a`, refusing settings
// that contradict each other.
absl::Status CheckReplicaSync(const FlagSet& flags, const RawFlags& raw, KfacArgs& a) {
  if (flags.WasSet("sync") && flags.WasSet("no-sync") && raw.sync == raw.no_sync) {
    return KfacUsageError("--sync and --no-sync contradict each other");
  }
  if (flags.WasSet("sync")) {
    a.sync = raw.sync ? kfac::ReplicaSync::kFactors : kfac::ReplicaSync::kNone;
  }
  if (flags.WasSet("no-sync")) {
    a.sync = raw.no_sync ? kfac::ReplicaSync::kNone : kfac::ReplicaSync::kFactors;
  }
  if (!flags.WasSet("replica-sync")) return absl::OkStatus();
  kfac::ReplicaSync r;
  if (raw.replica_sync == "auto") {
    if (a.sync) return KfacUsageError("--replica-sync auto contradicts --sync/--no-sync");
    a.auto_sync = true;
    r = kfac::ReplicaSync::kPreconditioned;  // unused: chosen in Run
  } else if (raw.replica_sync == "preconditioned") {
    r = kfac::ReplicaSync::kPreconditioned;
  } else if (raw.replica_sync == "factors") {
    r = kfac::ReplicaSync::kFactors;
  } else if (raw.replica_sync == "none") {
    r = kfac::ReplicaSync::kNone;
  } else {
    return KfacUsageError(absl::StrCat(
        "--replica-sync: auto, preconditioned, factors or none, got \"", raw.replica_sync, "\""));
  }
  if (!a.auto_sync) {
    if (a.sync && *a.sync != r) {
      return KfacUsageError("--replica-sync contradicts --sync/--no-sync");
    }
    a.sync = r;
  }
  return absl::OkStatus();
}

// A synthetic run needs its pipeline's shape and per-block times, and takes
// none of a real run's flags.
absl::Status CheckSyntheticFlags(const KfacArgs& a) {
  if (a.stages == 0) return KfacUsageError("--stages is required with --schedule");
  if (a.microbatches == 0) return KfacUsageError("--microbatches is required with --schedule");
  if (a.schedule == "chimera" && (a.stages % 2 != 0 || a.microbatches % 2 != 0)) {
    return KfacUsageError(absl::StrFormat(
        "--schedule chimera needs an even --stages and --microbatches (two pipelines in "
        "opposite directions, N/2 microbatches each), got %d and %d",
        a.stages, a.microbatches));
  }
  if (a.profile.empty()) {
    for (const auto& [flag, v] : std::vector<std::pair<const char*, std::optional<double>>>{
             {"--forward-ms", a.forward_ms},
             {"--backward-ms", a.backward_ms},
             {"--curvature-ms", a.curvature_ms},
             {"--inversion-ms", a.inversion_ms}}) {
      if (!v) return KfacUsageError(absl::StrCat(flag, " is required without --profile"));
    }
    if (a.blocks == 0) return KfacUsageError("--blocks is required without --profile");
  }
  if (!a.scheduler.empty() || a.tflops > 0 || a.has_seed) {
    return KfacUsageError("--scheduler, --tflops and --seed go with --cluster/--job");
  }
  return absl::OkStatus();
}

// A real run needs both spec files and takes none of a synthetic run's
// flags.
absl::Status CheckRealFlags(const KfacArgs& a) {
  if (a.cluster.empty()) return KfacUsageError("--cluster is required");
  if (a.job.empty()) return KfacUsageError("--job is required");
  if (!a.profile.empty() || a.stages || a.microbatches || a.blocks || a.forward_ms ||
      a.backward_ms || a.curvature_ms || a.inversion_ms || a.precondition_ms) {
    return KfacUsageError(
        "--profile, --stages, --microbatches, --blocks and --*-ms go with --schedule");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<KfacArgs> ParseKfacArgs(FlagSet& flags, const std::vector<std::string>& args) {
  KfacArgs a;
  RawFlags raw;
  DeclareFlags(flags, a, raw);
  ASSIGN_OR_RETURN(std::vector<std::string> rest, flags.Parse(args));
  if (!rest.empty()) return KfacUsageError(absl::StrCat("unexpected argument \"", rest[0], "\""));
  RETURN_IF_ERROR(CheckCounts(flags, raw, a));
  RETURN_IF_ERROR(CheckBlockTimes(flags, raw, a));
  RETURN_IF_ERROR(CheckValues(flags, raw, a));
  RETURN_IF_ERROR(CheckReplicaSync(flags, raw, a));
  const bool synthetic = !a.schedule.empty();
  const bool real = !a.cluster.empty() || !a.job.empty();
  if (synthetic == real) {
    return KfacUsageError("needs either --schedule (synthetic) or --cluster and --job");
  }
  RETURN_IF_ERROR(synthetic ? CheckSyntheticFlags(a) : CheckRealFlags(a));
  return a;
}

}  // namespace detour::sim_tool
