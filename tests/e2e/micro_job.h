// Small jobs for end-to-end training tests: a model small enough that an
// iteration takes well under a second on CPU.
#ifndef DETOUR_TESTS_E2E_MICRO_JOB_H_
#define DETOUR_TESTS_E2E_MICRO_JOB_H_

#include <string>
#include <vector>

#include "common/spec.h"
#include "detour/v1/spec.pb.h"

namespace detour::testing {

inline v1::JobSpec MicroJob(int stages, int data_nodes, int replicas, double skip, int iterations) {
  v1::JobSpec spec;
  spec.set_name("e2e");
  v1::ModelShape* m = spec.mutable_model();
  m->set_num_layers(stages);
  m->set_d_model(32);
  m->set_num_heads(2);
  m->set_ffn_dim(64);
  m->set_context_length(16);
  v1::PipelineSpec* p = spec.mutable_pipeline();
  p->set_num_stages(stages);
  p->set_data_nodes(data_nodes);
  p->set_replicas_per_stage(replicas);
  p->set_microbatches_per_data_node(2);
  p->set_samples_per_microbatch(2);
  p->set_skip_ratio(skip);
  if (skip == 0) p->set_scheduler(v1::SCHEDULER_FULL);
  spec.mutable_optimizer()->mutable_adamw()->set_lr(3e-3);
  spec.set_iterations(iterations);
  spec.set_seed(11);
  return *NormalizeJobSpec(spec);
}

// One LibTorch thread per worker: several workers share the test machine.
inline std::vector<std::string> WorkerFlags() { return {"--torch_threads=1"}; }

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_MICRO_JOB_H_
