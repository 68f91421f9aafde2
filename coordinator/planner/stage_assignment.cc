#include "coordinator/planner/stage_assignment.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "coordinator/planner/route_sets.h"
#include "coordinator/planner/lane_clusters.h"
#include "coordinator/planner/lane_routes.h"
#include "coordinator/planner/path_scheduler.h"

namespace detour::planner {
namespace {

// Microbatches × visited stages above which a plan counts as big: the
// quick plan and the refinement get lighter.
constexpr int kBigPlan = 2000;

// Permutation of all nodes cut into groups: data nodes, stage 1, ..., stage
// S-1, unused.
sim::StageAssignment Cut(const std::vector<int>& perm, const RouteRules& rules, int replicas) {
  sim::StageAssignment a;
  a.stage_nodes.resize(rules.num_stages);
  int pos = 0;
  for (int s = 0; s < rules.num_stages; ++s) {
    const int count = s == 0 ? rules.data_nodes : replicas;
    a.stage_nodes[s].assign(perm.begin() + pos, perm.begin() + pos + count);
    pos += count;
  }
  return a;
}

// The inverse of Cut: groups in stage order, then the unused nodes.
std::vector<int> Permutation(const sim::StageAssignment& a, int num_nodes) {
  std::vector<int> perm;
  std::vector<char> used(num_nodes, 0);
  for (const auto& group : a.stage_nodes) {
    for (int node : group) {
      perm.push_back(node);
      used[node] = 1;
    }
  }
  for (int node = 0; node < num_nodes; ++node) {
    if (!used[node]) perm.push_back(node);
  }
  return perm;
}

int GroupOf(int pos, const RouteRules& rules, int replicas) {
  if (pos < rules.data_nodes) return 0;
  const int g = 1 + (pos - rules.data_nodes) / replicas;
  return std::min(g, rules.num_stages);  // num_stages = unused
}

}  // namespace

double AssignmentScore(const sim::CostModel& cost, const RouteRules& rules,
                       const sim::StageAssignment& a) {
  const int num_stages = rules.num_stages;
  const double m = rules.microbatches_per_data_node;
  const double total = rules.total_microbatches();
  // (1) Compute load of the busiest stage.
  // A quarter of the mean load is added so that slow nodes are avoided even
  // where they do not set the maximum.
  double compute = 0;
  double load_sum = 0;
  for (int d : a.stage_nodes[0]) {
    const double load = m * (cost.ForwardTime(d, 0) + cost.LossTime(d) + cost.BackwardTime(d, 0));
    compute = std::max(compute, load);
    load_sum += load / a.stage_nodes[0].size();
  }
  if (num_stages > 1) {
    const double visits = total * (rules.visited_stages - 1) / (num_stages - 1);
    for (int s = 1; s < num_stages; ++s) {
      double capacity = 0;
      for (int n : a.stage_nodes[s]) {
        capacity += 1.0 / std::max(1e-12, cost.ForwardTime(n, s) + cost.BackwardTime(n, s));
      }
      const double load = visits / std::max(capacity, 1e-12);
      compute = std::max(compute, load);
      load_sum += load;
    }
  }
  compute += 0.25 * load_sum / num_stages;
  // (2) Slowest all-reduce.
  double allreduce = 0;
  for (int s = 0; s < num_stages; ++s) {
    allreduce = std::max(allreduce, cost.AllReduceTime(a.stage_nodes[s], s));
  }
  // (3) Network: mean cost of a hop to the nearest replica of another stage,
  // times the hops of a round trip, times the waves a data node runs.
  double hop_sum = 0;
  long hop_count = 0;
  for (int s = 0; s < num_stages; ++s) {
    for (int n : a.stage_nodes[s]) {
      for (int t = 0; t < num_stages; ++t) {
        if (t == s) continue;
        double best = std::numeric_limits<double>::infinity();
        for (int other : a.stage_nodes[t]) best = std::min(best, cost.TransferTime(n, other));
        hop_sum += best;
        ++hop_count;
      }
    }
  }
  const double hop = hop_count > 0 ? hop_sum / hop_count : 0;
  int slots = 1;
  if (!a.stage_nodes[0].empty()) slots = std::max(1, cost.memory_slots(a.stage_nodes[0][0]));
  const double waves = std::ceil(m / slots);
  const double network = num_stages > 1 ? waves * 2.0 * rules.visited_stages * hop : 0;
  return compute + allreduce + network;
}

QuickPlan QuickPlanFor(const sim::CostModel& cost, const RouteRules& rules,
                       const sim::StageAssignment& assignment, PlanEvaluator& evaluator,
                       uint64_t seed) {
  QuickPlan best;
  best.score = std::numeric_limits<double>::infinity();
  auto consider = [&](absl::StatusOr<std::vector<sim::Route>> routes) {
    if (!routes.ok()) return;
    const double v = evaluator.Score(assignment, *routes, best.score);
    if (v < best.score) {
      best.score = v;
      best.routes = *std::move(routes);
    }
  };
  // Big plans (hundreds of microbatches) get lanes only, with fewer orders:
  // the time-aware builder costs a route search per microbatch.
  const bool big = rules.total_microbatches() * rules.visited_stages > kBigPlan;
  for (const LaneOptions& lo : LaneVariants(rules, seed, /*restarts=*/big ? 2 : 4)) {
    consider(LaneRoutes(cost, assignment, rules, lo));
  }
  if (!big || best.routes.empty()) {
    consider(BuildRouteSet(cost, assignment, rules, RouteBuilder::Mode::kTimed, seed,
                           /*wave_memory_cap=*/false));
  }
  return best;
}

namespace {

// The proxy search: several starts, each improved by pairwise swaps scored
// by AssignmentScore. Returns each start's result, best first.
std::vector<std::pair<double, std::vector<int>>> ProxySearch(const sim::CostModel& cost,
                                                             const RouteRules& rules, int replicas,
                                                             const AssignmentOptions& options,
                                                             int* trials_run) {
  const int n = cost.num_nodes();
  const int needed = rules.data_nodes + (rules.num_stages - 1) * replicas;
  // Work per score evaluation grows with the square of the assigned nodes.
  const double work = static_cast<double>(needed) * needed + 1;
  const int restarts = options.restarts > 0 ? options.restarts : (needed <= 64 ? 6 : 2);
  const int trials = options.trials_per_restart > 0
                         ? options.trials_per_restart
                         : static_cast<int>(std::clamp(1.5e8 / work / restarts, 40.0, 3000.0));

  // Starting points: nodes grouped by region (replicas close together),
  // regions dealt round-robin (every stage everywhere), then random ones.
  std::vector<int> by_region(n);
  std::iota(by_region.begin(), by_region.end(), 0);
  // Order by the latency to node 0, a cheap 1-D embedding of geography.
  std::stable_sort(by_region.begin(), by_region.end(), [&](int a, int b) {
    const double la = a == 0 ? 0 : cost.Latency(0, a);
    const double lb = b == 0 ? 0 : cost.Latency(0, b);
    return la < lb;
  });
  Rng rng(options.seed);
  std::vector<std::pair<double, std::vector<int>>> results;
  for (int r = 0; r < restarts; ++r) {
    std::vector<int> perm;
    if (r == 0) {
      perm = by_region;
    } else if (r == 1) {
      // Deal the region-sorted nodes to groups in turn.
      const int groups = rules.num_stages;
      std::vector<std::vector<int>> dealt(groups);
      for (int i = 0; i < n; ++i) dealt[i % groups].push_back(by_region[i]);
      for (auto& g : dealt) perm.insert(perm.end(), g.begin(), g.end());
    } else {
      perm.resize(n);
      std::iota(perm.begin(), perm.end(), 0);
      for (int i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng.Uniform(i + 1)]);
    }
    double score = AssignmentScore(cost, rules, Cut(perm, rules, replicas));
    for (int t = 0; t < trials; ++t) {
      const int i = rng.Uniform(needed);
      const int j = rng.Uniform(n);
      if (GroupOf(i, rules, replicas) == GroupOf(j, rules, replicas)) continue;
      std::swap(perm[i], perm[j]);
      ++*trials_run;
      const double candidate = AssignmentScore(cost, rules, Cut(perm, rules, replicas));
      if (candidate < score) {
        score = candidate;
      } else {
        std::swap(perm[i], perm[j]);
      }
    }
    results.push_back({score, std::move(perm)});
  }
  std::stable_sort(results.begin(), results.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  return results;
}

// The plan-scored search over partitions (permutations cut into groups).
// Late acceptance on quick plans; the best few distinct partitions are kept
// and each gets a short route search, since the quick plan only sees pure
// lanes and the route search's mixing of lanes gains more on some
// partitions than on others.
class PartitionSearch {
 public:
  PartitionSearch(const sim::CostModel& cost, const RouteRules& rules, int replicas,
                  const AssignmentOptions& options, AssignmentStats& stats,
                  std::chrono::steady_clock::time_point started)
      : cost_(cost),
        rules_(rules),
        replicas_(replicas),
        options_(options),
        stats_(stats),
        started_(started),
        evaluator_(cost, options.evaluator) {}

  // Searches from `starts` (the first is the proxy's best) with `budget`
  // quick plans; returns the winning permutation and its refined routes.
  std::pair<std::vector<int>, std::vector<sim::Route>> Run(
      const std::vector<std::vector<int>>& starts, int budget) {
    budget_ = budget;
    size_t first = 0;
    double first_value = kInf;
    for (size_t k = 0; k < starts.size(); ++k) {
      const double v = Judge(starts[k]);
      if (k == 0) {
        stats_.proxy_plan_score = v;
        // The proxy's best partition is always refined: the plan-scored
        // search never ends worse than the proxy search alone would.
        proxy_best_ = pool_.empty() ? Candidate{} : Find(starts[0]);
      }
      if (v < first_value) {
        first_value = v;
        first = k;
      }
    }
    // One long descent: shorter ones from several starts did worse on the
    // rugged partition landscape.
    Descend(starts[first], first_value, budget);
    return Refine();
  }

 private:
  // Late-acceptance descent from `current` until `until` quick plans in all.
  void Descend(std::vector<int> current, double current_value, int until) {
    const int n = cost_.num_nodes();
    const int needed = rules_.data_nodes + (rules_.num_stages - 1) * replicas_;
    Rng rng(options_.seed ^ 0xa5519e5eull);
    std::vector<double> history(std::clamp((until - stats_.plan_evaluations) / 25, 5, 200),
                                current_value);
    const int non_zero = rules_.num_stages - 1;
    for (int step = 0; stats_.plan_evaluations < until && !OutOfTime(0.7); ++step) {
      std::vector<int> candidate = current;
      if (non_zero >= 2 && rng.Uniform(8) == 0) {
        // Two stages trade their replica groups (moves the jump structure).
        const int a = 1 + rng.Uniform(non_zero);
        const int b = 1 + rng.Uniform(non_zero);
        if (a == b) continue;
        const int pa = rules_.data_nodes + (a - 1) * replicas_;
        const int pb = rules_.data_nodes + (b - 1) * replicas_;
        for (int k = 0; k < replicas_; ++k) std::swap(candidate[pa + k], candidate[pb + k]);
      } else {
        const int i = rng.Uniform(needed);
        const int j = rng.Uniform(n);
        if (GroupOf(i, rules_, replicas_) == GroupOf(j, rules_, replicas_)) continue;
        std::swap(candidate[i], candidate[j]);
      }
      double& slot = history[step % history.size()];
      const double threshold = std::max(current_value, slot);
      const double v = Judge(candidate);
      if (v <= threshold) {
        current = std::move(candidate);
        current_value = v;
      }
      slot = current_value;
    }
  }

  static constexpr double kInf = std::numeric_limits<double>::infinity();
  // Partitions kept for refinement.
  static constexpr size_t kPool = 6;

  struct Candidate {
    double score = 0;
    std::vector<int> perm;
    sim::StageAssignment groups;  // sorted, for telling partitions apart
    std::vector<sim::Route> routes;
  };

  bool OutOfTime(double share) const {
    return options_.time_budget_s > 0 &&
           std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count() >
               share * options_.time_budget_s;
  }

  double Judge(const std::vector<int>& perm) {
    ++stats_.plan_evaluations;
    const sim::StageAssignment a = Cut(perm, rules_, replicas_);
    QuickPlan q = QuickPlanFor(cost_, rules_, a, evaluator_, options_.seed);
    if (q.score < kInf) Offer(q.score, perm, a, std::move(q.routes));
    return q.score;
  }

  // The pool's candidate with the partition of `perm`, or an empty one.
  Candidate Find(const std::vector<int>& perm) const {
    sim::StageAssignment groups = Cut(perm, rules_, replicas_);
    for (auto& g : groups.stage_nodes) std::sort(g.begin(), g.end());
    for (const Candidate& c : pool_) {
      if (c.groups.stage_nodes == groups.stage_nodes) return c;
    }
    return Candidate{};
  }

  // Keeps the kPool best distinct partitions.
  void Offer(double score, const std::vector<int>& perm, sim::StageAssignment groups,
             std::vector<sim::Route> routes) {
    if (pool_.size() == kPool && score >= pool_.back().score) return;
    for (auto& g : groups.stage_nodes) std::sort(g.begin(), g.end());
    for (Candidate& c : pool_) {
      if (c.groups.stage_nodes == groups.stage_nodes) {
        if (score < c.score) {
          c.score = score;
          c.routes = std::move(routes);
        }
        Sort();
        return;
      }
    }
    pool_.push_back(Candidate{score, perm, std::move(groups), std::move(routes)});
    Sort();
    if (pool_.size() > kPool) pool_.pop_back();
  }
  void Sort() {
    std::stable_sort(pool_.begin(), pool_.end(),
                     [](const Candidate& a, const Candidate& b) { return a.score < b.score; });
  }

  // A short route search on each kept partition; the best result wins.
  std::pair<std::vector<int>, std::vector<sim::Route>> Refine() {
    std::pair<std::vector<int>, std::vector<sim::Route>> best;
    double best_value = kInf;
    const int events_per_sim =
        std::max(1, 6 * rules_.total_microbatches() * std::max(1, rules_.visited_stages));
    // A small assignment budget (tests, huge plans) keeps refinement small.
    const int refine_budget = std::min(
        static_cast<int>(std::clamp(2e6 / events_per_sim, 50.0, 1500.0)), std::max(10, budget_));
    const bool big = rules_.total_microbatches() * rules_.visited_stages > kBigPlan;
    size_t refined = 0;
    std::vector<Candidate> candidates = pool_;
    if (!proxy_best_.perm.empty() && Find(proxy_best_.perm).perm.empty()) {
      candidates.push_back(proxy_best_);
    }
    for (const Candidate& c : candidates) {
      if (OutOfTime(0.9) && best_value < kInf) break;
      if (big && refined++ >= 2 && &c != &candidates.back()) continue;
      const sim::StageAssignment a = Cut(c.perm, rules_, replicas_);
      PathSchedulerOptions po;
      po.seed = options_.seed;
      po.max_evaluations = refine_budget;
      po.contention = options_.evaluator.contention;
      po.queue_policy = options_.evaluator.queue_policy;
      po.robust = options_.evaluator.robust;
      po.objective = options_.evaluator.objective;
      po.initial_routes = &c.routes;
      PathScheduler scheduler(cost_, a, rules_, po);
      auto routes = scheduler.Run();
      if (!routes.ok()) continue;
      ++stats_.refined;
      if (scheduler.stats().final_objective < best_value) {
        best_value = scheduler.stats().final_objective;
        best = {c.perm, *std::move(routes)};
      }
    }
    stats_.final_plan_score = best_value;
    return best;
  }

  const sim::CostModel& cost_;
  const RouteRules& rules_;
  int replicas_;
  const AssignmentOptions& options_;
  AssignmentStats& stats_;
  std::chrono::steady_clock::time_point started_;
  PlanEvaluator evaluator_;
  std::vector<Candidate> pool_;
  Candidate proxy_best_;
  int budget_ = 0;
};

}  // namespace

absl::StatusOr<sim::StageAssignment> AssignStages(const sim::CostModel& cost,
                                                  const RouteRules& rules, int replicas,
                                                  const AssignmentOptions& options,
                                                  AssignmentStats* stats,
                                                  std::vector<sim::Route>* quick_routes) {
  const auto started = std::chrono::steady_clock::now();
  AssignmentStats local;
  AssignmentStats& st = stats ? *stats : local;
  st = AssignmentStats();
  const int n = cost.num_nodes();
  const int needed = rules.data_nodes + (rules.num_stages - 1) * replicas;
  if (rules.data_nodes < 1 || (rules.num_stages > 1 && replicas < 1)) {
    return absl::InvalidArgumentError("pipeline needs at least one data node and one replica");
  }
  if (needed > n) {
    return absl::FailedPreconditionError(
        absl::StrFormat("cluster has %d nodes; the pipeline needs data_nodes + (num_stages-1) × "
                        "replicas_per_stage = %d + %d × %d = %d",
                        n, rules.data_nodes, rules.num_stages - 1, replicas, needed));
  }
  if (cost.num_stages() != rules.num_stages) {
    return absl::InvalidArgumentError("cost model and pipeline disagree on the stage count");
  }
  auto proxy = ProxySearch(cost, rules, replicas, options, &st.proxy_trials);
  std::vector<int> best = proxy.front().second;

  // Plan-scored search. The default budget shrinks with the size of a plan
  // (about 2 s at 20 nodes, 1200 partitions; at least 8).
  const double events_per_plan =
      8.0 * rules.total_microbatches() * std::max(1, rules.visited_stages) + 1;
  const int budget = options.plan_evaluations >= 0
                         ? options.plan_evaluations
                         : static_cast<int>(std::clamp(1.2e6 / events_per_plan, 8.0, 1200.0));
  if (budget > 0 && rules.num_stages > 1) {
    // The best proxy partitions and the lane clusters compete first.
    std::vector<std::vector<int>> starts;
    for (size_t k = 0; k < proxy.size() && k < 3; ++k) starts.push_back(proxy[k].second);
    for (int variant = 0; variant < 4; ++variant) {
      auto lanes = LaneClusterAssignment(cost, rules, replicas, options.seed, variant);
      if (lanes.ok()) starts.push_back(Permutation(*lanes, n));
    }
    PartitionSearch search(cost, rules, replicas, options, st, started);
    auto [perm, routes] = search.Run(starts, budget);
    if (!perm.empty()) {
      best = std::move(perm);
      if (quick_routes) *quick_routes = std::move(routes);
    }
  }
  sim::StageAssignment result = Cut(best, rules, replicas);
  // Keep each group in node order: stable output, readable reports.
  for (auto& nodes : result.stage_nodes) std::sort(nodes.begin(), nodes.end());
  return result;
}

}  // namespace detour::planner
