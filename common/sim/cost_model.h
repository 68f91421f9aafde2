// The cost model of one job on one cluster: how long each node needs for a
// stage's forward / backward / loss work on one microbatch, how long an
// activation (or its gradient) takes between two nodes, and how long a
// stage's replicas need to all-reduce their gradients.
//
// Units: seconds and bytes throughout. Node indices are positions in
// ClusterSpec.nodes. See docs/SCHEDULER.md §"Cost model" for the formulas.
#ifndef DETOUR_COMMON_SIM_COST_MODEL_H_
#define DETOUR_COMMON_SIM_COST_MODEL_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "detour/v1/spec.pb.h"

namespace detour::sim {

// Raw tables behind a CostModel. Built by CostModel::Create from specs, or by
// hand in tests (every vector sized to the node / stage count).
struct CostTables {
  std::vector<std::string> node_ids;
  // Activation memory of each node, in microbatches (>= 1).
  std::vector<int> memory_slots;
  // forward_s[node][stage]: forward time of `stage` on `node`, one microbatch.
  std::vector<std::vector<double>> forward_s;
  // backward_s[node][stage]: backward time, one microbatch.
  std::vector<std::vector<double>> backward_s;
  // loss_s[node]: loss + LM head (forward and backward) on a data node.
  std::vector<double> loss_s;
  // latency_s[a][b], bandwidth_bytes_per_s[a][b]: one-way link a -> b.
  std::vector<std::vector<double>> latency_s;
  std::vector<std::vector<double>> bandwidth_bytes_per_s;
  // Bytes of one microbatch's activation (= its gradient) on the wire.
  double activation_bytes = 0;
  // Gradient bytes of each stage's parameters (all-reduce payload).
  std::vector<double> stage_gradient_bytes;
};

// Immutable cost model. Thread-safe: all methods are const and it holds no
// shared mutable state. Copyable; owns its tables.
class CostModel {
 public:
  // Builds the model from specs. Defaults are applied to copies of both
  // specs, then they are validated; errors name the field (e.g. a region
  // pair without a link, a zero bandwidth). `tflops_override` > 0 replaces
  // cluster.compute.tflops.
  static absl::StatusOr<CostModel> Create(const v1::ClusterSpec& cluster, const v1::JobSpec& job,
                                          double tflops_override = 0);

  // Wraps hand-made tables (tests, synthetic studies). INVALID_ARGUMENT when
  // the tables are inconsistent (sizes, non-positive bandwidth, ...).
  static absl::StatusOr<CostModel> FromTables(CostTables tables);

  int num_nodes() const { return static_cast<int>(t_.node_ids.size()); }
  int num_stages() const { return static_cast<int>(t_.stage_gradient_bytes.size()); }
  const std::string& node_id(int node) const { return t_.node_ids[node]; }
  // Index of a node id, or -1.
  int NodeIndex(absl::string_view id) const;
  int memory_slots(int node) const { return t_.memory_slots[node]; }

  double ForwardTime(int node, int stage) const { return t_.forward_s[node][stage]; }
  double BackwardTime(int node, int stage) const { return t_.backward_s[node][stage]; }
  double LossTime(int node) const { return t_.loss_s[node]; }
  double Latency(int from, int to) const { return t_.latency_s[from][to]; }
  double Bandwidth(int from, int to) const { return t_.bandwidth_bytes_per_s[from][to]; }
  // Time the payload occupies the link (bytes / bandwidth), without latency.
  double SerializationTime(int from, int to) const {
    return t_.activation_bytes / t_.bandwidth_bytes_per_s[from][to];
  }
  // Latency + serialization: an uncontended activation transfer.
  double TransferTime(int from, int to) const {
    return Latency(from, to) + SerializationTime(from, to);
  }
  double activation_bytes() const { return t_.activation_bytes; }
  double StageGradientBytes(int stage) const { return t_.stage_gradient_bytes[stage]; }

  // Ring all-reduce of `stage`'s gradients among `nodes`: 2(r-1) steps, each
  // moving bytes/r over the group's slowest link and paying its largest
  // latency. 0 for fewer than two nodes.
  double AllReduceTime(const std::vector<int>& nodes, int stage) const;

  const CostTables& tables() const { return t_; }

 private:
  explicit CostModel(CostTables tables) : t_(std::move(tables)) {}
  CostTables t_;
};

// Model-shape arithmetic used by Create, exposed for tests and docs.
struct ModelCosts {
  // Parameters of one transformer block.
  double params_per_layer = 0;
  // Forward FLOPs of one block for one token (2·params + 2·context·d_model).
  double forward_flops_per_token_per_layer = 0;
  // Extra parameters on stage 0: embedding, final norm, LM head.
  double stage0_extra_params = 0;
};
ModelCosts ComputeModelCosts(const v1::ModelShape& shape);

// Blocks held by each stage: an even split, the remainder going to the last
// stages (stage 0 already carries the embedding, head and loss).
std::vector<int> LayersPerStage(int num_layers, int num_stages);

}  // namespace detour::sim

#endif  // DETOUR_COMMON_SIM_COST_MODEL_H_
