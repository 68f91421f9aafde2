// Fuzzes plan and route decoding: an IterationPlan in protobuf wire form (as
// it reaches a worker), every route turned into the planner's index form
// against a fixed cluster, checked by the route validator and, when valid,
// simulated.
#include <cstddef>
#include <cstdint>

#include "common/sim/cost_model.h"
#include "common/sim/event_simulator.h"
#include "common/spec.h"
#include "coordinator/planner/plan_proto.h"
#include "coordinator/planner/route_rules.h"
#include "coordinator/planner/route_validator.h"
#include "detour/v1/plan.pb.h"

namespace {

struct Fixture {
  detour::sim::CostModel cost;
  detour::planner::RouteRules rules;
  detour::sim::StageAssignment assignment;
};

const Fixture& GetFixture() {
  static const Fixture* f = [] {
    detour::v1::ClusterSpec c;
    for (int i = 0; i < 6; ++i) {
      auto* n = c.add_nodes();
      n->set_id("n" + std::to_string(i));
      n->set_region("r");
    }
    detour::v1::JobSpec job;
    job.set_name("fuzz");
    job.mutable_model()->set_preset("tiny");
    job.set_iterations(1);
    auto* p = job.mutable_pipeline();
    p->set_num_stages(3);
    p->set_data_nodes(2);
    p->set_replicas_per_stage(2);
    p->set_microbatches_per_data_node(2);
    p->set_skip_ratio(0.33);
    p->set_max_swaps(1);
    auto spec = *detour::NormalizeJobSpec(job);
    auto* fixture =
        new Fixture{*detour::sim::CostModel::Create(*detour::NormalizeClusterSpec(c), spec),
                    detour::planner::RulesFromPipeline(spec.pipeline()),
                    {}};
    fixture->assignment.stage_nodes = {{0, 1}, {2, 3}, {4, 5}};
    return fixture;
  }();
  return *f;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  detour::v1::IterationPlan plan;
  if (!plan.ParseFromArray(data, static_cast<int>(size))) return 0;
  const Fixture& f = GetFixture();
  detour::sim::Plan decoded;
  decoded.assignment = f.assignment;
  for (const detour::v1::Route& r : plan.routes()) {
    auto route = detour::planner::FromProtoRoute(f.cost, r);
    if (!route.ok()) return 0;
    decoded.routes.push_back(*std::move(route));
  }
  if (!detour::planner::ValidateRoutes(f.cost, decoded, f.rules).ok()) return 0;
  detour::sim::SimOptions options;
  options.record_timeline = false;
  if (!detour::sim::Simulate(f.cost, decoded, options).ok()) __builtin_trap();
  return 0;
}
