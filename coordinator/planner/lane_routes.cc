#include "coordinator/planner/lane_routes.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/status.h"
#include "coordinator/planner/route_sets.h"
#include "coordinator/planner/route_builder.h"
#include "coordinator/planner/route_moves.h"

namespace detour::planner {
namespace {

struct Path {
  std::vector<int> nodes;
  std::vector<int> stages;
};

// Estimated slowest slot chain: a data node's memory slot runs its
// microbatches one after another, each taking its round trip.
double SlowestChain(const sim::CostModel& cost, const RouteRules& rules,
                    const std::vector<sim::Route>& routes) {
  double worst = 0;
  std::vector<double> chain;
  for (int i = 0; i < rules.data_nodes; ++i) {
    const int first = MicrobatchId(rules, i, 0);
    const int slots = std::max(1, cost.memory_slots(routes[first].nodes[0]));
    chain.assign(slots, 0);
    for (int k = 0; k < rules.microbatches_per_data_node; ++k) {
      chain[k % slots] += StaticRouteCost(cost, routes[MicrobatchId(rules, i, k)]);
    }
    worst = std::max(worst, *std::max_element(chain.begin(), chain.end()));
  }
  return worst;
}

// The slowest chain plus a small share of the mean round trip (a tie
// breaker that prefers short routes everywhere).
double Estimate(const sim::CostModel& cost, const RouteRules& rules,
                const std::vector<sim::Route>& routes) {
  double total = 0;
  for (const sim::Route& r : routes) total += StaticRouteCost(cost, r);
  return SlowestChain(cost, rules, routes) + 1e-3 * total / std::max<size_t>(1, routes.size());
}

class LaneBuilder {
 public:
  LaneBuilder(const sim::CostModel& cost, const sim::StageAssignment& assignment,
              const RouteRules& rules, const std::vector<int>& quota, const std::vector<int>& caps,
              int groups, bool by_wave)
      : cost_(cost),
        assignment_(assignment),
        rules_(rules),
        quota_(quota),
        caps_(caps),
        groups_(groups),
        wave_size_(by_wave ? (rules.microbatches_per_data_node + groups - 1) / groups : 0) {}

  // One lane set for the data node order `order`, or nullopt.
  std::optional<std::vector<sim::Route>> Build(const std::vector<int>& order, double penalty) {
    const int m = rules_.microbatches_per_data_node;
    const auto& data = assignment_.stage_nodes[0];
    QuotaPacer pacer(cost_, assignment_, rules_, quota_, rules_.total_microbatches());
    // The most promising replicas per stage (by their links to the data
    // node), as in the other route builders: keeps big stages cheap.
    RouteBuilder builder(cost_, assignment_, rules_, RouteBuilder::Mode::kStatic, 0,
                         /*max_candidates=*/8);
    std::vector<int> load(cost_.num_nodes(), 0);
    std::vector<int> lanes_on(cost_.num_nodes(), 0);
    std::vector<std::vector<Path>> lane(rules_.data_nodes, std::vector<Path>(groups_));
    std::vector<sim::Route> routes(rules_.total_microbatches());
    RouteRequest req;
    for (int k = 0; k < m; ++k) {
      for (int i : order) {
        Path& path = lane[i][wave_size_ > 0 ? k / wave_size_ : k % groups_];
        bool reuse = !path.nodes.empty() && pacer.Fits(path.stages);
        for (size_t p = 1; reuse && p < path.nodes.size(); ++p) {
          reuse = load[path.nodes[p]] < caps_[path.nodes[p]];
        }
        if (!reuse) {
          req.data_node = data[i];
          pacer.Prepare(req);
          req.node_allowed.assign(cost_.num_nodes(), 0);
          req.node_price.assign(cost_.num_nodes(), 0);
          for (int n = 0; n < cost_.num_nodes(); ++n) {
            req.node_allowed[n] = load[n] < caps_[n];
            const bool mine =
                std::find(path.nodes.begin(), path.nodes.end(), n) != path.nodes.end();
            if (lanes_on[n] > 0 && !mine) req.node_price[n] = penalty * lanes_on[n];
          }
          std::optional<BuiltRoute> built = builder.Build(req);
          if (!built) {
            // Quotas the jump limit cannot meet now: any valid route, and
            // a rebalance at the end.
            std::fill(req.allowed.begin() + 1, req.allowed.end(), 1);
            std::fill(req.required.begin(), req.required.end(), 0);
            built = builder.Build(req);
          }
          if (!built) return std::nullopt;
          for (size_t p = 1; p < path.nodes.size(); ++p) --lanes_on[path.nodes[p]];
          path.nodes = built->nodes;
          path.stages = built->stages;
          for (size_t p = 1; p < path.nodes.size(); ++p) ++lanes_on[path.nodes[p]];
        }
        pacer.Take(path.stages);
        for (size_t p = 1; p < path.nodes.size(); ++p) ++load[path.nodes[p]];
        sim::Route& r = routes[MicrobatchId(rules_, i, k)];
        r.microbatch = MicrobatchId(rules_, i, k);
        r.nodes = path.nodes;
        r.stages = path.stages;
      }
    }
    if (!RebalanceVisits(cost_, assignment_, rules_, pacer.quota(), routes).ok()) {
      return std::nullopt;
    }
    return routes;
  }

 private:
  const sim::CostModel& cost_;
  const sim::StageAssignment& assignment_;
  const RouteRules& rules_;
  const std::vector<int>& quota_;
  const std::vector<int>& caps_;
  int groups_;
  int wave_size_;
};

}  // namespace

std::vector<LaneOptions> LaneVariants(const RouteRules& rules, uint64_t seed, int restarts) {
  std::vector<LaneOptions> out;
  LaneOptions o;
  o.seed = seed;
  o.restarts = restarts;
  out.push_back(o);
  const int slots = std::max(1, rules.memory_slots);
  const int m = rules.microbatches_per_data_node;
  if (slots > 1 && m > 1) {
    o.groups_per_data_node = std::min(slots, m);
    out.push_back(o);
  }
  if (rules.rounds() > 1) {
    o.groups_per_data_node = rules.rounds();
    o.by_wave = true;
    out.push_back(o);
  }
  return out;
}

absl::StatusOr<std::vector<sim::Route>> LaneRoutes(const sim::CostModel& cost,
                                                   const sim::StageAssignment& assignment,
                                                   const RouteRules& rules,
                                                   const LaneOptions& options) {
  ASSIGN_OR_RETURN(std::vector<std::vector<sim::Route>> sets,
                   LaneRouteSets(cost, assignment, rules, options));
  return std::move(sets.front());
}

absl::StatusOr<std::vector<std::vector<sim::Route>>> LaneRouteSets(
    const sim::CostModel& cost, const sim::StageAssignment& assignment, const RouteRules& rules,
    const LaneOptions& options) {
  if (assignment.num_stages() != rules.num_stages ||
      static_cast<int>(assignment.stage_nodes[0].size()) != rules.data_nodes) {
    return absl::InvalidArgumentError("lanes: assignment does not match the pipeline");
  }
  const std::vector<int> quota = StageQuotas(rules, StageCapacities(cost, assignment));
  ASSIGN_OR_RETURN(const std::vector<int> caps, NodeVisitCaps(rules, cost, assignment, quota));
  const int groups =
      std::clamp(options.groups_per_data_node, 1, std::max(1, rules.microbatches_per_data_node));
  LaneBuilder builder(cost, assignment, rules, quota, caps, groups, options.by_wave);

  // The hardest-connected data nodes choose first.
  const auto& data = assignment.stage_nodes[0];
  std::vector<double> difficulty(rules.data_nodes, 0);
  double hop = 0;
  int hops = 0;
  for (int i = 0; i < rules.data_nodes; ++i) {
    for (int s = 1; s < rules.num_stages; ++s) {
      for (int n : assignment.stage_nodes[s]) {
        const double t = cost.TransferTime(data[i], n) + cost.TransferTime(n, data[i]);
        difficulty[i] += t;
        hop += t;
        ++hops;
      }
    }
  }
  if (hops > 0) hop /= hops;
  std::vector<int> order(rules.data_nodes);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return difficulty[a] > difficulty[b]; });

  Rng rng(options.seed ^ 0x1a4e5u);
  std::vector<std::pair<double, std::vector<sim::Route>>> sets;
  for (int t = 0; t < std::max(1, options.restarts); ++t) {
    if (t > 0) {
      for (int i = rules.data_nodes - 1; i > 0; --i) std::swap(order[i], order[rng.Uniform(i + 1)]);
    }
    // Sharing a node with another lane costs about one hop.
    std::optional<std::vector<sim::Route>> routes = builder.Build(order, hop);
    if (!routes) continue;
    bool seen = false;
    for (const auto& [score, other] : sets) {
      seen = seen || std::equal(other.begin(), other.end(), routes->begin(), routes->end(),
                                [](const sim::Route& a, const sim::Route& b) {
                                  return a.nodes == b.nodes && a.stages == b.stages;
                                });
    }
    if (seen) continue;
    double score = Estimate(cost, rules, *routes);
    if (options.improve_steps > 0) {
      RouteMoves moves(cost, assignment, rules, *routes, LanesOf(*routes), caps,
                       options.seed + static_cast<uint64_t>(t));
      for (int step = 0; step < options.improve_steps; ++step) {
        if (!moves.Propose()) continue;
        const double v = Estimate(cost, rules, *routes);
        if (v <= score) {
          score = v;
          moves.Keep();
        } else {
          moves.Undo();
        }
      }
    }
    sets.push_back({score, *std::move(routes)});
  }
  std::stable_sort(sets.begin(), sets.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<sim::Route>> best;
  for (auto& [score, routes] : sets) best.push_back(std::move(routes));
  if (best.empty()) {
    return absl::FailedPreconditionError(
        absl::StrFormat("no lane set fits the rules (%d of %d stages per route, max_jump %d)",
                        rules.visited_stages, rules.num_stages, rules.max_jump));
  }
  return best;
}

}  // namespace detour::planner
