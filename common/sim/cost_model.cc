#include "common/sim/cost_model.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/region_links.h"
#include "common/spec.h"
#include "common/stage_layers.h"
#include "common/status.h"

namespace detour::sim {
namespace {

constexpr double kGiga = 1e9;
constexpr double kTera = 1e12;
constexpr double kMs = 1e-3;

}  // namespace

ModelCosts ComputeModelCosts(const v1::ModelShape& shape) {
  const double d = shape.d_model();
  const double heads = std::max<uint32_t>(1, shape.num_heads());
  const double kv_heads = shape.num_kv_heads() > 0 ? shape.num_kv_heads() : heads;
  const double kv_dim = d * kv_heads / heads;
  const double ffn = shape.ffn_dim();
  ModelCosts c;
  // q and o are d×d, k and v are d×kv_dim, SwiGLU has three d×ffn matrices,
  // plus two RMSNorm weight vectors.
  c.params_per_layer = 2 * d * d + 2 * d * kv_dim + 3 * d * ffn + 2 * d;
  c.forward_flops_per_token_per_layer = 2 * c.params_per_layer + 2.0 * shape.context_length() * d;
  c.stage0_extra_params = 2.0 * shape.vocab_size() * d + d;
  return c;
}

std::vector<int> LayersPerStage(int num_layers, int num_stages) {
  std::vector<int> layers;
  for (int s = 0; s < num_stages; ++s) {
    auto span = StageLayers(num_layers, num_stages, s);
    layers.push_back(span.ok() ? span->size() : 0);
  }
  return layers;
}

int CostModel::NodeIndex(absl::string_view id) const {
  for (int i = 0; i < num_nodes(); ++i) {
    if (t_.node_ids[i] == id) return i;
  }
  return -1;
}

double CostModel::AllReduceTime(const std::vector<int>& nodes, int stage) const {
  const int r = static_cast<int>(nodes.size());
  if (r < 2) return 0;
  double max_latency = 0;
  double min_bandwidth = 0;
  bool first = true;
  for (int a : nodes) {
    for (int b : nodes) {
      if (a == b) continue;
      max_latency = std::max(max_latency, Latency(a, b));
      min_bandwidth = first ? Bandwidth(a, b) : std::min(min_bandwidth, Bandwidth(a, b));
      first = false;
    }
  }
  const double chunk = StageGradientBytes(stage) / r;
  return 2.0 * (r - 1) * (max_latency + chunk / min_bandwidth);
}

absl::StatusOr<CostModel> CostModel::FromTables(CostTables t) {
  const size_t n = t.node_ids.size();
  const size_t s = t.stage_gradient_bytes.size();
  if (n == 0) return absl::InvalidArgumentError("cost tables: no nodes");
  if (s == 0) return absl::InvalidArgumentError("cost tables: no stages");
  if (t.memory_slots.size() != n || t.forward_s.size() != n || t.backward_s.size() != n ||
      t.loss_s.size() != n || t.latency_s.size() != n || t.bandwidth_bytes_per_s.size() != n) {
    return absl::InvalidArgumentError("cost tables: per-node tables must have one row per node");
  }
  for (size_t a = 0; a < n; ++a) {
    if (t.memory_slots[a] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("cost tables: node ", t.node_ids[a], " has no memory slots"));
    }
    if (t.forward_s[a].size() != s || t.backward_s[a].size() != s) {
      return absl::InvalidArgumentError("cost tables: compute rows need one entry per stage");
    }
    if (t.latency_s[a].size() != n || t.bandwidth_bytes_per_s[a].size() != n) {
      return absl::InvalidArgumentError("cost tables: link tables must be square");
    }
    for (size_t b = 0; b < n; ++b) {
      if (a == b) continue;
      if (!(t.bandwidth_bytes_per_s[a][b] > 0) || !std::isfinite(t.bandwidth_bytes_per_s[a][b])) {
        return absl::InvalidArgumentError(absl::StrCat("cost tables: bandwidth ", t.node_ids[a],
                                                       " -> ", t.node_ids[b], " must be > 0"));
      }
      if (!(t.latency_s[a][b] >= 0)) {
        return absl::InvalidArgumentError(absl::StrCat("cost tables: latency ", t.node_ids[a],
                                                       " -> ", t.node_ids[b], " must be >= 0"));
      }
    }
  }
  return CostModel(std::move(t));
}

absl::StatusOr<CostModel> CostModel::Create(const v1::ClusterSpec& cluster_in,
                                            const v1::JobSpec& job_in, double tflops_override) {
  ASSIGN_OR_RETURN(v1::ClusterSpec cluster, NormalizeClusterSpec(cluster_in));
  ASSIGN_OR_RETURN(v1::JobSpec job, NormalizeJobSpec(job_in));
  const v1::ComputeModel& cm = cluster.compute();
  const double tflops = tflops_override > 0 ? tflops_override : cm.tflops();
  if (!(tflops > 0)) {
    return absl::InvalidArgumentError(absl::StrFormat("compute.tflops: %g must be > 0", tflops));
  }
  const v1::PipelineSpec& p = job.pipeline();
  const int num_stages = static_cast<int>(p.num_stages());
  if (num_stages < 1 || static_cast<uint32_t>(num_stages) > job.model().num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("pipeline.num_stages: %d must be in [1, model.num_layers=%d]", num_stages,
                        job.model().num_layers()));
  }

  // Region links, both directions.
  for (int i = 0; i < cluster.links_size(); ++i) {
    const v1::RegionLink& l = cluster.links(i);
    if (!(l.bandwidth_gbytes_per_s() > 0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("links[%d].bandwidth_gbytes_per_s: %g (%s-%s) must be > 0", i,
                          l.bandwidth_gbytes_per_s(), l.region_a(), l.region_b()));
    }
    if (!(l.latency_ms() >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("links[%d].latency_ms: %g (%s-%s) must be >= 0", i, l.latency_ms(),
                          l.region_a(), l.region_b()));
    }
  }
  const RegionLinks links(cluster);
  if (!(cluster.intra_region_bandwidth_gbytes_per_s() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("intra_region_bandwidth_gbytes_per_s: %g must be > 0",
                        cluster.intra_region_bandwidth_gbytes_per_s()));
  }

  const ModelCosts mc = ComputeModelCosts(job.model());
  const std::vector<int> layers = LayersPerStage(job.model().num_layers(), num_stages);
  const double tokens =
      static_cast<double>(p.samples_per_microbatch()) * job.model().context_length();

  CostTables t;
  const int n = cluster.nodes_size();
  t.activation_bytes = tokens * job.model().d_model() * cm.activation_bytes();
  for (int s = 0; s < num_stages; ++s) {
    double params = layers[s] * mc.params_per_layer + (s == 0 ? mc.stage0_extra_params : 0);
    t.stage_gradient_bytes.push_back(params * cm.gradient_bytes());
  }
  t.latency_s.assign(n, std::vector<double>(n, 0));
  t.bandwidth_bytes_per_s.assign(n, std::vector<double>(n, 0));
  for (int a = 0; a < n; ++a) {
    const v1::NodeSpec& na = cluster.nodes(a);
    if (!(na.speed() > 0)) {
      return absl::InvalidArgumentError(
          absl::StrFormat("nodes[%d].speed: %g (%s) must be > 0", a, na.speed(), na.id()));
    }
    t.node_ids.push_back(na.id());
    t.memory_slots.push_back(na.memory_slots() > 0 ? static_cast<int>(na.memory_slots())
                                                   : static_cast<int>(p.memory_slots()));
    std::vector<double> fwd(num_stages), bwd(num_stages);
    for (int s = 0; s < num_stages; ++s) {
      fwd[s] =
          layers[s] * mc.forward_flops_per_token_per_layer * tokens / (tflops * kTera * na.speed());
      bwd[s] = fwd[s] * cm.backward_factor();
    }
    t.loss_s.push_back(fwd[0] * cm.loss_factor());
    t.forward_s.push_back(std::move(fwd));
    t.backward_s.push_back(std::move(bwd));
    for (int b = 0; b < n; ++b) {
      if (a == b) continue;
      const v1::NodeSpec& nb = cluster.nodes(b);
      // The fixed per-transfer overhead behaves like latency: it delays the
      // arrival and occupies no link.
      const double overhead = cluster.transfer_overhead_ms() * kMs;
      const std::optional<RegionLinkFigures> link = links.Between(na.region(), nb.region());
      if (!link.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrFormat("links: no link between regions %s (node %s) and %s (node %s)",
                            na.region(), na.id(), nb.region(), nb.id()));
      }
      t.latency_s[a][b] = link->latency_ms * kMs + overhead;
      t.bandwidth_bytes_per_s[a][b] = link->bandwidth_gbytes_per_s * kGiga;
    }
  }
  return FromTables(std::move(t));
}

}  // namespace detour::sim
