// The move set of the route searches: random changes to a route set that
// keep every rule (stage order within the jump and swap limits, the stage
// visit quotas, the per-node visit caps), applied in units — microbatches of
// one data node that follow one path together (a lane) move together; with
// one microbatch per unit it is the plain per-microbatch neighbourhood.
//
// Moves: re-home a visit to another replica; exchange the nodes of two
// units' visits of one stage; exchange stage visits between two units of
// one size; reorder two visits (create or remove a swap); exchange the paths
// of two units of one data node; let two replicas of a stage trade their
// visits (all of them, or one data node's).
//
// Thread-compatible. Does not own `assignment`, `rules` or `routes`, which
// must outlive it; Propose writes into `routes`.
#ifndef DETOUR_COORDINATOR_PLANNER_ROUTE_MOVES_H_
#define DETOUR_COORDINATOR_PLANNER_ROUTE_MOVES_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "coordinator/planner/route_rules.h"

namespace detour::planner {

class RouteMoves {
 public:
  // `units[u]`: indices into `routes` of the microbatches sharing a path
  // (they must share it now). `caps`: NodeVisitCaps of the route set.
  RouteMoves(const sim::CostModel& cost, const sim::StageAssignment& assignment,
             const RouteRules& rules, std::vector<sim::Route>& routes,
             std::vector<std::vector<int>> units, std::vector<int> caps, uint64_t seed);

  // Applies one random move and writes it into the routes. False when the
  // drawn move does not apply or breaks a cap (nothing changed then).
  bool Propose();
  // Takes back the last proposed move, or keeps it.
  void Undo();
  void Keep() { saved_.clear(); }

 private:
  int Weight(int u) const { return static_cast<int>(members_[u].size()); }
  void Tally(int u, int sign);
  void Write(int u);
  sim::Route& Touch(int u);

  bool Rehome(int u, int pos);
  bool ExchangeNodes(int u1, int p1);
  bool ExchangeStages(int u1, int u2);
  bool Reorder(int u);
  bool ExchangeRoutes(int u1);
  bool SwapRoles(bool one_data_node);

  const sim::StageAssignment& assignment_;
  const RouteRules& rules_;
  std::vector<sim::Route>& routes_;
  std::vector<std::vector<int>> members_;
  std::vector<sim::Route> paths_;
  std::vector<int> caps_;
  Rng rng_;
  std::vector<int> node_visits_;
  std::vector<std::vector<int>> by_data_;
  std::vector<int> multi_replica_stages_;
  // Units touched by the current move, with their paths before it.
  std::vector<std::pair<int, sim::Route>> saved_;
};

// Microbatches of one data node on the same path form a unit (a lane).
std::vector<std::vector<int>> LanesOf(const std::vector<sim::Route>& routes);
// One unit per microbatch.
std::vector<std::vector<int>> Singletons(size_t n);

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_ROUTE_MOVES_H_
