// Shared helpers for the worker/model tests: a small, fast JobSpec and
// tensor comparisons.
#ifndef DETOUR_TESTS_MODEL_MODEL_TEST_UTIL_H_
#define DETOUR_TESTS_MODEL_MODEL_TEST_UTIL_H_

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "common/spec.h"
#include "detour/v1/spec.pb.h"
#include "worker/model/stage.h"

namespace detour::model::testing {

// 4 layers, d_model 32, 4 heads over 2 KV heads (GQA), context 16, 4 stages,
// 4 microbatches of 2 samples. Defaults applied.
inline v1::JobSpec SmallSpec(uint64_t seed = 7) {
  v1::JobSpec spec;
  spec.set_name("test");
  spec.set_seed(seed);
  spec.set_iterations(10);
  auto* m = spec.mutable_model();
  m->set_num_layers(4);
  m->set_d_model(32);
  m->set_num_heads(4);
  m->set_num_kv_heads(2);
  m->set_ffn_dim(64);
  m->set_vocab_size(256);
  m->set_context_length(16);
  auto* p = spec.mutable_pipeline();
  p->set_num_stages(4);
  p->set_microbatches_per_data_node(4);
  p->set_samples_per_microbatch(2);
  ApplyJobDefaults(&spec);
  return spec;
}

inline std::map<std::string, at::Tensor> ToMap(const std::vector<NamedTensor>& v) {
  return std::map<std::string, at::Tensor>(v.begin(), v.end());
}

// Largest absolute element difference; +inf if shapes differ.
inline double MaxAbsDiff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.sizes().equals(b.sizes())) return 1e30;
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace detour::model::testing

#endif  // DETOUR_TESTS_MODEL_MODEL_TEST_UTIL_H_
