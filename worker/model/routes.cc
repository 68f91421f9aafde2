#include "worker/model/routes.h"

#include <algorithm>
#include <limits>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/spec.h"
#include "worker/model/text_data.h"

namespace detour::model {

absl::Status CheckRoute(const v1::Route& route, int num_stages) {
  const std::string ctx = absl::StrCat("route of microbatch ", route.microbatch());
  if (route.stages_size() == 0 || route.stages(0) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(ctx, ": must start at stage 0"));
  }
  if (route.nodes_size() != 0 && route.nodes_size() != route.stages_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ctx, ": ", route.nodes_size(), " nodes vs ", route.stages_size(), " stages"));
  }
  std::vector<bool> seen(num_stages, false);
  for (int i = 1; i < route.stages_size(); ++i) {
    const uint32_t s = route.stages(i);
    if (s == 0 || s >= static_cast<uint32_t>(num_stages)) {
      return absl::InvalidArgumentError(
          absl::StrCat(ctx, ": stage ", s, " at hop ", i, " is outside [1, ", num_stages, ")"));
    }
    if (seen[s]) {
      return absl::InvalidArgumentError(absl::StrCat(ctx, ": stage ", s, " visited twice"));
    }
    seen[s] = true;
  }
  return absl::OkStatus();
}

v1::Route MakeRoute(uint32_t mb, const std::vector<int>& stages) {
  v1::Route r;
  r.set_microbatch(mb);
  r.set_data_node("d0");
  for (int s : stages) {
    r.add_stages(static_cast<uint32_t>(s));
    r.add_nodes(s == 0 ? std::string("d0") : absl::StrCat("s", s));
  }
  return r;
}

absl::StatusOr<std::vector<v1::Route>> GenerateRoutes(const v1::PipelineSpec& pipeline,
                                                      int num_microbatches, uint64_t seed,
                                                      uint64_t iteration) {
  const int s_count = static_cast<int>(pipeline.num_stages());
  const int others = std::max(0, VisitedStages(pipeline) - 1);
  const int max_jump = pipeline.max_jump() > 0 ? static_cast<int>(pipeline.max_jump()) : 3;
  const int max_total = pipeline.max_total_swap_distance() > 0
                            ? static_cast<int>(pipeline.max_total_swap_distance())
                            : 2;
  // Each swap here has distance 1, so the total distance is the swap count.
  const int max_swaps = std::min(static_cast<int>(pipeline.max_swaps()), max_total);
  const int per_node = pipeline.microbatches_per_data_node() > 0
                           ? static_cast<int>(pipeline.microbatches_per_data_node())
                           : num_microbatches;
  if (s_count < 1 || others > s_count - 1) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline.num_stages: ", s_count, " too small"));
  }
  // Every ascending subset of size `others` of {1..S-1} whose jumps fit.
  std::vector<std::vector<int>> subsets;
  const int n = s_count - 1;
  if (n > 20) {
    return absl::InvalidArgumentError(
        "pipeline.num_stages: the in-process route generator handles <= 21 stages");
  }
  for (uint32_t mask = 0; mask < (1u << n); ++mask) {
    if (__builtin_popcount(mask) != others) continue;
    std::vector<int> set;
    int prev = 0;
    bool ok = true;
    for (int b = 0; b < n; ++b) {
      if (mask & (1u << b)) {
        if (b + 1 - prev > max_jump) ok = false;
        prev = b + 1;
        set.push_back(b + 1);
      }
    }
    if (ok) subsets.push_back(std::move(set));
  }
  if (subsets.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no route of ", others, " non-zero stages fits max_jump ", max_jump));
  }
  // Greedy level filling: each microbatch takes the feasible subset with the
  // least squared visit counts (random tie-break). Jump limits can make the
  // greedy choice unbalanced, so a few deterministic restarts keep the first
  // assignment with visits equal ±1 (or the most even one).
  std::vector<std::vector<int>> best_orders;
  int best_spread = std::numeric_limits<int>::max();
  for (uint64_t attempt = 0; attempt < 64 && best_spread > 1; ++attempt) {
    uint64_t rng = seed * 0x9e3779b97f4a7c15ULL + iteration * 0x100000001b3ULL +
                   attempt * 0xbf58476d1ce4e5b9ULL + 1;
    std::vector<int> visits(s_count, 0);
    std::vector<std::vector<int>> orders;
    for (int mb = 0; mb < num_microbatches; ++mb) {
      long best_score = std::numeric_limits<long>::max();
      std::vector<size_t> best;
      for (size_t i = 0; i < subsets.size(); ++i) {
        long score = 0;
        for (int st : subsets[i]) score += static_cast<long>(visits[st] + 1) * (visits[st] + 1);
        if (score < best_score) {
          best_score = score;
          best.clear();
        }
        if (score == best_score) best.push_back(i);
      }
      orders.push_back(subsets[best[SplitMix64(&rng) % best.size()]]);
      for (int st : orders.back()) ++visits[st];
    }
    int spread = 0;
    if (s_count > 1) {
      const auto [lo, hi] = std::minmax_element(visits.begin() + 1, visits.end());
      spread = *hi - *lo;
    }
    if (spread < best_spread) {
      best_spread = spread;
      best_orders = std::move(orders);
    }
  }
  uint64_t rng = seed * 0x2545f4914f6cdd1dULL + iteration + 7;
  std::vector<v1::Route> routes;
  for (int mb = 0; mb < num_microbatches; ++mb) {
    std::vector<int> order = best_orders[mb];
    // Adjacent swaps of consecutive stage numbers (a, a+1 -> a+1, a): the
    // later visit is 1 below the frontier; the jump to a+1 is re-checked.
    for (int k = 0; k < max_swaps; ++k) {
      if (SplitMix64(&rng) % 2 == 0) continue;
      std::vector<size_t> candidates;
      for (size_t i = 0; i + 1 < order.size(); ++i) {
        const int frontier = i == 0 ? 0 : *std::max_element(order.begin(), order.begin() + i);
        if (order[i + 1] == order[i] + 1 && order[i + 1] - frontier <= max_jump) {
          const bool touched = (i > 0 && order[i - 1] > order[i]) ||
                               (i + 2 < order.size() && order[i + 1] > order[i + 2]);
          if (!touched) candidates.push_back(i);
        }
      }
      if (candidates.empty()) break;
      const size_t i = candidates[SplitMix64(&rng) % candidates.size()];
      std::swap(order[i], order[i + 1]);
    }
    std::vector<int> stages = {0};
    stages.insert(stages.end(), order.begin(), order.end());
    v1::Route r = MakeRoute(static_cast<uint32_t>(mb), stages);
    const std::string data_node = absl::StrCat("d", mb / per_node);
    r.set_data_node(data_node);
    r.set_nodes(0, data_node);
    routes.push_back(std::move(r));
  }
  return routes;
}

absl::StatusOr<std::vector<v1::Route>> ParseRoutesJson(absl::string_view json) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  v1::IterationPlan plan;
  absl::string_view trimmed = absl::StripAsciiWhitespace(json);
  std::string text(trimmed);
  if (!trimmed.empty() && trimmed.front() == '[') {
    text = absl::StrCat("{\"routes\":", trimmed, "}");
  }
  auto status = google::protobuf::util::JsonStringToMessage(text, &plan, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("routes JSON: ", status.ToString()));
  }
  return std::vector<v1::Route>(plan.routes().begin(), plan.routes().end());
}

}  // namespace detour::model
