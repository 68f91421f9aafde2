#include "tools/detour_sim/kfac.h"

#include <algorithm>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
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
#include "tools/detour_sim/kfac_options.h"

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
planner::KfacLayerCost ProfileLayerCost(const BlockProfile& p) {
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

// The per-block times of a synthetic run: the named profile, if any, with
// the explicit --*-ms and --blocks values over it.
BlockProfile SyntheticProfile(const KfacArgs& a) {
  BlockProfile p{0, 0, 0, 0, 0, a.blocks, 1024};
  if (!a.profile.empty()) p = BlockProfiles().at(a.profile);
  if (a.forward_ms) p.forward_ms = *a.forward_ms;
  if (a.backward_ms) p.backward_ms = *a.backward_ms;
  if (a.curvature_ms) p.curvature_ms = *a.curvature_ms;
  if (a.inversion_ms) p.inversion_ms = *a.inversion_ms;
  if (a.precondition_ms) p.precondition_ms = *a.precondition_ms;
  if (a.blocks > 0) p.blocks = a.blocks;
  return p;
}

// A synthetic pipeline: D stages on D devices, N microbatches, `layers[s]`
// of the profile's blocks at stage s.
struct SyntheticShape {
  std::string schedule;  // gpipe, 1f1b or chimera
  int D = 0, N = 0;
  std::vector<int> layers;

  bool chimera() const { return schedule == "chimera"; }
  // The device running microbatch mb's stage s.
  int Device(int mb, int s) const { return chimera() ? ChimeraDevice(D, N, mb, s) : s; }
};

// Every device can run every stage at the profile's per-block times; links
// are free and instant, so the pipeline has no communication.
absl::StatusOr<sim::CostModel> SyntheticCostModel(const SyntheticShape& shape,
                                                  const BlockProfile& p) {
  const int D = shape.D, N = shape.N;
  sim::CostTables t;
  for (int d = 0; d < D; ++d) {
    t.node_ids.push_back(absl::StrCat(shape.chimera() ? "device" : "stage", d));
  }
  t.memory_slots.assign(D, N);
  t.forward_s.assign(D, std::vector<double>(D, 0));
  t.backward_s.assign(D, std::vector<double>(D, 0));
  for (int d = 0; d < D; ++d) {
    for (int s = 0; s < D; ++s) {
      t.forward_s[d][s] = shape.layers[s] * p.forward_ms * 1e-3;
      t.backward_s[d][s] = shape.layers[s] * p.backward_ms * 1e-3;
    }
  }
  t.loss_s.assign(D, 0);
  t.latency_s.assign(D, std::vector<double>(D, 0));
  t.bandwidth_bytes_per_s.assign(D, std::vector<double>(D, 1e18));
  t.activation_bytes = 0;
  t.stage_gradient_bytes.assign(D, 0);
  return sim::CostModel::FromTables(t);
}

// GPipe at stage s: all forwards, then the backwards in reverse microbatch
// order.
std::vector<Op> GpipeOrder(int N, int s) {
  std::vector<Op> ops;
  for (int m = 0; m < N; ++m) ops.push_back({true, m, s});
  for (int m = N - 1; m >= 0; --m) ops.push_back({false, m, s});
  return ops;
}

// 1F1B at stage s of D: min(D-1-s, N) warm-up forwards, then one forward
// and one backward in turn, then the remaining backwards.
std::vector<Op> OneFOneBOrder(int D, int N, int s) {
  std::vector<Op> ops;
  const int warm = std::min(D - 1 - s, N);
  for (int m = 0; m < warm; ++m) ops.push_back({true, m, s});
  for (int i = 0; i < N - warm; ++i) {
    ops.push_back({true, warm + i, s});
    ops.push_back({false, i, s});
  }
  for (int m = N - warm; m < N; ++m) ops.push_back({false, m, s});
  return ops;
}

// Each device's op order under the shape's schedule.
std::vector<std::vector<Op>> OpOrders(const SyntheticShape& shape) {
  if (shape.chimera()) return ChimeraOrders(shape.D, shape.N);
  std::vector<std::vector<Op>> ops(shape.D);
  for (int s = 0; s < shape.D; ++s) {
    ops[s] =
        shape.schedule == "gpipe" ? GpipeOrder(shape.N, s) : OneFOneBOrder(shape.D, shape.N, s);
  }
  return ops;
}

// Records the gaps between each device's compute activities, up to `end`.
void AddIdleGaps(double end, sim::SimResult& r) {
  r.idle.resize(r.compute.size());
  for (size_t d = 0; d < r.compute.size(); ++d) {
    double at = 0;
    for (const sim::Activity& act : r.compute[d]) {
      if (act.start_s > at) r.idle[d].push_back({at, act.start_s});
      at = act.end_s;
    }
    if (end > at) r.idle[d].push_back({at, end});
  }
}

// Replays each device's op list in order: an op starts when its device is
// free and its input has arrived. The result holds the timeline's compute
// activities and idle gaps; there are no sends.
absl::StatusOr<sim::SimResult> ReplayOps(const SyntheticShape& shape, const sim::CostModel& cost,
                                         const std::vector<std::vector<Op>>& ops) {
  const int D = shape.D, N = shape.N;
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
  r.sends.resize(D);
  AddIdleGaps(end, r);
  return r;
}

// The report's first line: the schedule, the pipeline's shape and the
// per-block times.
std::string SyntheticDescription(const KfacArgs& a, const SyntheticShape& shape,
                                 const BlockProfile& p) {
  const int D = shape.D, N = shape.N;
  return absl::StrFormat(
      "synthetic %s: %d stages, %d microbatches%s, %d blocks (%s; ms per block: forward %.2f, "
      "backward %.2f, curvature %.2f, inversion %.2f, precondition %.2f)",
      a.schedule, D, N,
      shape.chimera() ? absl::StrFormat(" (%d down, %d up; device d holds stages d and %d-d, 2 "
                                        "replicas per stage)",
                                        N / 2, N / 2, D - 1)
                      : "",
      p.blocks, a.profile.empty() ? "explicit" : a.profile, p.forward_ms, p.backward_ms,
      p.curvature_ms, p.inversion_ms, p.precondition_ms);
}

// One timeline row per device, labelled with its down-pipeline stage, and
// each microbatch's route over the devices.
sim::Plan SyntheticPlan(const SyntheticShape& shape) {
  sim::Plan plan;
  for (int d = 0; d < shape.D; ++d) plan.assignment.stage_nodes.push_back({d});
  for (int m = 0; m < shape.N; ++m) {
    sim::Route route;
    route.microbatch = m;
    for (int s = 0; s < shape.D; ++s) {
      route.nodes.push_back(shape.Device(m, s));
      route.stages.push_back(s);
    }
    plan.routes.push_back(route);
  }
  return plan;
}

// Each device's K-FAC work: the blocks of the stages it holds, each at the
// profile's costs.
planner::KfacWorkload SyntheticWorkload(const SyntheticShape& shape, const BlockProfile& p,
                                        const sim::CostModel& cost) {
  const int D = shape.D;
  const planner::KfacLayerCost block = ProfileLayerCost(p);
  std::vector<int> first(D + 1, 0);
  for (int s = 0; s < D; ++s) first[s + 1] = first[s] + shape.layers[s];
  planner::KfacWorkload workload;
  for (int d = 0; d < D; ++d) {
    planner::KfacNodeWork w;
    w.node_id = cost.node_id(d);
    // Chimera: device d holds the blocks of stages d and D-1-d, as does
    // device D-1-d: the two are each other's replicas (the planner groups
    // replicas by `stage` and matches layers by block index).
    std::vector<int> stages = {d};
    if (shape.chimera()) stages = {std::min(d, D - 1 - d), std::max(d, D - 1 - d)};
    w.stage = stages[0];
    for (int s : stages) {
      for (int l = first[s]; l < first[s + 1]; ++l) {
        w.layers.push_back(l);
        w.costs.push_back(block);
      }
    }
    workload.nodes.push_back(std::move(w));
  }
  return workload;
}

// Uniform pipeline without communication: the schedule's op orders
// replayed with the profile's times, every device holding K-FAC work for
// its blocks.
absl::StatusOr<Scenario> Synthetic(const KfacArgs& a) {
  const BlockProfile p = SyntheticProfile(a);
  if (a.stages > p.blocks) {
    return KfacUsageError(absl::StrFormat("--stages: %d stages for %d blocks", a.stages, p.blocks));
  }
  const SyntheticShape shape{a.schedule, a.stages, a.microbatches,
                             sim::LayersPerStage(p.blocks, a.stages)};
  ASSIGN_OR_RETURN(sim::CostModel cost, SyntheticCostModel(shape, p));
  ASSIGN_OR_RETURN(sim::SimResult result, ReplayOps(shape, cost, OpOrders(shape)));
  planner::KfacWorkload workload = SyntheticWorkload(shape, p, cost);
  return Scenario{SyntheticDescription(a, shape, p),
                  std::move(cost),
                  SyntheticPlan(shape),
                  std::move(result),
                  std::move(workload),
                  {},
                  shape.chimera()};
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

// Puts the flags' K-FAC settings into the scenario's spec; they override a
// real job's own.
void ApplyKfacFlags(const KfacArgs& a, v1::KfacSpec& k) {
  k.set_curvature_microbatches(a.curvature_microbatches);
  k.set_slack(a.slack);
  k.set_max_granule_ms(a.max_granule_ms);
  k.set_refresh_interval(a.refresh_interval);
  k.set_placement(a.serial ? v1::KFAC_PLACEMENT_SERIAL : v1::KFAC_PLACEMENT_BUBBLES);
}

// How replicas stay identical in a run and, when it was chosen as for a
// job's KFAC_REPLICA_SYNC_AUTO, the comparison behind the choice.
struct SyncSetting {
  kfac::ReplicaSync sync = kfac::ReplicaSync::kNone;
  std::optional<planner::ReplicaSyncChoice> choice;
};

// The flags' setting, none by default; with replicas and no setting (or
// auto), the job's choice on this plan.
absl::StatusOr<SyncSetting> ChooseSync(const KfacArgs& a, const Scenario& sc,
                                       const planner::IterationTimeline& timeline) {
  SyncSetting s;
  if (sc.replicated && !a.sync) {
    ASSIGN_OR_RETURN(
        s.choice, planner::ChooseReplicaSync(sc.workload, sc.kfac, sc.plan, timeline, a.refreshes));
  }
  s.sync = s.choice ? s.choice->sync : a.sync.value_or(kfac::ReplicaSync::kNone);
  return s;
}

// Records `sync` in the spec in both of its forms.
void SetReplicaSync(kfac::ReplicaSync sync, v1::KfacSpec& k) {
  k.set_sync_factors(sync == kfac::ReplicaSync::kFactors);
  k.set_replica_sync(sync == kfac::ReplicaSync::kFactors ? v1::KFAC_REPLICA_SYNC_FACTORS
                     : sync == kfac::ReplicaSync::kPreconditioned
                         ? v1::KFAC_REPLICA_SYNC_PRECONDITIONED
                         : v1::KFAC_REPLICA_SYNC_UNSPECIFIED);
}

// The --replica-sync word for `sync`.
const char* ReplicaSyncName(kfac::ReplicaSync sync) {
  return sync == kfac::ReplicaSync::kFactors          ? "factors"
         : sync == kfac::ReplicaSync::kPreconditioned ? "preconditioned"
                                                      : "none";
}

// The iterations planned with K-FAC, and the bubble planner's refreshes
// after them.
struct KfacRun {
  double pipeline_time_s = 0;  // one iteration without K-FAC
  std::vector<planner::IterationBubbles> iterations;
  uint64_t completed_refreshes = 0;
  double mean_refresh_interval = 0;
  std::vector<int> refresh_intervals;
};

// Plans --iterations iterations, or (at most 1000) until --refreshes
// refreshes are complete, all on the same pipeline timeline.
absl::StatusOr<KfacRun> PlanIterations(const KfacArgs& a, const Scenario& sc,
                                       const planner::IterationTimeline& timeline) {
  ASSIGN_OR_RETURN(planner::BubblePlanner bp, planner::BubblePlanner::Create(sc.workload, sc.kfac));
  KfacRun run;
  run.pipeline_time_s = timeline.end_s;
  const int max_iterations = a.iterations > 0 ? a.iterations : 1000;
  for (int i = 0; i < max_iterations; ++i) {
    ASSIGN_OR_RETURN(planner::IterationBubbles b, bp.PlanIteration(i, sc.plan, timeline));
    run.iterations.push_back(std::move(b));
    if (a.iterations == 0 && bp.completed_refreshes() >= static_cast<uint64_t>(a.refreshes)) {
      break;
    }
  }
  run.completed_refreshes = bp.completed_refreshes();
  run.mean_refresh_interval = bp.mean_refresh_interval();
  run.refresh_intervals = bp.refresh_intervals();
  return run;
}

// The nodes with K-FAC work: utilisation counts their time.
int KfacHolders(const planner::KfacWorkload& workload) {
  int holders = 0;
  for (const auto& w : workload.nodes) holders += !w.layers.empty();
  return holders;
}

// The steady state: the iterations after the first activation (the
// start-up iterations cannot have an earlier refresh's inversions to fill
// their bubbles).
struct SteadyState {
  std::optional<double> utilization;  // nullopt when no iteration follows it
  int iterations = 0;
};

SteadyState SteadyUtilization(const KfacRun& run, int holders) {
  SteadyState steady;
  double num = 0, den = 0;
  bool activated = false;
  for (const auto& b : run.iterations) {
    if (activated) {
      num += b.utilization_after * holders * b.iteration_time_s;
      den += holders * b.iteration_time_s;
      ++steady.iterations;
    }
    activated |= b.activate_refresh.has_value();
  }
  if (den > 0) steady.utilization = num / den;
  return steady;
}

// The longest task placed in a gap: the most pipeline work arriving while
// K-FAC runs waits (serial tasks run after the node's pipeline work).
struct LongestTask {
  double s = 0;
  std::string what = "none";
};

LongestTask LongestGapTask(const KfacRun& run) {
  LongestTask longest;
  for (const auto& b : run.iterations) {
    for (const v1::BubbleTask& t : b.tasks) {
      if (t.serial() || t.planned_duration_s() <= longest.s) continue;
      longest.s = t.planned_duration_s();
      longest.what = absl::StrCat(
          absl::AsciiStrToLower(v1::BubbleTask::Kind_Name(t.kind()).substr(5)),
          t.module().empty() ? "" : absl::StrCat(" ", t.module()),
          t.num_parts() > 1 ? absl::StrCat(" part ", t.part() + 1, "/", t.num_parts()) : "");
    }
  }
  return longest;
}

// What the report says about the planned iterations.
struct Summary {
  // Utilisation over all iterations without and with K-FAC (node-seconds
  // busy over available), and the iteration time added by K-FAC.
  double before = 0, after = 0, overhead = 0;
  SteadyState steady;
  LongestTask longest;
};

Summary Summarize(const KfacRun& run, int holders) {
  const double pipeline_s = run.pipeline_time_s;
  double before_num = 0, before_den = 0, after_num = 0, after_den = 0, end_sum = 0, time_sum = 0;
  for (const auto& b : run.iterations) {
    before_num += b.utilization_before * holders * pipeline_s;
    before_den += holders * pipeline_s;
    after_num += b.utilization_after * holders * b.iteration_time_s;
    after_den += holders * b.iteration_time_s;
    end_sum += pipeline_s;
    time_sum += b.iteration_time_s;
  }
  Summary s;
  s.before = before_den > 0 ? before_num / before_den : 0;
  s.after = after_den > 0 ? after_num / after_den : 0;
  s.overhead = end_sum > 0 ? time_sum / end_sum - 1 : 0;
  s.steady = SteadyUtilization(run, holders);
  s.longest = LongestGapTask(run);
  return s;
}

// The first iteration with K-FAC work; the first iteration if none has any.
size_t FirstIterationWithTasks(const std::vector<planner::IterationBubbles>& its) {
  for (size_t i = 0; i < its.size(); ++i) {
    if (!its[i].tasks.empty()) return i;
  }
  return 0;
}

// One bar per task of `b` over its node's timeline row.
std::vector<sim::SvgOverlay> TaskOverlays(const planner::KfacWorkload& workload,
                                          const planner::IterationBubbles& b) {
  std::map<std::string, int> index;
  for (size_t n = 0; n < workload.nodes.size(); ++n) {
    index[workload.nodes[n].node_id] = static_cast<int>(n);
  }
  std::vector<sim::SvgOverlay> overlays;
  for (const v1::BubbleTask& t : b.tasks) {
    sim::SvgOverlay ov;
    ov.node = index[t.node()];
    ov.start_s = t.planned_start_s();
    ov.end_s = t.planned_start_s() + t.planned_duration_s();
    ov.colour = TaskColour(t.kind());
    ov.label = absl::StrCat(v1::BubbleTask::Kind_Name(t.kind()), " layer ", t.layer(),
                            t.module().empty() ? "" : absl::StrCat(" ", t.module()),
                            t.serial() ? " (serial)" : "");
    overlays.push_back(std::move(ov));
  }
  return overlays;
}

// The legend of TaskColour's colours.
std::vector<std::pair<std::string, std::string>> TaskLegend() {
  static const std::map<int, const char*> names = {
      {v1::BubbleTask::KIND_CURVATURE_A, "K-FAC curvature A"},
      {v1::BubbleTask::KIND_CURVATURE_B, "curvature B"},
      {v1::BubbleTask::KIND_SYNC_FACTORS, "factor sync"},
      {v1::BubbleTask::KIND_INVERT_A, "inversion A"},
      {v1::BubbleTask::KIND_INVERT_B, "inversion B"}};
  std::vector<std::pair<std::string, std::string>> legend;
  for (auto kind : {v1::BubbleTask::KIND_CURVATURE_A, v1::BubbleTask::KIND_CURVATURE_B,
                    v1::BubbleTask::KIND_SYNC_FACTORS, v1::BubbleTask::KIND_INVERT_A,
                    v1::BubbleTask::KIND_INVERT_B}) {
    legend.push_back({TaskColour(kind), names.at(kind)});
  }
  return legend;
}

// Writes the pipeline's timeline with the K-FAC tasks of the first
// iteration that has any over it.
absl::Status WriteSvg(const std::string& path, const Scenario& sc, const KfacRun& run) {
  const size_t pick = FirstIterationWithTasks(run.iterations);
  const planner::IterationBubbles& b = run.iterations[pick];
  sim::SvgOptions o;
  o.title = absl::StrFormat("K-FAC in the bubbles, iteration %d (utilisation %.1f%% -> %.1f%%)",
                            pick, 100 * b.utilization_before, 100 * b.utilization_after);
  o.max_time_s = b.iteration_time_s;
  o.overlays = TaskOverlays(sc.workload, b);
  o.overlay_legend = TaskLegend();
  return WriteFileAtomically(path, sim::TimelineSvg(sc.cost, sc.plan, sc.result, o));
}

// The auto choice's comparison; null when the sync was not chosen.
void WriteSyncChoiceJson(const std::optional<planner::ReplicaSyncChoice>& choice,
                         sim::JsonWriter& w) {
  if (!choice) {
    w.Null();
    return;
  }
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
}

// Per iteration: its time, utilisation, bubble and serial seconds, tasks and
// the refresh it activates.
void WriteIterationsJson(const std::vector<planner::IterationBubbles>& its, sim::JsonWriter& w) {
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
}

// The --json report: the settings, the summary and one object per
// iteration.
void PrintJson(const Scenario& sc, const KfacArgs& a, const SyncSetting& sync, const KfacRun& run,
               const Summary& s) {
  const v1::KfacSpec& k = sc.kfac;
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
  w.String(ReplicaSyncName(sync.sync));
  w.Key("replica_sync_choice");
  WriteSyncChoiceJson(sync.choice, w);
  w.Key("pipeline_time_s");
  w.Number(run.pipeline_time_s);
  w.Key("utilization_before");
  w.Number(s.before);
  w.Key("utilization_after");
  w.Number(s.after);
  w.Key("time_overhead");
  w.Number(s.overhead);
  w.Key("utilization_after_steady");
  if (s.steady.utilization) {
    w.Number(*s.steady.utilization);
  } else {
    w.Null();
  }
  w.Key("steady_iterations");
  w.Int(s.steady.iterations);
  w.Key("max_granule_ms");
  w.Number(k.max_granule_ms());
  w.Key("longest_bubble_task_ms");
  w.Number(s.longest.s * 1e3);
  w.Key("longest_bubble_task");
  w.String(s.longest.what);
  w.Key("completed_refreshes");
  w.Int(static_cast<int64_t>(run.completed_refreshes));
  w.Key("mean_refresh_interval");
  w.Number(run.mean_refresh_interval);
  w.Key("refresh_intervals");
  w.IntArray(run.refresh_intervals);
  w.Key("iterations");
  WriteIterationsJson(run.iterations, w);
  w.EndObject();
  std::cout << w.str() << "\n";
}

// The text report: the settings, one row per iteration, then the summary.
void PrintText(const Scenario& sc, const KfacArgs& a, const SyncSetting& sync, const KfacRun& run,
               const Summary& s) {
  const v1::KfacSpec& k = sc.kfac;
  const char* sync_name = ReplicaSyncName(sync.sync);
  std::cout << sc.description << "\n";
  std::cout << absl::StrFormat(
      "K-FAC: %d curvature microbatch(es) per node, slack %.0f%%, %s, refresh interval %s, "
      "replica sync %s, granules up to %s\n\n",
      k.curvature_microbatches(), 100 * k.slack(), a.serial ? "serial placement" : "in the bubbles",
      k.refresh_interval() ? absl::StrCat(k.refresh_interval()) : "as the bubbles allow",
      sync.choice ? absl::StrCat(sync_name, " (auto)") : std::string(sync_name),
      k.max_granule_ms() > 0 ? absl::StrFormat("%g ms", k.max_granule_ms()) : "whole items");
  if (sync.choice) std::cout << sync.choice->reason << "\n\n";
  std::cout << absl::StrFormat("%9s %12s %12s %10s %10s %10s %6s %8s\n", "iteration", "pipeline_s",
                               "iteration_s", "before", "after", "serial_s", "tasks", "refresh");
  for (size_t i = 0; i < run.iterations.size(); ++i) {
    const auto& b = run.iterations[i];
    double serial = 0;
    for (double v : b.serial_s) serial = std::max(serial, v);
    std::cout << absl::StrFormat(
        "%9d %12.3f %12.3f %9.1f%% %9.1f%% %10.3f %6d %8s\n", i, run.pipeline_time_s,
        b.iteration_time_s, 100 * b.utilization_before, 100 * b.utilization_after, serial,
        b.tasks.size(),
        b.activate_refresh ? absl::StrCat("r", *b.activate_refresh) : std::string("-"));
  }
  std::cout << absl::StrFormat(
      "\nutilisation %.1f%% -> %.1f%% with K-FAC; time +%.1f%% (serial work and preconditioning); "
      "%d refreshes, mean refresh interval %.2f iterations\n"
      "longest K-FAC task in a gap: %.1f ms (%s)\n",
      100 * s.before, 100 * s.after, 100 * s.overhead, run.completed_refreshes,
      run.mean_refresh_interval, 1e3 * s.longest.s, s.longest.what);
  if (s.steady.utilization) {
    std::cout << absl::StrFormat(
        "steady state (the %d iterations after the first activation): utilisation %.1f%% "
        "with K-FAC\n",
        s.steady.iterations, 100 * *s.steady.utilization);
  }
}

// Plans K-FAC into the iterations of the scenario the flags describe and
// reports them (and the first with K-FAC work as --svg).
absl::Status Run(const KfacArgs& a) {
  ASSIGN_OR_RETURN(Scenario sc, a.schedule.empty() ? Real(a) : Synthetic(a));
  ApplyKfacFlags(a, sc.kfac);
  for (const auto& group : sc.plan.assignment.stage_nodes) sc.replicated |= group.size() > 1;
  const planner::IterationTimeline timeline = planner::TimelineFromSimulation(sc.result);
  ASSIGN_OR_RETURN(const SyncSetting sync, ChooseSync(a, sc, timeline));
  SetReplicaSync(sync.sync, sc.kfac);
  ASSIGN_OR_RETURN(const KfacRun run, PlanIterations(a, sc, timeline));
  const Summary summary = Summarize(run, KfacHolders(sc.workload));
  if (!a.svg.empty()) RETURN_IF_ERROR(WriteSvg(a.svg, sc, run));
  if (a.json) {
    PrintJson(sc, a, sync, run, summary);
  } else {
    PrintText(sc, a, sync, run, summary);
  }
  return absl::OkStatus();
}

}  // namespace

int RunKfac(const std::vector<std::string>& args) {
  FlagSet flags("detour-sim kfac", kKfacSummary);
  flags.SetEpilog(kKfacEpilog);
  absl::StatusOr<KfacArgs> a = ParseKfacArgs(flags, args);
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
