#include "tools/detour_sim/kfac.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/kfac_workload.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/json_writer.h"
#include "common/sim/timeline_export.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"
#include "coordinator/planner/bubble_planner.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/replica_sync_choice.h"

namespace detour::sim_tool {

namespace {

// `detour-sim kfac --help`: this text, then the flags FlagSet generates.
constexpr char kKfacSummary[] = R"(K-FAC work in the pipeline's bubbles (docs/KFAC.md).

  detour-sim kfac --schedule gpipe|1f1b|chimera --stages D --microbatches N
                  (--profile P | --forward-ms F --backward-ms B --curvature-ms C
                   --inversion-ms I [--precondition-ms X] --blocks L) [flags]
  detour-sim kfac --cluster C.json --job J.json [--scheduler skippipe|full|...]
                  [--tflops X] [--seed N] [flags]

Synthetic pipelines: D stages on D nodes, N microbatches, no communication,
the per-block times (ms) of a profile split evenly over the stages. chimera:
two pipelines in opposite directions (N/2 microbatches each; D and N even),
device d holds stage d of one and stage D-1-d of the other. Profiles:
  bert-large-bs32, bert-large-bs8 (24 blocks), bert-base-bs32, bert-base-bs8
  (12 blocks): the P100 reference profile of PipeFisher. Explicit --*-ms flags
  override a profile's values.
Real plans: one planned and simulated iteration of the job (its routes and
timeline reused every iteration), K-FAC costs from the model shape and each
node's speed.)";

constexpr char kKfacEpilog[] =
    "Exit status: 0 on success, 1 on bad input or a failed plan, 2 on bad usage.";

// Usage errors found after parsing carry this prefix (exit 2).
absl::Status UsageError(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("usage: ", what));
}

struct Profile {
  double forward_ms, backward_ms, curvature_ms, inversion_ms, precondition_ms;
  int blocks;
  int d_model;
};

// pipefisher.md §5: per transformer block on a P100.
const std::map<std::string, Profile>& Profiles() {
  static const auto* p = new std::map<std::string, Profile>{
      {"bert-large-bs8", {4.50, 7.65, 11.93, 126.74, 14.88, 24, 1024}},
      {"bert-large-bs32", {16.10, 26.95, 43.50, 126.70, 14.73, 24, 1024}},
      {"bert-base-bs8", {2.73, 4.65, 6.80, 71.64, 6.85, 12, 768}},
      {"bert-base-bs32", {9.75, 16.45, 25.55, 71.67, 6.81, 12, 768}},
  };
  return *p;
}

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

// Declares the flags of `detour-sim kfac` on `flags`, parses `args` and
// checks the values and their combinations. CANCELLED after --help.
absl::StatusOr<KfacArgs> Parse(FlagSet& flags, const std::vector<std::string>& args) {
  KfacArgs a;
  int64_t stages = 0, microbatches = 0, blocks = 0, iterations = 0, refreshes = a.refreshes,
          curvature_microbatches = a.curvature_microbatches, refresh_interval = a.refresh_interval;
  double forward_ms = 0, backward_ms = 0, curvature_ms = 0, inversion_ms = 0, precondition_ms = 0;
  std::string seed, placement = "bubbles", replica_sync;
  bool sync = false, no_sync = false;
  flags.String("schedule", &a.schedule, "synthetic pipeline: gpipe, 1f1b or chimera");
  flags.String("profile", &a.profile,
               "per-block times: bert-large-bs32, bert-large-bs8, bert-base-bs32, bert-base-bs8");
  flags.Int("stages", &stages, "D, synthetic stages (required with --schedule)");
  flags.Int("microbatches", &microbatches, "N, microbatches (required with --schedule)");
  flags.Int("blocks", &blocks, "transformer blocks (required without --profile)");
  flags.Double("forward-ms", &forward_ms, "forward ms per block and microbatch");
  flags.Double("backward-ms", &backward_ms, "backward ms per block and microbatch");
  flags.Double("curvature-ms", &curvature_ms, "curvature (A+B) ms per block and microbatch");
  flags.Double("inversion-ms", &inversion_ms, "inversion ms per block (all factors)");
  flags.Double("precondition-ms", &precondition_ms, "preconditioning ms per block and step");
  flags.String("cluster", &a.cluster, "cluster spec (real plan)");
  flags.String("job", &a.job, "job spec (real plan)");
  flags.String("scheduler", &a.scheduler,
               "real plan: skippipe, full, random, skip-no-collision (default: the job's)");
  flags.Double("tflops", &a.tflops,
               "real plan: TFLOP/s of a speed-1.0 node (default: the cluster's)");
  flags.String("seed", &seed, "real plan: seed, an unsigned integer (default: the job's)");
  flags.Int("iterations", &iterations,
            "plan K iterations (default 0: until --refreshes refreshes complete)");
  flags.Int("refreshes", &refreshes, "refreshes to complete when --iterations is 0");
  flags.Int("curvature-microbatches", &curvature_microbatches,
            "curvature microbatches per node and refresh");
  flags.Double("slack", &a.slack, "placement margin, in [0, 1)");
  flags.Double("max-granule-ms", &a.max_granule_ms,
               "longest K-FAC task placed in a gap, ms: longer items are split into parts "
               "(docs/KFAC.md \"Granules\"); 0 = never split");
  flags.Int("refresh-interval", &refresh_interval,
            "fixed refresh interval (0: as the bubbles allow)");
  flags.String("placement", &placement, "bubbles or serial");
  flags.String("replica-sync", &replica_sync,
               "how replicas stay identical: auto (the default when a stage has replicas, "
               "chimera's have 2: factors when the modelled iteration is within 5% of "
               "preconditioned's, as for a job), preconditioned (each preconditions its own "
               "gradient), factors (all-reduce the factors) or none");
  flags.Bool("sync", &sync, "the same as --replica-sync factors");
  flags.Bool("no-sync", &no_sync, "the same as --replica-sync none");
  flags.Bool("json", &a.json, "machine-readable output");
  flags.String("svg", &a.svg, "timeline of the first iteration with K-FAC work");
  flags.SetEpilog(kKfacEpilog);
  ASSIGN_OR_RETURN(std::vector<std::string> rest, flags.Parse(args));
  if (!rest.empty()) return UsageError(absl::StrCat("unexpected argument \"", rest[0], "\""));

  auto count = [&](const char* name, int64_t v, int min, int* out) -> absl::Status {
    if (flags.WasSet(name) && (v < min || v > std::numeric_limits<int>::max())) {
      return UsageError(absl::StrCat("--", name, ": needs a whole number >= ", min, ", got ", v));
    }
    *out = static_cast<int>(v);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(count("stages", stages, 1, &a.stages));
  RETURN_IF_ERROR(count("microbatches", microbatches, 1, &a.microbatches));
  RETURN_IF_ERROR(count("blocks", blocks, 1, &a.blocks));
  RETURN_IF_ERROR(count("iterations", iterations, 1, &a.iterations));
  RETURN_IF_ERROR(count("refreshes", refreshes, 1, &a.refreshes));
  RETURN_IF_ERROR(
      count("curvature-microbatches", curvature_microbatches, 1, &a.curvature_microbatches));
  RETURN_IF_ERROR(count("refresh-interval", refresh_interval, 0, &a.refresh_interval));
  for (const auto& [name, v, out] :
       std::vector<std::tuple<const char*, double, std::optional<double>*>>{
           {"forward-ms", forward_ms, &a.forward_ms},
           {"backward-ms", backward_ms, &a.backward_ms},
           {"curvature-ms", curvature_ms, &a.curvature_ms},
           {"inversion-ms", inversion_ms, &a.inversion_ms},
           {"precondition-ms", precondition_ms, &a.precondition_ms}}) {
    if (!flags.WasSet(name)) continue;
    if (!(v >= 0) || !std::isfinite(v)) {
      return UsageError(absl::StrCat("--", name, ": needs a number >= 0, got ", v));
    }
    *out = v;
  }
  if (flags.WasSet("schedule") && a.schedule != "gpipe" && a.schedule != "1f1b" &&
      a.schedule != "chimera") {
    return UsageError(absl::StrCat("--schedule: gpipe, 1f1b or chimera, got ", a.schedule));
  }
  if (flags.WasSet("profile") && !Profiles().count(a.profile)) {
    return UsageError(absl::StrCat("--profile: unknown profile \"", a.profile,
                                   "\" (bert-large-bs32, bert-large-bs8, bert-base-bs32, "
                                   "bert-base-bs8)"));
  }
  if (flags.WasSet("tflops") && !(a.tflops > 0)) {
    return UsageError(absl::StrCat("--tflops: needs a positive number, got ", a.tflops));
  }
  if (flags.WasSet("seed")) {
    if (!absl::SimpleAtoi(seed, &a.seed))
      return UsageError(absl::StrCat("--seed: bad number ", seed));
    a.has_seed = true;
  }
  if (!(a.max_granule_ms == 0 || (a.max_granule_ms >= 0.01 && a.max_granule_ms <= 60000))) {
    return UsageError(absl::StrCat("--max-granule-ms: needs 0 or a number in [0.01, 60000], got ",
                                   a.max_granule_ms));
  }
  if (!(a.slack >= 0 && a.slack < 1)) {
    return UsageError(absl::StrCat("--slack: needs a number in [0, 1), got ", a.slack));
  }
  if (placement != "bubbles" && placement != "serial") {
    return UsageError(absl::StrCat("--placement: bubbles or serial, got ", placement));
  }
  a.serial = placement == "serial";
  if (flags.WasSet("sync") && flags.WasSet("no-sync") && sync == no_sync) {
    return UsageError("--sync and --no-sync contradict each other");
  }
  if (flags.WasSet("sync")) a.sync = sync ? kfac::ReplicaSync::kFactors : kfac::ReplicaSync::kNone;
  if (flags.WasSet("no-sync")) {
    a.sync = no_sync ? kfac::ReplicaSync::kNone : kfac::ReplicaSync::kFactors;
  }
  if (flags.WasSet("replica-sync")) {
    kfac::ReplicaSync r;
    if (replica_sync == "auto") {
      if (a.sync) return UsageError("--replica-sync auto contradicts --sync/--no-sync");
      a.auto_sync = true;
      r = kfac::ReplicaSync::kPreconditioned;  // unused: chosen in Run
    } else if (replica_sync == "preconditioned") {
      r = kfac::ReplicaSync::kPreconditioned;
    } else if (replica_sync == "factors") {
      r = kfac::ReplicaSync::kFactors;
    } else if (replica_sync == "none") {
      r = kfac::ReplicaSync::kNone;
    } else {
      return UsageError(absl::StrCat(
          "--replica-sync: auto, preconditioned, factors or none, got \"", replica_sync, "\""));
    }
    if (!a.auto_sync) {
      if (a.sync && *a.sync != r) {
        return UsageError("--replica-sync contradicts --sync/--no-sync");
      }
      a.sync = r;
    }
  }
  const bool synthetic = !a.schedule.empty();
  const bool real = !a.cluster.empty() || !a.job.empty();
  if (synthetic == real) {
    return UsageError("needs either --schedule (synthetic) or --cluster and --job");
  }
  if (synthetic) {
    if (a.stages == 0) return UsageError("--stages is required with --schedule");
    if (a.microbatches == 0) return UsageError("--microbatches is required with --schedule");
    if (a.schedule == "chimera" && (a.stages % 2 != 0 || a.microbatches % 2 != 0)) {
      return UsageError(absl::StrFormat(
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
        if (!v) return UsageError(absl::StrCat(flag, " is required without --profile"));
      }
      if (a.blocks == 0) return UsageError("--blocks is required without --profile");
    }
    if (!a.scheduler.empty() || a.tflops > 0 || a.has_seed) {
      return UsageError("--scheduler, --tflops and --seed go with --cluster/--job");
    }
  } else {
    if (a.cluster.empty()) return UsageError("--cluster is required");
    if (a.job.empty()) return UsageError("--job is required");
    if (!a.profile.empty() || a.stages || a.microbatches || a.blocks || a.forward_ms ||
        a.backward_ms || a.curvature_ms || a.inversion_ms || a.precondition_ms) {
      return UsageError(
          "--profile, --stages, --microbatches, --blocks and --*-ms go with --schedule");
    }
  }
  return a;
}

// One scenario, ready for the bubble planner.
struct Scenario {
  std::string description;
  sim::CostModel cost;  // for the SVG (synthetic: unit tables)
  sim::Plan plan;
  sim::SimResult result;  // with timeline
  planner::KfacWorkload workload;
  v1::KfacSpec kfac;
  // Some stage has more than one replica (the default of --sync).
  bool replicated = false;
};

// Splits a block's measured curvature / inversion time like the FLOP
// estimate of a block of width d with ffn = 4d (BERT's MLP width).
planner::KfacLayerCost ProfileLayerCost(const Profile& p) {
  v1::ModelShape shape;
  shape.set_d_model(p.d_model);
  shape.set_num_heads(p.d_model / 64);
  shape.set_ffn_dim(4 * p.d_model);
  const planner::KfacLayerCost flops = planner::EstimateKfacLayerCost(shape, 1, 1);
  planner::KfacLayerCost c;
  const double curvature = p.curvature_ms * 1e-3;
  c.curvature_a_s = curvature * flops.curvature_a_s / (flops.curvature_a_s + flops.curvature_b_s);
  c.curvature_b_s = curvature - c.curvature_a_s;
  double cubes = 0;
  for (double v : flops.invert_a_s) cubes += v;
  for (double v : flops.invert_b_s) cubes += v;
  for (double v : flops.invert_a_s) c.invert_a_s.push_back(p.inversion_ms * 1e-3 * v / cubes);
  for (double v : flops.invert_b_s) c.invert_b_s.push_back(p.inversion_ms * 1e-3 * v / cubes);
  c.precondition_s = p.precondition_ms * 1e-3;
  c.shape = flops.shape;
  return c;
}

// One compute op of a synthetic pipeline: microbatch `mb` at `stage`.
struct Op {
  bool forward = true;
  int mb = 0;
  int stage = 0;
};

// Chimera (Li & Hoefler, SC'21): microbatches [0, N/2) flow down (stage s on
// device s), [N/2, N) flow up (stage s on device D-1-s).
int ChimeraDevice(int D, int N, int mb, int stage) { return mb < N / 2 ? stage : D - 1 - stage; }

// Per-device op order of Chimera, from a list schedule in unit slots
// (forward = backward = one slot). In slot t every device runs one op whose
// input was produced in an earlier slot, choosing by: backward before
// forward; the lower microbatch index within its pipeline; for a forward the
// pipeline in which the device's stage comes earlier, for a backward the one
// in which it comes later (the op with more work after it); the down
// pipeline. The orders are then replayed with the real durations. With N = D
// the replay takes D forward and 2D-2 backward times on its critical path
// for any forward/backward ratio (pipefisher.md §5; checked for D = 2..16).
std::vector<std::vector<Op>> ChimeraOrders(int D, int N) {
  const int half = N / 2;
  std::vector<std::vector<int>> f_slot(N, std::vector<int>(D, -1));
  std::vector<std::vector<int>> b_slot(N, std::vector<int>(D, -1));
  std::vector<std::vector<Op>> orders(D);
  auto done_before = [](int slot, int t) { return slot >= 0 && slot < t; };
  int left = 2 * N * D;
  for (int t = 0; left > 0; ++t) {
    for (int d = 0; d < D; ++d) {
      std::optional<Op> best;
      std::tuple<int, int, int, int> best_key;
      for (int mb = 0; mb < N; ++mb) {
        const int pipe = mb < half ? 0 : 1;
        const int s = pipe == 0 ? d : D - 1 - d;
        const int index = mb - pipe * half;
        if (f_slot[mb][s] < 0 && (s == 0 || done_before(f_slot[mb][s - 1], t))) {
          const std::tuple<int, int, int, int> key{1, index, s, pipe};
          if (!best || key < best_key) best = Op{true, mb, s}, best_key = key;
        }
        if (b_slot[mb][s] < 0 && done_before(s == D - 1 ? f_slot[mb][s] : b_slot[mb][s + 1], t)) {
          const std::tuple<int, int, int, int> key{0, index, -s, pipe};
          if (!best || key < best_key) best = Op{false, mb, s}, best_key = key;
        }
      }
      if (!best) continue;
      (best->forward ? f_slot : b_slot)[best->mb][best->stage] = t;
      orders[d].push_back(*best);
      --left;
    }
  }
  return orders;
}

// Uniform pipeline without communication: each device runs its op list in
// order, an op starting when the device is free and its input has arrived.
absl::StatusOr<Scenario> Synthetic(const KfacArgs& a) {
  Profile p{0, 0, 0, 0, 0, a.blocks, 1024};
  if (!a.profile.empty()) p = Profiles().at(a.profile);
  if (a.forward_ms) p.forward_ms = *a.forward_ms;
  if (a.backward_ms) p.backward_ms = *a.backward_ms;
  if (a.curvature_ms) p.curvature_ms = *a.curvature_ms;
  if (a.inversion_ms) p.inversion_ms = *a.inversion_ms;
  if (a.precondition_ms) p.precondition_ms = *a.precondition_ms;
  if (a.blocks > 0) p.blocks = a.blocks;
  const int D = a.stages, N = a.microbatches;
  if (D > p.blocks) {
    return UsageError(absl::StrFormat("--stages: %d stages for %d blocks", D, p.blocks));
  }
  const bool chimera = a.schedule == "chimera";
  std::vector<int> layers = sim::LayersPerStage(p.blocks, D);
  // The device running microbatch mb's stage s.
  auto device = [&](int mb, int s) { return chimera ? ChimeraDevice(D, N, mb, s) : s; };

  sim::CostTables t;
  for (int d = 0; d < D; ++d) t.node_ids.push_back(absl::StrCat(chimera ? "device" : "stage", d));
  t.memory_slots.assign(D, N);
  t.forward_s.assign(D, std::vector<double>(D, 0));
  t.backward_s.assign(D, std::vector<double>(D, 0));
  for (int d = 0; d < D; ++d) {
    for (int s = 0; s < D; ++s) {
      t.forward_s[d][s] = layers[s] * p.forward_ms * 1e-3;
      t.backward_s[d][s] = layers[s] * p.backward_ms * 1e-3;
    }
  }
  t.loss_s.assign(D, 0);
  t.latency_s.assign(D, std::vector<double>(D, 0));
  t.bandwidth_bytes_per_s.assign(D, std::vector<double>(D, 1e18));
  t.activation_bytes = 0;
  t.stage_gradient_bytes.assign(D, 0);
  ASSIGN_OR_RETURN(sim::CostModel cost, sim::CostModel::FromTables(t));

  std::vector<std::vector<Op>> ops(D);
  if (chimera) {
    ops = ChimeraOrders(D, N);
  } else {
    for (int s = 0; s < D; ++s) {
      if (a.schedule == "gpipe") {
        for (int m = 0; m < N; ++m) ops[s].push_back({true, m, s});
        for (int m = N - 1; m >= 0; --m) ops[s].push_back({false, m, s});
      } else {
        const int warm = std::min(D - 1 - s, N);
        for (int m = 0; m < warm; ++m) ops[s].push_back({true, m, s});
        for (int i = 0; i < N - warm; ++i) {
          ops[s].push_back({true, warm + i, s});
          ops[s].push_back({false, i, s});
        }
        for (int m = N - warm; m < N; ++m) ops[s].push_back({false, m, s});
      }
    }
  }
  // End of microbatch mb's forward (backward) at stage s, -1 before.
  std::vector<std::vector<double>> f_end(N, std::vector<double>(D, -1));
  std::vector<std::vector<double>> b_end(N, std::vector<double>(D, -1));
  std::vector<size_t> next(D, 0);
  std::vector<double> free_at(D, 0);
  sim::SimResult r;
  r.compute.resize(D);
  r.busy_s.assign(D, 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int d = 0; d < D; ++d) {
      while (next[d] < ops[d].size()) {
        const Op op = ops[d][next[d]];
        const int s = op.stage, m = op.mb;
        double ready = 0;
        if (op.forward) {
          ready = s == 0 ? 0 : f_end[m][s - 1];
        } else {
          ready = s == D - 1 ? f_end[m][s] : b_end[m][s + 1];
        }
        if (ready < 0) break;
        const double start = std::max(ready, free_at[d]);
        const double dur = op.forward ? cost.ForwardTime(d, s) : cost.BackwardTime(d, s);
        (op.forward ? f_end : b_end)[m][s] = start + dur;
        free_at[d] = start + dur;
        r.busy_s[d] += dur;
        sim::Activity act;
        act.start_s = start;
        act.end_s = start + dur;
        act.kind = op.forward ? sim::ActivityKind::kForward : sim::ActivityKind::kBackward;
        act.microbatch = m;
        act.stage = s;
        r.compute[d].push_back(act);
        ++next[d];
        progress = true;
      }
    }
  }
  double end = 0, busy = 0;
  for (int d = 0; d < D; ++d) {
    if (next[d] != ops[d].size()) return absl::InternalError("synthetic pipeline deadlocked");
    end = std::max(end, free_at[d]);
    busy += r.busy_s[d];
  }
  r.iteration_time_s = r.pipeline_time_s = end;
  r.utilization = r.pipeline_utilization = end > 0 ? busy / (D * end) : 0;
  r.idle.resize(D);
  r.sends.resize(D);
  for (int d = 0; d < D; ++d) {
    double at = 0;
    for (const sim::Activity& act : r.compute[d]) {
      if (act.start_s > at) r.idle[d].push_back({at, act.start_s});
      at = act.end_s;
    }
    if (end > at) r.idle[d].push_back({at, end});
  }

  Scenario sc{
      absl::StrFormat("synthetic %s: %d stages, %d microbatches%s, %d blocks (%s; ms per block: "
                      "forward %.2f, backward %.2f, curvature %.2f, inversion %.2f, precondition "
                      "%.2f)",
                      a.schedule, D, N,
                      chimera ? absl::StrFormat(" (%d down, %d up; device d holds stages d and "
                                                "%d-d, 2 replicas per stage)",
                                                N / 2, N / 2, D - 1)
                              : "",
                      p.blocks, a.profile.empty() ? "explicit" : a.profile, p.forward_ms,
                      p.backward_ms, p.curvature_ms, p.inversion_ms, p.precondition_ms),
      std::move(cost),
      {},
      std::move(r),
      {},
      {},
      chimera};
  // One timeline row per device, labelled with its down-pipeline stage.
  for (int d = 0; d < D; ++d) sc.plan.assignment.stage_nodes.push_back({d});
  for (int m = 0; m < N; ++m) {
    sim::Route route;
    route.microbatch = m;
    for (int s = 0; s < D; ++s) {
      route.nodes.push_back(device(m, s));
      route.stages.push_back(s);
    }
    sc.plan.routes.push_back(route);
  }
  const planner::KfacLayerCost block = ProfileLayerCost(p);
  std::vector<int> first(D + 1, 0);
  for (int s = 0; s < D; ++s) first[s + 1] = first[s] + layers[s];
  for (int d = 0; d < D; ++d) {
    planner::KfacNodeWork w;
    w.node_id = sc.cost.node_id(d);
    // Chimera: device d holds the blocks of stages d and D-1-d, as does
    // device D-1-d: the two are each other's replicas (the planner groups
    // replicas by `stage` and matches layers by block index).
    std::vector<int> stages = {d};
    if (chimera) stages = {std::min(d, D - 1 - d), std::max(d, D - 1 - d)};
    w.stage = stages[0];
    for (int s : stages) {
      for (int l = first[s]; l < first[s + 1]; ++l) {
        w.layers.push_back(l);
        w.costs.push_back(block);
      }
    }
    sc.workload.nodes.push_back(std::move(w));
  }
  return sc;
}

absl::StatusOr<Scenario> Real(const KfacArgs& a) {
  ASSIGN_OR_RETURN(v1::ClusterSpec cluster, LoadClusterSpec(a.cluster));
  ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec(a.job));
  ASSIGN_OR_RETURN(cluster, NormalizeClusterSpec(cluster));
  ASSIGN_OR_RETURN(sim::CostModel cost, sim::CostModel::Create(cluster, job, a.tflops));
  planner::PlannerOptions o;
  o.seed = a.has_seed ? a.seed : job.seed();
  o.sim.record_timeline = true;
  if (!a.scheduler.empty()) {
    ASSIGN_OR_RETURN(o.scheduler, planner::ParseSchedulerName(a.scheduler));
  }
  ASSIGN_OR_RETURN(planner::PlannedIteration it, planner::PlanIteration(cost, job, o));

  const v1::ModelShape& shape = job.model();
  const v1::PipelineSpec& p = job.pipeline();
  const double tokens = static_cast<double>(p.samples_per_microbatch()) * shape.context_length();
  const double tflops = a.tflops > 0 ? a.tflops : cluster.compute().tflops();
  const int num_stages = it.plan.assignment.num_stages();
  const std::vector<int> stage = it.plan.assignment.NodeStages(cost.num_nodes());
  Scenario sc{"", cost, it.plan, it.result, {}, job.optimizer().kfac()};
  // One block's workload, shared with the coordinator and the workers; the
  // factor sync is priced as the runtime sends it (kfac::SyncSeconds), used
  // only with --replica-sync factors.
  const kfac::BlockWorkload block(shape);
  for (int n = 0; n < cost.num_nodes(); ++n) {
    planner::KfacNodeWork w;
    w.node_id = cost.node_id(n);
    w.stage = stage[n];
    if (stage[n] >= 0) {
      ASSIGN_OR_RETURN(LayerSpan span, StageLayers(shape.num_layers(), num_stages, stage[n]));
      const double flops = tflops * 1e12 * cluster.nodes(n).speed();
      planner::KfacLayerCost c = planner::EstimateKfacLayerCost(block, tokens, flops);
      c.sync_s = planner::StageSyncSeconds(cost, it.plan.assignment.stage_nodes[stage[n]], block,
                                           kfac::ReplicaSync::kFactors);
      for (int l = span.begin; l < span.end; ++l) {
        w.layers.push_back(l);
        w.costs.push_back(c);
      }
    }
    sc.workload.nodes.push_back(std::move(w));
  }
  sc.description = absl::StrFormat(
      "cluster %s, job %s: scheduler %s, %d stages, %d data nodes x %d microbatches, %d "
      "replicas, %s model (%d blocks), %.0f tokens per microbatch, %.0f TFLOP/s per speed unit",
      cluster.name(), job.name(), planner::SchedulerName(it.scheduler), num_stages, p.data_nodes(),
      p.microbatches_per_data_node(), p.replicas_per_stage(),
      shape.preset().empty() ? "explicit" : shape.preset(), shape.num_layers(), tokens, tflops);
  return sc;
}

const char* TaskColour(v1::BubbleTask::Kind k) {
  switch (k) {
    case v1::BubbleTask::KIND_CURVATURE_A: return "#b07aa1";
    case v1::BubbleTask::KIND_CURVATURE_B: return "#d4a6c8";
    case v1::BubbleTask::KIND_SYNC_FACTORS: return "#9c755f";
    case v1::BubbleTask::KIND_INVERT_A: return "#76b7b2";
    default: return "#2f8f89";
  }
}

absl::Status Run(const KfacArgs& a) {
  ASSIGN_OR_RETURN(Scenario sc, a.schedule.empty() ? Real(a) : Synthetic(a));
  v1::KfacSpec& k = sc.kfac;
  k.set_curvature_microbatches(a.curvature_microbatches);
  k.set_slack(a.slack);
  k.set_max_granule_ms(a.max_granule_ms);
  k.set_refresh_interval(a.refresh_interval);
  k.set_placement(a.serial ? v1::KFAC_PLACEMENT_SERIAL : v1::KFAC_PLACEMENT_BUBBLES);
  for (const auto& group : sc.plan.assignment.stage_nodes) sc.replicated |= group.size() > 1;
  const planner::IterationTimeline timeline = planner::TimelineFromSimulation(sc.result);
  // auto: the job's choice (KFAC_REPLICA_SYNC_AUTO) on this plan.
  std::optional<planner::ReplicaSyncChoice> choice;
  if (sc.replicated && !a.sync) {
    ASSIGN_OR_RETURN(choice,
                     planner::ChooseReplicaSync(sc.workload, k, sc.plan, timeline, a.refreshes));
  }
  const kfac::ReplicaSync sync = choice ? choice->sync : a.sync.value_or(kfac::ReplicaSync::kNone);
  k.set_sync_factors(sync == kfac::ReplicaSync::kFactors);
  k.set_replica_sync(sync == kfac::ReplicaSync::kFactors ? v1::KFAC_REPLICA_SYNC_FACTORS
                     : sync == kfac::ReplicaSync::kPreconditioned
                         ? v1::KFAC_REPLICA_SYNC_PRECONDITIONED
                         : v1::KFAC_REPLICA_SYNC_UNSPECIFIED);
  const char* sync_name = sync == kfac::ReplicaSync::kFactors          ? "factors"
                          : sync == kfac::ReplicaSync::kPreconditioned ? "preconditioned"
                                                                       : "none";

  ASSIGN_OR_RETURN(planner::BubblePlanner bp, planner::BubblePlanner::Create(sc.workload, k));
  const int max_iterations = a.iterations > 0 ? a.iterations : 1000;
  std::vector<planner::IterationBubbles> its;
  int holders = 0;
  for (const auto& w : sc.workload.nodes) holders += !w.layers.empty();
  for (int i = 0; i < max_iterations; ++i) {
    ASSIGN_OR_RETURN(planner::IterationBubbles b, bp.PlanIteration(i, sc.plan, timeline));
    its.push_back(std::move(b));
    if (a.iterations == 0 && bp.completed_refreshes() >= static_cast<uint64_t>(a.refreshes)) {
      break;
    }
  }
  // Totals over the iterations: node-seconds busy and available.
  double before_num = 0, before_den = 0, after_num = 0, after_den = 0, end_sum = 0, time_sum = 0;
  for (const auto& b : its) {
    before_num += b.utilization_before * holders * timeline.end_s;
    before_den += holders * timeline.end_s;
    after_num += b.utilization_after * holders * b.iteration_time_s;
    after_den += holders * b.iteration_time_s;
    end_sum += timeline.end_s;
    time_sum += b.iteration_time_s;
  }
  const double before = before_den > 0 ? before_num / before_den : 0;
  const double after = after_den > 0 ? after_num / after_den : 0;
  const double overhead = end_sum > 0 ? time_sum / end_sum - 1 : 0;
  // The steady state: the iterations after the first activation (the
  // start-up iterations cannot have an earlier refresh's inversions to fill
  // their bubbles); nullopt when no iteration follows it.
  std::optional<double> steady;
  int steady_iterations = 0;
  {
    double num = 0, den = 0;
    bool activated = false;
    for (const auto& b : its) {
      if (activated) {
        num += b.utilization_after * holders * b.iteration_time_s;
        den += holders * b.iteration_time_s;
        ++steady_iterations;
      }
      activated |= b.activate_refresh.has_value();
    }
    if (den > 0) steady = num / den;
  }
  // The longest task placed in a gap: the most pipeline work arriving while
  // K-FAC runs waits (serial tasks run after the node's pipeline work).
  double longest_s = 0;
  std::string longest_what = "none";
  for (const auto& b : its) {
    for (const v1::BubbleTask& t : b.tasks) {
      if (t.serial() || t.planned_duration_s() <= longest_s) continue;
      longest_s = t.planned_duration_s();
      longest_what = absl::StrCat(
          absl::AsciiStrToLower(v1::BubbleTask::Kind_Name(t.kind()).substr(5)),
          t.module().empty() ? "" : absl::StrCat(" ", t.module()),
          t.num_parts() > 1 ? absl::StrCat(" part ", t.part() + 1, "/", t.num_parts()) : "");
    }
  }

  if (!a.svg.empty()) {
    size_t pick = 0;
    for (size_t i = 0; i < its.size(); ++i) {
      if (!its[i].tasks.empty()) {
        pick = i;
        break;
      }
    }
    sim::SvgOptions o;
    o.title =
        absl::StrFormat("K-FAC in the bubbles, iteration %d (utilisation %.1f%% -> %.1f%%)", pick,
                        100 * its[pick].utilization_before, 100 * its[pick].utilization_after);
    o.max_time_s = its[pick].iteration_time_s;
    std::map<std::string, int> index;
    for (size_t n = 0; n < sc.workload.nodes.size(); ++n) {
      index[sc.workload.nodes[n].node_id] = static_cast<int>(n);
    }
    for (const v1::BubbleTask& t : its[pick].tasks) {
      sim::SvgOverlay ov;
      ov.node = index[t.node()];
      ov.start_s = t.planned_start_s();
      ov.end_s = t.planned_start_s() + t.planned_duration_s();
      ov.colour = TaskColour(t.kind());
      ov.label = absl::StrCat(v1::BubbleTask::Kind_Name(t.kind()), " layer ", t.layer(),
                              t.module().empty() ? "" : absl::StrCat(" ", t.module()),
                              t.serial() ? " (serial)" : "");
      o.overlays.push_back(std::move(ov));
    }
    for (auto kind : {v1::BubbleTask::KIND_CURVATURE_A, v1::BubbleTask::KIND_CURVATURE_B,
                      v1::BubbleTask::KIND_SYNC_FACTORS, v1::BubbleTask::KIND_INVERT_A,
                      v1::BubbleTask::KIND_INVERT_B}) {
      static const std::map<int, const char*> names = {
          {v1::BubbleTask::KIND_CURVATURE_A, "K-FAC curvature A"},
          {v1::BubbleTask::KIND_CURVATURE_B, "curvature B"},
          {v1::BubbleTask::KIND_SYNC_FACTORS, "factor sync"},
          {v1::BubbleTask::KIND_INVERT_A, "inversion A"},
          {v1::BubbleTask::KIND_INVERT_B, "inversion B"}};
      o.overlay_legend.push_back({TaskColour(kind), names.at(kind)});
    }
    RETURN_IF_ERROR(WriteFileAtomically(a.svg, sim::TimelineSvg(sc.cost, sc.plan, sc.result, o)));
  }

  if (a.json) {
    sim::JsonWriter w;
    w.BeginObject();
    w.Key("scenario");
    w.String(sc.description);
    w.Key("curvature_microbatches");
    w.Int(k.curvature_microbatches());
    w.Key("slack");
    w.Number(k.slack());
    w.Key("placement");
    w.String(a.serial ? "serial" : "bubbles");
    w.Key("sync_factors");
    w.Bool(k.sync_factors());
    w.Key("replica_sync");
    w.String(sync_name);
    w.Key("replica_sync_choice");
    if (choice) {
      w.BeginObject();
      w.Key("factors_iteration_s");
      w.Number(choice->factors_s);
      w.Key("preconditioned_iteration_s");
      w.Number(choice->preconditioned_s);
      w.Key("iterations");
      w.Int(choice->iterations);
      w.Key("reason");
      w.String(choice->reason);
      w.EndObject();
    } else {
      w.Null();
    }
    w.Key("pipeline_time_s");
    w.Number(timeline.end_s);
    w.Key("utilization_before");
    w.Number(before);
    w.Key("utilization_after");
    w.Number(after);
    w.Key("time_overhead");
    w.Number(overhead);
    w.Key("utilization_after_steady");
    if (steady) {
      w.Number(*steady);
    } else {
      w.Null();
    }
    w.Key("steady_iterations");
    w.Int(steady_iterations);
    w.Key("max_granule_ms");
    w.Number(k.max_granule_ms());
    w.Key("longest_bubble_task_ms");
    w.Number(longest_s * 1e3);
    w.Key("longest_bubble_task");
    w.String(longest_what);
    w.Key("completed_refreshes");
    w.Int(static_cast<int64_t>(bp.completed_refreshes()));
    w.Key("mean_refresh_interval");
    w.Number(bp.mean_refresh_interval());
    w.Key("refresh_intervals");
    w.IntArray(bp.refresh_intervals());
    w.Key("iterations");
    w.BeginArray();
    for (size_t i = 0; i < its.size(); ++i) {
      const auto& b = its[i];
      double bubble = 0, serial = 0;
      for (double v : b.bubble_s) bubble += v;
      for (double v : b.serial_s) serial = std::max(serial, v);
      w.BeginObject();
      w.Key("iteration");
      w.Int(static_cast<int64_t>(i));
      w.Key("iteration_time_s");
      w.Number(b.iteration_time_s);
      w.Key("utilization_before");
      w.Number(b.utilization_before);
      w.Key("utilization_after");
      w.Number(b.utilization_after);
      w.Key("bubble_s");
      w.Number(bubble);
      w.Key("serial_s");
      w.Number(serial);
      w.Key("tasks");
      w.Int(static_cast<int64_t>(b.tasks.size()));
      w.Key("activate_refresh");
      if (b.activate_refresh) {
        w.Int(static_cast<int64_t>(*b.activate_refresh));
      } else {
        w.Null();
      }
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
    std::cout << w.str() << "\n";
    return absl::OkStatus();
  }
  std::cout << sc.description << "\n";
  std::cout << absl::StrFormat(
      "K-FAC: %d curvature microbatch(es) per node, slack %.0f%%, %s, refresh interval %s, "
      "replica sync %s, granules up to %s\n\n",
      k.curvature_microbatches(), 100 * k.slack(), a.serial ? "serial placement" : "in the bubbles",
      k.refresh_interval() ? absl::StrCat(k.refresh_interval()) : "as the bubbles allow",
      choice ? absl::StrCat(sync_name, " (auto)") : std::string(sync_name),
      k.max_granule_ms() > 0 ? absl::StrFormat("%g ms", k.max_granule_ms()) : "whole items");
  if (choice) std::cout << choice->reason << "\n\n";
  std::cout << absl::StrFormat("%9s %12s %12s %10s %10s %10s %6s %8s\n", "iteration", "pipeline_s",
                               "iteration_s", "before", "after", "serial_s", "tasks", "refresh");
  for (size_t i = 0; i < its.size(); ++i) {
    const auto& b = its[i];
    double serial = 0;
    for (double v : b.serial_s) serial = std::max(serial, v);
    std::cout << absl::StrFormat(
        "%9d %12.3f %12.3f %9.1f%% %9.1f%% %10.3f %6d %8s\n", i, timeline.end_s, b.iteration_time_s,
        100 * b.utilization_before, 100 * b.utilization_after, serial, b.tasks.size(),
        b.activate_refresh ? absl::StrCat("r", *b.activate_refresh) : std::string("-"));
  }
  std::cout << absl::StrFormat(
      "\nutilisation %.1f%% -> %.1f%% with K-FAC; time +%.1f%% (serial work and preconditioning); "
      "%d refreshes, mean refresh interval %.2f iterations\n"
      "longest K-FAC task in a gap: %.1f ms (%s)\n",
      100 * before, 100 * after, 100 * overhead, bp.completed_refreshes(),
      bp.mean_refresh_interval(), 1e3 * longest_s, longest_what);
  if (steady) {
    std::cout << absl::StrFormat(
        "steady state (the %d iterations after the first activation): utilisation %.1f%% "
        "with K-FAC\n",
        steady_iterations, 100 * *steady);
  }
  return absl::OkStatus();
}

}  // namespace

int RunKfac(const std::vector<std::string>& args) {
  FlagSet flags("detour-sim kfac", kKfacSummary);
  absl::StatusOr<KfacArgs> a = Parse(flags, args);
  absl::Status s = a.ok() ? Run(*a) : a.status();
  if (s.ok()) return 0;
  if (absl::IsCancelled(s)) return flags.Fail(s);  // --help
  if (absl::IsInvalidArgument(s) && (!a.ok() || absl::StartsWith(s.message(), "usage: "))) {
    absl::string_view message = s.message();
    absl::ConsumePrefix(&message, "usage: ");
    return flags.Fail(absl::InvalidArgumentError(message));
  }
  std::cerr << "detour-sim kfac: error: " << s.ToString() << "\n";
  return 1;
}

}  // namespace detour::sim_tool
