#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/kfac_workload.h"
#include "common/log.h"
#include "common/sim/cost_model.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"
#include "common/timing.h"
#include "coordinator/iteration_round.h"
#include "coordinator/planner/bubble_planner.h"
#include "coordinator/planner/plan_proto.h"
#include "coordinator/planner/planner.h"
#include "coordinator/planner/replica_sync_choice.h"
#include "coordinator/stage_reassignment.h"
#include "coordinator/stragglers.h"
#include "common/checkpoint_manifest.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp Now() {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
}

absl::Time FromProto(const google::protobuf::Timestamp& t) {
  return absl::FromUnixNanos(TimeUtil::TimestampToNanoseconds(t));
}

// Iterations completed when the checkpoint in `dir` was taken; its
// manifest's presence marks it complete.
absl::StatusOr<uint64_t> CheckpointIteration(const std::string& dir) {
  auto manifest = model::ReadManifest(dir);
  if (!manifest.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", dir, " is not complete (", manifest.status().message(), ")"));
  }
  return manifest->iteration;
}

bool SameTime(const google::protobuf::Timestamp& a, const google::protobuf::Timestamp& b) {
  return a.seconds() == b.seconds() && a.nanos() == b.nanos();
}

// Most history events a job record keeps.
constexpr int kMaxHistory = 200;

}  // namespace

RunnerMetrics::RunnerMetrics(metrics::Registry* m) {
  if (m == nullptr) return;
  auto counter = [&](const char* name, const char* help) {
    return metrics::OptionalCounter(m, name, help);
  };
  recoveries = counter("detour_coordinator_recoveries",
                       "Recoveries of running jobs from lost workers (re-planned around them).");
  lost = counter("detour_coordinator_job_workers_lost", "Workers that left a running job.");
  joined = counter("detour_coordinator_job_workers_joined", "Workers that joined a running job.");
  reassigned = counter("detour_coordinator_job_workers_reassigned",
                       "Workers moved from one stage of a running job to another (the planner "
                       "predicted a gain repaying the move).");
  stragglers = counter("detour_coordinator_stragglers",
                       "Workers found persistently slower than their replicas or their "
                       "prediction (routed around with fewer visits).");
  if (auto f = m->AddHistogram("detour_coordinator_recovery_seconds",
                               "From the detection of a lost worker to the job running again "
                               "(re-planned microbatches sent, or the next iteration planned).",
                               metrics::DefaultLatencyBuckets());
      f.ok()) {
    if (auto h = (*f)->WithLabels({}); h.ok()) recovery_seconds = *h;
  }
  if (auto f = m->AddCounter("detour_coordinator_microbatches_recovered",
                             "Microbatches of iterations that lost a worker: rerun on new routes, "
                             "or dropped (their backward had partly run).",
                             {"outcome"});
      f.ok()) {
    microbatches = *f;
  }
  if (auto f =
          m->AddGauge("detour_coordinator_job_members", "Workers taking part in running jobs.");
      f.ok()) {
    if (auto g = (*f)->WithLabels({}); g.ok()) members = *g;
  }
}

void RunnerMetrics::Recovered(double seconds) {
  if (recoveries != nullptr) recoveries->Increment();
  if (recovery_seconds != nullptr) recovery_seconds->Observe(seconds);
}
void RunnerMetrics::Microbatches(const char* outcome, int n) {
  if (microbatches == nullptr || n <= 0) return;
  if (auto c = microbatches->WithLabels({outcome}); c.ok()) (void)(*c)->IncrementBy(n);
}
void RunnerMetrics::WorkerLost() {
  if (lost != nullptr) lost->Increment();
}
void RunnerMetrics::WorkerJoined() {
  if (joined != nullptr) joined->Increment();
}
void RunnerMetrics::WorkerReassigned() {
  if (reassigned != nullptr) reassigned->Increment();
}
void RunnerMetrics::StragglerFound() {
  if (stragglers != nullptr) stragglers->Increment();
}
void RunnerMetrics::MembersChanged(int delta) {
  if (members != nullptr) members->Increment(delta);
}

class JobRunner::Impl {
 public:
  Impl(RunnerHost* host, std::string job_id, v1::JobSpec spec, std::vector<v1::WorkerInfo> workers,
       JobRunner::StartMode start)
      : host_(host), job_id_(std::move(job_id)), spec_(std::move(spec)), start_mode_(start) {
    for (v1::WorkerInfo& w : workers) infos_[w.worker_id()] = std::move(w);
  }

  ~Impl() {
    RequestStop(JobEnd{v1::JOB_STATE_FAILED, "coordinator stopped while the job was running"});
    if (thread_.joinable()) thread_.join();
  }

  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  void Post(const std::string& worker_id, const v1::WorkerMessage& message) {
    absl::MutexLock lock(&mu_);
    inbox_.emplace_back(worker_id, message);
  }

  void Poke() {
    absl::MutexLock lock(&mu_);
    poked_ = true;
  }

  void RequestStop(JobEnd stop) {
    absl::MutexLock lock(&mu_);
    if (!stop_) stop_ = std::move(stop);
  }

  bool finished() const {
    absl::MutexLock lock(&mu_);
    return finished_;
  }

 private:
  using Message = std::pair<std::string, v1::WorkerMessage>;

  // What one wait brought: messages, workers found lost, or the end.
  struct Event {
    std::deque<Message> messages;
    std::vector<std::string> lost;  // already removed from the membership
    std::optional<JobEnd> end;
    bool changed = false;  // the registry changed (return_on_change)
  };

  // How an iteration ended.
  enum class Outcome { kDone, kRetry };

  void Run() {
    auto end = Drive();
    Finish(end);
    absl::MutexLock lock(&mu_);
    finished_ = true;
  }

  bool elastic() const { return !spec_.elastic().disabled(); }
  bool kfac() const { return spec_.optimizer().kind() == v1::OPTIMIZER_KFAC; }
  const JobManagerOptions& options() const { return host_->options(); }

  JobEnd Drive() {
    LoadCheckpointList();
    if (start_mode_ == JobRunner::StartMode::kReattach) {
      if (auto e = Reattach(); e) return *e;
    } else {
      SetState(v1::JOB_STATE_ASSIGNING,
               absl::StrCat("assigning stages to ", infos_.size(), " workers"));
      if (auto e = Assign(); e) return *e;
    }
    SetState(v1::JOB_STATE_RUNNING, "training");
    host_->jobs()
        .Update(job_id_,
                [](v1::Job* j) {
                  if (!j->has_start_time()) *j->mutable_start_time() = Now();
                })
        .IgnoreError();
    started_ = absl::Now();
    started_iteration_ = next_iteration_;
    reassign_epoch_ = epoch_;
    while (next_iteration_ < spec_.iterations()) {
      if (auto e = Grow(); e) return *e;
      if (auto e = Reassign(); e) return *e;
      if (std::string why = Infeasible(); !why.empty()) {
        if (auto e = Pause(next_iteration_, why); e) return *e;
      }
      auto outcome = RunIteration(next_iteration_);
      if (!outcome.ok()) return *outcome.status_end;
      if (*outcome.outcome == Outcome::kDone) ++next_iteration_;
    }
    return {v1::JOB_STATE_SUCCEEDED, absl::StrCat("trained ", spec_.iterations(), " iterations")};
  }

  // --- membership and planning model ----------------------------------------

  // Worker id -> stage of the live members.
  std::map<std::string, int> Members() const { return members_; }

  std::vector<std::string> StageMembers(int stage) const {
    std::vector<std::string> out;
    for (int n : assignment_.stage_nodes[stage]) out.push_back(cost_->node_id(n));
    return out;
  }

  // Builds the planning cluster over every worker the job ever had (lost ones
  // stay in it, unused, so node indices never change).
  absl::Status BuildCostModel() {
    v1::ClusterSpec cluster = options().network;
    cluster.clear_nodes();
    std::set<std::string> regions;
    for (const std::string& id : node_order_) {
      const v1::WorkerInfo& w = infos_.at(id);
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
    auto cost = sim::CostModel::Create(cluster_, spec_);
    if (!cost.ok()) return Annotate(cost.status(), "cost model");
    if (!link_bandwidth_.empty()) {
      // Links the workers measured: their fitted bandwidths replace the
      // spec's (UpdateLinksFromTimings).
      sim::CostTables t = cost->tables();
      for (const auto& [link, bandwidth] : link_bandwidth_) {
        const int a = cost->NodeIndex(link.first);
        const int b = cost->NodeIndex(link.second);
        if (a >= 0 && b >= 0 && a != b) t.bandwidth_bytes_per_s[a][b] = bandwidth;
      }
      cost = sim::CostModel::FromTables(std::move(t));
      if (!cost.ok()) return Annotate(cost.status(), "cost model with measured links");
    }
    cost_ = std::make_unique<sim::CostModel>(*std::move(cost));
    return absl::OkStatus();
  }

  // Every measured link between members: the planner keeps the link's
  // latency and takes the bandwidth that makes one activation's transfer
  // last what the workers measured (one transfer size cannot separate the
  // two). Returns how many links were fitted.
  int UpdateLinksFromTimings() {
    int fitted = 0;
    const sim::CostTables& t = cost_->tables();
    for (const auto& [a, sa] : members_) {
      for (const auto& [b, sb] : members_) {
        if (a == b) continue;
        const double seconds = host_->estimates().Transfer(a, b);
        if (!(seconds > 0)) continue;
        const int ia = cost_->NodeIndex(a), ib = cost_->NodeIndex(b);
        if (ia < 0 || ib < 0) continue;
        const double wire = std::max(1e-6, seconds - t.latency_s[ia][ib]);
        link_bandwidth_[{a, b}] = t.activation_bytes / wire;
        ++fitted;
      }
    }
    return fitted;
  }

  // The assignment (node indices of cost_) of the live members.
  void RebuildAssignment() {
    assignment_.stage_nodes.assign(spec_.pipeline().num_stages(), {});
    for (const auto& [id, stage] : members_) {
      assignment_.stage_nodes[stage].push_back(cost_->NodeIndex(id));
    }
    for (auto& nodes : assignment_.stage_nodes) std::sort(nodes.begin(), nodes.end());
  }

  // Why the live members cannot train ("" = they can).
  // Stages without a live worker are skipped by every route when the job's
  // routes skip stages anyway (SkipSpec); otherwise, and for stage 0 (the
  // data), the job cannot train.
  std::string Infeasible() const {
    const std::vector<int> empty = EmptyStages();
    if (empty.empty() || SkipSpec(empty.size()).ok()) return "";
    return absl::StrCat("stage", empty.size() > 1 ? "s " : " ", absl::StrJoin(empty, ", "),
                        empty.size() > 1 ? " have" : " has", " no worker left");
  }

  std::vector<int> EmptyStages() const {
    std::vector<int> empty;
    for (int s = 0; s < assignment_.num_stages(); ++s) {
      if (assignment_.stage_nodes[s].empty()) empty.push_back(s);
    }
    return empty;
  }

  // The pipeline over the stages that have workers when `missing` stages
  // have none: each route still visits the job's P stages, among the
  // remaining ones; jumps and swap distances shrink by `missing`, so that
  // mapped back onto the real stages they stay within the job's limits.
  // FAILED_PRECONDITION when that is impossible (stage 0 gone, the full
  // pipeline, too few stages left, jumps too short). K-FAC jobs skip like
  // the others: their bubble plan covers the stages that have workers.
  absl::StatusOr<v1::PipelineSpec> SkipSpec(size_t missing) const {
    const v1::PipelineSpec& p = spec_.pipeline();
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

  // The job's pipeline for the live members: the data nodes that remain
  // share the iteration's microbatches (the total stays the job's).
  v1::JobSpec LiveSpec(int microbatches) const {
    v1::JobSpec live = spec_;
    const uint32_t data = static_cast<uint32_t>(assignment_.stage_nodes[0].size());
    live.mutable_pipeline()->set_data_nodes(data);
    live.mutable_pipeline()->set_microbatches_per_data_node(
        static_cast<uint32_t>((microbatches + data - 1) / data));
    live.mutable_pipeline()->set_replicas_per_stage(1);
    live.mutable_pipeline()->clear_assignment();
    return live;
  }

  int total_microbatches() const {
    return static_cast<int>(spec_.pipeline().data_nodes() *
                            spec_.pipeline().microbatches_per_data_node());
  }

  // Routes for `count` microbatches over the live members, the first
  // `count` of a plan for the live pipeline.
  absl::StatusOr<planner::PlannedIteration> PlanLive(uint64_t seed, int count,
                                                     const std::vector<sim::Route>* warm,
                                                     int evaluations,
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
  absl::StatusOr<planner::PlannedIteration> PlanAroundEmptyStages(v1::JobSpec live,
                                                                  planner::PlannerOptions o,
                                                                  const std::vector<int>& empty,
                                                                  int count) {
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

  v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                       const std::string& state_from,
                                       const std::string& restore_from) {
    v1::CoordinatorMessage m;
    v1::StageAssignment* a = m.mutable_assignment();
    a->set_job_id(job_id_);
    *a->mutable_spec() = spec_;
    a->set_stage(stage);
    auto layers = StageLayers(static_cast<int>(spec_.model().num_layers()),
                              static_cast<int>(spec_.pipeline().num_stages()), stage);
    if (layers.ok()) {
      a->set_layer_begin(layers->begin);
      a->set_layer_end(layers->end);
    }
    for (const v1::Peer& p : Peers()) *a->add_peers() = p;
    for (const std::string& r : StageMembers(stage)) a->add_replica_group(r);
    a->set_seed(spec_.seed());
    a->set_worker_id(id);
    a->set_start_iteration(start);
    a->set_state_from(state_from);
    a->set_restore_from(restore_from);
    a->set_epoch(epoch_);
    if (options().emulate_network) *a->mutable_emulate_network() = cluster_;
    return m;
  }

  std::vector<v1::Peer> Peers() const {
    std::vector<v1::Peer> peers;
    for (const auto& [id, stage] : members_) {
      const v1::WorkerInfo& w = infos_.at(id);
      v1::Peer p;
      p.set_worker_id(id);
      p.set_address(w.address());
      p.set_data_address(w.data_address());
      p.set_region(w.region());
      p.set_stage(stage);
      peers.push_back(std::move(p));
    }
    return peers;
  }

  void AddReplicaGroups(google::protobuf::RepeatedPtrField<v1::ReplicaGroup>* groups) const {
    for (int s = 0; s < assignment_.num_stages(); ++s) {
      v1::ReplicaGroup* g = groups->Add();
      g->set_stage(s);
      for (const std::string& id : StageMembers(s)) g->add_nodes(id);
    }
  }

  // Sends to a member and keeps the message for a replay when its session
  // reopens. False (the worker counts as lost) when it has no session.
  bool SendTo(const std::string& id, const v1::CoordinatorMessage& m) {
    sent_[id].push_back(m);
    absl::Status s = host_->Send(id, m);
    if (!s.ok()) {
      LogWarning("job ", job_id_, ": cannot reach worker ", id, ": ", s.message());
      Suspect(id, "its session is closed");
    }
    return s.ok();
  }

  void SendToAll(const v1::CoordinatorMessage& m) {
    for (const auto& [id, stage] : members_) SendTo(id, m);
  }

  // An iteration plan goes to every member with only its own K-FAC tasks:
  // split into granules, the job's tasks run into thousands per iteration.
  void SendPlan(const v1::CoordinatorMessage& m) {
    if (m.plan().bubble_tasks().empty()) return SendToAll(m);
    std::map<std::string, std::vector<const v1::BubbleTask*>> mine;
    for (const v1::BubbleTask& t : m.plan().bubble_tasks()) mine[t.node()].push_back(&t);
    v1::CoordinatorMessage own = m;
    for (const auto& [id, stage] : members_) {
      own.mutable_plan()->clear_bubble_tasks();
      for (const v1::BubbleTask* t : mine[id]) *own.mutable_plan()->add_bubble_tasks() = *t;
      SendTo(id, own);
    }
  }

  // --- history ---------------------------------------------------------------

  void AddEvent(v1::JobHistoryEvent::Kind kind, uint64_t iteration, const std::string& worker,
                const std::string& message) {
    LogInfo("job ", job_id_, ": ", message);
    host_->jobs()
        .Update(job_id_,
                [&](v1::Job* j) {
                  v1::JobHistoryEvent* e = j->add_history();
                  *e->mutable_time() = Now();
                  e->set_kind(kind);
                  e->set_iteration(iteration);
                  e->set_worker(worker);
                  e->set_message(message);
                  if (j->history_size() > kMaxHistory) {
                    j->mutable_history()->DeleteSubrange(0, j->history_size() - kMaxHistory);
                  }
                  j->set_epoch(epoch_);
                })
        .IgnoreError();
  }

  // --- assignment --------------------------------------------------------------

  std::optional<JobEnd> Assign() {
    // A resumed job (or one started from another job's checkpoint) restores
    // every stage and continues at the checkpoint's iteration.
    std::string restore = spec_.checkpoint().resume_from();
    if (!restore.empty()) {
      auto done = CheckpointIteration(restore);
      if (!done.ok())
        return Failed(absl::StrCat("checkpoint.resume_from: ", done.status().message()));
      if (*done >= spec_.iterations()) {
        return Failed(absl::StrCat("checkpoint.resume_from: ", restore, " was taken after ", *done,
                                   " iterations; the job has only ", spec_.iterations()));
      }
      next_iteration_ = *done;
    }
    for (const auto& [id, w] : infos_) node_order_.push_back(id);
    if (absl::Status s = BuildCostModel(); !s.ok()) return Failed(s.message());
    planner::PlannerOptions po;
    // The plan of iteration i is seeded with seed + i, resumed or not.
    po.seed = spec_.seed() + next_iteration_;
    // K-FAC places its work into the simulated timeline's gaps; otherwise
    // only the predicted time is used.
    po.sim.record_timeline = kfac();
    auto first = planner::PlanIteration(*cost_, spec_, po);
    if (!first.ok()) return Failed(absl::StrCat("planner: ", first.status().message()));
    assignment_ = first->plan.assignment;
    first_plan_ = std::move(*first);
    for (int s = 0; s < assignment_.num_stages(); ++s) {
      for (int n : assignment_.stage_nodes[s]) members_[cost_->node_id(n)] = s;
    }
    host_->runner_metrics().MembersChanged(static_cast<int>(members_.size()));
    if (auto e = ResolveReplicaSync(); e) return e;
    if (auto e = CreateBubblePlanner(); e) return e;
    if (!restore.empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_RESUMED, next_iteration_, "",
               absl::StrCat("resuming from checkpoint ", restore, " at iteration ", next_iteration_,
                            " on ", members_.size(), " workers (",
                            spec_.pipeline().replicas_per_stage(), " per stage)"));
      // Progress restarts at the checkpoint: what came after it is redone.
      // The last iteration's loss, speed and ETA belong to the run that
      // stopped (a later iteration than the checkpoint's): cleared until the
      // resumed run completes an iteration.
      host_->jobs()
          .Update(job_id_,
                  [&](v1::Job* j) {
                    v1::JobProgress* p = j->mutable_progress();
                    p->set_iteration(next_iteration_);
                    p->set_total_iterations(spec_.iterations());
                    p->clear_loss();
                    p->clear_tokens_per_s();
                    p->clear_iteration_time_s();
                    p->clear_eta_s();
                  })
          .IgnoreError();
    }
    if (restore.empty() && !spec_.checkpoint().init_from().empty()) {
      LogInfo("job ", job_id_, ": workers initialise their stages from ",
              spec_.checkpoint().init_from(), " (checkpoint.init_from)");
    }
    RecordStages();
    std::set<std::string> waiting;
    for (const auto& [id, s] : members_) {
      waiting.insert(id);
      if (!SendTo(id, AssignmentFor(id, s, next_iteration_, "", restore))) {
        return Failed(absl::StrCat("worker ", id, " has no open session"));
      }
    }
    return AwaitStageReady(waiting, "stage builds of ");
  }

  std::optional<JobEnd> AwaitStageReady(std::set<std::string> waiting, const char* what) {
    const absl::Time deadline = absl::Now() + options().assign_timeout;
    while (!waiting.empty()) {
      Event ev = Wait(deadline, [&] { return absl::StrCat(what, absl::StrJoin(waiting, ", ")); });
      if (ev.end) return ev.end;
      // A worker lost while building fails the job: there is nothing to
      // recover yet.
      if (!ev.lost.empty()) {
        return Failed(absl::StrCat("worker ", absl::StrJoin(ev.lost, ", "),
                                   " lost while building its stage"));
      }
      for (auto& [worker, m] : ev.messages) {
        if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_) waiting.erase(worker);
      }
    }
    LogInfo("job ", job_id_, ": all ", members_.size(), " stages built");
    return std::nullopt;
  }

  // optimizer.kfac.replica_sync AUTO: FACTORS or PRECONDITIONED for the
  // whole job, from the cost model on the first plan's timeline
  // (planner::ChooseReplicaSync). The choice goes into spec_ (the workers'
  // assignments carry it), into the stored job's spec before any worker
  // holds a stage (a resumed or re-attached job keeps it), and into the
  // history with both modelled iteration times.
  std::optional<JobEnd> ResolveReplicaSync() {
    v1::KfacSpec* k = spec_.mutable_optimizer()->mutable_kfac();
    if (!kfac() || k->replica_sync() != v1::KFAC_REPLICA_SYNC_AUTO) return std::nullopt;
    auto choice =
        planner::ChooseReplicaSync(KfacWorkload(kfac::ReplicaSync::kFactors), *k, first_plan_->plan,
                                   planner::TimelineFromSimulation(first_plan_->result));
    if (!choice.ok()) {
      return Failed(absl::StrCat("K-FAC replica sync choice: ", choice.status().message()));
    }
    const bool factors = choice->sync == kfac::ReplicaSync::kFactors;
    const v1::KfacReplicaSync chosen =
        factors ? v1::KFAC_REPLICA_SYNC_FACTORS : v1::KFAC_REPLICA_SYNC_PRECONDITIONED;
    k->set_replica_sync(chosen);
    k->set_sync_factors(factors);
    auto recorded = host_->jobs().Update(job_id_, [&](v1::Job* j) {
      v1::KfacSpec* stored = j->mutable_spec()->mutable_optimizer()->mutable_kfac();
      stored->set_replica_sync(chosen);
      stored->set_sync_factors(factors);
    });
    if (!recorded.ok()) {
      return Failed(absl::StrCat("cannot write the job record: ", recorded.status().message()));
    }
    LogInfo("job ", job_id_, ": ", choice->reason);
    AddEvent(v1::JobHistoryEvent::KIND_CONFIGURED, next_iteration_, "", choice->reason);
    return std::nullopt;
  }

  std::optional<JobEnd> CreateBubblePlanner() {
    if (!kfac()) return std::nullopt;
    auto bubbles = planner::BubblePlanner::Create(KfacWorkload(), spec_.optimizer().kfac());
    if (!bubbles.ok()) {
      return Failed(absl::StrCat("K-FAC bubble planner: ", bubbles.status().message()));
    }
    bubbles_ = std::make_unique<planner::BubblePlanner>(*std::move(bubbles));
    return std::nullopt;
  }

  // The job record's stage lists follow the membership.
  void RecordStages() {
    host_->jobs()
        .Update(job_id_,
                [&](v1::Job* j) {
                  j->clear_stages();
                  for (int s = 0; s < assignment_.num_stages(); ++s) {
                    auto* nodes = j->add_stages();
                    for (const std::string& id : StageMembers(s)) nodes->add_nodes(id);
                  }
                  j->set_epoch(epoch_);
                  j->mutable_progress()->set_members(static_cast<uint32_t>(members_.size()));
                })
        .IgnoreError();
  }

  // --- re-attaching after a coordinator restart -----------------------------------

  std::optional<JobEnd> Reattach() {
    auto stored = host_->jobs().Get(job_id_);
    if (!stored.ok()) return Failed(std::string(stored.status().message()));
    epoch_ = stored->epoch() + 1;
    for (int s = 0; s < stored->stages_size(); ++s) {
      for (const std::string& id : stored->stages(s).nodes()) members_[id] = s;
    }
    if (members_.empty()) {
      return Failed("coordinator restarted before the job's stages were assigned; resume it");
    }
    SetState(v1::JOB_STATE_RUNNING, absl::StrCat("re-attaching to ", members_.size(),
                                                 " workers after a coordinator restart"));
    // Workers re-register and report what they hold (JobStatus) once their
    // session reopens.
    std::map<std::string, v1::JobStatus> status;
    const absl::Time deadline = absl::Now() + options().assign_timeout;
    while (status.size() < members_.size() && absl::Now() < deadline) {
      Event ev = Wait(
          deadline, [&] { return "workers to re-attach"; }, /*detect_loss=*/false);
      if (ev.end && StopRequested()) return ev.end;
      if (ev.end) break;  // timed out: the missing ones are lost
      for (auto& [worker, m] : ev.messages) {
        if (m.has_job_status() && m.job_status().job_id() == job_id_ && members_.count(worker)) {
          status[worker] = m.job_status();
        }
      }
    }
    for (const v1::WorkerInfo& w : host_->registry().List(true)) {
      if (members_.count(w.worker_id())) infos_[w.worker_id()] = w;
    }
    std::vector<std::string> missing;
    for (auto it = members_.begin(); it != members_.end();) {
      if (status.count(it->first) && infos_.count(it->first)) {
        ++it;
      } else {
        missing.push_back(it->first);
        host_->Unreserve(job_id_, it->first);
        it = members_.erase(it);
      }
    }
    for (const auto& [id, s] : members_) node_order_.push_back(id);
    std::set<uint64_t> completed;
    for (const auto& [id, st] : status) {
      if (members_.count(id)) completed.insert(st.completed_iterations());
    }
    if (members_.empty() || completed.size() != 1) {
      return Failed(absl::StrCat("coordinator restarted; ",
                                 members_.empty() ? "no worker of the job came back"
                                                  : "the workers stopped at different "
                                                    "iterations",
                                 "; resume the job from its last checkpoint (detourctl resume ",
                                 job_id_, ")"));
    }
    next_iteration_ = *completed.begin();
    if (absl::Status s = BuildCostModel(); !s.ok()) return Failed(s.message());
    RebuildAssignment();
    host_->runner_metrics().MembersChanged(static_cast<int>(members_.size()));
    if (auto e = ResolveReplicaSync(); e) return e;
    if (auto e = CreateBubblePlanner(); e) return e;
    // Whatever iteration was in flight is run again from its start.
    v1::CoordinatorMessage abort;
    abort.mutable_abort()->set_job_id(job_id_);
    abort.mutable_abort()->set_iteration(next_iteration_);
    abort.mutable_abort()->set_reason("the coordinator restarted; the iteration runs again");
    SendToAll(abort);
    for (const std::string& id : missing) {
      AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
               absl::StrCat("worker ", id, " did not come back after the coordinator restarted"));
    }
    AddEvent(v1::JobHistoryEvent::KIND_REATTACHED, next_iteration_, "",
             absl::StrCat("re-attached ", members_.size(),
                          " workers after a coordinator "
                          "restart; continuing at iteration ",
                          next_iteration_));
    if (std::string why = Infeasible(); !why.empty()) {
      if (auto e = Pause(next_iteration_, why); e) return e;
    }
    RecordStages();
    return std::nullopt;
  }

  // --- one iteration ------------------------------------------------------------

  struct IterationOutcome {
    std::optional<Outcome> outcome;
    std::optional<JobEnd> status_end;
    bool ok() const { return outcome.has_value(); }
  };
  static IterationOutcome End(JobEnd e) { return {std::nullopt, std::move(e)}; }
  static IterationOutcome Done(Outcome o) { return {o, std::nullopt}; }

  // What one iteration collected, for the record.
  struct Collected {
    std::map<std::string, v1::TimingReport> timings;
    int rerun = 0;
    absl::Duration overhead;  // coordinator work, not waiting
  };

  // One iteration: plan, send, collect norms / step / results (re-planning
  // around workers lost meanwhile), check, checkpoint, record.
  IterationOutcome RunIteration(uint64_t iteration) {
    const absl::Time begin = absl::Now();
    sent_.clear();
    lost_this_iteration_.clear();
    auto planned = PlanIteration(iteration);
    if (!planned.ok()) return End(Failed(absl::StrCat("planner: ", planned.status().message())));
    auto message = PlanMessage(iteration, *planned);
    if (!message.ok()) return End(Failed(message.status().message()));
    const v1::IterationPlan& plan = message->plan();
    routes_.clear();
    for (const v1::Route& r : plan.routes()) routes_[r.microbatch()] = r;
    IterationRound round(iteration, total_microbatches(), members_, epoch_);
    SendPlan(*message);
    Collected collected;
    collected.overhead = absl::Now() - begin;
    if (recovering_since_) {
      host_->runner_metrics().Recovered(absl::ToDoubleSeconds(absl::Now() - *recovering_since_));
      recovering_since_.reset();
    }
    const absl::Time deadline = absl::Now() + options().iteration_timeout;
    if (auto outcome = Collect(iteration, deadline, &round, &collected); outcome) return *outcome;

    // Checks: replicas identical, every microbatch completed exactly once
    // (or dropped with a lost worker).
    if (absl::Status s = round.Check(); !s.ok()) return End(Failed(s.message()));
    for (const auto& [id, r] : round.results()) last_checksum_[r.stage()] = r.parameter_checksum();
    // An iteration whose microbatches were all dropped has no loss of its
    // own: the last one stands.
    const double loss = round.completed() > 0 ? round.loss_sum() / round.completed() : last_loss_;
    last_loss_ = loss;
    if (!std::isfinite(loss)) {
      return End(Failed(absl::StrCat("the loss became non-finite at iteration ", iteration)));
    }
    if (plan.checkpoint()) {
      if (auto s =
              CommitCheckpoint(iteration + 1, plan.checkpoint_dir(), round.results(), deadline);
          s) {
        return End(*s);
      }
    }
    if (!round.dropped().empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_MICROBATCHES_DROPPED, iteration, "",
               absl::StrCat("iteration ", iteration, ": dropped microbatch(es) ",
                            absl::StrJoin(round.dropped(), ","),
                            " (part of their backward ran on a lost worker)"));
    }
    rerun_total_ += collected.rerun;
    dropped_total_ += round.dropped().size();
    if (auto e = RecordProgress(iteration, loss, round, plan, collected, begin); e) return End(*e);
    if (planned->scheduler == v1::SCHEDULER_SKIPPIPE) last_routes_ = planned->plan.routes;
    AdaptCosts(iteration, plan, collected.timings);
    return Done(Outcome::kDone);
  }

  // The iteration's plan for every worker: routes, replica groups, peers,
  // K-FAC bubble tasks, checkpoint.
  absl::StatusOr<v1::CoordinatorMessage> PlanMessage(uint64_t iteration,
                                                     const planner::PlannedIteration& planned) {
    v1::CoordinatorMessage m;
    v1::IterationPlan* plan = m.mutable_plan();
    plan->set_job_id(job_id_);
    plan->set_iteration(iteration);
    plan->set_epoch(epoch_);
    AddReplicaGroups(plan->mutable_replica_groups());
    for (const v1::Peer& p : Peers()) *plan->add_peers() = p;
    for (const sim::Route& r : planned.plan.routes) {
      v1::Route* route = plan->add_routes();
      *route = planner::ToProtoRoute(*cost_, r);
      route->set_epoch(epoch_);
    }
    plan->set_predicted_time_s(planned.result.iteration_time_s);
    const v1::CheckpointPolicy& policy = spec_.checkpoint();
    // A stage without workers has no file to write: no checkpoint is taken
    // while one is empty (the last complete one stays the newest).
    if (EmptyStages().empty() && !policy.disabled() &&
        ((policy.every_iterations() > 0 && (iteration + 1) % policy.every_iterations() == 0) ||
         iteration + 1 == spec_.iterations())) {
      plan->set_checkpoint(true);
      plan->set_checkpoint_dir(
          absl::StrFormat("%s/%s/iter-%06d", options().checkpoint_root, job_id_, iteration + 1));
    }
    if (bubbles_ != nullptr) {
      // A checkpoint closes the K-FAC refresh window: no refresh is in
      // flight across it, so a job resumed from it plans the same K-FAC
      // work as one that went on (BubblePlanner::PlanIteration). Not the
      // last iteration's: no iteration follows it.
      const bool close = plan->checkpoint() && iteration + 1 < spec_.iterations();
      // The workers anchor their refresh numbers to the planner's.
      const std::optional<uint64_t> last = bubbles_->last_activated_refresh();
      plan->set_kfac_refresh_base(last ? *last + 2 : 1);
      auto placed = bubbles_->PlanIteration(iteration, planned.plan,
                                            planner::TimelineFromSimulation(planned.result),
                                            /*close_window=*/close);
      if (!placed.ok()) return Annotate(placed.status(), "K-FAC bubble planner");
      for (v1::BubbleTask& t : placed->tasks) *plan->add_bubble_tasks() = std::move(t);
      if (placed->activate_refresh) plan->set_kfac_activate_refresh(*placed->activate_refresh + 1);
      plan->set_predicted_time_s(placed->iteration_time_s);
    }
    return m;
  }

  // Gradient norms (one per live worker of the epoch), then the step, then
  // results; workers lost meanwhile are re-planned around (OnLoss). An
  // outcome when the iteration ends otherwise (failure, pause).
  std::optional<IterationOutcome> Collect(uint64_t iteration, absl::Time deadline,
                                          IterationRound* round, Collected* collected) {
    bool stepped = false;
    while (!round->ResultsComplete()) {
      Event ev = Wait(deadline, [&] {
        return absl::StrCat(
            stepped ? "iteration results" : "gradient norms", " of iteration ", iteration, " from ",
            absl::StrJoin(stepped ? round->MissingResults() : round->MissingNorms(), ", "));
      });
      if (ev.end) return End(*ev.end);
      if (!ev.lost.empty()) {
        auto handled = OnLoss(iteration, ev.lost, stepped, round, &collected->rerun, deadline);
        if (handled) return *handled;
      }
      for (auto& [worker, msg] : ev.messages) {
        if (msg.has_grad_norm()) {
          round->AddNorm(worker, msg.grad_norm());
        } else if (msg.has_result()) {
          round->AddResult(worker, msg.result());
        } else if (msg.has_timing() && msg.timing().iteration() == iteration &&
                   !collected->timings.count(worker)) {
          host_->estimates().Add(msg.timing(), region_of_, members_);
          collected->timings[worker] = msg.timing();
        }
      }
      if (!stepped && round->NormsComplete()) {
        const absl::Time step_start = absl::Now();
        auto squared = round->SquaredNorm();
        if (!squared.ok()) return End(Failed(squared.status().message()));
        v1::CoordinatorMessage step;
        step.mutable_step()->set_job_id(job_id_);
        step.mutable_step()->set_iteration(iteration);
        step.mutable_step()->set_squared_norm(*squared);
        step.mutable_step()->set_epoch(epoch_);
        step.mutable_step()->set_completed_microbatches(static_cast<uint32_t>(
            total_microbatches() - static_cast<int>(round->dropped().size())));
        SendToAll(step);
        stepped = true;
        collected->overhead += absl::Now() - step_start;
      }
    }
    return std::nullopt;
  }

  // Progress of the finished iteration into the job record (durably: a job
  // whose record cannot be written stops).
  std::optional<JobEnd> RecordProgress(uint64_t iteration, double loss, const IterationRound& round,
                                       const v1::IterationPlan& plan, const Collected& collected,
                                       absl::Time begin) {
    const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - started_);
    // Measured busy fractions, mean over the workers that reported.
    double utilization = 0, utilization_kfac = 0, max_delay = 0;
    const auto& timings = collected.timings;
    for (const auto& [id, t] : timings) {
      max_delay = std::max(max_delay, t.bubble_delay_max_s());
      if (!(t.iteration_time_s() > 0)) continue;
      const BusySeconds busy = SumBusy(t);
      utilization += busy.pipeline / t.iteration_time_s() / static_cast<double>(timings.size());
      utilization_kfac +=
          (busy.pipeline + busy.kfac) / t.iteration_time_s() / static_cast<double>(timings.size());
    }
    const uint64_t tokens = round.tokens();
    auto recorded = host_->jobs().Update(job_id_, [&](v1::Job* j) {
      v1::JobProgress* p = j->mutable_progress();
      p->set_iteration(iteration + 1);
      p->set_total_iterations(spec_.iterations());
      p->set_loss(loss);
      p->set_iteration_time_s(seconds);
      p->set_predicted_iteration_time_s(plan.predicted_time_s());
      p->set_utilization(utilization);
      p->set_utilization_with_kfac(utilization_kfac);
      if (bubbles_ != nullptr) {
        p->set_kfac_refreshes(bubbles_->completed_refreshes());
        p->set_kfac_refresh_interval(bubbles_->mean_refresh_interval());
        p->set_kfac_max_delay_s(max_delay);
      }
      p->set_coordinator_overhead_s(absl::ToDoubleSeconds(collected.overhead));
      p->set_tokens_per_s(seconds > 0 ? tokens / seconds : 0);
      const double per_iteration =
          elapsed / static_cast<double>(iteration + 1 - started_iteration_);
      p->set_eta_s(per_iteration * static_cast<double>(spec_.iterations() - iteration - 1));
      p->set_recoveries(recoveries_);
      p->set_microbatches_rerun(rerun_total_);
      p->set_microbatches_dropped(dropped_total_);
      p->set_members(static_cast<uint32_t>(members_.size()));
      p->clear_planned_visits();
      for (const auto& [id, stage] : members_) (*p->mutable_planned_visits())[id] = 0;
      for (const v1::Route& r : plan.routes()) {
        for (const std::string& id : r.nodes()) {
          auto v = p->mutable_planned_visits()->find(id);
          if (v != p->mutable_planned_visits()->end()) ++v->second;
        }
      }
      j->set_epoch(epoch_);
    });
    if (!recorded.ok()) {
      // Training on without a durable record would leave the job's state to
      // chance after a restart: stop, with the reason.
      return Failed(absl::StrCat("cannot write the job record: ", recorded.status().message()));
    }
    LogDebug("job ", job_id_, " iteration ", iteration, " loss ", loss, " in ", seconds, " s");
    return std::nullopt;
  }

  // Every --replan_every iterations: node speeds and links from the timing
  // reports, and K-FAC costs from the bubble tasks' measured speed.
  void AdaptCosts(uint64_t iteration, const v1::IterationPlan& plan,
                  const std::map<std::string, v1::TimingReport>& timings) {
    const int every = options().replan_every;
    if (bubbles_ != nullptr) MeasureKfacSpeeds(plan, timings);
    if (every <= 0 || (iteration + 1) % every != 0) return;
    UpdateSpeedsFromTimings(iteration);
    if (bubbles_ != nullptr) {
      if (absl::Status s = bubbles_->UpdateCosts(KfacWorkload()); !s.ok()) {
        LogWarning("job ", job_id_, ": keeping the K-FAC cost estimates: ", s.message());
      }
    }
  }

  absl::StatusOr<planner::PlannedIteration> PlanIteration(uint64_t iteration) {
    if (first_plan_ && iteration == next_iteration_ && epoch_ == 0) {
      planner::PlannedIteration p = std::move(*first_plan_);
      first_plan_.reset();
      return p;
    }
    first_plan_.reset();
    // Re-planning starts from the last iteration's routes with a small
    // budget: the assignment is fixed, speeds drift slowly.
    std::optional<v1::SchedulerKind> scheduler;
    const uint32_t k = spec_.pipeline().full_model_every();
    if (k > 0 && (iteration + 1) % k == 0) scheduler = v1::SCHEDULER_FULL;
    return PlanLive(spec_.seed() + iteration, total_microbatches(),
                    last_routes_.empty() ? nullptr : &last_routes_, kReplanEvaluations, scheduler);
  }

  // --- losing workers --------------------------------------------------------------

  // Workers were lost during `iteration`. Before the step: freeze what
  // crossed them, re-plan what can run again, drop the rest. After the step:
  // the survivors' results are the iteration's.
  std::optional<IterationOutcome> OnLoss(uint64_t iteration, const std::vector<std::string>& lost,
                                         bool stepped, IterationRound* round, int* rerun,
                                         absl::Time deadline) {
    if (!elastic()) {
      return End(Failed(absl::StrCat("worker ", absl::StrJoin(lost, ", "), " lost (", loss_reason_,
                                     ") during iteration ", iteration,
                                     "; elastic training is disabled (elastic.disabled)")));
    }
    const absl::Time detected = absl::Now();
    if (!recovering_since_) recovering_since_ = detected;
    ++recoveries_;
    lost_this_iteration_.insert(lost.begin(), lost.end());
    if (stepped) {
      // The survivors stepped with a reduction that included the lost
      // workers' gradients; a lost data node's microbatches count as dropped
      // unless its result came in.
      for (const std::string& id : lost) {
        auto r = round->results().find(id);
        if (r != round->results().end()) continue;
        for (const auto& [mb, route] : routes_) {
          if (route.data_node() == id) round->Drop(mb);
        }
      }
      round->SetMembers(members_, epoch_);
      RecordStages();
      return std::nullopt;
    }
    if (std::string why = Infeasible(); !why.empty()) {
      if (auto e = Pause(iteration, why); e) return End(*e);
      return Done(Outcome::kRetry);
    }
    round->SetMembers(members_, epoch_);
    // Tell the survivors and learn what ran where.
    v1::CoordinatorMessage change;
    v1::MembershipChange* c = change.mutable_membership();
    c->set_job_id(job_id_);
    c->set_iteration(iteration);
    c->set_epoch(epoch_);
    for (const std::string& id : lost_this_iteration_) c->add_lost(id);
    AddReplicaGroups(c->mutable_replica_groups());
    SendToAll(change);
    std::set<uint32_t> backward_ran, completed;
    std::set<std::string> acked;
    while (acked.size() < members_.size()) {
      Event ev = Wait(deadline, [&] {
        std::vector<std::string> missing;
        for (const auto& [id, s] : members_) {
          if (!acked.count(id)) missing.push_back(id);
        }
        return absl::StrCat("membership acks of epoch ", epoch_, " from ",
                            absl::StrJoin(missing, ", "));
      });
      if (ev.end) return End(*ev.end);
      if (!ev.lost.empty()) {
        // Another loss while recovering: start over with the larger set.
        return OnLoss(iteration, ev.lost, false, round, rerun, deadline);
      }
      for (auto& [worker, msg] : ev.messages) {
        if (msg.has_membership_ack() && msg.membership_ack().epoch() == epoch_ &&
            msg.membership_ack().iteration() == iteration && members_.count(worker)) {
          acked.insert(worker);
          backward_ran.insert(msg.membership_ack().backward_ran().begin(),
                              msg.membership_ack().backward_ran().end());
          completed.insert(msg.membership_ack().completed().begin(),
                           msg.membership_ack().completed().end());
        } else if (msg.has_result()) {
          round->AddResult(worker, msg.result());
        }
      }
    }
    // Every microbatch whose route crosses a lost worker: completed (its
    // data node says so), dropped (some backward ran), or run again.
    std::vector<uint32_t> again;
    int dropped = 0;
    for (const auto& [mb, route] : routes_) {
      if (round->dropped().count(mb)) continue;
      bool crosses = false;
      for (const std::string& n : route.nodes()) crosses |= lost_this_iteration_.count(n) > 0;
      if (!crosses || completed.count(mb)) continue;
      if (backward_ran.count(mb)) {
        round->Drop(mb);
        ++dropped;
      } else {
        again.push_back(mb);
      }
    }
    v1::CoordinatorMessage amend;
    v1::RouteAmendment* a = amend.mutable_reroute();
    a->set_job_id(job_id_);
    a->set_iteration(iteration);
    a->set_epoch(epoch_);
    if (!again.empty()) {
      auto planned =
          PlanLive(spec_.seed() + iteration * 7919 + epoch_, static_cast<int>(again.size()),
                   nullptr, kRerunEvaluations, std::nullopt);
      if (!planned.ok()) {
        return End(Failed(absl::StrCat("re-planning around ", absl::StrJoin(lost, ", "), ": ",
                                       planned.status().message())));
      }
      // Planned microbatch k stands for the k-th to run again.
      for (const sim::Route& planned_route : planned->plan.routes) {
        v1::Route r = planner::ToProtoRoute(*cost_, planned_route);
        const uint32_t mb = again.at(static_cast<size_t>(planned_route.microbatch));
        r.set_microbatch(mb);
        r.set_epoch(epoch_);
        routes_[mb] = r;
        *a->add_routes() = r;
      }
    }
    SendToAll(amend);
    *rerun += static_cast<int>(again.size());
    host_->runner_metrics().Microbatches("rerun", static_cast<int>(again.size()));
    host_->runner_metrics().Microbatches("dropped", dropped);
    host_->runner_metrics().Recovered(absl::ToDoubleSeconds(absl::Now() - *recovering_since_));
    recovering_since_.reset();
    RecordStages();
    AddEvent(v1::JobHistoryEvent::KIND_REROUTED, iteration, "",
             absl::StrCat("iteration ", iteration, " epoch ", epoch_, ": re-planned ", again.size(),
                          " microbatch(es) around ", absl::StrJoin(lost_this_iteration_, ", "),
                          again.empty() ? "" : absl::StrCat(" (", absl::StrJoin(again, ","), ")"),
                          dropped > 0 ? absl::StrCat(", dropped ", dropped) : "", " in ",
                          absl::FormatDuration(absl::Now() - detected)));
    return std::nullopt;
  }

  // Removes `id` from the membership (a new epoch), tells it to drop the job
  // in case it is alive, and records the event.
  void RemoveMember(const std::string& id, const std::string& why, uint64_t iteration) {
    auto it = members_.find(id);
    if (it == members_.end()) return;
    const int stage = it->second;
    members_.erase(it);
    ++epoch_;
    RebuildAssignment();
    last_routes_.clear();  // the warm start routes through it
    host_->Unreserve(job_id_, id);
    host_->runner_metrics().WorkerLost();
    host_->runner_metrics().MembersChanged(-1);
    v1::CoordinatorMessage cancel;
    cancel.mutable_cancel()->set_job_id(job_id_);
    cancel.mutable_cancel()->set_reason(absl::StrCat("left the job: ", why));
    host_->Send(id, cancel).IgnoreError();
    suspects_.erase(id);
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, iteration, id,
             absl::StrCat("worker ", id, " (stage ", stage, ") lost: ", why));
    if (assignment_.stage_nodes[stage].empty() && Infeasible().empty()) {
      AddEvent(v1::JobHistoryEvent::KIND_REROUTED, iteration, "",
               absl::StrCat("stage ", stage,
                            " has no worker left: every route skips it until a "
                            "worker joins (no checkpoints meanwhile)"));
    }
    straggler_replans_.erase(id);
    stragglers_.erase(id);
    KfacMembershipChanged();
  }

  // The K-FAC bubble plan follows the membership: the lost worker's blocks
  // leave it, a joiner's enter it (refreshes in flight start over).
  void KfacMembershipChanged() {
    if (bubbles_ == nullptr) return;
    if (absl::Status s = bubbles_->SetWorkload(KfacWorkload()); !s.ok()) {
      LogWarning("job ", job_id_, ": K-FAC workload after a membership change: ", s.message());
    }
  }

  void Suspect(const std::string& id, const std::string& why) {
    if (!members_.count(id)) return;
    suspects_.emplace(id, std::make_pair(absl::Now(), why));
  }

  // The members found lost now (removed from the membership).
  std::vector<std::string> DetectLoss() {
    std::vector<std::string> lost;
    const absl::Time now = absl::Now();
    const absl::Duration grace = absl::Milliseconds(spec_.elastic().reconnect_grace_ms());
    std::map<std::string, v1::WorkerInfo> registry;
    for (v1::WorkerInfo& w : host_->registry().List(true)) {
      registry[w.worker_id()] = std::move(w);
    }
    std::vector<std::pair<std::string, std::string>> gone;
    for (const auto& [id, stage] : members_) {
      auto r = registry.find(id);
      std::string why;
      if (r == registry.end()) {
        why = "it is no longer registered";
      } else if (r->second.state() == v1::WORKER_STATE_LOST) {
        why = absl::StrCat("no heartbeat for ", absl::FormatDuration(host_->registry().silence()));
      } else if (!r->second.session_open() &&
                 now - FromProto(r->second.session_change_time()) > grace) {
        why = absl::StrCat("its session closed ",
                           absl::FormatDuration(now - FromProto(r->second.session_change_time())),
                           " ago");
      } else if (infos_.count(id) &&
                 !SameTime(r->second.registered_time(), infos_.at(id).registered_time())) {
        // It registered anew: a restarted process, or one that reconnected.
        // One that still holds the job says so (JobStatus).
        Suspect(id, "it registered again without the job");
      }
      auto s = suspects_.find(id);
      if (why.empty() && s != suspects_.end() && now - s->second.first > grace)
        why = s->second.second;
      if (!why.empty()) gone.emplace_back(id, why);
    }
    for (const auto& [id, why] : gone) {
      loss_reason_ = why;
      RemoveMember(id, why, next_iteration_);
      lost.push_back(id);
    }
    return lost;
  }

  // Waits until a message arrives, the deadline passes, a worker of the job
  // is lost or reports an error, or the job is stopped.
  template <typename Describe>
  Event Wait(absl::Time deadline, Describe describe, bool detect_loss = true,
             bool return_on_change = false) {
    Event ev;
    bool first = true;
    while (true) {
      bool check = false;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) {
          ev.end = stop_;
          return ev;
        }
        // The registry changed, suspicions are pending, or a while passed.
        check = poked_ || !suspects_.empty() || absl::Now() - last_loss_check_ > kLossCheck;
        if (poked_ && return_on_change && !first) {
          poked_ = false;
          ev.changed = true;
          return ev;
        }
        if (!return_on_change) poked_ = false;
      }
      first = false;
      if (detect_loss && check) {
        last_loss_check_ = absl::Now();
        std::vector<std::string> lost = DetectLoss();
        if (!lost.empty()) {
          if (!elastic()) {
            ev.end = Failed(absl::StrCat("worker ", absl::StrJoin(lost, ", "), " lost (",
                                         loss_reason_, ") while waiting for ", describe()));
            return ev;
          }
          ev.lost = std::move(lost);
          return ev;
        }
      }
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !inbox_.empty() || stop_.has_value() || poked_;
        };
        mu_.AwaitWithTimeout(absl::Condition(&ready), kLossCheck);
        ev.messages.swap(inbox_);
      }
      for (auto it = ev.messages.begin(); it != ev.messages.end();) {
        const auto& [worker, m] = *it;
        if (m.has_error() && m.error().job_id() == job_id_ && members_.count(worker)) {
          ev.end = Failed(m.error().message());
          return ev;
        }
        if (m.has_job_status()) {
          OnJobStatus(worker, m.job_status());
        } else if (m.has_peer_unreachable() && m.peer_unreachable().job_id() == job_id_ &&
                   members_.count(worker)) {
          Suspect(m.peer_unreachable().peer(), absl::StrCat(worker, " could not reach it (",
                                                            m.peer_unreachable().message(), ")"));
        }
        ++it;
      }
      if (!ev.messages.empty()) return ev;
      if (absl::Now() > deadline) {
        ev.end = Failed(absl::StrCat("timed out waiting for ", describe()));
        return ev;
      }
    }
  }

  // A member's session reopened (or the coordinator restarted): it still
  // holds the job. What it may have missed is sent again.
  void OnJobStatus(const std::string& worker, const v1::JobStatus& status) {
    if (status.job_id() != job_id_ || !members_.count(worker)) return;
    suspects_.erase(worker);
    for (const v1::WorkerInfo& w : host_->registry().List(true)) {
      if (w.worker_id() == worker) infos_[worker] = w;
    }
    auto sent = sent_.find(worker);
    if (sent == sent_.end()) return;
    LogInfo("job ", job_id_, ": worker ", worker, " reconnected; repeating ", sent->second.size(),
            " message(s)");
    for (const v1::CoordinatorMessage& m : sent->second) host_->Send(worker, m).IgnoreError();
  }

  // --- pausing and joining ---------------------------------------------------------

  // The live members cannot train: abort the iteration, wait for workers to
  // fill the gaps (pause_timeout_s), then run the iteration again.
  std::optional<JobEnd> Pause(uint64_t iteration, const std::string& why) {
    v1::CoordinatorMessage abort;
    abort.mutable_abort()->set_job_id(job_id_);
    abort.mutable_abort()->set_iteration(iteration);
    abort.mutable_abort()->set_reason(absl::StrCat("paused: ", why));
    SendToAll(abort);
    const uint32_t timeout_s = spec_.elastic().pause_timeout_s();
    // The state first: whoever sees the event also sees the paused state.
    SetState(v1::JOB_STATE_RUNNING, absl::StrCat("paused: ", why, "; waiting for workers"));
    AddEvent(v1::JobHistoryEvent::KIND_PAUSED, iteration, "",
             absl::StrCat("paused at iteration ", iteration, ": ", why, "; waiting up to ",
                          timeout_s, " s for workers to join"));
    if (spec_.elastic().never_join()) {
      return Failed(absl::StrCat(why, " and elastic.never_join forbids replacements"));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
    while (!Infeasible().empty()) {
      if (auto e = Grow(); e) return e;
      if (auto e = Reassign(); e) return e;
      if (Infeasible().empty()) break;
      Event ev = Wait(
          deadline, [&] { return absl::StrCat("workers to join (", why, ")"); },
          /*detect_loss=*/true, /*return_on_change=*/true);
      if (ev.end) return ev.end;
    }
    SetState(v1::JOB_STATE_RUNNING, "training");
    AddEvent(
        v1::JobHistoryEvent::KIND_CONTINUED, iteration, "",
        absl::StrCat("continuing at iteration ", iteration, " with ", members_.size(), " workers"));
    return std::nullopt;
  }

  // Workers the job misses per stage (its spec's counts minus the live ones).
  std::map<int, int> Deficit() const {
    std::map<int, int> deficit;
    for (int s = 0; s < assignment_.num_stages(); ++s) {
      const int target = s == 0 ? static_cast<int>(spec_.pipeline().data_nodes())
                                : static_cast<int>(spec_.pipeline().replicas_per_stage());
      const int have = static_cast<int>(assignment_.stage_nodes[s].size());
      if (have < target) deficit[s] = target - have;
    }
    return deficit;
  }

  // At an iteration boundary: idle workers join where the job lacks
  // capacity, the empty stages first, then the stage whose new replica the
  // planner predicts the shortest iteration for.
  std::optional<JobEnd> Grow() {
    if (spec_.elastic().never_join() || !elastic()) return std::nullopt;
    std::map<int, int> deficit = Deficit();
    int wanted = 0;
    for (const auto& [s, n] : deficit) wanted += n;
    if (wanted == 0) return std::nullopt;
    std::set<std::string> exclude(lost_this_iteration_.begin(), lost_this_iteration_.end());
    for (const auto& [id, s] : members_) exclude.insert(id);
    for (const auto& [id, until] : join_backoff_) {
      if (absl::Now() < until) exclude.insert(id);
    }
    std::vector<v1::WorkerInfo> idle = host_->ReserveIdle(job_id_, wanted, exclude);
    for (v1::WorkerInfo& w : idle) {
      const int stage = ChooseStage(w, deficit);
      if (auto e = Join(w, stage); e) return e;
      if (--deficit[stage] == 0) deficit.erase(stage);
    }
    return std::nullopt;
  }

  int ChooseStage(const v1::WorkerInfo& w, const std::map<int, int>& deficit) {
    for (const auto& [s, n] : deficit) {
      if (assignment_.stage_nodes[s].empty()) return s;
    }
    if (deficit.size() == 1) return deficit.begin()->first;
    // Judge each candidate by the plan it allows (a quick route search), with
    // `w` tried in each stage; then everything is put back as it was. `w` may
    // be a worker the job had before (lost, then back and idle): it keeps its
    // entry and node index, which BuildCostModel needs for every node.
    int best = deficit.begin()->first;
    double best_time = std::numeric_limits<double>::infinity();
    const std::string id = w.worker_id();
    const auto had_info = infos_.find(id);
    const std::optional<v1::WorkerInfo> old_info =
        had_info != infos_.end() ? std::optional<v1::WorkerInfo>(had_info->second) : std::nullopt;
    const bool had_node =
        std::find(node_order_.begin(), node_order_.end(), id) != node_order_.end();
    infos_[id] = w;
    if (!had_node) node_order_.push_back(id);
    if (BuildCostModel().ok()) {
      for (const auto& [s, n] : deficit) {
        members_[id] = s;
        RebuildAssignment();
        auto p = PlanLive(spec_.seed() + s, total_microbatches(), nullptr, 200, std::nullopt);
        if (p.ok() && p->result.iteration_time_s < best_time) {
          best_time = p->result.iteration_time_s;
          best = s;
        }
      }
    }
    members_.erase(id);
    if (!had_node) node_order_.pop_back();
    if (old_info.has_value()) {
      infos_[id] = *old_info;
    } else {
      infos_.erase(id);
    }
    BuildCostModel().IgnoreError();
    RebuildAssignment();
    return best;
  }

  // `w` joins stage `stage` at the next iteration: it builds the stage and
  // receives a live replica's state (or the newest checkpoint's). With
  // `move`, `w` is a member moving from move->from (it already left it): it
  // drops that stage and takes the new one the same way.
  std::optional<JobEnd> Join(const v1::WorkerInfo& w, int stage, const StageMove* move = nullptr) {
    const std::string id = w.worker_id();
    infos_[id] = w;
    if (std::find(node_order_.begin(), node_order_.end(), id) == node_order_.end()) {
      node_order_.push_back(id);
    }
    if (absl::Status s = BuildCostModel(); !s.ok()) return Failed(s.message());
    const std::vector<std::string> replicas = StageMembers(stage);
    const std::string donor = replicas.empty() ? "" : replicas.front();
    members_[id] = stage;
    ++epoch_;
    RebuildAssignment();
    last_routes_.clear();
    if (move == nullptr) host_->runner_metrics().MembersChanged(1);
    KfacMembershipChanged();
    const std::string restore = donor.empty() ? last_checkpoint_ : "";
    const std::string verb = move == nullptr ? "join" : "move to";
    auto fail_join = [&](const std::string& why) -> std::optional<JobEnd> {
      // Not again for a while: a worker that cannot join would otherwise be
      // tried at every iteration.
      join_backoff_[id] = absl::Now() + kJoinBackoff;
      AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
               absl::StrCat("worker ", id, " could not ", verb, " stage ", stage, ": ", why));
      RemoveMember(id, why, next_iteration_);
      return std::nullopt;
    };
    const absl::Time begin = absl::Now();
    if (!SendTo(id, AssignmentFor(id, stage, next_iteration_, donor, restore))) {
      return fail_join("it has no open session");
    }
    const absl::Time deadline = absl::Now() + options().assign_timeout;
    bool ready = false;
    bool received = donor.empty();
    uint64_t checksum = 0;
    while (!ready || !received) {
      Event ev = Wait(deadline,
                      [&] { return absl::StrCat("worker ", id, " to ", verb, " stage ", stage); });
      if (ev.end) {
        if (ev.end->state == v1::JOB_STATE_FAILED && !StopRequested()) {
          return fail_join(ev.end->message);
        }
        return ev.end;
      }
      if (!ev.lost.empty()) {
        if (!members_.count(id)) return std::nullopt;  // the joiner itself
        if (!donor.empty() && !members_.count(donor)) return fail_join("its donor was lost");
      }
      for (auto& [worker, m] : ev.messages) {
        if (worker != id) continue;
        if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_ && !ready) {
          ready = true;
          if (!donor.empty()) {
            v1::CoordinatorMessage send;
            send.mutable_send_state()->set_job_id(job_id_);
            send.mutable_send_state()->set_to(id);
            send.mutable_send_state()->set_epoch(epoch_);
            for (const v1::Peer& p : Peers()) {
              if (p.worker_id() == id) *send.mutable_send_state()->mutable_peer() = p;
            }
            SendTo(donor, send);
          }
        } else if (m.has_state_received() && m.state_received().job_id() == job_id_) {
          received = true;
          checksum = m.state_received().parameter_checksum();
        }
      }
    }
    if (!donor.empty() && last_checksum_.count(stage) && checksum != last_checksum_.at(stage)) {
      return fail_join(absl::StrCat("the state it received has checksum ", checksum,
                                    ", its replicas ", last_checksum_.at(stage)));
    }
    RecordStages();
    const std::string source =
        donor.empty() ? (restore.empty() ? " (fresh parameters: no replica or checkpoint was left)"
                                         : absl::StrCat(" from checkpoint ", restore))
                      : absl::StrCat(" with the state of ", donor);
    if (move == nullptr) {
      host_->runner_metrics().WorkerJoined();
      AddEvent(v1::JobHistoryEvent::KIND_WORKER_JOINED, next_iteration_, id,
               absl::StrCat("worker ", id, " joined stage ", stage, " at iteration ",
                            next_iteration_, source));
      return std::nullopt;
    }
    host_->runner_metrics().WorkerReassigned();
    AddEvent(
        v1::JobHistoryEvent::KIND_REASSIGNED, next_iteration_, id,
        absl::StrCat("worker ", id, " moved from stage ", move->from, " to stage ", stage,
                     " at iteration ", next_iteration_, source, " in ",
                     absl::FormatDuration(absl::Trunc(absl::Now() - begin, absl::Milliseconds(1))),
                     " (", MoveReason(*move), ")"));
    return std::nullopt;
  }

  // --- moving workers between stages -----------------------------------------------

  // At an iteration boundary after a membership change or a re-plan with
  // measured speeds: moves one worker from a stage with spare replicas to
  // another stage when the planner predicts a gain that repays the move
  // within the horizon, or to a stage left empty (stage_reassignment.h).
  std::optional<JobEnd> Reassign() {
    if (!elastic() || spec_.elastic().reassign_disabled()) return std::nullopt;
    if (epoch_ == reassign_epoch_ && cost_version_ == reassign_costs_) return std::nullopt;
    reassign_epoch_ = epoch_;
    reassign_costs_ = cost_version_;
    const uint64_t left = spec_.iterations() - next_iteration_;
    const uint64_t horizon =
        std::min<uint64_t>(spec_.elastic().reassign_horizon_iterations(), left);
    if (horizon == 0) return std::nullopt;
    std::vector<std::vector<std::string>> stages;
    for (int s = 0; s < assignment_.num_stages(); ++s) stages.push_back(StageMembers(s));
    auto seconds = [this](const std::string& id, int stage) {
      const int n = cost_->NodeIndex(id);
      return n < 0 ? 0.0 : cost_->ForwardTime(n, stage) + cost_->BackwardTime(n, stage);
    };
    std::vector<StageMove> moves = CandidateMoves(stages, seconds, /*limit=*/-1);
    if (moves.empty()) return std::nullopt;
    // Every candidate is judged by the same quick route search.
    const uint64_t seed = spec_.seed() + next_iteration_;
    const double current = PredictIteration(seed);
    if (std::isfinite(current)) {  // workers that can train: recent moves settle first
      const size_t before = moves.size();
      moves.erase(std::remove_if(moves.begin(), moves.end(),
                                 [&](const StageMove& m) {
                                   return MoveMustSettle(m, made_moves_, next_iteration_, epoch_);
                                 }),
                  moves.end());
      if (moves.size() < before) {
        LogDebug("job ", job_id_, ": ", before - moves.size(),
                 " stage move(s) wait for a recent move of their worker to settle");
      }
    }
    if (moves.size() > static_cast<size_t>(kMoveCandidates)) moves.resize(kMoveCandidates);
    if (moves.empty()) return std::nullopt;
    for (StageMove& m : moves) {
      members_[m.worker] = m.to;
      RebuildAssignment();
      m.predicted_iteration_s = PredictIteration(seed);
      members_[m.worker] = m.from;
      RebuildAssignment();
      m.cost_s = MoveCost(m);
    }
    std::optional<StageMove> move = ChooseMove(current, moves, horizon);
    if (!move) {
      LogDebug("job ", job_id_, ": no stage move pays within ", horizon, " iterations (",
               moves.size(), " judged)");
      return std::nullopt;
    }
    move_baseline_s_ = current;
    LogInfo("job ", job_id_, ": moving worker ", move->worker, " from stage ", move->from,
            " to stage ", move->to, " (", MoveReason(*move), ")");
    members_.erase(move->worker);
    RebuildAssignment();
    std::optional<JobEnd> end = Join(infos_.at(move->worker), move->to, &*move);
    auto moved = members_.find(move->worker);
    if (!end && moved != members_.end() && moved->second == move->to) {
      made_moves_[move->worker] = MadeMove{next_iteration_, horizon, epoch_};
    }
    return end;
  }

  // The iteration time a quick plan predicts for the membership as it is
  // now; infinity when it cannot train or the planner fails.
  double PredictIteration(uint64_t seed) {
    if (!Infeasible().empty()) return std::numeric_limits<double>::infinity();
    auto p = PlanLive(seed, total_microbatches(), nullptr, kQuickEvaluations, std::nullopt);
    return p.ok() ? p->result.iteration_time_s : std::numeric_limits<double>::infinity();
  }

  // Seconds the job stands still for `m`: the target stage's state (fp32
  // parameters, AdamW moments, K-FAC factors and inverses) over the link
  // from its first replica, plus kMovePause; from a checkpoint the pause.
  double MoveCost(const StageMove& m) const {
    const sim::ModelCosts mc = sim::ComputeModelCosts(spec_.model());
    const std::vector<int> layers =
        sim::LayersPerStage(static_cast<int>(spec_.model().num_layers()), assignment_.num_stages());
    const int blocks = layers.at(static_cast<size_t>(m.to));
    const double params = blocks * mc.params_per_layer + (m.to == 0 ? mc.stage0_extra_params : 0);
    double kfac_values = 0;
    if (kfac()) {
      // Pending sums, running factors, active and staged inverses, and the
      // grafting moments of the projections.
      const kfac::BlockWorkload block(spec_.model());
      kfac_values = blocks * (4.0 * static_cast<double>(block.FactorSyncElements()) +
                              2.0 * static_cast<double>(block.ProjectionElements()));
    }
    const double bytes = StageStateBytes(params, kfac_values);
    const double pause = absl::ToDoubleSeconds(kMovePause);
    const std::vector<std::string> donors = StageMembers(m.to);
    const int a = donors.empty() ? -1 : cost_->NodeIndex(donors.front());
    const int b = cost_->NodeIndex(m.worker);
    if (a < 0 || b < 0) return MoveCostSeconds(bytes, 0, 0, pause);
    return MoveCostSeconds(bytes, cost_->Latency(a, b), cost_->Bandwidth(a, b), pause);
  }

  std::string MoveReason(const StageMove& m) const {
    if (m.fills_empty_stage) {
      return absl::StrFormat("stage %d had no worker; predicted iteration %.3g s", m.to,
                             m.predicted_iteration_s);
    }
    if (!std::isfinite(move_baseline_s_)) {
      return absl::StrFormat("the workers left could not train; predicted iteration %.3g s",
                             m.predicted_iteration_s);
    }
    const double gain = move_baseline_s_ - m.predicted_iteration_s;
    return absl::StrFormat(
        "predicted iteration %.3g s -> %.3g s; the move costs %.3g s, repaid in %.1f iterations",
        move_baseline_s_, m.predicted_iteration_s, m.cost_s, gain > 0 ? m.cost_s / gain : 0.0);
  }

  bool StopRequested() const {
    absl::MutexLock lock(&mu_);
    return stop_.has_value();
  }

  // --- K-FAC and speeds ---------------------------------------------------------------

  // Every planning node's blocks and the estimated cost of their K-FAC work
  // at the node's current speed (cluster_, calibrated from timings).
  // Remembers the FLOP/s each node's costs assume (workload_flops_).
  // `sync` prices the factor all-reduce of another scheme than the job's
  // (ResolveReplicaSync).
  planner::KfacWorkload KfacWorkload(std::optional<kfac::ReplicaSync> sync_override = {}) {
    planner::KfacWorkload w;
    const std::vector<int> stage_of = assignment_.NodeStages(cost_->num_nodes());
    const double tokens = static_cast<double>(spec_.pipeline().samples_per_microbatch()) *
                          spec_.model().context_length();
    const kfac::BlockWorkload block(spec_.model());
    const kfac::ReplicaSync sync =
        sync_override.value_or(kfac::ReplicaSyncOf(spec_.optimizer().kfac()));
    for (int n = 0; n < cost_->num_nodes(); ++n) {
      planner::KfacNodeWork node;
      node.node_id = cost_->node_id(n);
      node.stage = stage_of[n];
      if (node.stage >= 0) {
        auto layers = StageLayers(static_cast<int>(spec_.model().num_layers()),
                                  static_cast<int>(spec_.pipeline().num_stages()), node.stage);
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

  // FLOP/s a node's K-FAC work runs at: measured from its bubble tasks once
  // it has run some, else the node's speed (which is calibrated on forward
  // work: matrix products of another shape than K-FAC's, and no Cholesky).
  double KfacFlopsPerSecond(int node) const {
    auto measured = kfac_flops_.find(cost_->node_id(node));
    if (measured != kfac_flops_.end()) return measured->second;
    return cluster_.compute().tflops() * 1e12 * cluster_.nodes(node).speed();
  }

  // Every worker's K-FAC speed from this iteration: the FLOPs of the tasks
  // it ran (planned seconds × the FLOP/s they were planned at) over the
  // seconds it measured, folded into a moving average.
  void MeasureKfacSpeeds(const v1::IterationPlan& plan,
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

  // Re-derives every node's speed from its measured forward time against the
  // cost model's prediction, and rebuilds the cost model for later planning
  // (the next iteration boundary judges stage moves with it: Reassign).
  void UpdateSpeedsFromTimings(uint64_t iteration) {
    const int links = UpdateLinksFromTimings();
    int changed = 0;
    std::vector<ForwardSample> samples;
    for (const auto& [id, stage] : members_) {
      const int index = cost_->NodeIndex(id);
      if (index < 0) continue;
      const double measured = host_->estimates().Compute(id, stage, v1::TaskTiming::KIND_FORWARD);
      const double predicted = cost_->ForwardTime(index, stage);
      if (!(measured > 0) || !(predicted > 0)) continue;
      const double assumed = cluster_.nodes(index).speed();
      speeds_[id] = assumed * predicted / measured;
      ++changed;
      // What the node's registered speed predicts (the cost model's speed
      // may already be a measured one).
      const double registered =
          infos_.count(id) && infos_.at(id).speed() > 0 ? infos_.at(id).speed() : 1.0;
      samples.push_back({id, stage, measured, predicted * assumed / registered});
    }
    NoteStragglers(iteration, samples);
    if (changed == 0 && links == 0) return;
    if (absl::Status s = BuildCostModel(); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
      return;
    }
    ++cost_version_;
    LogDebug("job ", job_id_, ": node speeds updated from ", changed, " workers' timings, ", links,
             " links measured (iteration ", iteration, ")");
  }

  // Workers slow at kStragglerReplans consecutive re-plans become
  // stragglers (history STRAGGLER, once per episode); one no longer slow is
  // recorded again (REPLANNED). Routing needs no flag: the measured speeds
  // already give a slow worker fewer visits.
  void NoteStragglers(uint64_t iteration, const std::vector<ForwardSample>& samples) {
    std::map<std::string, Slowdown> slow;
    for (Slowdown& d : FindSlowdowns(samples, kStragglerFactor)) slow[d.worker] = std::move(d);
    for (const ForwardSample& sample : samples) {
      const std::string& id = sample.worker;
      auto found = slow.find(id);
      if (found == slow.end()) {
        straggler_replans_.erase(id);
        if (stragglers_.erase(id) > 0) {
          AddEvent(v1::JobHistoryEvent::KIND_REPLANNED, iteration, id,
                   absl::StrCat("worker ", id, " (stage ", sample.stage,
                                ") is no longer slower than its replicas or its prediction"));
        }
        continue;
      }
      const Slowdown& d = found->second;
      if (++straggler_replans_[id] < kStragglerReplans || stragglers_.count(id)) continue;
      stragglers_[id] = d.factor;
      host_->runner_metrics().StragglerFound();
      AddEvent(v1::JobHistoryEvent::KIND_STRAGGLER, iteration, id,
               absl::StrFormat("worker %s (stage %d) is a straggler: its forward passes take "
                               "%.1fx %s at %d re-plans in a row; routes give it fewer visits",
                               id, d.stage, d.factor,
                               d.replica.empty()
                                   ? std::string("what its speed predicts, relative to the job")
                                   : absl::StrCat("those of its replica ", d.replica),
                               straggler_replans_[id]));
    }
  }

  // --- checkpoints ----------------------------------------------------------------

  // The job's existing checkpoints (a resumed job keeps pruning them).
  void LoadCheckpointList() {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path root = fs::path(options().checkpoint_root) / job_id_;
    std::vector<std::string> dirs;
    for (auto it = fs::directory_iterator(root, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.rfind("iter-", 0) == 0 && fs::exists(it->path() / "manifest.json", ec)) {
        dirs.push_back(it->path().string());
      }
    }
    std::sort(dirs.begin(), dirs.end());
    checkpoints_.assign(dirs.begin(), dirs.end());
    auto job = host_->jobs().Get(job_id_);
    if (job.ok()) last_checkpoint_ = job->last_checkpoint();
  }

  // Asks the first data node to write the manifest over the stage files the
  // results name, waits for it, then keeps only the newest keep_last.
  std::optional<JobEnd> CommitCheckpoint(uint64_t iterations_done, const std::string& dir,
                                         const std::map<std::string, v1::IterationResult>& results,
                                         absl::Time deadline) {
    v1::CoordinatorMessage m;
    v1::CommitCheckpoint* c = m.mutable_commit();
    c->set_job_id(job_id_);
    c->set_iteration(iterations_done);
    c->set_dir(dir);
    std::set<uint32_t> stages;
    for (const auto& [id, r] : results) {
      if (r.has_checkpoint() && stages.insert(r.checkpoint().stage()).second) {
        *c->add_files() = r.checkpoint();
      }
    }
    if (static_cast<int>(stages.size()) != assignment_.num_stages()) {
      const std::string why = absl::StrCat("checkpoint ", dir, ": ", stages.size(), " of ",
                                           assignment_.num_stages(), " stage files were written");
      if (!elastic() || lost_this_iteration_.empty()) return Failed(why);
      // The writer of a stage was lost after the step: this checkpoint is
      // incomplete; the last one stands and the next one will be whole.
      AddEvent(v1::JobHistoryEvent::KIND_CHECKPOINT_SKIPPED, iterations_done, "",
               absl::StrCat(why, " (a writer was lost); skipped, ",
                            last_checkpoint_.empty()
                                ? "no earlier checkpoint"
                                : absl::StrCat(last_checkpoint_, " stays the newest")));
      return std::nullopt;
    }
    const std::string writer = StageMembers(0).front();
    if (!SendTo(writer, m)) return Failed(absl::StrCat("worker ", writer, " has no open session"));
    while (true) {
      Event ev = Wait(deadline, [&] { return absl::StrCat("checkpoint ", dir); });
      if (ev.end) return ev.end;
      if (!ev.lost.empty() && !members_.count(writer)) {
        return Failed(absl::StrCat("worker ", writer, " was lost while writing checkpoint ", dir));
      }
      bool committed = false;
      for (auto& [worker, msg] : ev.messages) {
        committed |= msg.has_checkpoint_committed() && msg.checkpoint_committed().dir() == dir;
      }
      if (committed) break;
    }
    LogInfo("job ", job_id_, ": checkpoint ", dir);
    if (checkpoints_.empty() || checkpoints_.back() != dir) checkpoints_.push_back(dir);
    last_checkpoint_ = dir;
    const uint32_t keep = std::max<uint32_t>(1, spec_.checkpoint().keep_last());
    while (checkpoints_.size() > keep) {
      std::error_code ec;
      std::filesystem::remove_all(checkpoints_.front(), ec);
      checkpoints_.pop_front();
    }
    host_->jobs().Update(job_id_, [&](v1::Job* j) { j->set_last_checkpoint(dir); }).IgnoreError();
    return std::nullopt;
  }

  // --- job state ---------------------------------------------------------------------

  JobEnd Failed(absl::string_view message) const {
    return JobEnd{v1::JOB_STATE_FAILED, std::string(message)};
  }

  void SetState(v1::JobState state, const std::string& message) {
    host_->jobs()
        .Update(job_id_,
                [&](v1::Job* j) {
                  j->set_state(state);
                  j->set_message(message);
                })
        .IgnoreError();
  }

  void Finish(const JobEnd& end) {
    // Release every worker of the job, whatever the outcome.
    for (const auto& [id, s] : members_) {
      v1::CoordinatorMessage m;
      m.mutable_cancel()->set_job_id(job_id_);
      m.mutable_cancel()->set_reason(end.message);
      host_->Send(id, m).IgnoreError();
    }
    host_->runner_metrics().MembersChanged(-static_cast<int>(members_.size()));
    host_->Release(job_id_);
    host_->jobs()
        .Update(job_id_,
                [&](v1::Job* j) {
                  if (JobStore::IsFinal(j->state())) return;  // e.g. cancelled by request
                  j->set_state(end.state);
                  j->set_message(end.message);
                  *j->mutable_end_time() = Now();
                })
        .IgnoreError();
    if (end.state == v1::JOB_STATE_FAILED) {
      LogWarning("job ", job_id_, " failed: ", end.message);
    } else {
      LogInfo("job ", job_id_, " ", v1::JobState_Name(end.state), ": ", end.message);
    }
  }

  RunnerHost* const host_;
  const std::string job_id_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::deque<Message> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<JobEnd> stop_ ABSL_GUARDED_BY(mu_);
  bool poked_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;

  // Runner-thread state.
  v1::JobSpec spec_;
  const JobRunner::StartMode start_mode_;
  std::map<std::string, v1::WorkerInfo> infos_;  // every worker the job had
  std::vector<std::string> node_order_;          // planning node order
  std::map<std::string, double> speeds_;         // measured relative speeds
  // Measured links (from, to) -> fitted bandwidth, bytes/s.
  std::map<std::pair<std::string, std::string>, double> link_bandwidth_;
  std::map<std::string, int> members_;  // live: worker -> stage
  uint64_t epoch_ = 0;
  uint64_t next_iteration_ = 0;
  uint64_t started_iteration_ = 0;
  absl::Time started_;
  v1::ClusterSpec cluster_;
  std::unique_ptr<sim::CostModel> cost_;
  sim::StageAssignment assignment_;
  std::optional<planner::PlannedIteration> first_plan_;
  // The last skippipe routes (the warm start of the next iteration's search).
  std::vector<sim::Route> last_routes_;
  // Route-search simulations per re-plan, and per re-run after a loss.
  static constexpr int kReplanEvaluations = 2000;
  static constexpr int kRerunEvaluations = 300;
  std::unique_ptr<planner::BubblePlanner> bubbles_;  // K-FAC jobs only
  std::map<std::string, double> kfac_flops_;         // node -> measured K-FAC FLOP/s
  std::map<std::string, double> workload_flops_;     // node -> FLOP/s the planner's costs use
  std::map<std::string, std::string> region_of_;
  std::deque<std::string> checkpoints_;  // newest last
  std::string last_checkpoint_;
  // This iteration's routes (re-runs replace theirs) and messages sent.
  std::map<uint32_t, v1::Route> routes_;
  std::map<std::string, std::vector<v1::CoordinatorMessage>> sent_;
  // Elastic book-keeping.
  std::map<std::string, std::pair<absl::Time, std::string>> suspects_;
  std::set<std::string> lost_this_iteration_;
  std::string loss_reason_;
  std::map<uint32_t, uint64_t> last_checksum_;  // stage -> parameters after the last step
  std::optional<absl::Time> recovering_since_;
  absl::Time last_loss_check_ = absl::InfinitePast();
  static constexpr absl::Duration kLossCheck = absl::Milliseconds(500);
  // Stage reassignment: the epoch and cost model last judged, and the
  // iteration time predicted before the move being made.
  uint64_t reassign_epoch_ = 0;
  uint64_t cost_version_ = 0;  // bumped whenever measured speeds change the cost model
  uint64_t reassign_costs_ = 0;
  double move_baseline_s_ = 0;
  // Each worker's last stage move (MoveMustSettle).
  std::map<std::string, MadeMove> made_moves_;
  static constexpr int kMoveCandidates = 4;
  static constexpr int kQuickEvaluations = 200;
  static constexpr absl::Duration kMovePause = absl::Seconds(1);
  // Stragglers: consecutive re-plans each worker was found slow at, and
  // those recorded as stragglers (worker -> slowdown).
  std::map<std::string, int> straggler_replans_;
  std::map<std::string, double> stragglers_;
  static constexpr double kStragglerFactor = 2.0;
  static constexpr int kStragglerReplans = 3;
  std::map<std::string, absl::Time> join_backoff_;  // worker -> no join before
  static constexpr absl::Duration kJoinBackoff = absl::Seconds(60);
  uint64_t recoveries_ = 0;
  double last_loss_ = 0;
  uint64_t rerun_total_ = 0;
  uint64_t dropped_total_ = 0;
};

JobRunner::JobRunner(RunnerHost* host, std::string job_id, v1::JobSpec spec,
                     std::vector<v1::WorkerInfo> workers, StartMode start)
    : impl_(std::make_unique<Impl>(host, std::move(job_id), std::move(spec), std::move(workers),
                                   start)) {}
JobRunner::~JobRunner() = default;
void JobRunner::Start() { impl_->Start(); }
void JobRunner::Post(const std::string& worker_id, const v1::WorkerMessage& message) {
  impl_->Post(worker_id, message);
}
void JobRunner::Poke() { impl_->Poke(); }
void JobRunner::RequestStop(JobEnd stop) { impl_->RequestStop(std::move(stop)); }
bool JobRunner::finished() const { return impl_->finished(); }

}  // namespace detour
