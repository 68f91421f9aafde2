// Hand-made cost tables for exact simulator tests.
#ifndef DETOUR_TESTS_SIM_SIM_TEST_UTIL_H_
#define DETOUR_TESTS_SIM_SIM_TEST_UTIL_H_

#include <string>
#include <vector>

#include "common/sim/cost_model.h"

namespace detour::sim::testing {

// `num_nodes` nodes, `num_stages` stages; every node computes any stage in
// forward `f`, backward `b`, loss `l`; every link has `latency` and moves one
// activation in `serialization` seconds (activation 1e6 bytes).
inline CostTables UniformTables(int num_nodes, int num_stages, double f, double b, double l,
                                double latency, double serialization, int slots) {
  CostTables t;
  for (int i = 0; i < num_nodes; ++i) t.node_ids.push_back("n" + std::to_string(i));
  t.memory_slots.assign(num_nodes, slots);
  t.forward_s.assign(num_nodes, std::vector<double>(num_stages, f));
  t.backward_s.assign(num_nodes, std::vector<double>(num_stages, b));
  t.loss_s.assign(num_nodes, l);
  t.latency_s.assign(num_nodes, std::vector<double>(num_nodes, latency));
  t.activation_bytes = serialization > 0 ? 1e6 : 0;
  t.bandwidth_bytes_per_s.assign(
      num_nodes, std::vector<double>(num_nodes, serialization > 0 ? 1e6 / serialization : 1e9));
  t.stage_gradient_bytes.assign(num_stages, 0);
  return t;
}

}  // namespace detour::sim::testing

#endif  // DETOUR_TESTS_SIM_SIM_TEST_UTIL_H_
