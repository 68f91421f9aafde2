// The low-level search shared by the route planners: the best route for one
// microbatch, given which stages it may / must visit, as a dynamic program
// over (stage, node, stages visited so far) along ascending stage order with
// the max_jump limit. Three ways to price a route:
//  * kStatic: network-aware, time-blind — the sum of hop transfer times both
//    ways plus compute (what "skip without collision avoidance" optimises);
//  * kTimed: time-aware — forward work is placed into per-node reservation
//    calendars holding the routes committed before, and the route that
//    finishes its backward earliest wins (prioritised planning, the role of
//    A* + CBS collision constraints in the reference);
//  * kRandom: random prices, i.e. a uniformly drawn valid route.
// Thread-compatible: one instance per planning call. Does not own `cost`,
// `assignment` or `rules`, which must outlive it.
#ifndef DETOUR_COORDINATOR_PLANNER_ROUTE_BUILDER_H_
#define DETOUR_COORDINATOR_PLANNER_ROUTE_BUILDER_H_

#include <optional>
#include <utility>
#include <vector>

#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

// Busy intervals of one node's compute server, sorted and disjoint.
class Calendar {
 public:
  // Earliest start >= t of a gap at least `duration` long.
  double EarliestFit(double t, double duration) const;
  void Reserve(double start, double duration);
  double busy_s() const { return busy_s_; }

 private:
  std::vector<std::pair<double, double>> busy_;
  double busy_s_ = 0;
};

struct RouteRequest {
  int data_node = 0;
  // When the data node may start the forward (kTimed).
  double release_s = 0;
  // Per stage: may be visited (quota left) / must be visited (quota equals
  // the routes left). Stage 0 is ignored.
  std::vector<char> allowed;
  std::vector<char> required;
  // Per node, optional: nodes that may be used (e.g. memory left in this
  // wave). Empty = all.
  std::vector<char> node_allowed;
  // Per stage, optional: seconds added to a route's price for visiting the
  // stage (negative = encouraged). Keeps visit quotas paced. Empty = none.
  std::vector<double> stage_price;
  // Per node, optional (kStatic): seconds added for visiting the node.
  std::vector<double> node_price;
};

// Keeps the stage visit quotas of a route set reachable while its routes are
// built one at a time: fills a request's allowed / required stages (hard
// rules) and stage prices (pacing), and counts what each route takes.
// Thread-compatible.
class QuotaPacer {
 public:
  // `quota[s]`: visits stage s must receive from the `routes` routes.
  QuotaPacer(const sim::CostModel& cost, const sim::StageAssignment& assignment,
             const RouteRules& rules, std::vector<int> quota, int routes);

  // No stage beyond its quota; a stage whose quota equals the routes left is
  // required; a stage lagging its fair share of the remaining visits gets
  // cheaper, one ahead dearer, so greedy choices cannot strand a stage that
  // the jump limit later makes unreachable. The tolerance shrinks towards
  // the end, where the last routes must use exactly the visits left.
  void Prepare(RouteRequest& req) const;
  // Whether a route visiting `stages` (stage 0 first) keeps the quotas
  // exactly reachable: every stage within quota, every required one in.
  bool Fits(const std::vector<int>& stages) const;
  // Counts a committed route.
  void Take(const std::vector<int>& stages);

  std::vector<int>& quota() { return quota_; }
  int left() const { return left_; }

 private:
  int num_stages_;
  std::vector<int> quota_;
  int left_;
  double fraction_;
  double slack_;
  // A typical hop's price (compute and transfers both ways).
  double unit_ = 0;
};

struct BuiltRoute {
  std::vector<int> nodes;
  std::vector<int> stages;
  // kStatic: summed cost; kTimed: estimated end of the backward on the data
  // node; kRandom: meaningless.
  double score = 0;
  // kTimed: compute reservations (node, start, duration) to commit.
  std::vector<std::pair<int, std::pair<double, double>>> reservations;
};

class RouteBuilder {
 public:
  enum class Mode { kStatic, kTimed, kRandom };

  // `max_candidates` bounds the nodes of a stage the search considers (the
  // most promising ones); <= 0 means all.
  RouteBuilder(const sim::CostModel& cost, const sim::StageAssignment& assignment,
               const RouteRules& rules, Mode mode, uint64_t seed, int max_candidates = 8);

  // The best ascending route for the request, or nullopt if the rules leave
  // none (e.g. a required stage out of reach).
  std::optional<BuiltRoute> Build(const RouteRequest& request);

  // kTimed: reserves the route's compute in the calendars.
  void Commit(const BuiltRoute& route);

  const std::vector<Calendar>& calendars() const { return calendars_; }

 private:
  // Appends the nodes of `stage` the search considers to `out`.
  void Candidates(int stage, const RouteRequest& request, std::vector<int>& out);

  const sim::CostModel& cost_;
  const sim::StageAssignment& assignment_;
  const RouteRules& rules_;
  Mode mode_;
  Rng rng_;
  int max_candidates_;
  std::vector<Calendar> calendars_;
  // Buffers of Build, reused across calls.
  std::vector<std::vector<int>> cand_;
  std::vector<int> next_required_, offset_, parent_;
  std::vector<double> value_, finish_;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_ROUTE_BUILDER_H_
