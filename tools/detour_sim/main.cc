// detour-sim: plan and simulate an iteration of a job on a cluster without
// GPUs, compare schedulers, export timelines. See --help and
// docs/SCHEDULER.md.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/flags.h"
#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/sim/json_writer.h"
#include "common/sim/timeline_export.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/version.h"
#include "coordinator/planner/plan_proto.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/route_validator.h"
#include "tools/detour_sim/kfac.h"

namespace detour::sim_tool {
namespace {

using planner::PlannedIteration;
using planner::PlannerOptions;

constexpr char kUsage[] = R"(detour-sim: plan and simulate detour training iterations without GPUs.

Usage:
  detour-sim plan     --cluster C.json --job J.json [--scheduler S] [--seed N]
                      [--json] [--trace T.json] [--svg T.svg] [flags]
  detour-sim simulate --cluster C.json --job J.json --routes R.json
                      [--json] [--trace T.json] [--svg T.svg] [flags]
  detour-sim compare  --cluster C.json --job J.json [--seed N] [--json]
                      [--svg-dir DIR] [flags]
  detour-sim kfac     --schedule gpipe|1f1b|chimera --stages D --microbatches N --profile P
                      | --cluster C.json --job J.json
  detour-sim --help | --version
  detour-sim COMMAND --help   (every flag of COMMAND, with its default)

Commands:
  plan      Assign nodes to stages, plan every microbatch's route with one
            scheduler, simulate the iteration and report it.
  simulate  Evaluate routes given from outside: R.json is what `plan --json`
            writes (its "stages" and "routes"; other fields are ignored).
            Routes that break the job's rules are refused.
  compare   Run every scheduler on the same node-to-stage assignment and print
            them side by side with the ratio to the full pipeline.
  kfac      Fill the pipeline's bubbles with K-FAC work (bubble planner) and
            report utilisation before/after and the refresh interval.

Common flags (plan, simulate, compare): --tflops X (override the cluster's
compute.tflops), --contention uplink|link|none (docs/SCHEDULER.md), --seed N;
plan and compare: --evaluations N (skippipe search budget). Flags take
`--name value` or `--name=value`; unknown flags get a did-you-mean.

Times are simulated seconds. "pipeline" ends with the last backward (the
SkipPipe paper's metric); "iteration" adds each stage's gradient all-reduce.
Exit status: 0 on success, 1 on bad input or a failed plan, 2 on bad usage.
)";

// The summary of `detour-sim COMMAND --help`.
std::string CommandSummary(const std::string& command) {
  if (command == "plan") {
    return "Assigns nodes to stages, plans every microbatch's route with one scheduler,\n"
           "simulates the iteration and reports it.";
  }
  if (command == "simulate") {
    return "Evaluates routes given from outside: R.json is what `plan --json` writes (its\n"
           "\"stages\" and \"routes\"; other fields are ignored). Routes that break the\n"
           "job's rules are refused.";
  }
  return "Runs every scheduler on the same node-to-stage assignment and prints them side\n"
         "by side with the ratio to the full pipeline.";
}

struct Args {
  std::string command;
  std::string cluster, job, routes, trace, svg, svg_dir;
  std::string scheduler;
  bool json = false;
  bool has_seed = false;
  uint64_t seed = 0;
  double tflops = 0;
  int evaluations = -1;
  int assignment_evaluations = -1;
  double time_budget_s = 0;
  std::string assignment, objective, queue;
  sim::Contention contention = sim::Contention::kSenderUplink;
};

// Usage errors are INVALID_ARGUMENT (exit 2).
absl::Status UsageError(absl::string_view what) { return absl::InvalidArgumentError(what); }

constexpr char kEpilog[] =
    "Times are simulated seconds. \"pipeline\" ends with the last backward (the SkipPipe\n"
    "paper's metric); \"iteration\" adds each stage's gradient all-reduce. The contention\n"
    "models are described in docs/SCHEDULER.md.\n"
    "Exit status: 0 on success, 1 on bad input or a failed plan, 2 on bad usage.";

// The commands that take each flag of plan, simulate and compare (for the
// message when a flag is given to another command).
const std::map<std::string, std::string>& FlagCommands() {
  static const auto* m = new std::map<std::string, std::string>{
      {"cluster", "plan, simulate, compare"},
      {"job", "plan, simulate, compare"},
      {"routes", "simulate"},
      {"scheduler", "plan"},
      {"seed", "plan, simulate, compare"},
      {"json", "plan, simulate, compare"},
      {"trace", "plan, simulate"},
      {"svg", "plan, simulate"},
      {"svg-dir", "compare"},
      {"tflops", "plan, simulate, compare"},
      {"contention", "plan, simulate, compare"},
      {"evaluations", "plan, compare"},
      {"assignment-evaluations", "plan, compare"},
      {"time-budget", "plan, compare"},
      {"assignment", "plan, compare"},
      {"objective", "plan, compare"},
      {"queue", "plan, simulate, compare"},
  };
  return *m;
}

// Declares the flags of `command` (plan, simulate or compare) on `flags`,
// parses `args` (after the command) and checks the values. CANCELLED after
// --help.
absl::StatusOr<Args> ParseArgs(const std::string& command, const std::vector<std::string>& args,
                               FlagSet& flags) {
  Args a;
  a.command = command;
  std::string seed, contention = "uplink";
  int64_t evaluations = a.evaluations;
  const bool plan = command == "plan", simulate = command == "simulate";
  flags.String("cluster", &a.cluster, "cluster spec C.json (required)");
  flags.String("job", &a.job, "job spec J.json (required)");
  if (simulate) {
    flags.String("routes", &a.routes,
                 "R.json: what `plan --json` writes (its \"stages\" and \"routes\"; required)");
  }
  if (plan) {
    flags.String("scheduler", &a.scheduler,
                 "skippipe, full, random, skip-no-collision (default: the job's)");
  }
  flags.String("seed", &seed,
               simulate ? "seed reported with the routes, an unsigned integer (default: the "
                          "job's seed)"
                        : "seed for assignment and route search, an unsigned integer (default: "
                          "the job's seed)");
  flags.Bool("json", &a.json, "machine-readable output on stdout");
  if (!simulate && !plan) {
    flags.String("svg-dir", &a.svg_dir, "one SVG per scheduler, all on one time scale");
  } else {
    flags.String("trace", &a.trace, "Chrome trace-event JSON (open in ui.perfetto.dev)");
    flags.String("svg", &a.svg, "per-node timeline as SVG");
  }
  flags.Double("tflops", &a.tflops, "override the cluster's compute.tflops (speed-1.0 node)");
  flags.String("contention", &contention, "uplink, link or none");
  int64_t assignment_evaluations = a.assignment_evaluations;
  if (!simulate) {
    flags.Int("evaluations", &evaluations,
              "skippipe local-search budget in simulations (-1: automatic)");
    flags.Int("assignment-evaluations", &assignment_evaluations,
              "partitions the assignment search judges by their plan (-1: automatic, 0: the "
              "proxy score alone)");
    flags.Double("time-budget", &a.time_budget_s,
                 "wall-clock cap on planning in seconds, 0 = none (a cap that cuts the search "
                 "short makes results depend on the machine)");
    flags.String("assignment", &a.assignment,
                 "pin the node-to-stage assignment: stage groups separated by ';', nodes by "
                 "',' (node ids or indices into the cluster's nodes), data nodes first, e.g. "
                 "\"0,3,4;15,8,14;...\" (default: the job's pipeline.assignment, else searched)");
    flags.String("objective", &a.objective,
                 "iteration or pipeline: what the search minimises (default: the job's "
                 "pipeline.plan_objective)");
  }
  flags.String("queue", &a.queue,
               "arrival or backward-first: the workers' queue policy the plan is judged under "
               "(default: the job's pipeline.queue_policy)");
  flags.SetEpilog(kEpilog);
  absl::StatusOr<std::vector<std::string>> rest = flags.Parse(args);
  if (!rest.ok()) {
    // A flag of another command: say which command takes it.
    absl::string_view message = rest.status().message();
    if (absl::ConsumePrefix(&message, "unknown flag --")) {
      const std::string name(message.substr(0, message.find(' ')));
      if (command == "compare" && (name == "svg" || name == "trace")) {
        return UsageError("compare writes timelines with --svg-dir");
      }
      if (auto it = FlagCommands().find(name); it != FlagCommands().end()) {
        return UsageError(absl::StrCat("--", name, " only goes with ", it->second));
      }
    }
    return rest.status();
  }
  if (!rest->empty()) return UsageError(absl::StrCat("unexpected argument \"", (*rest)[0], "\""));
  if (flags.WasSet("seed")) {
    if (!absl::SimpleAtoi(seed, &a.seed))
      return UsageError(absl::StrCat("--seed: bad number ", seed));
    a.has_seed = true;
  }
  if (flags.WasSet("tflops") && !(a.tflops > 0)) {
    return UsageError(absl::StrCat("--tflops: needs a positive number, got ", a.tflops));
  }
  if (flags.WasSet("assignment-evaluations")) {
    if (assignment_evaluations < 0 || assignment_evaluations > std::numeric_limits<int>::max()) {
      return UsageError(absl::StrCat("--assignment-evaluations: needs a count >= 0, got ",
                                     assignment_evaluations));
    }
    a.assignment_evaluations = static_cast<int>(assignment_evaluations);
  }
  if (!(a.time_budget_s >= 0 && a.time_budget_s <= 86400)) {
    return UsageError(
        absl::StrCat("--time-budget: needs seconds in [0, 86400], got ", a.time_budget_s));
  }
  if (!a.objective.empty() && a.objective != "iteration" && a.objective != "pipeline") {
    return UsageError(absl::StrCat("--objective: iteration or pipeline, got ", a.objective));
  }
  if (!a.queue.empty() && !sim::ParseQueuePolicy(a.queue).ok()) {
    return UsageError(absl::StrCat("--queue: arrival or backward-first, got ", a.queue));
  }
  if (flags.WasSet("evaluations")) {
    if (evaluations < 0 || evaluations > std::numeric_limits<int>::max()) {
      return UsageError(absl::StrCat("--evaluations: needs a count >= 0, got ", evaluations));
    }
    a.evaluations = static_cast<int>(evaluations);
  }
  if (contention == "uplink") {
    a.contention = sim::Contention::kSenderUplink;
  } else if (contention == "link") {
    a.contention = sim::Contention::kPerLink;
  } else if (contention == "none") {
    a.contention = sim::Contention::kNone;
  } else {
    return UsageError(absl::StrCat("--contention: uplink, link or none, got ", contention));
  }
  if (a.cluster.empty()) return UsageError("--cluster is required");
  if (a.job.empty()) return UsageError("--job is required");
  if (simulate && a.routes.empty()) return UsageError("simulate needs --routes");
  return a;
}

struct Context {
  v1::ClusterSpec cluster;
  v1::JobSpec job;
  sim::CostModel cost;
};

// Parses --assignment into pipeline.assignment: node ids or indices.
absl::Status ApplyAssignment(const std::string& text, const v1::ClusterSpec& cluster,
                             v1::PipelineSpec* pipeline) {
  pipeline->clear_assignment();
  for (absl::string_view group : absl::StrSplit(text, ';')) {
    v1::StageNodes* stage = pipeline->add_assignment();
    for (absl::string_view raw : absl::StrSplit(group, ',', absl::SkipWhitespace())) {
      const std::string item(absl::StripAsciiWhitespace(raw));
      int index = -1;
      if (absl::SimpleAtoi(item, &index)) {
        if (index < 0 || index >= cluster.nodes_size()) {
          return UsageError(absl::StrFormat("--assignment: node index %d outside [0, %d)", index,
                                            cluster.nodes_size()));
        }
        stage->add_nodes(cluster.nodes(index).id());
        continue;
      }
      bool known = false;
      for (const auto& n : cluster.nodes()) known = known || n.id() == item;
      if (!known) {
        return UsageError(
            absl::StrCat("--assignment: \"", item, "\" is not a node of the cluster"));
      }
      stage->add_nodes(item);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Context> Load(const Args& a) {
  ASSIGN_OR_RETURN(v1::ClusterSpec cluster, LoadClusterSpec(a.cluster));
  ASSIGN_OR_RETURN(v1::JobSpec job, LoadJobSpec(a.job));
  v1::PipelineSpec* p = job.mutable_pipeline();
  if (!a.assignment.empty()) {
    RETURN_IF_ERROR(ApplyAssignment(a.assignment, cluster, p));
    auto normalized = NormalizeJobSpec(job);
    if (!normalized.ok()) {
      return UsageError(absl::StrCat("--assignment: ", normalized.status().message()));
    }
  }
  if (!a.objective.empty()) {
    p->set_plan_objective(a.objective == "pipeline" ? v1::PLAN_OBJECTIVE_PIPELINE
                                                    : v1::PLAN_OBJECTIVE_ITERATION);
  }
  if (!a.queue.empty()) {
    p->set_queue_policy(*sim::ParseQueuePolicy(a.queue) == sim::QueuePolicy::kBackwardFirst
                            ? v1::QUEUE_POLICY_BACKWARD_FIRST
                            : v1::QUEUE_POLICY_ARRIVAL);
  }
  ASSIGN_OR_RETURN(sim::CostModel cost, sim::CostModel::Create(cluster, job, a.tflops));
  return Context{std::move(cluster), std::move(job), std::move(cost)};
}

PlannerOptions Options(const Args& a, const Context& c) {
  PlannerOptions o;
  o.seed = a.has_seed ? a.seed : c.job.seed();
  o.max_evaluations = a.evaluations;
  o.assignment_evaluations = a.assignment_evaluations;
  o.time_budget_s = a.time_budget_s;
  o.sim.contention = a.contention;
  o.sim.record_timeline = true;
  return o;
}

void WriteReport(sim::JsonWriter& w, const Context& c, const PlannedIteration& it, uint64_t seed) {
  const sim::CostModel& cost = c.cost;
  w.BeginObject();
  w.Key("scheduler");
  w.String(planner::SchedulerName(it.scheduler));
  w.Key("cluster");
  w.String(c.cluster.name());
  w.Key("job");
  w.String(c.job.name());
  w.Key("seed");
  w.Int(static_cast<int64_t>(seed));
  w.Key("iteration_time_s");
  w.Number(it.result.iteration_time_s);
  w.Key("pipeline_time_s");
  w.Number(it.result.pipeline_time_s);
  w.Key("utilization");
  w.Number(it.result.utilization);
  w.Key("pipeline_utilization");
  w.Number(it.result.pipeline_utilization);
  w.Key("planning_time_s");
  w.Number(it.planning_time_s);
  const sim::QueuePolicy policy = planner::QueuePolicyOf(c.job.pipeline());
  w.Key("queue_policy");
  w.String(sim::QueuePolicyName(policy));
  w.Key("collisions");
  w.Int(it.result.collisions);
  w.Key("queue_wait_s");
  w.Number(it.result.queue_wait_s);
  // The same plan with the workers ordering their ready work the other way.
  w.Key("other_queue_policy");
  w.BeginObject();
  w.Key("queue_policy");
  w.String(sim::QueuePolicyName(policy == sim::QueuePolicy::kArrival
                                    ? sim::QueuePolicy::kBackwardFirst
                                    : sim::QueuePolicy::kArrival));
  w.Key("pipeline_time_s");
  w.Number(it.other_policy_pipeline_s);
  w.Key("iteration_time_s");
  w.Number(it.other_policy_iteration_s);
  w.EndObject();
  w.Key("objective");
  w.String(c.job.pipeline().plan_objective() == v1::PLAN_OBJECTIVE_PIPELINE ? "pipeline"
                                                                            : "iteration");
  if (it.assignment_search.proxy_trials > 0) {
    w.Key("assignment_search");
    w.BeginObject();
    w.Key("proxy_trials");
    w.Int(it.assignment_search.proxy_trials);
    w.Key("partitions_judged");
    w.Int(it.assignment_search.plan_evaluations);
    w.Key("partitions_refined");
    w.Int(it.assignment_search.refined);
    w.Key("proxy_plan_score");
    w.Number(it.assignment_search.proxy_plan_score);
    w.Key("final_plan_score");
    w.Number(it.assignment_search.final_plan_score);
    w.EndObject();
  }
  if (it.search.evaluations > 0) {
    w.Key("route_search");
    w.BeginObject();
    w.Key("simulations");
    w.Int(it.search.evaluations);
    w.Key("accepted");
    w.Int(it.search.accepted);
    w.Key("start_score");
    w.Number(std::min({it.search.timed_start, it.search.static_start, it.search.lane_start,
                       it.search.warm_start}));
    w.Key("final_score");
    w.Number(it.search.final_objective);
    w.EndObject();
  }
  w.Key("visited_stages");
  w.Int(it.plan.routes.empty() ? 0 : static_cast<int64_t>(it.plan.routes[0].stages.size()));
  w.Key("allreduce_s");
  w.BeginArray();
  for (double v : it.result.allreduce_s) w.Number(v);
  w.EndArray();
  w.Key("stages");
  w.BeginArray();
  for (const auto& nodes : it.plan.assignment.stage_nodes) {
    std::vector<std::string> ids;
    for (int n : nodes) ids.push_back(cost.node_id(n));
    w.StringArray(ids);
  }
  w.EndArray();
  w.Key("routes");
  w.BeginArray();
  for (size_t r = 0; r < it.plan.routes.size(); ++r) {
    const sim::Route& route = it.plan.routes[r];
    std::vector<std::string> ids;
    for (int n : route.nodes) ids.push_back(cost.node_id(n));
    w.BeginObject();
    w.Key("microbatch");
    w.Int(route.microbatch);
    w.Key("data_node");
    w.String(ids.empty() ? "" : ids[0]);
    w.Key("nodes");
    w.StringArray(ids);
    w.Key("stages");
    w.IntArray(route.stages);
    if (r < it.result.routes.size()) {
      w.Key("start_s");
      w.Number(it.result.routes[r].start_s);
      w.Key("end_s");
      w.Number(it.result.routes[r].end_s);
    }
    w.EndObject();
  }
  w.EndArray();
  w.Key("nodes");
  w.BeginArray();
  const std::vector<int> stage = it.plan.assignment.NodeStages(cost.num_nodes());
  for (int n = 0; n < cost.num_nodes(); ++n) {
    w.BeginObject();
    w.Key("id");
    w.String(cost.node_id(n));
    w.Key("stage");
    w.Int(stage[n]);
    w.Key("busy_s");
    w.Number(n < static_cast<int>(it.result.busy_s.size()) ? it.result.busy_s[n] : 0);
    w.EndObject();
  }
  w.EndArray();
  w.EndObject();
}

std::string Describe(const Context& c) {
  const v1::PipelineSpec& p = c.job.pipeline();
  return absl::StrFormat(
      "cluster %s (%d nodes), job %s: %s model, %d stages, %d data nodes x %d microbatches, "
      "%d replicas per stage, skip %.2f -> %d of %d stages per microbatch",
      c.cluster.name(), c.cluster.nodes_size(), c.job.name(),
      c.job.model().preset().empty() ? "explicit" : c.job.model().preset(), p.num_stages(),
      p.data_nodes(), p.microbatches_per_data_node(), p.replicas_per_stage(), p.skip_ratio(),
      VisitedStages(p), p.num_stages());
}

std::string TextReport(const Context& c, const PlannedIteration& it) {
  std::string out = Describe(c) + "\n";
  absl::StrAppendFormat(&out,
                        "scheduler %s: pipeline %.3f s, iteration %.3f s (with all-reduce), "
                        "utilisation %.1f%%, planned in %.3f s\n",
                        planner::SchedulerName(it.scheduler), it.result.pipeline_time_s,
                        it.result.iteration_time_s, 100 * it.result.utilization,
                        it.planning_time_s);
  const sim::QueuePolicy policy = planner::QueuePolicyOf(c.job.pipeline());
  absl::StrAppendFormat(
      &out,
      "queue policy %s (the workers'): %d collisions, tasks waited %.3f s in all; under "
      "%s: pipeline %.3f s, iteration %.3f s\n",
      sim::QueuePolicyName(policy), it.result.collisions, it.result.queue_wait_s,
      sim::QueuePolicyName(policy == sim::QueuePolicy::kArrival ? sim::QueuePolicy::kBackwardFirst
                                                                : sim::QueuePolicy::kArrival),
      it.other_policy_pipeline_s, it.other_policy_iteration_s);
  if (it.assignment_search.proxy_trials > 0) {
    absl::StrAppendFormat(
        &out,
        "assignment search: %d partitions judged by their plan (score %.3f -> %.3f, %d "
        "refined), %d proxy trials\n",
        it.assignment_search.plan_evaluations, it.assignment_search.proxy_plan_score,
        it.assignment_search.final_plan_score, it.assignment_search.refined,
        it.assignment_search.proxy_trials);
  }
  if (it.search.evaluations > 0) {
    absl::StrAppendFormat(&out, "route search: %d simulations, score %.3f -> %.3f\n",
                          it.search.evaluations,
                          std::min({it.search.timed_start, it.search.static_start,
                                    it.search.lane_start, it.search.warm_start}),
                          it.search.final_objective);
  }
  for (int s = 0; s < it.plan.assignment.num_stages(); ++s) {
    absl::StrAppendFormat(&out, "  stage %d:", s);
    for (int n : it.plan.assignment.stage_nodes[s]) absl::StrAppend(&out, " ", c.cost.node_id(n));
    absl::StrAppendFormat(&out, "  (all-reduce %.2f s)\n", it.result.allreduce_s[s]);
  }
  return out;
}

absl::Status ExportTimelines(const Args& a, const Context& c, const PlannedIteration& it,
                             const std::string& trace, const std::string& svg, double max_t) {
  const std::string title = absl::StrFormat("%s on %s — %s", planner::SchedulerName(it.scheduler),
                                            c.cluster.name(), c.job.name());
  if (!trace.empty()) {
    RETURN_IF_ERROR(
        WriteFileAtomically(trace, sim::ChromeTraceJson(c.cost, it.plan, it.result, title)));
  }
  if (!svg.empty()) {
    sim::SvgOptions o;
    o.title = title;
    o.max_time_s = max_t;
    RETURN_IF_ERROR(WriteFileAtomically(svg, sim::TimelineSvg(c.cost, it.plan, it.result, o)));
  }
  return absl::OkStatus();
}

absl::Status Plan(const Args& a) {
  ASSIGN_OR_RETURN(Context c, Load(a));
  PlannerOptions o = Options(a, c);
  if (!a.scheduler.empty()) {
    ASSIGN_OR_RETURN(o.scheduler, planner::ParseSchedulerName(a.scheduler));
  }
  ASSIGN_OR_RETURN(PlannedIteration it, planner::PlanIteration(c.cost, c.job, o));
  RETURN_IF_ERROR(ExportTimelines(a, c, it, a.trace, a.svg, 0));
  if (a.json) {
    sim::JsonWriter w;
    WriteReport(w, c, it, o.seed);
    std::cout << w.str() << "\n";
  } else {
    std::cout << TextReport(c, it);
  }
  return absl::OkStatus();
}

// Reads the "stages" and "routes" of a plan report.
absl::Status ReadRoutes(const std::string& path, const sim::CostModel& cost, sim::Plan* plan,
                        std::string* scheduler) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  google::protobuf::Value root;
  auto parsed = google::protobuf::util::JsonStringToMessage(text, &root);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not valid JSON: ", parsed.message().as_string()));
  }
  if (!root.has_struct_value()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": expected an object with \"routes\""));
  }
  const auto& fields = root.struct_value().fields();
  if (auto it = fields.find("scheduler"); it != fields.end())
    *scheduler = it->second.string_value();
  auto routes_it = fields.find("routes");
  if (routes_it == fields.end() || !routes_it->second.has_list_value()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": \"routes\" must be a list"));
  }
  const auto& list = routes_it->second.list_value().values();
  for (int i = 0; i < list.size(); ++i) {
    const auto& rf = list[i].struct_value().fields();
    auto field = [&](const char* name) -> const google::protobuf::Value* {
      auto f = rf.find(name);
      return f == rf.end() ? nullptr : &f->second;
    };
    const google::protobuf::Value* mb = field("microbatch");
    const google::protobuf::Value* nodes = field("nodes");
    const google::protobuf::Value* stages = field("stages");
    if (!mb || !mb->has_number_value() || !nodes || !nodes->has_list_value() || !stages ||
        !stages->has_list_value()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: routes[%d] needs \"microbatch\" (number), \"nodes\" and \"stages\" (lists)", path,
          i));
    }
    v1::Route route;
    route.set_microbatch(static_cast<uint32_t>(mb->number_value()));
    if (const auto* d = field("data_node")) route.set_data_node(d->string_value());
    for (const auto& n : nodes->list_value().values()) route.add_nodes(n.string_value());
    for (const auto& s : stages->list_value().values()) {
      if (!s.has_number_value() || s.number_value() < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("%s: routes[%d].stages must hold stage numbers", path, i));
      }
      route.add_stages(static_cast<uint32_t>(s.number_value()));
    }
    auto converted = planner::FromProtoRoute(cost, route);
    if (!converted.ok()) return Annotate(converted.status(), path);
    plan->routes.push_back(*std::move(converted));
  }
  auto stages_it = fields.find("stages");
  if (stages_it != fields.end() && stages_it->second.has_list_value()) {
    plan->assignment.stage_nodes.clear();
    for (const auto& group : stages_it->second.list_value().values()) {
      std::vector<int> ids;
      for (const auto& v : group.list_value().values()) {
        const int n = cost.NodeIndex(v.string_value());
        if (n < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": stages: unknown node \"", v.string_value(), "\""));
        }
        ids.push_back(n);
      }
      plan->assignment.stage_nodes.push_back(std::move(ids));
    }
  } else {
    ASSIGN_OR_RETURN(plan->assignment, planner::AssignmentFromRoutes(cost, plan->routes));
  }
  return absl::OkStatus();
}

absl::Status Simulate(const Args& a) {
  ASSIGN_OR_RETURN(Context c, Load(a));
  PlannedIteration it;
  std::string scheduler_name;
  RETURN_IF_ERROR(ReadRoutes(a.routes, c.cost, &it.plan, &scheduler_name));
  it.scheduler = c.job.pipeline().scheduler();
  if (!scheduler_name.empty()) {
    ASSIGN_OR_RETURN(it.scheduler, planner::ParseSchedulerName(scheduler_name));
  }
  const planner::RouteRules rules = planner::RulesFor(c.job.pipeline(), it.scheduler);
  if (absl::Status s = planner::ValidateRoutes(c.cost, it.plan, rules); !s.ok()) {
    return Annotate(s, a.routes);
  }
  PlannerOptions o = Options(a, c);
  RETURN_IF_ERROR(planner::SimulatePlanned(c.cost, c.job, o.sim, it));
  RETURN_IF_ERROR(ExportTimelines(a, c, it, a.trace, a.svg, 0));
  if (a.json) {
    sim::JsonWriter w;
    WriteReport(w, c, it, o.seed);
    std::cout << w.str() << "\n";
  } else {
    std::cout << TextReport(c, it);
  }
  return absl::OkStatus();
}

absl::Status Compare(const Args& a) {
  ASSIGN_OR_RETURN(Context c, Load(a));
  PlannerOptions o = Options(a, c);
  std::vector<PlannedIteration> runs;
  for (v1::SchedulerKind k : {v1::SCHEDULER_FULL, v1::SCHEDULER_RANDOM,
                              v1::SCHEDULER_SKIP_NO_COLLISION, v1::SCHEDULER_SKIPPIPE}) {
    o.scheduler = k;
    ASSIGN_OR_RETURN(PlannedIteration it, planner::PlanIteration(c.cost, c.job, o));
    // Every scheduler runs on the assignment of the first.
    if (!o.assignment) o.assignment = it.plan.assignment;
    runs.push_back(std::move(it));
  }
  const PlannedIteration& full = runs[0];
  if (!a.svg_dir.empty()) {
    double max_t = 0;
    for (const auto& r : runs) max_t = std::max(max_t, r.result.iteration_time_s);
    for (const auto& r : runs) {
      RETURN_IF_ERROR(ExportTimelines(
          a, c, r, "", absl::StrCat(a.svg_dir, "/", planner::SchedulerName(r.scheduler), ".svg"),
          max_t));
    }
  }
  if (a.json) {
    sim::JsonWriter w;
    w.BeginObject();
    w.Key("cluster");
    w.String(c.cluster.name());
    w.Key("job");
    w.String(c.job.name());
    w.Key("seed");
    w.Int(static_cast<int64_t>(o.seed));
    w.Key("schedulers");
    w.BeginArray();
    for (const auto& r : runs) {
      w.BeginObject();
      w.Key("scheduler");
      w.String(planner::SchedulerName(r.scheduler));
      w.Key("pipeline_time_s");
      w.Number(r.result.pipeline_time_s);
      w.Key("iteration_time_s");
      w.Number(r.result.iteration_time_s);
      w.Key("pipeline_ratio_to_full");
      w.Number(r.result.pipeline_time_s / full.result.pipeline_time_s);
      w.Key("iteration_ratio_to_full");
      w.Number(r.result.iteration_time_s / full.result.iteration_time_s);
      w.Key("utilization");
      w.Number(r.result.utilization);
      w.Key("planning_time_s");
      w.Number(r.planning_time_s);
      w.EndObject();
    }
    w.EndArray();
    w.EndObject();
    std::cout << w.str() << "\n";
    return absl::OkStatus();
  }
  std::cout << Describe(c) << "\n\n";
  std::cout << absl::StrFormat("%-18s %12s %9s %13s %9s %12s %10s\n", "scheduler", "pipeline_s",
                               "vs full", "iteration_s", "vs full", "utilisation", "plan_s");
  for (const auto& r : runs) {
    std::cout << absl::StrFormat(
        "%-18s %12.2f %8.2fx %13.2f %8.2fx %11.1f%% %10.3f\n", planner::SchedulerName(r.scheduler),
        r.result.pipeline_time_s, r.result.pipeline_time_s / full.result.pipeline_time_s,
        r.result.iteration_time_s, r.result.iteration_time_s / full.result.iteration_time_s,
        100 * r.result.utilization, r.planning_time_s);
  }
  std::cout
      << "\npipeline_s: simulated time until the last backward finishes (SkipPipe's metric).\n"
         "iteration_s: plus each stage's ring all-reduce of its gradients.\n"
         "vs full: ratio to the full pipeline on the same nodes (lower is better).\n"
         "utilisation: share of node-time spent computing over the iteration.\n";
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << "detour-sim: missing command (plan, simulate, compare, kfac); see --help\n";
    return 2;
  }
  const std::string& command = args[0];
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (command == "--version" || command == "version") {
    std::cout << "detour-sim " << kVersion << " (" << kGitRevision << ")\n";
    return 0;
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (command == "kfac") return RunKfac(rest);
  if (command != "plan" && command != "simulate" && command != "compare") {
    std::cerr << "detour-sim: unknown command \"" << command << "\"; see --help\n";
    return 2;
  }
  FlagSet flags(absl::StrCat("detour-sim ", command), CommandSummary(command));
  absl::StatusOr<Args> parsed = ParseArgs(command, rest, flags);
  if (!parsed.ok()) return flags.Fail(parsed.status());
  absl::Status s;
  if (command == "plan") {
    s = Plan(*parsed);
  } else if (command == "simulate") {
    s = Simulate(*parsed);
  } else {
    s = Compare(*parsed);
  }
  if (!s.ok()) {
    // A flag value that only the loaded cluster could check is still bad
    // usage.
    if (absl::IsInvalidArgument(s) && absl::StartsWith(s.message(), "--")) {
      std::cerr << "detour-sim " << command << ": " << s.message() << "\n";
      return 2;
    }
    std::cerr << "detour-sim: error: " << s.ToString() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace detour::sim_tool

int main(int argc, char** argv) { return detour::sim_tool::Main(argc, argv); }
