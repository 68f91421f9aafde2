#include "coordinator/planner/lane_clusters.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_format.h"

namespace detour::planner {
namespace {

class Clustering {
 public:
  Clustering(const sim::CostModel& cost, std::vector<int> nodes, int clusters, Rng& rng)
      : nodes_(std::move(nodes)), rng_(rng) {
    const int n = static_cast<int>(nodes_.size());
    pair_.assign(n, std::vector<double>(n, 0));
    for (int a = 0; a < n; ++a) {
      for (int b = 0; b < n; ++b) {
        if (a != b)
          pair_[a][b] =
              cost.TransferTime(nodes_[a], nodes_[b]) + cost.TransferTime(nodes_[b], nodes_[a]);
      }
    }
    size_.assign(clusters, n / clusters);
    for (int c = 0; c < n % clusters; ++c) ++size_[c];
  }

  // Farthest-first seeds, capacity-bounded greedy fill, then pairwise swaps
  // between clusters while they shorten the lanes. Returns members as
  // indices into `nodes`.
  std::vector<std::vector<int>> Run(bool random_first) {
    const int n = static_cast<int>(nodes_.size());
    const int k = static_cast<int>(size_.size());
    std::vector<int> seeds;
    // The first seed: the node with the densest neighbourhood (or a random
    // one), then each next seed as far as possible from the chosen ones.
    int first = 0;
    if (random_first) {
      first = rng_.Uniform(n);
    } else {
      double best = kInf;
      for (int a = 0; a < n; ++a) {
        std::vector<double> row = pair_[a];
        std::sort(row.begin(), row.end());
        double sum = 0;
        for (int i = 1; i < std::min(n, size_[0]); ++i) sum += row[i];
        if (sum < best) {
          best = sum;
          first = a;
        }
      }
    }
    seeds.push_back(first);
    while (static_cast<int>(seeds.size()) < k) {
      int far = -1;
      double far_d = -1;
      for (int a = 0; a < n; ++a) {
        double d = kInf;
        for (int s : seeds) d = std::min(d, a == s ? 0.0 : pair_[a][s]);
        if (d > far_d) {
          far_d = d;
          far = a;
        }
      }
      seeds.push_back(far);
    }
    // Greedy fill: cheapest (node, seed) pairs first, within capacity.
    std::vector<std::tuple<double, int, int>> pairs;
    for (int a = 0; a < n; ++a) {
      for (int c = 0; c < k; ++c)
        pairs.push_back({a == seeds[c] ? -1.0 : pair_[a][seeds[c]], a, c});
    }
    std::sort(pairs.begin(), pairs.end());
    cluster_of_.assign(n, -1);
    std::vector<int> fill(k, 0);
    for (const auto& [d, a, c] : pairs) {
      if (cluster_of_[a] >= 0 || fill[c] >= size_[c]) continue;
      cluster_of_[a] = c;
      ++fill[c];
    }
    members_.assign(k, {});
    for (int a = 0; a < n; ++a) members_[cluster_of_[a]].push_back(a);
    // Swaps between clusters that shorten the two lanes: every pair, a few
    // passes, on small clusters; random pairs under a budget on big ones.
    auto try_swap = [&](int a, int b) {
      const int ca = cluster_of_[a], cb = cluster_of_[b];
      if (ca == cb) return false;
      const double before = LaneCost(ca) + LaneCost(cb);
      Move(a, cb);
      Move(b, ca);
      if (LaneCost(ca) + LaneCost(cb) < before - 1e-9) return true;
      Move(a, ca);
      Move(b, cb);
      return false;
    };
    if (n <= 64) {
      for (int pass = 0; pass < 20; ++pass) {
        bool improved = false;
        for (int a = 0; a < n; ++a) {
          for (int b = a + 1; b < n; ++b) improved = try_swap(a, b) || improved;
        }
        if (!improved) break;
      }
    } else {
      for (int trial = 0; trial < 20 * n; ++trial) try_swap(rng_.Uniform(n), rng_.Uniform(n));
    }
    return members_;
  }

  double Pair(int a, int b) const { return pair_[a][b]; }

 private:
  // Moves node a into cluster c.
  void Move(int a, int c) {
    auto& from = members_[cluster_of_[a]];
    from.erase(std::find(from.begin(), from.end(), a));
    members_[c].push_back(a);
    cluster_of_[a] = c;
  }

  // A lane's cost: each member's two cheapest links within the cluster (a
  // round trip enters and leaves every member once), squared so that one
  // terrible link weighs more than several fair ones.
  double LaneCost(int c) const {
    double total = 0;
    for (int a : members_[c]) {
      double m1 = kInf, m2 = kInf;
      for (int b : members_[c]) {
        if (b == a) continue;
        const double d = pair_[a][b];
        if (d < m1) {
          m2 = m1;
          m1 = d;
        } else if (d < m2) {
          m2 = d;
        }
      }
      if (m1 < kInf) total += m1 * m1;
      if (m2 < kInf) total += m2 * m2;
    }
    return total;
  }

  std::vector<int> nodes_;
  Rng& rng_;
  std::vector<std::vector<double>> pair_;
  std::vector<int> size_;
  std::vector<int> cluster_of_;
  std::vector<std::vector<int>> members_;
};

// The order of `members` (after the data node) whose cycle data node ->
// members -> data node is cheapest; exhaustive up to 7 members, else
// nearest neighbour.
std::vector<int> CheapestCycle(const sim::CostModel& cost, int data, std::vector<int> members) {
  auto cycle = [&](const std::vector<int>& order) {
    double t = 0;
    int prev = data;
    for (int m : order) {
      t += cost.TransferTime(prev, m) + cost.TransferTime(m, prev);
      prev = m;
    }
    return t + cost.TransferTime(prev, data) + cost.TransferTime(data, prev);
  };
  if (members.size() <= 7) {
    std::sort(members.begin(), members.end());
    std::vector<int> best = members;
    double best_t = cycle(members);
    while (std::next_permutation(members.begin(), members.end())) {
      const double t = cycle(members);
      if (t < best_t) {
        best_t = t;
        best = members;
      }
    }
    return best;
  }
  std::vector<int> order;
  int prev = data;
  while (!members.empty()) {
    auto it = std::min_element(members.begin(), members.end(), [&](int a, int b) {
      return cost.TransferTime(prev, a) < cost.TransferTime(prev, b);
    });
    prev = *it;
    order.push_back(prev);
    members.erase(it);
  }
  return order;
}

}  // namespace

absl::StatusOr<sim::StageAssignment> LaneClusterAssignment(const sim::CostModel& cost,
                                                           const RouteRules& rules, int replicas,
                                                           uint64_t seed, int variant) {
  const int n = cost.num_nodes();
  const int d = rules.data_nodes;
  const int needed = d + (rules.num_stages - 1) * replicas;
  if (d < 1 || needed > n) {
    return absl::FailedPreconditionError(
        absl::StrFormat("lane clusters need %d nodes, the cluster has %d", needed, n));
  }
  Rng rng(seed * 31 + static_cast<uint64_t>(variant));
  // With spare nodes, keep the best connected (cheapest links to their
  // nearest lane-size neighbours, per unit of speed).
  const int lane = std::max(1, needed / d);
  std::vector<std::pair<double, int>> keyed;
  for (int a = 0; a < n; ++a) {
    std::vector<double> links;
    for (int b = 0; b < n; ++b) {
      if (b != a) links.push_back(cost.TransferTime(a, b) + cost.TransferTime(b, a));
    }
    std::sort(links.begin(), links.end());
    double sum = 0;
    for (int i = 0; i < std::min<int>(lane, links.size()); ++i) sum += links[i];
    keyed.push_back({(sum + 1e-9) / std::max(1e-9, 1.0 / cost.ForwardTime(a, 0)), a});
  }
  std::stable_sort(keyed.begin(), keyed.end());
  std::vector<int> nodes;
  for (int i = 0; i < needed; ++i) nodes.push_back(keyed[i].second);
  std::sort(nodes.begin(), nodes.end());

  Clustering clustering(cost, nodes, d, rng);
  std::vector<std::vector<int>> members = clustering.Run(variant > 0);

  sim::StageAssignment a;
  a.stage_nodes.resize(rules.num_stages);
  // The data node of a lane: its best connected member.
  std::vector<int> data_of(d);
  std::vector<std::vector<int>> rest(d);
  for (int c = 0; c < d; ++c) {
    double best = kInf;
    for (int x : members[c]) {
      double sum = 0;
      for (int y : members[c]) sum += x == y ? 0 : clustering.Pair(x, y);
      if (sum < best) {
        best = sum;
        data_of[c] = x;
      }
    }
    for (int x : members[c]) {
      if (x != data_of[c]) rest[c].push_back(nodes[x]);
    }
    a.stage_nodes[0].push_back(nodes[data_of[c]]);
  }
  // Stage labels dealt round-robin in lane order: lane c takes the next
  // |rest[c]| labels of 1, 2, ..., S-1, 1, 2, ... — each stage exactly
  // `replicas` times, consecutive (distinct) stages within a lane.
  const int labels = rules.num_stages - 1;
  int next = 0;
  for (int c = 0; c < d; ++c) {
    std::vector<int> stages;
    for (size_t i = 0; i < rest[c].size(); ++i) stages.push_back(1 + (next++ % labels));
    std::sort(stages.begin(), stages.end());
    // The members in cycle order take the stages in ascending order.
    const std::vector<int> order = CheapestCycle(cost, nodes[data_of[c]], rest[c]);
    for (size_t i = 0; i < order.size(); ++i) a.stage_nodes[stages[i]].push_back(order[i]);
  }
  for (auto& g : a.stage_nodes) std::sort(g.begin(), g.end());
  return a;
}

}  // namespace detour::planner
