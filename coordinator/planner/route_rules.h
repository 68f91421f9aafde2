// The convergence rules of skippipe.md §2 in a form the planners and the
// validator share, plus the small pieces of arithmetic every planner needs
// (visit quotas, microbatch numbering, a portable seeded RNG).
#ifndef DETOUR_COORDINATOR_PLANNER_ROUTE_RULES_H_
#define DETOUR_COORDINATOR_PLANNER_ROUTE_RULES_H_

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/sim/cost_model.h"
#include "common/sim/plan.h"
#include "detour/v1/spec.pb.h"

namespace detour::planner {

// No route, no value yet: the planners' unreachable cost.
inline constexpr double kInf = std::numeric_limits<double>::infinity();

struct RouteRules {
  int num_stages = 1;
  // P: stages each route visits, stage 0 included.
  int visited_stages = 1;
  int data_nodes = 1;
  int microbatches_per_data_node = 1;
  int max_jump = 3;
  int max_swaps = 0;
  int max_swap_distance = 1;
  int max_total_swap_distance = 2;
  // The job's activation slots per node and the per-node visit cap: > 0 a
  // fixed cap, 0 = derived (NodeVisitCaps), < 0 = none (the full pipeline).
  int memory_slots = 3;
  int max_visits_per_node = 0;

  int total_microbatches() const { return data_nodes * microbatches_per_data_node; }
  // Waves of a data node: how often its memory slots fill with microbatches.
  int rounds() const {
    const int slots = memory_slots > 0 ? memory_slots : 1;
    return (microbatches_per_data_node + slots - 1) / slots;
  }
};

// Rules of a defaulted pipeline. `full` keeps every stage in order (P = S,
// no swaps): the full-pipeline baseline.
RouteRules RulesFromPipeline(const v1::PipelineSpec& pipeline, bool full = false);

// Microbatch id of the k-th microbatch of the i-th data node (data-node
// major), and back.
inline int MicrobatchId(const RouteRules& r, int data_index, int k) {
  return data_index * r.microbatches_per_data_node + k;
}

// Checks the order rules (jump, swaps) of a stage sequence that starts with
// stage 0. Returns "" when it is fine, else why not.
std::string CheckStageOrder(const RouteRules& rules, const std::vector<int>& stages);

// Visits each non-zero stage receives: total × (P-1) spread over S-1 stages,
// the remainder going to the stages of greatest compute capacity (ties: lower
// stage). Entry 0 is 0.
std::vector<int> StageQuotas(const RouteRules& rules, const std::vector<double>& capacity);

// Most visits each node may receive per iteration: for a node of stage s >= 1
// max_visits_per_node if set, else its memory slots × rounds(), raised to
// ceil(stage_visits[s] / replicas of s) so that the replicas can take the
// stage's share (a set cap too small for that is FAILED_PRECONDITION naming
// the field). Data nodes and unused nodes: INT32_MAX; all INT32_MAX when the
// rules cap nothing. `stage_visits[s]`: the visits stage s receives.
absl::StatusOr<std::vector<int>> NodeVisitCaps(const RouteRules& rules, const sim::CostModel& cost,
                                               const sim::StageAssignment& assignment,
                                               const std::vector<int>& stage_visits);

// splitmix64: small, fast and identical on every platform (std::
// distributions are not), which keeps plans reproducible from the seed.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n); n > 0.
  int Uniform(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }
  double UniformReal() { return (Next() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  uint64_t state_;
};

}  // namespace detour::planner

#endif  // DETOUR_COORDINATOR_PLANNER_ROUTE_RULES_H_
