// K-FAC bubble planner: a property test over random timelines and workloads
// (dependencies, the overlap rules 1 and 2 of docs/KFAC.md §Planner,
// intervals); the hand-built cases are in bubble_planner_test.cc.
#include "coordinator/planner/bubble_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/kfac_workload.h"
#include "tests/planner/bubble_test_util.h"
#include "tests/planner/planner_test_util.h"

namespace detour::planner {
namespace {

using Kind = v1::BubbleTask::Kind;
using BK = BusyInterval::Kind;
using testing::BubbleTaskName;
using testing::Cost;
using testing::Spec;

struct RandomCase {
  KfacWorkload workload;
  v1::KfacSpec kfac;
  sim::Plan plan;
  std::vector<IterationTimeline> timelines;  // one per iteration
};

RandomCase MakeRandom(uint64_t seed, int iterations) {
  std::mt19937_64 rng(seed);
  auto uni = [&](double lo, double hi) { return std::uniform_real_distribution<>(lo, hi)(rng); };
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<>(lo, hi)(rng); };
  RandomCase c;
  const int stages = pick(1, 3);
  const int replicas = pick(1, 3);
  const int num_mbs = pick(1, 5);
  int layer = 0;
  for (int s = 0; s < stages; ++s) {
    const int layers = pick(1, 3);
    std::vector<int> ids;
    for (int l = 0; l < layers; ++l) ids.push_back(layer++);
    std::vector<KfacLayerCost> costs;
    // Half the cases give the blocks a shape, so items split into parts
    // under the cap (wide factors: inversions of 6 or 8 units).
    kfac::BlockShape shape;
    if (pick(0, 1)) {
      shape.d_model = pick(0, 1) ? 64 : 2048;
      shape.kv_dim = shape.d_model / (pick(0, 1) ? 1 : 2);
      shape.ffn_dim = pick(0, 1) ? 3 * shape.d_model : 1500;
    }
    for (int l = 0; l < layers; ++l) {
      KfacLayerCost k = Cost(uni(0, 2), uni(0, 2), 0, uni(0, 0.2), uni(0, 0.5));
      for (double& v : k.invert_a_s) v = pick(0, 9) == 0 ? uni(5, 30) : uni(0, 2);
      for (double& v : k.invert_b_s) v = uni(0, 2);
      k.shape = shape;
      costs.push_back(k);
    }
    for (int r = 0; r < replicas; ++r) {
      c.workload.nodes.push_back({absl::StrCat("s", s, "r", r), s, ids, costs});
    }
  }
  if (pick(0, 3) == 0) c.workload.nodes.push_back({"idle", -1, {}, {}});
  const int n = static_cast<int>(c.workload.nodes.size());
  c.kfac = Spec(pick(0, 1) ? 0.05 : uni(0, 0.3), pick(0, 3) == 0 ? pick(1, 4) : 0, pick(1, 3));
  c.kfac.set_sync_factors(pick(0, 1) == 1);
  if (pick(0, 2) != 0) c.kfac.set_max_granule_ms(uni(100, 3000));
  if (pick(0, 7) == 0) c.kfac.set_placement(v1::KFAC_PLACEMENT_SERIAL);
  // Routes: each microbatch visits a random subset of the block nodes.
  for (int mb = 0; mb < num_mbs; ++mb) {
    sim::Route r;
    r.microbatch = mb;
    for (int i = 0; i < n; ++i) {
      if (!c.workload.nodes[i].layers.empty() && pick(0, 3) != 0) {
        r.nodes.push_back(i);
        r.stages.push_back(c.workload.nodes[i].stage);
      }
    }
    c.plan.routes.push_back(r);
  }
  for (int it = 0; it < iterations; ++it) {
    IterationTimeline tl;
    tl.nodes.resize(n);
    double end = 0;
    for (int i = 0; i < n; ++i) {
      // Forwards in microbatch order, each backward somewhere after its forward.
      std::vector<std::pair<BK, int>> ops;
      for (const auto& r : c.plan.routes) {
        if (std::find(r.nodes.begin(), r.nodes.end(), i) == r.nodes.end()) continue;
        ops.push_back({BK::kForward, r.microbatch});
      }
      std::vector<std::pair<BK, int>> order = ops;
      for (const auto& f : ops) {
        size_t after = 0;
        while (order[after] != f) ++after;
        const size_t pos = std::uniform_int_distribution<size_t>(after + 1, order.size())(rng);
        order.insert(order.begin() + pos, {BK::kBackward, f.second});
      }
      double t = uni(0, 3);
      for (const auto& [kind, mb] : order) {
        const double d = uni(0.1, 2);
        tl.nodes[i].busy.push_back({t, t + d, kind, mb});
        t += d + (pick(0, 2) == 0 ? 0 : uni(0, 4));
      }
      if (pick(0, 1)) {
        const double d = uni(0.1, 2);
        tl.nodes[i].busy.push_back({t, t + d, BK::kOther, -1});
        t += d;
      }
      end = std::max(end, t);
    }
    tl.end_s = end + uni(0, 2);
    c.timelines.push_back(tl);
  }
  return c;
}

TEST(BubblePlannerTest, PropertiesOverRandomTimelines) {
  constexpr int kIterations = 12;
  int activations_total = 0, serial_total = 0, bubble_total = 0, overlapping_total = 0,
      split_total = 0;
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    RandomCase c = MakeRandom(seed, kIterations);
    auto planner = BubblePlanner::Create(c.workload, c.kfac);
    ASSERT_TRUE(planner.ok()) << planner.status();
    const int n = static_cast<int>(c.workload.nodes.size());
    const double slack = 1 + c.kfac.slack();
    std::map<std::string, int> index;
    for (int i = 0; i < n; ++i) index[c.workload.nodes[i].node_id] = i;

    // (iteration, time) of every task end, per refresh / node / layer.
    using When = std::pair<uint64_t, double>;
    // a no later than b, up to rounding of sums of durations.
    auto before = [](const When& a, const When& b) {
      return a.first < b.first || (a.first == b.first && a.second <= b.second + 1e-9);
    };
    struct Track {
      When last_curvature{0, -1};
      When first_inversion{1u << 30, 0};
      double first_inversion_end = 0;  // in first_inversion's iteration
      When sync{0, -1};
      When first_sync{1u << 30, 0};
      When last_inversion{0, -1};
      int inversions = 0, curv_a = 0, curv_b = 0, syncs = 0;  // whole items
    };
    // Every part placed, per item (refresh, node, layer, kind, module, mb).
    struct Part {
      uint32_t part, num_parts;
      uint64_t iteration;
      double start, end;
    };
    std::map<std::tuple<uint64_t, int, uint32_t, int, std::string, uint32_t>, std::vector<Part>>
        parts;
    std::map<std::tuple<uint64_t, int, uint32_t>, Track> track;
    std::map<uint64_t, uint64_t> activated;  // refresh -> iteration
    std::map<uint64_t, uint64_t> last_task_iteration;
    uint64_t expected_refresh = 0;
    int overlapping = 0;  // iterations with tasks of two refreshes
    for (uint64_t it = 0; it < kIterations; ++it) {
      const IterationTimeline& tl = c.timelines[it];
      auto out = planner->PlanIteration(it, c.plan, tl);
      ASSERT_TRUE(out.ok()) << out.status();
      std::vector<std::vector<std::pair<double, double>>> used(n);
      for (const v1::BubbleTask& t : out->tasks) {
        ASSERT_TRUE(index.count(t.node())) << t.node();
        const int node = index[t.node()];
        const double s = t.planned_start_s(), d = t.planned_duration_s();
        EXPECT_GE(d, 0);
        ASSERT_GE(t.num_parts(), 1u);
        ASSERT_LT(t.part(), t.num_parts());
        split_total += t.num_parts() > 1;
        if (t.num_parts() > 1) {
          ASSERT_GT(c.kfac.max_granule_ms(), 0) << "split without a cap";
        }
        // Under the cap, unless the item is split as finely as it can be.
        const KfacLayerCost& lc =
            c.workload.nodes[node]
                .costs[std::find(c.workload.nodes[node].layers.begin(),
                                 c.workload.nodes[node].layers.end(), static_cast<int>(t.layer())) -
                       c.workload.nodes[node].layers.begin()];
        if (!t.serial() && c.kfac.max_granule_ms() > 0 && lc.shape.d_model > 0 &&
            t.kind() != v1::BubbleTask::KIND_SYNC_FACTORS) {
          const kfac::BlockWorkload block(lc.shape);
          const int m = kfac::ModuleIndex(t.module());
          const size_t units =
              t.kind() == v1::BubbleTask::KIND_CURVATURE_A ? 4
              : t.kind() == v1::BubbleTask::KIND_CURVATURE_B
                  ? 7
                  : kfac::InversionUnitWeights(
                        t.kind() == v1::BubbleTask::KIND_INVERT_A ? block.f_in(m) : block.f_out(m))
                        .size();
          if (t.num_parts() < units) {
            EXPECT_LE(d, c.kfac.max_granule_ms() * 1e-3 * (1 + 1e-9))
                << BubbleTaskName(t) << " exceeds the cap";
          }
        }
        parts[{t.refresh(), node, t.layer(), static_cast<int>(t.kind()), t.module(),
               t.microbatch()}]
            .push_back({t.part(), t.num_parts(), it, s, s + d});
        // At most two refreshes in flight: the oldest not activated, and the
        // next one (not with serial placement).
        EXPECT_GE(t.refresh(), expected_refresh);
        EXPECT_LE(t.refresh(),
                  expected_refresh + (c.kfac.placement() == v1::KFAC_PLACEMENT_SERIAL ? 0 : 1));
        // Rule 2 (fixed interval): inversions of q only after q-1's
        // activation iteration. Rule 2' (adaptive): after q-1's inversions
        // of the layer on the node (checked at the end).
        if (t.refresh() > 0 && t.kind() >= v1::BubbleTask::KIND_INVERT_A &&
            c.kfac.refresh_interval() > 0) {
          ASSERT_TRUE(activated.count(t.refresh() - 1))
              << "inversion of refresh " << t.refresh() << " before " << t.refresh() - 1
              << " was activated";
          EXPECT_LT(activated.at(t.refresh() - 1), it);
        }
        last_task_iteration[t.refresh()] = it;
        if (t.serial()) {
          ++serial_total;
          EXPECT_GE(s, tl.end_s - 1e-9);
        } else {
          ++bubble_total;
          EXPECT_NE(c.kfac.placement(), v1::KFAC_PLACEMENT_SERIAL);
          EXPECT_GE(s, -1e-9);
          EXPECT_LE(s + d * slack, tl.end_s + 1e-9);
          for (const BusyInterval& b : tl.nodes[node].busy) {
            EXPECT_TRUE(s + d * slack <= b.start_s + 1e-9 || s >= b.end_s - 1e-9)
                << "task at " << s << " overlaps busy " << b.start_s << "-" << b.end_s;
          }
          used[node].push_back({s, s + d * slack});
        }
        // Dependencies on the node's own pipeline work.
        if (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
            t.kind() == v1::BubbleTask::KIND_CURVATURE_B) {
          const BK want =
              t.kind() == v1::BubbleTask::KIND_CURVATURE_A ? BK::kForward : BK::kBackward;
          double after = -1;
          for (const BusyInterval& b : tl.nodes[node].busy) {
            if (b.kind == want && b.microbatch == static_cast<int>(t.microbatch())) {
              after = b.end_s;
            }
          }
          ASSERT_GE(after, 0) << "curvature of a microbatch that did not run on the node";
          EXPECT_GE(s, after - 1e-9);
        }
        Track& tr = track[{t.refresh(), node, t.layer()}];
        const When end{it, s + d};
        const When start{it, s};
        switch (t.kind()) {
          case v1::BubbleTask::KIND_CURVATURE_A:
          case v1::BubbleTask::KIND_CURVATURE_B:
            tr.last_curvature = std::max(tr.last_curvature, end);
            if (t.part() + 1 == t.num_parts()) {
              (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ? tr.curv_a : tr.curv_b)++;
            }
            break;
          case v1::BubbleTask::KIND_SYNC_FACTORS:
            EXPECT_TRUE(t.serial());
            tr.sync = std::max(tr.sync, end);
            tr.first_sync = std::min(tr.first_sync, start);
            ++tr.syncs;
            break;
          case v1::BubbleTask::KIND_INVERT_A:
          case v1::BubbleTask::KIND_INVERT_B:
            if (start < tr.first_inversion) {
              tr.first_inversion = start;
              tr.first_inversion_end = s + d;
            }
            tr.last_inversion = std::max(tr.last_inversion, end);
            if (t.part() + 1 == t.num_parts()) ++tr.inversions;
            break;
          default: ADD_FAILURE() << "unexpected kind " << t.kind();
        }
      }
      // Rule 1, per task: curvature of q on (node, layer) only after q-1's
      // first inversion there (same iteration: from its end). The sync of q
      // only once that holds on every replica of the stage, and (the worker
      // holds inversions of a syncing layer until the all-reduce) not in an
      // iteration with bubble inversions of q-1 for the layer.
      std::set<uint64_t> refreshes;
      for (const v1::BubbleTask& t : out->tasks) {
        refreshes.insert(t.refresh());
        if (t.refresh() == 0) continue;
        const int node = index[t.node()];
        auto first_inversion_done = [&](int m, double at) {
          auto prev = track.find({t.refresh() - 1, m, t.layer()});
          // Any inversion task (a first part) of the previous refresh.
          if (prev == track.end() || prev->second.first_inversion.first == (1u << 30)) {
            return false;
          }
          const Track& p = prev->second;
          return p.first_inversion.first < it ||
                 (p.first_inversion.first == it && p.first_inversion_end <= at + 1e-9);
        };
        if (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
            t.kind() == v1::BubbleTask::KIND_CURVATURE_B) {
          EXPECT_TRUE(first_inversion_done(node, t.planned_start_s()))
              << "curvature of refresh " << t.refresh() << " layer " << t.layer() << " on "
              << t.node() << " at " << it << "/" << t.planned_start_s()
              << " before the first inversion of refresh " << t.refresh() - 1;
        }
        if (t.kind() == v1::BubbleTask::KIND_SYNC_FACTORS) {
          for (int m = 0; m < n; ++m) {
            if (c.workload.nodes[m].stage != c.workload.nodes[node].stage) continue;
            EXPECT_TRUE(first_inversion_done(m, t.planned_start_s()))
                << "sync of refresh " << t.refresh() << " before rule 1 holds on replica " << m;
            for (const v1::BubbleTask& o : out->tasks) {
              EXPECT_FALSE(o.refresh() + 1 == t.refresh() && o.layer() == t.layer() &&
                           !o.serial() && o.kind() >= v1::BubbleTask::KIND_INVERT_A &&
                           index[o.node()] == m)
                  << "bubble inversion of the previous refresh while syncing layer " << t.layer();
            }
          }
        }
      }
      overlapping += refreshes.size() > 1;
      // No two bubble tasks of a node overlap.
      for (auto& u : used) {
        std::sort(u.begin(), u.end());
        for (size_t i = 1; i < u.size(); ++i) EXPECT_LE(u[i - 1].second, u[i].first + 1e-9);
      }
      if (out->activate_refresh) {
        EXPECT_EQ(*out->activate_refresh, expected_refresh);
        EXPECT_FALSE(activated.count(*out->activate_refresh)) << "activated twice";
        activated[*out->activate_refresh] = it;
        ++expected_refresh;
        ++activations_total;
      }
      EXPECT_GE(out->utilization_after, 0);
      EXPECT_LE(out->utilization_after, 1 + 1e-9);
      EXPECT_GE(out->iteration_time_s, tl.end_s);
    }
    // Every activated refresh: dependencies held, all items present.
    for (const auto& [key, tr] : track) {
      const auto& [refresh, node_binding, layer] = key;
      // A plain copy: lambdas below capture it (clang 14 cannot capture
      // structured bindings).
      const auto node = node_binding;
      if (!activated.count(refresh)) continue;
      const bool needs_sync =
          c.kfac.sync_factors() &&
          std::count_if(c.workload.nodes.begin(), c.workload.nodes.end(), [&](const auto& w) {
            return w.stage == c.workload.nodes[node].stage && !w.layers.empty();
          }) > 1;
      EXPECT_EQ(tr.inversions, 14) << "refresh " << refresh << " node " << node;
      EXPECT_LE(tr.curv_a, static_cast<int>(c.kfac.curvature_microbatches()));
      EXPECT_LE(tr.curv_b, static_cast<int>(c.kfac.curvature_microbatches()));
      EXPECT_EQ(tr.syncs, needs_sync ? 1 : 0);
      if (tr.curv_a + tr.curv_b > 0) {
        EXPECT_TRUE(before(tr.last_curvature, tr.first_inversion)) << "inversion before curvature";
      }
      if (needs_sync) {
        EXPECT_TRUE(before(tr.sync, tr.first_inversion)) << "inversion before sync";
        // Sync after every replica's curvature of the layer.
        for (const auto& [k2, t2] : track) {
          if (std::get<0>(k2) == refresh && std::get<2>(k2) == layer &&
              c.workload.nodes[std::get<1>(k2)].stage == c.workload.nodes[node].stage) {
            EXPECT_TRUE(before(t2.last_curvature, tr.first_sync));
          }
        }
      }
      EXPECT_LE(last_task_iteration[refresh], activated.at(refresh));
    }
    // An item's parts: each once, in order, each after the previous one;
    // a curvature microbatch's all in one iteration (its data lives there).
    for (const auto& [key, list] : parts) {
      const int kind = std::get<3>(key);
      for (size_t i = 0; i < list.size(); ++i) {
        const Part& p = list[i];
        EXPECT_EQ(p.num_parts, list[0].num_parts);
        // Items not finished by the end of the run may lack their last parts.
        EXPECT_EQ(p.part, i % p.num_parts) << "part order, kind " << kind;
        if (i > 0 && p.part > 0) {
          const Part& q = list[i - 1];
          EXPECT_TRUE(q.iteration < p.iteration ||
                      (q.iteration == p.iteration && q.end <= p.start + 1e-9))
              << "part " << p.part << " before part " << q.part;
          if (kind <= v1::BubbleTask::KIND_CURVATURE_B) {
            EXPECT_EQ(q.iteration, p.iteration);
          }
        }
      }
    }
    // Rule 2': the next refresh's inversions of a layer on a node after all
    // of the previous refresh's there.
    if (c.kfac.refresh_interval() == 0) {
      for (const auto& [key, list] : parts) {
        const auto& [refresh, node, layer, kind, module, mb] = key;
        if (refresh == 0 || kind < v1::BubbleTask::KIND_INVERT_A) continue;
        auto prev = track.find({refresh - 1, node, layer});
        if (prev == track.end()) continue;
        for (const Part& p : list) {
          EXPECT_TRUE(before(prev->second.last_inversion, When{p.iteration, p.start}))
              << "inversion of refresh " << refresh << " layer " << layer << " on node " << node
              << " (kind " << kind << " " << module << " part " << p.part << ") at iteration "
              << p.iteration << " time " << p.start << " before refresh " << refresh - 1
              << "'s last, iteration " << prev->second.last_inversion.first << " end "
              << prev->second.last_inversion.second;
        }
      }
    }
    overlapping_total += overlapping;
    // Intervals add up: refresh r spans (activation r-1, activation r].
    const std::vector<int>& intervals = planner->refresh_intervals();
    ASSERT_EQ(intervals.size(), activated.size());
    for (size_t r = 0; r < intervals.size(); ++r) {
      const uint64_t start = r == 0 ? 0 : activated[r - 1] + 1;
      EXPECT_EQ(static_cast<uint64_t>(intervals[r]), activated[r] - start + 1);
      if (c.kfac.refresh_interval() > 0) {
        EXPECT_EQ(intervals[r], static_cast<int>(c.kfac.refresh_interval()));
      }
    }
  }
  // The random cases exercise both paths, and overlapping refreshes.
  EXPECT_GT(activations_total, 300);
  EXPECT_GT(overlapping_total, 300);
  EXPECT_GT(serial_total, 0);
  EXPECT_GT(bubble_total, 0);
  EXPECT_GT(split_total, 1000);  // parts are exercised
}

}  // namespace
}  // namespace detour::planner
