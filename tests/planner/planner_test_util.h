// Shared fixtures for planner tests: hand-made cost tables, random clusters
// and the shipped example.
#ifndef DETOUR_TESTS_PLANNER_PLANNER_TEST_UTIL_H_
#define DETOUR_TESTS_PLANNER_PLANNER_TEST_UTIL_H_

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/sim/cost_model.h"
#include "common/spec.h"
#include "coordinator/planner/route_rules.h"
#include "detour/v1/spec.pb.h"
#include "tests/test_paths.h"

namespace detour::planner::testing {

using detour::testing::SourceDir;

// Every node computes any stage in 1 s forward, 2 s backward, 0.5 s loss;
// links 0.1 s latency + 0.1 s serialisation.
inline sim::CostModel UniformModel(int nodes, int stages, int slots = 3) {
  sim::CostTables t;
  for (int i = 0; i < nodes; ++i) t.node_ids.push_back(absl::StrCat("n", i));
  t.memory_slots.assign(nodes, slots);
  t.forward_s.assign(nodes, std::vector<double>(stages, 1.0));
  t.backward_s.assign(nodes, std::vector<double>(stages, 2.0));
  t.loss_s.assign(nodes, 0.5);
  t.latency_s.assign(nodes, std::vector<double>(nodes, 0.1));
  t.bandwidth_bytes_per_s.assign(nodes, std::vector<double>(nodes, 1e7));
  t.activation_bytes = 1e6;
  t.stage_gradient_bytes.assign(stages, 1e6);
  return *sim::CostModel::FromTables(t);
}

struct Example {
  v1::ClusterSpec cluster;
  v1::JobSpec job;
};

inline Example LoadExample() {
  Example e;
  auto c = LoadClusterSpec(SourceDir() + "/examples/clusters/geo20.json");
  auto j = LoadJobSpec(SourceDir() + "/examples/jobs/geo20_1.5b.json");
  if (c.ok()) e.cluster = *c;
  if (j.ok()) e.job = *j;
  return e;
}

// The SkipPipe reference's own 20-node example.
inline Example LoadReferenceExample() {
  Example e;
  auto c = LoadClusterSpec(SourceDir() + "/examples/clusters/skippipe_ref20.json");
  auto j = LoadJobSpec(SourceDir() + "/examples/jobs/skippipe_ref20.json");
  if (c.ok()) e.cluster = *c;
  if (j.ok()) e.job = *j;
  return e;
}

// A random small cluster and job (tiny model), deterministic in `seed`.
inline Example RandomCase(uint64_t seed) {
  Rng rng(seed);
  Example e;
  const int regions = 1 + rng.Uniform(4);
  const int stages = 1 + rng.Uniform(5);
  const int data = 1 + rng.Uniform(3);
  const int replicas = 1 + rng.Uniform(3);
  const int nodes = data + (stages - 1) * replicas + rng.Uniform(3);
  e.cluster.set_name(absl::StrCat("random-", seed));
  for (int i = 0; i < nodes; ++i) {
    auto* n = e.cluster.add_nodes();
    n->set_id(absl::StrCat("n", i));
    n->set_region(absl::StrCat("r", rng.Uniform(regions)));
    n->set_speed(0.5 + 1.5 * rng.UniformReal());
  }
  for (int a = 0; a < regions; ++a) {
    for (int b = a + 1; b < regions; ++b) {
      auto* l = e.cluster.add_links();
      l->set_region_a(absl::StrCat("r", a));
      l->set_region_b(absl::StrCat("r", b));
      l->set_latency_ms(5 + 200 * rng.UniformReal());
      l->set_bandwidth_gbytes_per_s(0.01 + rng.UniformReal());
    }
  }
  e.job.set_name("random");
  e.job.set_iterations(1);
  e.job.mutable_model()->set_preset("small");
  auto* p = e.job.mutable_pipeline();
  p->set_num_stages(stages);
  p->set_data_nodes(data);
  p->set_replicas_per_stage(replicas);
  p->set_microbatches_per_data_node(1 + rng.Uniform(5));
  const double skips[] = {0, 0.25, 0.33, 0.5};
  p->set_skip_ratio(skips[rng.Uniform(4)]);
  p->set_max_jump(1 + rng.Uniform(3));
  p->set_max_swaps(rng.Uniform(3));
  p->set_max_swap_distance(1 + rng.Uniform(2));
  p->set_max_total_swap_distance(1 + rng.Uniform(3));
  p->set_memory_slots(1 + rng.Uniform(3));
  return e;
}

}  // namespace detour::planner::testing

#endif  // DETOUR_TESTS_PLANNER_PLANNER_TEST_UTIL_H_
