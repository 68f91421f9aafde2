#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <filesystem>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/sim/cost_model.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"
#include "common/timing.h"
#include "coordinator/planner/bubble_planner.h"
#include "coordinator/planner/plan_proto.h"
#include "coordinator/planner/planner.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

google::protobuf::Timestamp Now() {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
}

}  // namespace

// How a job ended: its final state and the reason.
struct JobEnd {
  v1::JobState state;
  std::string message;
};

// Drives one job whose workers are reserved, from assignment to its end, on
// its own thread. Pending jobs have no runner (JobManager::ScheduleLoop).
class JobRunner {
 public:
  JobRunner(JobManager* manager, std::string job_id, v1::JobSpec spec,
            std::vector<v1::WorkerInfo> workers)
      : manager_(manager),
        job_id_(std::move(job_id)),
        spec_(std::move(spec)),
        workers_(std::move(workers)) {}

  ~JobRunner() {
    RequestStop(JobEnd{v1::JOB_STATE_FAILED, "coordinator stopped while the job was running"});
    if (thread_.joinable()) thread_.join();
  }

  void Start() { thread_ = std::thread([this] { Run(); }); }

  void Post(const std::string& worker_id, const v1::WorkerMessage& message) {
    absl::MutexLock lock(&mu_);
    inbox_.emplace_back(worker_id, message);
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

  void Run() {
    auto end = Drive();
    Finish(end);
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
  }

  JobEnd Drive() {
    // ASSIGNING.
    SetState(v1::JOB_STATE_ASSIGNING,
             absl::StrCat("assigning stages to ", workers_.size(), " workers"));
    if (auto s = Assign(); s) return *s;

    // RUNNING.
    SetState(v1::JOB_STATE_RUNNING, "training");
    manager_->jobs_->Update(job_id_, [](v1::Job* j) { *j->mutable_start_time() = Now(); })
        .IgnoreError();
    const absl::Time started = absl::Now();
    for (uint64_t it = 0; it < spec_.iterations(); ++it) {
      if (auto s = RunIteration(it, started); s) return *s;
    }
    return {v1::JOB_STATE_SUCCEEDED, absl::StrCat("trained ", spec_.iterations(), " iterations")};
  }

  std::optional<JobEnd> Assign() {
    // The planning cluster: the reserved workers with the operator's network.
    v1::ClusterSpec cluster = manager_->options_.network;
    cluster.clear_nodes();
    std::set<std::string> regions;
    for (const v1::WorkerInfo& w : workers_) {
      v1::NodeSpec* n = cluster.add_nodes();
      n->set_id(w.worker_id());
      n->set_region(w.region());
      n->set_speed(w.speed());
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
    auto normalized = NormalizeClusterSpec(cluster);
    if (!normalized.ok()) return JobEnd{v1::JOB_STATE_FAILED, std::string(normalized.status().message())};
    cluster_ = *normalized;
    auto cost = sim::CostModel::Create(cluster_, spec_);
    if (!cost.ok()) return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("cost model: ", cost.status().message())};
    cost_ = std::make_unique<sim::CostModel>(*std::move(cost));
    planner::PlannerOptions options;
    options.seed = spec_.seed();
    // K-FAC places its work into the simulated timeline's gaps; otherwise
    // only the predicted time is used.
    options.sim.record_timeline = kfac();
    auto first = planner::PlanIteration(*cost_, spec_, options);
    if (!first.ok()) return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("planner: ", first.status().message())};
    assignment_ = first->plan.assignment;
    first_plan_ = std::move(*first);
    if (kfac()) {
      auto bubbles = planner::BubblePlanner::Create(KfacWorkload(), spec_.optimizer().kfac());
      if (!bubbles.ok()) {
        return JobEnd{v1::JOB_STATE_FAILED,
                      absl::StrCat("K-FAC bubble planner: ", bubbles.status().message())};
      }
      bubbles_ = std::make_unique<planner::BubblePlanner>(*std::move(bubbles));
    }

    // Stage assignments.
    std::vector<v1::Peer> peers;
    stage_of_.clear();
    for (int s = 0; s < assignment_.num_stages(); ++s) {
      for (int n : assignment_.stage_nodes[s]) {
        const std::string& id = cost_->node_id(n);
        stage_of_[id] = s;
        v1::Peer peer;
        peer.set_worker_id(id);
        peer.set_region(region_of_[id]);
        peer.set_stage(s);
        for (const v1::WorkerInfo& w : workers_) {
          if (w.worker_id() == id) peer.set_address(w.address());
        }
        peers.push_back(peer);
      }
    }
    manager_->jobs_->Update(job_id_, [&](v1::Job* j) {
      j->clear_stages();
      for (int s = 0; s < assignment_.num_stages(); ++s) {
        auto* nodes = j->add_stages();
        for (int n : assignment_.stage_nodes[s]) nodes->add_nodes(cost_->node_id(n));
      }
    }).IgnoreError();
    for (int s = 0; s < assignment_.num_stages(); ++s) {
      auto layers = StageLayers(static_cast<int>(spec_.model().num_layers()),
                                static_cast<int>(spec_.pipeline().num_stages()), s);
      if (!layers.ok()) return JobEnd{v1::JOB_STATE_FAILED, std::string(layers.status().message())};
      for (int n : assignment_.stage_nodes[s]) {
        v1::CoordinatorMessage m;
        v1::StageAssignment* a = m.mutable_assignment();
        a->set_job_id(job_id_);
        *a->mutable_spec() = spec_;
        a->set_stage(s);
        a->set_layer_begin(layers->begin);
        a->set_layer_end(layers->end);
        for (const v1::Peer& p : peers) *a->add_peers() = p;
        for (int r : assignment_.stage_nodes[s]) a->add_replica_group(cost_->node_id(r));
        a->set_seed(spec_.seed());
        a->set_worker_id(cost_->node_id(n));
        if (manager_->options_.emulate_network) *a->mutable_emulate_network() = cluster_;
        if (auto sent = manager_->control_->Send(cost_->node_id(n), std::move(m)); !sent.ok()) {
          return JobEnd{v1::JOB_STATE_FAILED, std::string(sent.message())};
        }
      }
    }
    std::set<std::string> waiting;
    for (const auto& [id, s] : stage_of_) waiting.insert(id);
    const absl::Time deadline = absl::Now() + manager_->options_.assign_timeout;
    while (!waiting.empty()) {
      std::deque<Message> batch;
      if (auto s = Wait(deadline, &batch, [&] {
            return absl::StrCat("stage builds of ", absl::StrJoin(waiting, ", "));
          });
          s) {
        return s;
      }
      for (auto& [worker, m] : batch) {
        if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_) waiting.erase(worker);
      }
    }
    LogInfo("job ", job_id_, ": all ", stage_of_.size(), " stages built");
    return std::nullopt;
  }

  std::optional<JobEnd> RunIteration(uint64_t iteration, absl::Time started) {
    const absl::Time begin = absl::Now();
    absl::Duration overhead;  // coordinator work, not waiting
    planner::PlannedIteration planned;
    if (iteration == 0) {
      planned = first_plan_;
    } else {
      planner::PlannerOptions options;
      options.seed = spec_.seed() + iteration;
      options.assignment = assignment_;
      options.sim.record_timeline = kfac();
      // Re-planning starts from the last iteration's routes with a small
      // budget: the assignment is fixed, speeds drift slowly.
      options.initial_routes = last_routes_.empty() ? nullptr : &last_routes_;
      options.max_evaluations = kReplanEvaluations;
      const uint32_t k = spec_.pipeline().full_model_every();
      if (k > 0 && (iteration + 1) % k == 0) options.scheduler = v1::SCHEDULER_FULL;
      auto p = planner::PlanIteration(*cost_, spec_, options);
      if (!p.ok()) return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("planner: ", p.status().message())};
      planned = std::move(*p);
    }
    if (planned.scheduler == v1::SCHEDULER_SKIPPIPE) last_routes_ = planned.plan.routes;
    v1::CoordinatorMessage m;
    v1::IterationPlan* plan = m.mutable_plan();
    plan->set_job_id(job_id_);
    plan->set_iteration(iteration);
    for (const sim::Route& r : planned.plan.routes) {
      *plan->add_routes() = planner::ToProtoRoute(*cost_, r);
    }
    plan->set_predicted_time_s(planned.result.iteration_time_s);
    if (bubbles_ != nullptr) {
      auto placed = bubbles_->PlanIteration(
          iteration, planned.plan, planner::TimelineFromSimulation(planned.result));
      if (!placed.ok()) {
        return JobEnd{v1::JOB_STATE_FAILED,
                      absl::StrCat("K-FAC bubble planner: ", placed.status().message())};
      }
      for (v1::BubbleTask& t : placed->tasks) *plan->add_bubble_tasks() = std::move(t);
      if (placed->activate_refresh) plan->set_kfac_activate_refresh(*placed->activate_refresh + 1);
      plan->set_predicted_time_s(placed->iteration_time_s);
    }
    const v1::CheckpointPolicy& policy = spec_.checkpoint();
    const bool checkpoint =
        !policy.disabled() &&
        ((policy.every_iterations() > 0 && (iteration + 1) % policy.every_iterations() == 0) ||
         iteration + 1 == spec_.iterations());
    std::string checkpoint_dir;
    if (checkpoint) {
      checkpoint_dir = absl::StrFormat("%s/%s/iter-%06d", manager_->options_.checkpoint_root,
                                       job_id_, iteration + 1);
      plan->set_checkpoint(true);
      plan->set_checkpoint_dir(checkpoint_dir);
    }
    const int total_microbatches = plan->routes_size();
    for (const auto& [id, s] : stage_of_) {
      if (auto sent = manager_->control_->Send(id, m); !sent.ok()) {
        return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("worker ", id, ": ", sent.message())};
      }
    }
    overhead += absl::Now() - begin;

    // Gradient norms (one per worker), then the step, then results.
    const absl::Time deadline = absl::Now() + manager_->options_.iteration_timeout;
    std::map<int, double> stage_norm;
    std::set<std::string> norms_from;
    std::map<std::string, v1::IterationResult> results;
    std::map<std::string, v1::TimingReport> timings;
    bool stepped = false;
    while (results.size() < stage_of_.size()) {
      std::deque<Message> batch;
      auto waiting_for = [&] {
        std::vector<std::string> missing;
        for (const auto& [id, s] : stage_of_) {
          if (!(stepped ? results.count(id) : norms_from.count(id))) missing.push_back(id);
        }
        return absl::StrCat(stepped ? "iteration results" : "gradient norms", " of iteration ",
                            iteration, " from ", absl::StrJoin(missing, ", "));
      };
      if (auto s = Wait(deadline, &batch, waiting_for); s) return s;
      for (auto& [worker, msg] : batch) {
        if (msg.has_grad_norm() && msg.grad_norm().iteration() == iteration) {
          norms_from.insert(worker);
          stage_norm.emplace(static_cast<int>(msg.grad_norm().stage()),
                             msg.grad_norm().squared_norm());
        } else if (msg.has_result() && msg.result().iteration() == iteration) {
          results[worker] = msg.result();
        } else if (msg.has_timing() && msg.timing().iteration() == iteration) {
          manager_->estimates_.Add(msg.timing(), region_of_, stage_of_);
          timings[worker] = msg.timing();
        }
      }
      if (!stepped && norms_from.size() == stage_of_.size()) {
        const absl::Time step_start = absl::Now();
        double squared = 0;
        for (const auto& [s, sq] : stage_norm) {
          // A non-finite gradient is never stepped on: the parameters (and
          // the last checkpoint) stay as they were.
          if (!(sq >= 0) || !std::isfinite(sq)) {
            return JobEnd{v1::JOB_STATE_FAILED,
                          absl::StrCat("the gradient of stage ", s, " became non-finite at "
                                       "iteration ", iteration, " (squared norm ", sq,
                                       "); the step was not applied")};
          }
          squared += sq;
        }
        v1::CoordinatorMessage step;
        step.mutable_step()->set_job_id(job_id_);
        step.mutable_step()->set_iteration(iteration);
        step.mutable_step()->set_squared_norm(squared);
        for (const auto& [id, s] : stage_of_) {
          if (auto sent = manager_->control_->Send(id, step); !sent.ok()) {
            return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("worker ", id, ": ", sent.message())};
          }
        }
        stepped = true;
        overhead += absl::Now() - step_start;
      }
    }

    // Checks: replicas identical, every microbatch completed exactly once.
    std::map<int, uint64_t> checksum;
    std::map<uint32_t, int> completions;
    double loss_sum = 0;
    uint64_t tokens = 0;
    for (const auto& [id, r] : results) {
      auto [it, fresh] = checksum.emplace(static_cast<int>(r.stage()), r.parameter_checksum());
      if (!fresh && it->second != r.parameter_checksum()) {
        return JobEnd{v1::JOB_STATE_FAILED,
                    absl::StrCat("replicas of stage ", r.stage(), " diverged at iteration ",
                                 iteration, " (worker ", id, ")")};
      }
      if (r.stage() == 0) {
        for (uint32_t mb : r.microbatches()) ++completions[mb];
        loss_sum += r.loss_sum();
        tokens += r.tokens();
      }
    }
    for (int mb = 0; mb < total_microbatches; ++mb) {
      if (completions[static_cast<uint32_t>(mb)] != 1) {
        return JobEnd{v1::JOB_STATE_FAILED,
                    absl::StrCat("microbatch ", mb, " of iteration ", iteration, " completed ",
                                 completions[static_cast<uint32_t>(mb)], " times")};
      }
    }

    if (checkpoint) {
      if (auto s = CommitCheckpoint(iteration + 1, checkpoint_dir, results, deadline); s) return s;
    }

    const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
    const double elapsed = absl::ToDoubleSeconds(absl::Now() - started);
    const double loss = total_microbatches > 0 ? loss_sum / total_microbatches : 0;
    if (!std::isfinite(loss)) {
      return JobEnd{v1::JOB_STATE_FAILED,
                    absl::StrCat("the loss became non-finite at iteration ", iteration)};
    }
    // Measured busy fractions, mean over the workers that reported.
    double utilization = 0, utilization_kfac = 0, max_delay = 0;
    for (const auto& [id, t] : timings) {
      max_delay = std::max(max_delay, t.bubble_delay_max_s());
      if (!(t.iteration_time_s() > 0)) continue;
      const BusySeconds busy = SumBusy(t);
      utilization += busy.pipeline / t.iteration_time_s() / static_cast<double>(timings.size());
      utilization_kfac += (busy.pipeline + busy.kfac) / t.iteration_time_s() /
                          static_cast<double>(timings.size());
    }
    auto recorded = manager_->jobs_->Update(job_id_, [&](v1::Job* j) {
      v1::JobProgress* p = j->mutable_progress();
      p->set_iteration(iteration + 1);
      p->set_total_iterations(spec_.iterations());
      p->set_loss(loss);
      p->set_iteration_time_s(seconds);
      p->set_predicted_iteration_time_s(plan->predicted_time_s());
      p->set_utilization(utilization);
      p->set_utilization_with_kfac(utilization_kfac);
      if (bubbles_ != nullptr) {
        p->set_kfac_refreshes(bubbles_->completed_refreshes());
        p->set_kfac_refresh_interval(bubbles_->mean_refresh_interval());
        p->set_kfac_max_delay_s(max_delay);
      }
      p->set_coordinator_overhead_s(absl::ToDoubleSeconds(overhead));
      p->set_tokens_per_s(seconds > 0 ? tokens / seconds : 0);
      const double per_iteration = elapsed / static_cast<double>(iteration + 1);
      p->set_eta_s(per_iteration * static_cast<double>(spec_.iterations() - iteration - 1));
    });
    if (!recorded.ok()) {
      // Training on without a durable record would leave the job's state to
      // chance after a restart: stop, with the reason.
      return JobEnd{v1::JOB_STATE_FAILED,
                    absl::StrCat("cannot write the job record: ", recorded.status().message())};
    }
    LogDebug("job ", job_id_, " iteration ", iteration, " loss ", loss, " in ", seconds, " s");
    const int every = manager_->options_.replan_every;
    if (bubbles_ != nullptr) MeasureKfacSpeeds(*plan, timings);
    if (every > 0 && (iteration + 1) % every == 0) {
      UpdateSpeedsFromTimings();
      if (bubbles_ != nullptr) {
        // K-FAC costs follow the measured speeds (and K-FAC's own, below).
        if (absl::Status s = bubbles_->UpdateCosts(KfacWorkload()); !s.ok()) {
          LogWarning("job ", job_id_, ": keeping the K-FAC cost estimates: ", s.message());
        }
      }
    }
    return std::nullopt;
  }

  bool kfac() const { return spec_.optimizer().kind() == v1::OPTIMIZER_KFAC; }

  // Every planning node's blocks and the estimated cost of their K-FAC work
  // at the node's current speed (cluster_, calibrated from timings).
  // Remembers the FLOP/s each node's costs assume (workload_flops_).
  planner::KfacWorkload KfacWorkload() {
    planner::KfacWorkload w;
    const std::vector<int> stage_of = assignment_.NodeStages(cost_->num_nodes());
    const double tokens = static_cast<double>(spec_.pipeline().samples_per_microbatch()) *
                          spec_.model().context_length();
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
          for (int l = layers->begin; l < layers->end; ++l) {
            node.layers.push_back(l);
            node.costs.push_back(planner::EstimateKfacLayerCost(spec_.model(), tokens, flops));
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
  // cost model's prediction, and rebuilds the cost model for later planning.
  // The stage assignment stays (moving stages would mean moving weights).
  void UpdateSpeedsFromTimings() {
    v1::ClusterSpec updated = cluster_;
    int changed = 0;
    for (v1::NodeSpec& n : *updated.mutable_nodes()) {
      auto stage = stage_of_.find(n.id());
      const int index = cost_->NodeIndex(n.id());
      if (stage == stage_of_.end() || index < 0) continue;
      const double measured =
          manager_->estimates_.Compute(n.id(), v1::TaskTiming::KIND_FORWARD);
      const double predicted = cost_->ForwardTime(index, stage->second);
      if (!(measured > 0) || !(predicted > 0)) continue;
      n.set_speed(n.speed() * predicted / measured);
      ++changed;
    }
    if (changed == 0) return;
    auto cost = sim::CostModel::Create(updated, spec_);
    if (!cost.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", cost.status().message());
      return;
    }
    cluster_ = std::move(updated);
    cost_ = std::make_unique<sim::CostModel>(*std::move(cost));
    LogDebug("job ", job_id_, ": node speeds updated from ", changed, " workers' timings");
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
      return JobEnd{v1::JOB_STATE_FAILED,
                    absl::StrCat("checkpoint ", dir, ": ", stages.size(), " of ",
                                 assignment_.num_stages(), " stage files were written")};
    }
    const std::string writer = cost_->node_id(assignment_.stage_nodes[0][0]);
    if (auto sent = manager_->control_->Send(writer, std::move(m)); !sent.ok()) {
      return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("worker ", writer, ": ", sent.message())};
    }
    while (true) {
      std::deque<Message> batch;
      if (auto s = Wait(deadline, &batch, [&] { return absl::StrCat("checkpoint ", dir); }); s) {
        return s;
      }
      bool committed = false;
      for (auto& [worker, msg] : batch) {
        committed |= msg.has_checkpoint_committed() && msg.checkpoint_committed().dir() == dir;
      }
      if (committed) break;
    }
    LogInfo("job ", job_id_, ": checkpoint ", dir);
    checkpoints_.push_back(dir);
    const uint32_t keep = std::max<uint32_t>(1, spec_.checkpoint().keep_last());
    while (checkpoints_.size() > keep) {
      std::error_code ec;
      std::filesystem::remove_all(checkpoints_.front(), ec);
      checkpoints_.pop_front();
    }
    manager_->jobs_->Update(job_id_, [&](v1::Job* j) { j->set_last_checkpoint(dir); })
        .IgnoreError();
    return std::nullopt;
  }

  // Waits until a message arrives, the deadline passes, a worker of the job
  // is lost or reports an error, or the job is stopped.
  template <typename Describe>
  std::optional<JobEnd> Wait(absl::Time deadline, std::deque<Message>* batch, Describe describe) {
    while (true) {
      if (auto s = CheckStop(); s) return s;
      for (const v1::WorkerInfo& w : manager_->registry_->List(true)) {
        if (stage_of_.count(w.worker_id()) && w.state() == v1::WORKER_STATE_LOST) {
          return JobEnd{v1::JOB_STATE_FAILED,
                      absl::StrCat("worker ", w.worker_id(), " lost (no heartbeat for ",
                                   absl::FormatDuration(manager_->registry_->silence()),
                                   ") while waiting for ", describe())};
        }
      }
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return !inbox_.empty() || stop_.has_value();
        };
        mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(100));
        batch->swap(inbox_);
      }
      for (const auto& [worker, m] : *batch) {
        if (m.has_error() && m.error().job_id() == job_id_) {
          return JobEnd{v1::JOB_STATE_FAILED, m.error().message()};
        }
      }
      if (!batch->empty()) return std::nullopt;
      if (absl::Now() > deadline) {
        return JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("timed out waiting for ", describe())};
      }
    }
  }

  std::optional<JobEnd> CheckStop() {
    absl::MutexLock lock(&mu_);
    return stop_;
  }

  void SetState(v1::JobState state, const std::string& message) {
    manager_->jobs_->Update(job_id_, [&](v1::Job* j) {
      j->set_state(state);
      j->set_message(message);
    }).IgnoreError();
  }

  void Finish(const JobEnd& end) {
    // Release every worker of the job, whatever the outcome.
    for (const auto& [id, s] : stage_of_) {
      v1::CoordinatorMessage m;
      m.mutable_cancel()->set_job_id(job_id_);
      m.mutable_cancel()->set_reason(end.message);
      manager_->control_->Send(id, std::move(m)).IgnoreError();
    }
    manager_->Release(job_id_);
    manager_->jobs_->Update(job_id_, [&](v1::Job* j) {
      if (JobStore::IsFinal(j->state())) return;  // e.g. cancelled by request
      j->set_state(end.state);
      j->set_message(end.message);
      *j->mutable_end_time() = Now();
    }).IgnoreError();
    if (end.state == v1::JOB_STATE_FAILED) {
      LogWarning("job ", job_id_, " failed: ", end.message);
    } else {
      LogInfo("job ", job_id_, " ", v1::JobState_Name(end.state), ": ", end.message);
    }
  }

  JobManager* const manager_;
  const std::string job_id_;
  std::thread thread_;

  mutable absl::Mutex mu_;
  std::deque<Message> inbox_ ABSL_GUARDED_BY(mu_);
  std::optional<JobEnd> stop_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;

  // Runner-thread state.
  v1::JobSpec spec_;
  std::vector<v1::WorkerInfo> workers_;
  v1::ClusterSpec cluster_;
  std::unique_ptr<sim::CostModel> cost_;
  sim::StageAssignment assignment_;
  // The last skippipe routes (the warm start of the next iteration's search).
  std::vector<sim::Route> last_routes_;
  // Route-search simulations per re-plan.
  static constexpr int kReplanEvaluations = 2000;
  std::unique_ptr<planner::BubblePlanner> bubbles_;  // K-FAC jobs only
  std::map<std::string, double> kfac_flops_;  // node -> measured K-FAC FLOP/s
  std::map<std::string, double> workload_flops_;  // node -> FLOP/s the planner's costs use
  planner::PlannedIteration first_plan_;
  std::map<std::string, int> stage_of_;
  std::map<std::string, std::string> region_of_;
  std::deque<std::string> checkpoints_;  // newest last
};

JobManager::JobManager(JobStore* jobs, WorkerRegistry* registry, ControlServiceImpl* control,
                       JobManagerOptions options)
    : jobs_(jobs),
      registry_(registry),
      control_(control),
      options_(std::move(options)),
      estimates_(options_.metrics) {
  scheduler_ = std::thread([this] { ScheduleLoop(); });
}

JobManager::~JobManager() { Shutdown(); }

void JobManager::Recover() {
  for (const v1::Job& job : jobs_->List(v1::JOB_STATE_UNSPECIFIED)) {
    if (job.state() == v1::JOB_STATE_ASSIGNING || job.state() == v1::JOB_STATE_RUNNING) {
      jobs_->Update(job.id(), [](v1::Job* j) {
        j->set_state(v1::JOB_STATE_FAILED);
        j->set_message("coordinator restarted while the job was running; resubmit it");
        *j->mutable_end_time() = Now();
      }).IgnoreError();
    } else if (job.state() == v1::JOB_STATE_PENDING) {
      // A stored spec is input like any other: one that no longer validates
      // (limits added since, a hand-edited file) fails its job instead of
      // reaching the planner.
      Add(job.id(), "stored spec is invalid: ");
    }
  }
}

void JobManager::Add(const std::string& job_id, const std::string& invalid_prefix) {
  auto job = jobs_->Get(job_id);
  if (!job.ok()) return;
  auto spec = NormalizeJobSpec(job->spec());
  if (!spec.ok()) {
    jobs_->Update(job_id, [&](v1::Job* j) {
      j->set_state(v1::JOB_STATE_FAILED);
      j->set_message(absl::StrCat(invalid_prefix, spec.status().message()));
      *j->mutable_end_time() = Now();
    }).IgnoreError();
    return;
  }
  absl::MutexLock lock(&mu_);
  if (shutting_down_ || runners_.count(job_id)) return;
  for (const Pending& p : pending_) {
    if (p.job_id == job_id) return;
  }
  pending_.push_back(Pending{job_id, *std::move(spec), ""});
  wake_ = true;
}

void JobManager::Cancel(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->job_id == job_id) {
      pending_.erase(it);  // the store already says CANCELLED
      return;
    }
  }
  auto it = runners_.find(job_id);
  if (it != runners_.end()) it->second->RequestStop(JobEnd{v1::JOB_STATE_CANCELLED, "cancelled by request"});
}

// One loop for all pending jobs (no thread per job): it wakes when a job is
// added, a job releases its workers or the manager stops, and at least every
// 250 ms for registry changes, then starts every pending job (in submission
// order) whose workers are idle now.
void JobManager::ScheduleLoop() {
  while (true) {
    std::vector<std::pair<std::string, std::string>> messages;  // job -> why it waits
    {
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return wake_ || shutting_down_; };
      mu_.AwaitWithTimeout(absl::Condition(&woken), absl::Milliseconds(250));
      if (shutting_down_) return;
      wake_ = false;
      for (auto it = runners_.begin(); it != runners_.end();) {
        it = it->second->finished() ? runners_.erase(it) : std::next(it);
      }
      if (pending_.empty()) continue;
      std::vector<v1::WorkerInfo> free;
      for (const v1::WorkerInfo& w : registry_->List(false)) {
        if (w.state() == v1::WORKER_STATE_IDLE && !reserved_.count(w.worker_id())) {
          free.push_back(w);
        }
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        std::string why;
        auto workers = TakeWorkers(it->spec, free, &why);
        if (!workers) {
          if (why != it->message) {
            it->message = why;
            messages.push_back({it->job_id, why});
          }
          ++it;
          continue;
        }
        for (const v1::WorkerInfo& w : *workers) reserved_[w.worker_id()] = it->job_id;
        auto runner =
            std::make_unique<JobRunner>(this, it->job_id, std::move(it->spec), *std::move(workers));
        runner->Start();
        runners_[it->job_id] = std::move(runner);
        it = pending_.erase(it);
      }
    }
    // Store writes (fsync) outside the lock that routes worker messages.
    for (const auto& message : messages) {
      const std::string& why = message.second;
      jobs_->Update(message.first, [&](v1::Job* j) {
        if (j->state() == v1::JOB_STATE_PENDING) j->set_message(why);
      }).IgnoreError();
    }
  }
}

std::optional<std::vector<v1::WorkerInfo>> JobManager::TakeWorkers(
    const v1::JobSpec& spec, std::vector<v1::WorkerInfo>& free, std::string* why) {
  const v1::PipelineSpec& p = spec.pipeline();
  const size_t needed = p.data_nodes() + (p.num_stages() - 1) * size_t{p.replicas_per_stage()};
  std::set<std::string> pinned;
  for (const v1::StageNodes& g : p.assignment()) pinned.insert(g.nodes().begin(), g.nodes().end());
  std::vector<size_t> chosen;
  for (size_t i = 0; i < free.size() && chosen.size() < needed; ++i) {
    if (pinned.empty() || pinned.count(free[i].worker_id())) chosen.push_back(i);
  }
  if (chosen.size() < needed) {
    if (pinned.empty()) {
      *why = absl::StrCat("waiting for ", needed, " idle workers (", free.size(), " available)");
    } else {
      std::vector<std::string> missing;
      for (const std::string& id : pinned) {
        const bool found = std::any_of(free.begin(), free.end(),
                                       [&](const v1::WorkerInfo& w) { return w.worker_id() == id; });
        if (!found) missing.push_back(id);
      }
      *why = absl::StrCat("waiting for the pinned workers ", absl::StrJoin(missing, ", "),
                          " (pipeline.assignment; not registered or busy)");
    }
    return std::nullopt;
  }
  std::vector<v1::WorkerInfo> taken;
  for (size_t i : chosen) taken.push_back(free[i]);
  for (auto it = chosen.rbegin(); it != chosen.rend(); ++it) free.erase(free.begin() + *it);
  return taken;
}

void JobManager::OnWorkerMessage(const std::string& worker_id, const v1::WorkerMessage& message) {
  std::string job;
  switch (message.kind_case()) {
    case v1::WorkerMessage::kStageReady: job = message.stage_ready().job_id(); break;
    case v1::WorkerMessage::kTiming: job = message.timing().job_id(); break;
    case v1::WorkerMessage::kResult: job = message.result().job_id(); break;
    case v1::WorkerMessage::kError: job = message.error().job_id(); break;
    case v1::WorkerMessage::kGradNorm: job = message.grad_norm().job_id(); break;
    case v1::WorkerMessage::kCheckpointCommitted:
      job = message.checkpoint_committed().job_id();
      break;
    default: return;
  }
  absl::MutexLock lock(&mu_);
  auto it = runners_.find(job);
  if (it != runners_.end()) it->second->Post(worker_id, message);
}

void JobManager::Shutdown() {
  std::map<std::string, std::unique_ptr<JobRunner>> runners;
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    runners.swap(runners_);
  }
  if (scheduler_.joinable()) scheduler_.join();
  // Running jobs stop (FAILED, their workers told); pending jobs have no
  // runner and stay PENDING in the store for the next start.
  runners.clear();  // each destructor stops and joins its runner
}

void JobManager::CheckWorkerJob(const std::string& worker_id, const std::string& job_id) {
  {
    absl::MutexLock lock(&mu_);
    auto reserved = reserved_.find(worker_id);
    if (reserved != reserved_.end() && reserved->second == job_id) return;  // a live job
    const absl::Time now = absl::Now();
    auto told = told_to_drop_.find(worker_id);
    if (told != told_to_drop_.end() && now - told->second < absl::Seconds(5)) return;
    told_to_drop_[worker_id] = now;
  }
  LogInfo("worker ", worker_id, " still holds job ", job_id,
          ", which this coordinator does not run; telling it to drop the job");
  v1::CoordinatorMessage m;
  m.mutable_cancel()->set_job_id(job_id);
  m.mutable_cancel()->set_reason("the coordinator no longer runs this job (it restarted)");
  control_->Send(worker_id, std::move(m)).IgnoreError();
}

void JobManager::Release(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto it = reserved_.begin(); it != reserved_.end();) {
    it = it->second == job_id ? reserved_.erase(it) : std::next(it);
  }
  wake_ = true;  // pending jobs may fit now
}

}  // namespace detour
