#include "coordinator/runner_planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"
#include "coordinator/planner/replica_sync_choice.h"
#include "coordinator/planner/route_validator.h"

namespace detour {
namespace {

bool SameRoutes(const std::vector<sim::Route>& a, const std::vector<sim::Route>& b) {
  return std::equal(
      a.begin(), a.end(), b.begin(), b.end(), [](const sim::Route& x, const sim::Route& y) {
        return x.microbatch == y.microbatch && x.nodes == y.nodes && x.stages == y.stages;
      });
}

}  // namespace

RunnerPlanner::RunnerPlanner(std::string job_id, const v1::JobSpec* spec,
                             const v1::ClusterSpec* network, const RunnerMembership* membership)
    : job_id_(std::move(job_id)), spec_(spec), network_(network), membership_(membership) {}

bool RunnerPlanner::kfac() const { return spec_->optimizer().kind() == v1::OPTIMIZER_KFAC; }

absl::Status RunnerPlanner::BuildCostModel() {
  v1::ClusterSpec cluster = *network_;
  cluster.clear_nodes();
  std::set<std::string> regions;
  for (const std::string& id : membership_->node_order()) {
    const v1::WorkerInfo& w = membership_->infos().at(id);
    v1::NodeSpec* n = cluster.add_nodes();
    n->set_id(w.worker_id());
    n->set_region(w.region());
    auto speed = speeds_.find(w.worker_id());
    n->set_speed(speed != speeds_.end() ? speed->second : w.speed());
    n->set_memory_slots(w.memory_slots());
    n->set_address(w.address());
    regions.insert(w.region());
    region_of_[w.worker_id()] = w.region();
  }
  // Regions the network does not describe are treated as one fast network
  // (a uniform cluster, the right model for a single site).
  std::set<std::pair<std::string, std::string>> known;
  for (const v1::RegionLink& l : cluster.links()) {
    known.insert(std::minmax(l.region_a(), l.region_b()));
  }
  for (auto a = regions.begin(); a != regions.end(); ++a) {
    for (auto b = std::next(a); b != regions.end(); ++b) {
      if (known.count({*a, *b})) continue;
      v1::RegionLink* l = cluster.add_links();
      l->set_region_a(*a);
      l->set_region_b(*b);
      l->set_latency_ms(cluster.intra_region_latency_ms() > 0 ? cluster.intra_region_latency_ms()
                                                              : 1.0);
      l->set_bandwidth_gbytes_per_s(cluster.intra_region_bandwidth_gbytes_per_s() > 0
                                        ? cluster.intra_region_bandwidth_gbytes_per_s()
                                        : 5.0);
    }
  }
  ASSIGN_OR_RETURN(cluster_, NormalizeClusterSpec(cluster));
  auto cost = sim::CostModel::Create(cluster_, *spec_);
  if (!cost.ok()) return Annotate(cost.status(), "cost model");
  LinkMatrix::TransferRounds rounds;
  std::vector<std::vector<double>> table = cost->tables().bandwidth_bytes_per_s;
  if (!links_.entries().empty() || !cut_links_.empty()) {
    // Links the workers measured (probes: latency and bandwidth; fits to
    // the job's transfers: bandwidth) replace the region table's; cut ones
    // crawl both ways. A link known by probes only is planned as slow as
    // the job's transfers run on the links fitted to them: its rate (the
    // probe's, or the table's where its bulk probe never finished but its
    // round trip was measured), or their median time on the wire in round
    // trips, whichever is slower. Otherwise a refit rates every link the job
    // did not use far above those it did, and the search leaves the second
    // for the first.
    sim::CostTables t = cost->tables();
    rounds = links_.TransferRoundTrips();
    for (const auto& [link, e] : links_.entries()) {
      const int a = cost->NodeIndex(link.first);
      const int b = cost->NodeIndex(link.second);
      if (a < 0 || b < 0 || a == b) continue;
      if (e.latency_s) t.latency_s[a][b] = *e.latency_s;
    }
    for (const auto& [link, e] : links_.entries()) {
      const int a = cost->NodeIndex(link.first);
      const int b = cost->NodeIndex(link.second);
      if (a < 0 || b < 0 || a == b) continue;
      double& planned = t.bandwidth_bytes_per_s[a][b];
      if (e.bandwidth && e.bandwidth_source == v1::JobLink::SOURCE_TRAFFIC) {
        planned = *e.bandwidth;
      } else if (e.bandwidth || e.latency_source == v1::JobLink::SOURCE_PROBE) {
        planned =
            LinkMatrix::PlannedProbeRate(e.bandwidth ? *e.bandwidth : planned, t.activation_bytes,
                                         t.latency_s[a][b] + t.latency_s[b][a], rounds.round_trips);
      }
    }
    for (const auto& [first, second] : cut_links_) {
      const int a = cost->NodeIndex(first);
      const int b = cost->NodeIndex(second);
      if (a < 0 || b < 0 || a == b) continue;
      t.bandwidth_bytes_per_s[a][b] = kCutLinkBytesPerS;
      t.bandwidth_bytes_per_s[b][a] = kCutLinkBytesPerS;
    }
    cost = sim::CostModel::FromTables(std::move(t));
    if (!cost.ok()) return Annotate(cost.status(), "cost model with measured links");
  }
  cost_ = std::make_unique<sim::CostModel>(*std::move(cost));
  planned_rounds_ = rounds;
  table_bandwidth_ = std::move(table);  // indexed as cost_'s nodes
  return absl::OkStatus();
}

void RunnerPlanner::RebuildAssignment() {
  assignment_.stage_nodes.assign(spec_->pipeline().num_stages(), {});
  for (const auto& [id, stage] : membership_->members()) {
    assignment_.stage_nodes[stage].push_back(cost_->NodeIndex(id));
  }
  for (auto& nodes : assignment_.stage_nodes) std::sort(nodes.begin(), nodes.end());
}

std::vector<std::string> RunnerPlanner::StageMembers(int stage) const {
  std::vector<std::string> out;
  for (int n : assignment_.stage_nodes[stage]) out.push_back(cost_->node_id(n));
  return out;
}

std::vector<int> RunnerPlanner::EmptyStages() const {
  std::vector<int> empty;
  for (int s = 0; s < assignment_.num_stages(); ++s) {
    if (assignment_.stage_nodes[s].empty()) empty.push_back(s);
  }
  return empty;
}

std::vector<int> RunnerPlanner::StageSizes() const {
  std::vector<int> sizes;
  for (const auto& nodes : assignment_.stage_nodes) sizes.push_back(static_cast<int>(nodes.size()));
  return sizes;
}

std::string RunnerPlanner::Infeasible() const {
  const std::vector<int> empty = EmptyStages();
  if (empty.empty() || SkipSpec(empty.size()).ok()) return "";
  return absl::StrCat("stage", empty.size() > 1 ? "s " : " ", absl::StrJoin(empty, ", "),
                      empty.size() > 1 ? " have" : " has", " no worker left");
}

// Each route still visits the job's P stages, among the remaining ones; jumps
// and swap distances shrink by `missing`, so that mapped back onto the real
// stages they stay within the job's limits. Impossible with stage 0 gone, the
// full pipeline, too few stages left or jumps too short. K-FAC jobs skip like
// the others: their bubble plan covers the stages that have workers.
absl::StatusOr<v1::PipelineSpec> RunnerPlanner::SkipSpec(size_t missing) const {
  const v1::PipelineSpec& p = spec_->pipeline();
  const int stages = static_cast<int>(p.num_stages()) - static_cast<int>(missing);
  const int visited = VisitedStages(p);
  const int jump = static_cast<int>(p.max_jump()) - static_cast<int>(missing);
  if (assignment_.stage_nodes.empty() || assignment_.stage_nodes[0].empty()) {
    return absl::FailedPreconditionError("no data node is left");
  }
  if (p.scheduler() == v1::SCHEDULER_FULL || p.skip_ratio() <= 0 || p.full_model_every() > 0) {
    return absl::FailedPreconditionError("the job's routes cannot skip a stage");
  }
  if (visited > stages || jump < 1 || (visited > 1 && jump * (visited - 1) < stages - 1)) {
    return absl::FailedPreconditionError("too few stages are left to route around the gap");
  }
  v1::PipelineSpec out = p;
  out.set_num_stages(static_cast<uint32_t>(stages));
  out.set_skip_ratio(1.0 - static_cast<double>(visited) / stages);
  out.set_max_jump(static_cast<uint32_t>(jump));
  const int swap = static_cast<int>(p.max_swap_distance()) - static_cast<int>(missing);
  out.set_max_swap_distance(static_cast<uint32_t>(std::max(1, swap)));
  out.set_max_total_swap_distance(static_cast<uint32_t>(
      std::max(1, static_cast<int>(p.max_total_swap_distance()) - static_cast<int>(missing))));
  if (swap < 1) out.set_max_swaps(0);
  out.set_scheduler(v1::SCHEDULER_SKIPPIPE);
  return out;
}

int RunnerPlanner::total_microbatches() const {
  return static_cast<int>(spec_->pipeline().data_nodes() *
                          spec_->pipeline().microbatches_per_data_node());
}

// The job's pipeline for the live members: the data nodes that remain share
// the iteration's microbatches (the total stays the job's).
v1::JobSpec RunnerPlanner::LiveSpec(int microbatches) const {
  v1::JobSpec live = *spec_;
  const uint32_t data = static_cast<uint32_t>(assignment_.stage_nodes[0].size());
  live.mutable_pipeline()->set_data_nodes(data);
  live.mutable_pipeline()->set_microbatches_per_data_node(
      static_cast<uint32_t>((microbatches + data - 1) / data));
  live.mutable_pipeline()->set_replicas_per_stage(1);
  live.mutable_pipeline()->clear_assignment();
  return live;
}

absl::StatusOr<const planner::PlannedIteration*> RunnerPlanner::PlanFirst(uint64_t seed) {
  planner::PlannerOptions po;
  po.seed = seed;
  // K-FAC places its work into the simulated timeline's gaps; otherwise
  // only the predicted time is used.
  po.sim.record_timeline = kfac();
  ASSIGN_OR_RETURN(planner::PlannedIteration first, planner::PlanIteration(*cost_, *spec_, po));
  assignment_ = first.plan.assignment;
  first_plan_ = std::move(first);
  return &*first_plan_;
}

absl::StatusOr<planner::PlannedIteration> RunnerPlanner::PlanIteration(uint64_t iteration,
                                                                       uint64_t first_iteration,
                                                                       uint64_t epoch) {
  if (first_plan_ && iteration == first_iteration && epoch == 0) {
    planner::PlannedIteration p = std::move(*first_plan_);
    first_plan_.reset();
    return p;
  }
  first_plan_.reset();
  // Re-planning starts from the last iteration's routes with a small
  // budget: the assignment is fixed, speeds drift slowly. Routes the search
  // changes under a cost model refitted since the last ones were adopted
  // must be predicted kRouteSwitchMargin faster than those measured (on the
  // WAN test bed the refitted model misjudged the routes it was fitted on
  // by a quarter), and the saving must repay the cold first iteration; under
  // the same model, the saving it predicts must (docs/SCHEDULER.md
  // §"Re-planning a running job").
  const uint64_t seed = spec_->seed() + iteration;
  const std::vector<sim::Route>& warm = skip_routes_.routes;
  auto p = PlanLive(seed, total_microbatches(), warm.empty() ? nullptr : &warm, kReplanEvaluations,
                    ReplanScheduler(iteration));
  if (!p.ok()) return p;
  // The full scheduler's routes are the same rule's too: they change which
  // replica each microbatch visits, and new pairs start cold as well.
  RouteRecord* last = Record(p->scheduler);
  if (last == nullptr || last->routes.empty()) return p;
  return JudgeRouteChange(iteration, *last, *std::move(p));
}

RunnerPlanner::RouteRecord* RunnerPlanner::Record(v1::SchedulerKind scheduler) {
  if (scheduler == v1::SCHEDULER_SKIPPIPE) return &skip_routes_;
  if (scheduler == v1::SCHEDULER_FULL) return &full_routes_;
  return nullptr;
}

absl::StatusOr<planner::PlannedIteration> RunnerPlanner::JudgeRouteChange(
    uint64_t iteration, RouteRecord& last, planner::PlannedIteration searched) {
  if (SameRoutes(searched.plan.routes, last.routes)) return searched;
  // Not judged around empty stages (no warm start there). A K-FAC job's
  // measured iterations are judged without the work the bubble planner put
  // after the pipeline (KeepRoutes), as the search predicts them.
  if (!EmptyStages().empty()) return searched;
  // The last routes under the model as it is now.
  auto kept = PlanRoutes(last.routes, searched.scheduler);
  const double predicted = searched.result.iteration_time_s;
  const double model_gain = kept.ok() && kept->result.iteration_time_s > 0
                                ? 1 - predicted / kept->result.iteration_time_s
                                : 0;
  const bool refitted = cost_version_ != last.cost_version;
  const bool measured_enough = static_cast<int>(last.seconds.size()) >= kJudgedIterations;
  const bool judged = refitted && measured_enough;
  const double measured = last.Measured();
  // What the change costs: what the first iteration on the last routes (or
  // on one of the few before them, the most) took beyond their mean. What it
  // gains: the predicted saving over the horizon a stage move is judged by,
  // or the iterations left when fewer.
  const double cost = last.SwitchCost();
  const uint64_t left = spec_->iterations() > iteration ? spec_->iterations() - iteration : 0;
  const double horizon =
      static_cast<double>(std::min<uint64_t>(left, spec_->elastic().reassign_horizon_iterations()));
  // The saving is the lesser of what the search's prediction is below the
  // routes' measure and the model's own gain on that measure: a model that
  // predicts absolute times low (a third low on the WAN test bed) would
  // otherwise pass a change it rates a few per cent faster.
  const double gain = std::min(measured - predicted, model_gain * measured) * horizon;
  // Under the model the last routes were planned under, its predictions were
  // never fitted to what they measured, so the two do not compare; nor are
  // routes with fewer than kJudgedIterations measured judged against their
  // measure. The search's gain by the model itself, as a share of what the
  // routes measured (of what the model predicts for them before any later
  // iteration was measured), must repay a change.
  if (!judged && kept.ok()) {
    const bool any = !last.seconds.empty();
    const double base = any ? measured : kept->result.iteration_time_s;
    const double saving = model_gain * base * horizon;
    if (!(saving > cost)) {
      LogInfo("job ", job_id_, ": iteration ", iteration, " keeps its routes: the ",
              refitted ? "refitted model" : "model they were planned under",
              " predicts the search's ", absl::StrFormat("%.1f %%", model_gain * 100), " faster, ",
              absl::StrFormat("%.3f", saving), " s of their ",
              any ? absl::StrFormat("measured %.3f s (mean of %d iterations)", measured,
                                    static_cast<int>(last.seconds.size()))
                  : absl::StrFormat("predicted %.3f s (none measured yet)", base),
              " over ", absl::StrFormat("%.0f", horizon),
              " iterations, which does not repay a change (", absl::StrFormat("%.3f", cost),
              " s, what the first iteration on new routes took beyond the later ones)");
      return kept;
    }
  }
  if (judged && (!(predicted < measured * (1 - kRouteSwitchMargin)) || !(gain > cost))) {
    if (kept.ok()) {
      LogInfo("job ", job_id_, ": iteration ", iteration, " keeps its routes: they took ",
              absl::StrFormat("%.3f", measured), " s (mean of ", last.seconds.size(),
              " iterations; a change costs ", absl::StrFormat("%.3f", cost),
              " s, what the first iteration on new routes took beyond the later ones); the "
              "refitted model predicts ",
              absl::StrFormat("%.3f", predicted), " s for the search's routes (",
              absl::StrFormat("%.1f %%", model_gain * 100),
              " faster than it predicts the kept ones): ",
              predicted < measured * (1 - kRouteSwitchMargin)
                  ? absl::StrFormat("%.3f s saved over %.0f iterations does not repay the change",
                                    gain, horizon)
                  : absl::StrFormat("not %.0f %% faster than measured", kRouteSwitchMargin * 100));
      return kept;
    }
    LogWarning("job ", job_id_, ": iteration ", iteration, " cannot plan its last routes again (",
               kept.status().message(), "); taking the search's");
  }
  LogInfo("job ", job_id_, ": iteration ", iteration,
          " changes routes: ", absl::StrFormat("%.3f", predicted), " s predicted, ",
          absl::StrFormat("%.1f %%", model_gain * 100), " faster than the last routes by the model",
          judged ? absl::StrFormat(", which measured %.3f s", measured) : std::string());
  return searched;
}

absl::StatusOr<planner::PlannedIteration> RunnerPlanner::PlanRoutes(
    const std::vector<sim::Route>& routes, v1::SchedulerKind scheduler) const {
  planner::PlannedIteration p;
  p.scheduler = scheduler;
  p.plan.assignment = assignment_;
  p.plan.routes = routes;
  const v1::JobSpec live = LiveSpec(total_microbatches());
  RETURN_IF_ERROR(
      planner::ValidateRoutes(*cost_, p.plan, planner::RulesFor(live.pipeline(), scheduler)));
  sim::SimOptions options;
  options.record_timeline = kfac();
  RETURN_IF_ERROR(planner::SimulatePlanned(*cost_, live, options, p));
  return p;
}

// Every pipeline.full_model_every-th iteration runs the full pipeline.
std::optional<v1::SchedulerKind> RunnerPlanner::ReplanScheduler(uint64_t iteration) const {
  const uint32_t k = spec_->pipeline().full_model_every();
  if (k > 0 && (iteration + 1) % k == 0) return v1::SCHEDULER_FULL;
  return std::nullopt;
}

v1::CheckpointPlan RunnerPlanner::WarmStart(const std::string& dir,
                                            uint64_t iterations_done) const {
  v1::CheckpointPlan out;
  out.set_checkpoint(dir);
  out.set_iteration(iterations_done);
  // node index -> (stage, replica position)
  std::map<int, std::pair<int, int>> position;
  for (int s = 0; s < assignment_.num_stages(); ++s) {
    v1::PlannedStage* stage = out.add_stages();
    const std::vector<int>& nodes = assignment_.stage_nodes[s];
    for (size_t r = 0; r < nodes.size(); ++r) {
      stage->add_nodes(static_cast<uint32_t>(nodes[r]));
      position[nodes[r]] = {s, static_cast<int>(r)};
    }
  }
  size_t visits = 0;
  for (const sim::Route& r : skip_routes_.routes) visits += r.nodes.size();
  if (visits > static_cast<size_t>(kMaxKeptRouteVisits)) return out;
  for (const sim::Route& r : skip_routes_.routes) {
    v1::PlannedRoute* route = out.add_routes();
    route->set_microbatch(static_cast<uint32_t>(r.microbatch));
    for (size_t i = 0; i < r.nodes.size(); ++i) {
      auto p = position.find(r.nodes[i]);
      if (p == position.end() || i >= r.stages.size() || p->second.first != r.stages[i]) {
        // A route through a node the assignment no longer has: the warm
        // start is not one the resumed job can use (nor a re-plan: the
        // search drops invalid warm starts), so none is kept.
        out.clear_routes();
        return out;
      }
      route->add_stages(static_cast<uint32_t>(p->second.first));
      route->add_replicas(static_cast<uint32_t>(p->second.second));
    }
  }
  return out;
}

absl::Status RunnerPlanner::CheckStored(const v1::CheckpointPlan& stored,
                                        uint64_t iteration) const {
  if (stored.iteration() != iteration) {
    return absl::FailedPreconditionError(absl::StrCat(
        "it was kept at iteration ", stored.iteration(), ", the job resumes at ", iteration));
  }
  const int stages = assignment_.num_stages();
  if (stored.stages_size() != stages) {
    return absl::FailedPreconditionError(
        absl::StrCat("it has ", stored.stages_size(), " stages, the job ", stages));
  }
  std::set<uint32_t> indices;
  size_t assigned = 0;
  for (int s = 0; s < stages; ++s) {
    const int had = stored.stages(s).nodes_size();
    const size_t has = assignment_.stage_nodes[s].size();
    if (static_cast<size_t>(had) != has) {
      return absl::FailedPreconditionError(
          absl::StrCat("stage ", s, " had ", had, " workers, the resumed job gives it ", has));
    }
    for (uint32_t n : stored.stages(s).nodes()) {
      if (!indices.insert(n).second) {
        return absl::DataLossError(absl::StrCat("node index ", n, " holds two positions"));
      }
    }
    assigned += has;
  }
  if (assigned != membership_->node_order().size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the first plan assigns ", assigned, " of ", membership_->node_order().size(), " workers"));
  }
  const int total = total_microbatches();
  if (stored.routes_size() > total) {
    return absl::DataLossError(
        absl::StrCat(stored.routes_size(), " routes for ", total, " microbatches"));
  }
  std::set<uint32_t> microbatches;
  for (const v1::PlannedRoute& r : stored.routes()) {
    if (r.microbatch() >= static_cast<uint32_t>(total) ||
        !microbatches.insert(r.microbatch()).second) {
      return absl::DataLossError(
          absl::StrCat("route microbatch ", r.microbatch(), " is repeated or not below ", total));
    }
    if (r.stages_size() == 0 || r.stages_size() > stages || r.stages_size() != r.replicas_size() ||
        r.stages(0) != 0) {
      return absl::DataLossError(absl::StrCat("the route of microbatch ", r.microbatch(), " has ",
                                              r.stages_size(), " stages and ", r.replicas_size(),
                                              " replicas, or does not start at stage 0"));
    }
    for (int i = 0; i < r.stages_size(); ++i) {
      const uint32_t s = r.stages(i);
      if (s >= static_cast<uint32_t>(stages) ||
          r.replicas(i) >= static_cast<uint32_t>(stored.stages(static_cast<int>(s)).nodes_size())) {
        return absl::DataLossError(absl::StrCat("the route of microbatch ", r.microbatch(),
                                                " visits stage ", s, " replica ", r.replicas(i),
                                                ", which the plan does not have"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> RunnerPlanner::ResumedNodeOrder(
    const v1::CheckpointPlan& stored, uint64_t iteration) const {
  RETURN_IF_ERROR(CheckStored(stored, iteration));
  // stored node index -> the first plan's worker at that position
  std::map<uint32_t, std::string> order;
  for (int s = 0; s < assignment_.num_stages(); ++s) {
    for (size_t r = 0; r < assignment_.stage_nodes[s].size(); ++r) {
      order[stored.stages(s).nodes(static_cast<int>(r))] =
          cost_->node_id(assignment_.stage_nodes[s][r]);
    }
  }
  std::vector<std::string> out;
  for (const auto& [index, id] : order) out.push_back(id);
  return out;
}

absl::Status RunnerPlanner::PlanResumed(const v1::CheckpointPlan& stored, uint64_t iteration) {
  RETURN_IF_ERROR(CheckStored(stored, iteration));
  // The node order is the stored indices' order: position -> its rank.
  std::map<uint32_t, int> rank;
  for (const v1::PlannedStage& s : stored.stages()) {
    for (uint32_t n : s.nodes()) rank[n] = 0;
  }
  int next = 0;
  for (auto& [index, r] : rank) r = next++;
  sim::StageAssignment assignment;
  for (const v1::PlannedStage& s : stored.stages()) {
    std::vector<int>& nodes = assignment.stage_nodes.emplace_back();
    for (uint32_t n : s.nodes()) nodes.push_back(rank.at(n));
  }
  std::vector<sim::Route> routes;
  for (const v1::PlannedRoute& r : stored.routes()) {
    sim::Route& route = routes.emplace_back();
    route.microbatch = static_cast<int>(r.microbatch());
    for (int i = 0; i < r.stages_size(); ++i) {
      const int s = static_cast<int>(r.stages(i));
      route.stages.push_back(s);
      route.nodes.push_back(
          assignment.stage_nodes[static_cast<size_t>(s)][static_cast<size_t>(r.replicas(i))]);
    }
  }
  const sim::StageAssignment fresh = assignment_;
  assignment_ = assignment;
  auto planned =
      PlanLive(spec_->seed() + iteration, total_microbatches(), routes.empty() ? nullptr : &routes,
               kReplanEvaluations, ReplanScheduler(iteration));
  if (!planned.ok()) {
    assignment_ = fresh;
    return planned.status();
  }
  ForgetRoutes();
  skip_routes_.routes = std::move(routes);
  skip_routes_.cost_version = cost_version_;
  first_plan_ = *std::move(planned);
  return absl::OkStatus();
}

absl::StatusOr<planner::PlannedIteration> RunnerPlanner::PlanLive(
    uint64_t seed, int count, const std::vector<sim::Route>* warm, int evaluations,
    std::optional<v1::SchedulerKind> scheduler) {
  v1::JobSpec live = LiveSpec(count);
  planner::PlannerOptions o;
  o.seed = seed;
  o.assignment = assignment_;
  o.sim.record_timeline = kfac();
  o.initial_routes = warm;
  o.max_evaluations = evaluations;
  if (scheduler) o.scheduler = *scheduler;
  const std::vector<int> empty = EmptyStages();
  if (!empty.empty()) return PlanAroundEmptyStages(std::move(live), o, empty, count);
  ASSIGN_OR_RETURN(planner::PlannedIteration p, planner::PlanIteration(*cost_, live, o));
  if (static_cast<int>(p.plan.routes.size()) > count) {
    p.plan.routes.erase(
        std::remove_if(p.plan.routes.begin(), p.plan.routes.end(),
                       [count](const sim::Route& r) { return r.microbatch >= count; }),
        p.plan.routes.end());
  }
  return p;
}

// Plans over the stages that have workers (SkipSpec) with a cost model of
// those stages' columns, then maps the routes back onto the real stages.
absl::StatusOr<planner::PlannedIteration> RunnerPlanner::PlanAroundEmptyStages(
    v1::JobSpec live, planner::PlannerOptions o, const std::vector<int>& empty, int count) {
  ASSIGN_OR_RETURN(v1::PipelineSpec pipeline, SkipSpec(empty.size()));
  pipeline.set_data_nodes(live.pipeline().data_nodes());
  pipeline.set_microbatches_per_data_node(live.pipeline().microbatches_per_data_node());
  pipeline.set_replicas_per_stage(1);
  pipeline.clear_assignment();
  *live.mutable_pipeline() = pipeline;
  std::vector<int> kept;  // real stage of each planned one
  for (int s = 0; s < assignment_.num_stages(); ++s) {
    if (!assignment_.stage_nodes[s].empty()) kept.push_back(s);
  }
  sim::CostTables t = cost_->tables();
  auto pick = [&](const std::vector<double>& row) {
    std::vector<double> out;
    for (int s : kept) out.push_back(row[s]);
    return out;
  };
  for (auto& row : t.forward_s) row = pick(row);
  for (auto& row : t.backward_s) row = pick(row);
  t.stage_gradient_bytes = pick(t.stage_gradient_bytes);
  ASSIGN_OR_RETURN(sim::CostModel cost, sim::CostModel::FromTables(std::move(t)));
  sim::StageAssignment assignment;
  for (int s : kept) assignment.stage_nodes.push_back(assignment_.stage_nodes[s]);
  o.assignment = assignment;
  o.scheduler = v1::SCHEDULER_SKIPPIPE;
  o.initial_routes = nullptr;
  ASSIGN_OR_RETURN(planner::PlannedIteration p, planner::PlanIteration(cost, live, o));
  p.plan.routes.erase(
      std::remove_if(p.plan.routes.begin(), p.plan.routes.end(),
                     [count](const sim::Route& r) { return r.microbatch >= count; }),
      p.plan.routes.end());
  for (sim::Route& r : p.plan.routes) {
    for (int& s : r.stages) s = kept.at(static_cast<size_t>(s));
  }
  p.plan.assignment = assignment_;
  return p;
}

double RunnerPlanner::PredictIteration(uint64_t seed) {
  if (!Infeasible().empty()) return std::numeric_limits<double>::infinity();
  auto p = PlanLive(seed, total_microbatches(), nullptr, kQuickEvaluations, std::nullopt);
  return p.ok() ? p->result.iteration_time_s : std::numeric_limits<double>::infinity();
}

void RunnerPlanner::KeepRoutes(const planner::PlannedIteration& planned, double seconds,
                               double kfac_seconds) {
  RouteRecord* record = Record(planned.scheduler);
  if (record == nullptr) return;
  // The pipeline's part, as the search predicts it; none when the K-FAC
  // estimate leaves nothing of it.
  kfac_seconds = std::max(0.0, kfac_seconds);
  seconds = seconds > kfac_seconds ? seconds - kfac_seconds : 0;
  RouteRecord& last = *record;
  if (!SameRoutes(planned.plan.routes, last.routes)) {
    last.Forget();
    last.routes = planned.plan.routes;
    last.cost_version = cost_version_;
  }
  // The first iteration on them opened their connections: what it took
  // beyond the later ones is what a change of routes costs.
  if (++last.iterations == 1) {
    last.first_seconds = seconds;
  } else if (seconds > 0) {
    last.seconds.push_back(seconds);
    if (static_cast<int>(last.seconds.size()) > kMeasuredWindow) last.seconds.pop_front();
  }
}

double RunnerPlanner::RouteRecord::Measured() const {
  double mean = 0;
  for (double x : seconds) mean += x / static_cast<double>(seconds.size());
  return mean;
}

std::optional<double> RunnerPlanner::RouteRecord::OwnCost() const {
  if (!(first_seconds > 0) || seconds.empty()) return std::nullopt;
  return std::max(0.0, first_seconds - Measured());
}

double RunnerPlanner::RouteRecord::SwitchCost() const {
  double cost = OwnCost().value_or(0);
  for (double x : past_costs) cost = std::max(cost, x);
  return cost;
}

void RunnerPlanner::RouteRecord::Forget() {
  if (const std::optional<double> own = OwnCost()) {
    past_costs.push_back(*own);
    if (static_cast<int>(past_costs.size()) >= kSwitchCosts) past_costs.pop_front();
  }
  routes.clear();
  iterations = 0;
  first_seconds = 0;
  seconds.clear();
}

void RunnerPlanner::ForgetRoutes() {
  skip_routes_.Forget();
  full_routes_.Forget();
}

int RunnerPlanner::UpdateLinksFromTimings(const TimingEstimates& estimates) {
  int fitted = 0;
  const sim::CostTables& t = cost_->tables();
  for (const auto& [a, sa] : membership_->members()) {
    for (const auto& [b, sb] : membership_->members()) {
      if (a == b) continue;
      const double seconds = estimates.Transfer(a, b);
      if (!(seconds > 0)) continue;
      // A link no transfer crossed since the last refit keeps what it has:
      // the plans left it, and a running bulk probe may have measured it
      // since (RunnerLinks).
      const uint64_t reports = estimates.TransferReports(a, b);
      uint64_t& fitted_at = refit_reports_[{a, b}];
      if (reports == fitted_at) continue;
      fitted_at = reports;
      const int ia = cost_->NodeIndex(a), ib = cost_->NodeIndex(b);
      if (ia < 0 || ib < 0) continue;
      // A transfer's time runs from its first byte to the peer's
      // acknowledgement: the way there, the acknowledgement's way back (the
      // round trip a probe's ping measures) and the bytes on the wire. Only
      // the last is the bandwidth's; with the way back left in, a long link's
      // fit read a fraction of its rate, and every plan's prediction grew by
      // a one-way latency per hop.
      const double rtt = t.latency_s[ia][ib] + t.latency_s[ib][ia];
      const double wire = seconds - rtt;
      if (!(wire >= kMinWireShare * seconds)) continue;
      links_.Fitted({a, b}, t.activation_bytes / wire, rtt > 0 ? wire / rtt : 0, absl::Now());
      ++fitted;
    }
  }
  return fitted;
}

std::vector<ForwardSample> RunnerPlanner::UpdateSpeedsFromTimings(
    const TimingEstimates& estimates) {
  const int links = UpdateLinksFromTimings(estimates);
  int changed = 0;
  std::vector<ForwardSample> samples;
  for (const auto& [id, stage] : membership_->members()) {
    const int index = cost_->NodeIndex(id);
    if (index < 0) continue;
    const double measured = estimates.Compute(id, stage, v1::TaskTiming::KIND_FORWARD);
    const double predicted = cost_->ForwardTime(index, stage);
    if (!(measured > 0) || !(predicted > 0)) continue;
    const double assumed = cluster_.nodes(index).speed();
    speeds_[id] = assumed * predicted / measured;
    ++changed;
    // What the node's registered speed predicts (the cost model's speed may
    // already be a measured one).
    const auto& infos = membership_->infos();
    const double registered =
        infos.count(id) && infos.at(id).speed() > 0 ? infos.at(id).speed() : 1.0;
    samples.push_back({id, stage, measured, predicted * assumed / registered});
  }
  if (changed == 0 && links == 0) return samples;
  if (absl::Status s = BuildCostModel(); !s.ok()) {
    LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
    return samples;
  }
  ++cost_version_;
  const LinkMatrix::TransferRounds& rounds = planned_rounds_;
  if (links > 0 && rounds.links > 0) {
    LogInfo("job ", job_id_, ": ", links,
            " links fitted to the job's transfers; on the wire (beyond the way there and the "
            "acknowledgement's way back) they took ",
            absl::StrFormat("%.2f-%.2f", rounds.low, rounds.high), " round trips on the ",
            rounds.links, " fitted",
            rounds.links >= LinkMatrix::kMinFitLinks
                ? absl::StrFormat(" (median %.2f): links known by probes only are planned at "
                                  "their probe's rate (the table's where only their round trip "
                                  "was measured) or %.2f round trips, whichever is slower",
                                  rounds.round_trips, rounds.round_trips)
                : std::string());
  }
  LogDebug("job ", job_id_, ": node speeds updated from ", changed, " workers' timings, ", links,
           " links measured");
  return samples;
}

absl::Status RunnerPlanner::RefreshLinks() {
  RETURN_IF_ERROR(BuildCostModel());
  ++cost_version_;
  return absl::OkStatus();
}

v1::GetLinksResponse RunnerPlanner::LinkSnapshot(
    const std::set<std::pair<std::string, std::string>>& cuts) const {
  v1::GetLinksResponse out;
  out.set_job_id(job_id_);
  out.set_probe_rounds(links_.rounds());
  auto stamp = [](absl::Time t, google::protobuf::Timestamp* ts) {
    ts->set_seconds(absl::ToUnixSeconds(t));
    ts->set_nanos(static_cast<int32_t>(absl::ToUnixNanos(t) % 1000000000));
  };
  if (links_.last_round() != absl::InfinitePast())
    stamp(links_.last_round(), out.mutable_last_probe());
  out.set_transfer_round_trips(planned_rounds_.round_trips);
  out.set_transfer_round_trip_links(static_cast<uint32_t>(planned_rounds_.links));
  if (cost_ == nullptr) return out;
  const sim::CostTables& t = cost_->tables();
  for (const auto& [a, sa] : membership_->members()) {
    for (const auto& [b, sb] : membership_->members()) {
      if (a == b) continue;
      const int ia = cost_->NodeIndex(a), ib = cost_->NodeIndex(b);
      if (ia < 0 || ib < 0) continue;
      v1::JobLink* l = out.add_links();
      l->set_from(a);
      l->set_to(b);
      l->set_latency_seconds(t.latency_s[ia][ib]);
      l->set_bandwidth_bytes_per_s(t.bandwidth_bytes_per_s[ia][ib]);
      l->set_measured_bandwidth_bytes_per_s(table_bandwidth_[ia][ib]);
      l->set_latency_source(v1::JobLink::SOURCE_REGION_TABLE);
      l->set_bandwidth_source(v1::JobLink::SOURCE_REGION_TABLE);
      l->set_cut(cuts.count(std::minmax(a, b)) > 0);
      if (const LinkMatrix::Entry* e = links_.Find({a, b})) {
        if (e->latency_s) {
          l->set_latency_source(e->latency_source);
          stamp(e->latency_time, l->mutable_latency_measured());
        }
        if (e->bandwidth) {
          l->set_bandwidth_source(e->bandwidth_source);
          l->set_measured_bandwidth_bytes_per_s(*e->bandwidth);
          stamp(e->bandwidth_time, l->mutable_bandwidth_measured());
        }
        l->set_probe_error(e->probe_error);
      }
    }
  }
  return out;
}

absl::Status RunnerPlanner::SetCutLinks(const std::set<std::pair<std::string, std::string>>& cuts) {
  if (cuts == cut_links_) return absl::OkStatus();
  cut_links_ = cuts;
  ForgetRoutes();  // the warm start may cross a cut link
  RETURN_IF_ERROR(BuildCostModel());
  ++cost_version_;
  return absl::OkStatus();
}

absl::StatusOr<planner::PlannedIteration> RunnerPlanner::PlanAroundCuts(uint64_t iteration) {
  return PlanLive(spec_->seed() + iteration, total_microbatches(), nullptr, kReplanEvaluations,
                  v1::SCHEDULER_SKIPPIPE);
}

std::optional<std::pair<std::string, std::string>> RunnerPlanner::CrossedCut(
    const sim::Plan& plan) const {
  if (cut_links_.empty()) return std::nullopt;
  const std::vector<std::string>& ids = cost_->tables().node_ids;
  auto id = [&](int node) -> const std::string& { return ids.at(static_cast<size_t>(node)); };
  auto cut = [&](int a, int b) -> std::optional<std::pair<std::string, std::string>> {
    if (a == b) return std::nullopt;
    std::pair<std::string, std::string> link = std::minmax(id(a), id(b));
    if (cut_links_.count(link)) return link;
    return std::nullopt;
  };
  for (const sim::Route& r : plan.routes) {
    const size_t n = r.nodes.size();
    for (size_t i = 0; i + 1 < n; ++i) {
      if (auto c = cut(r.nodes[i], r.nodes[i + 1])) return c;
    }
    if (n > 1) {
      if (auto c = cut(r.nodes[n - 1], r.nodes[0])) return c;
    }
  }
  for (const std::vector<int>& replicas : plan.assignment.stage_nodes) {
    for (size_t i = 0; i < replicas.size(); ++i) {
      for (size_t j = i + 1; j < replicas.size(); ++j) {
        if (auto c = cut(replicas[i], replicas[j])) return c;
      }
    }
  }
  return std::nullopt;
}

double RunnerPlanner::MoveCost(const StageMove& m, double pause_s) const {
  const sim::ModelCosts mc = sim::ComputeModelCosts(spec_->model());
  const std::vector<int> layers =
      sim::LayersPerStage(static_cast<int>(spec_->model().num_layers()), assignment_.num_stages());
  const int blocks = layers.at(static_cast<size_t>(m.to));
  const double params = blocks * mc.params_per_layer + (m.to == 0 ? mc.stage0_extra_params : 0);
  double kfac_values = 0;
  if (kfac()) {
    // Pending sums, running factors, active and staged inverses, and the
    // grafting moments of the projections.
    const kfac::BlockWorkload block(spec_->model());
    kfac_values = blocks * (4.0 * static_cast<double>(block.FactorSyncElements()) +
                            2.0 * static_cast<double>(block.ProjectionElements()));
  }
  const double bytes = StageStateBytes(params, kfac_values);
  const std::vector<std::string> donors = StageMembers(m.to);
  const int a = donors.empty() ? -1 : cost_->NodeIndex(donors.front());
  const int b = cost_->NodeIndex(m.worker);
  if (a < 0 || b < 0) return MoveCostSeconds(bytes, 0, 0, pause_s);
  return MoveCostSeconds(bytes, cost_->Latency(a, b), cost_->Bandwidth(a, b), pause_s);
}

planner::KfacWorkload RunnerPlanner::KfacWorkload(std::optional<kfac::ReplicaSync> sync_override) {
  planner::KfacWorkload w;
  const std::vector<int> stage_of = assignment_.NodeStages(cost_->num_nodes());
  const double tokens = static_cast<double>(spec_->pipeline().samples_per_microbatch()) *
                        spec_->model().context_length();
  const kfac::BlockWorkload block(spec_->model());
  const kfac::ReplicaSync sync =
      sync_override.value_or(kfac::ReplicaSyncOf(spec_->optimizer().kfac()));
  for (int n = 0; n < cost_->num_nodes(); ++n) {
    planner::KfacNodeWork node;
    node.node_id = cost_->node_id(n);
    node.stage = stage_of[n];
    if (node.stage >= 0) {
      auto layers = StageLayers(static_cast<int>(spec_->model().num_layers()),
                                static_cast<int>(spec_->pipeline().num_stages()), node.stage);
      if (layers.ok()) {
        const double flops = KfacFlopsPerSecond(n);
        workload_flops_[cost_->node_id(n)] = flops;
        // The factors' bytes over the stage's (measured) links: never free.
        planner::KfacLayerCost c = planner::EstimateKfacLayerCost(block, tokens, flops);
        c.sync_s =
            planner::StageSyncSeconds(*cost_, assignment_.stage_nodes[node.stage], block, sync);
        for (int l = layers->begin; l < layers->end; ++l) {
          node.layers.push_back(l);
          node.costs.push_back(c);
        }
      }
    }
    w.nodes.push_back(std::move(node));
  }
  return w;
}

// FLOP/s a node's K-FAC work runs at: measured from its bubble tasks once it
// has run some, else the node's speed (which is calibrated on forward work:
// matrix products of another shape than K-FAC's, and no Cholesky).
double RunnerPlanner::KfacFlopsPerSecond(int node) const {
  auto measured = kfac_flops_.find(cost_->node_id(node));
  if (measured != kfac_flops_.end()) return measured->second;
  return cluster_.compute().tflops() * 1e12 * cluster_.nodes(node).speed();
}

absl::Status RunnerPlanner::CreateBubblePlanner() {
  if (!kfac()) return absl::OkStatus();
  ASSIGN_OR_RETURN(planner::BubblePlanner bubbles,
                   planner::BubblePlanner::Create(KfacWorkload(), spec_->optimizer().kfac()));
  bubbles_ = std::make_unique<planner::BubblePlanner>(std::move(bubbles));
  return absl::OkStatus();
}

void RunnerPlanner::KfacMembershipChanged() {
  if (bubbles_ == nullptr) return;
  if (absl::Status s = bubbles_->SetWorkload(KfacWorkload()); !s.ok()) {
    LogWarning("job ", job_id_, ": K-FAC workload after a membership change: ", s.message());
  }
}

// The FLOPs of the tasks each worker ran (planned seconds × the FLOP/s they
// were planned at) over the seconds it measured, folded into a moving
// average.
void RunnerPlanner::MeasureKfacSpeeds(const v1::IterationPlan& plan,
                                      const std::map<std::string, v1::TimingReport>& timings) {
  std::map<std::string, double> planned_flops;
  for (const v1::BubbleTask& t : plan.bubble_tasks()) {
    if (t.kind() == v1::BubbleTask::KIND_SYNC_FACTORS) continue;  // network, not compute
    auto assumed = workload_flops_.find(t.node());
    if (assumed != workload_flops_.end()) {
      planned_flops[t.node()] += t.planned_duration_s() * assumed->second;
    }
  }
  for (const auto& [id, flops] : planned_flops) {
    auto report = timings.find(id);
    if (report == timings.end() || !(flops > 0)) continue;
    double seconds = 0;
    for (const v1::TaskTiming& task : report->second.tasks()) {
      if (task.kind() == v1::TaskTiming::KIND_BUBBLE) seconds += task.duration_s();
    }
    if (!(seconds > 0)) continue;
    const double speed = flops / seconds;
    auto [it, fresh] = kfac_flops_.emplace(id, speed);
    if (!fresh) it->second = 0.7 * it->second + 0.3 * speed;
  }
}

}  // namespace detour
