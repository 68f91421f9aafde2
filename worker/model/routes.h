// Route checks and a small deterministic route generator for in-process
// training and tests (the coordinator's path scheduler produces the real
// routes; this one ignores the network). No LibTorch. Thread-safe.
#ifndef DETOUR_WORKER_MODEL_ROUTES_H_
#define DETOUR_WORKER_MODEL_ROUTES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "detour/v1/plan.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour::model {

// Checks what the engine relies on: stages[0] == 0, every other stage in
// [1, num_stages) and visited at most once, nodes (when given) as long as
// stages. INVALID_ARGUMENT naming the microbatch otherwise.
absl::Status CheckRoute(const v1::Route& route, int num_stages);

// Routes of one iteration honouring skippipe.md §2 for a single-process run:
// `num_microbatches` routes, each starting at stage 0 and visiting exactly
// P-1 = VisitedStages(pipeline)-1 distinct non-zero stages; visits per
// non-zero stage equal ±1 over the iteration; forward jumps from the frontier
// at most max_jump; up to max_swaps adjacent swaps per route (each of
// distance 1, so max_swap_distance and max_total_swap_distance hold for
// values >= 1 and >= max_swaps). Microbatch m belongs to data node
// m / microbatches_per_data_node, named "d<k>"; stage s>0 node "s<s>".
// Deterministic in (pipeline, seed, iteration). INVALID_ARGUMENT when no
// route satisfies the jump limit.
absl::StatusOr<std::vector<v1::Route>> GenerateRoutes(const v1::PipelineSpec& pipeline,
                                                      int num_microbatches, uint64_t seed,
                                                      uint64_t iteration);

// A route through the given stages (stage 0 first) for microbatch `mb`.
v1::Route MakeRoute(uint32_t mb, const std::vector<int>& stages);

// Routes from JSON: either an IterationPlan ({"routes": [...]}, as the
// coordinator and detour-sim emit it) or a bare array of Route objects.
absl::StatusOr<std::vector<v1::Route>> ParseRoutesJson(absl::string_view json);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_ROUTES_H_
