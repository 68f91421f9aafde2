// The smallest valid job for the coordinator's store and backend tests: the
// tiny model, ten iterations, normalized as a submitted job would be.
#ifndef DETOUR_TESTS_COORDINATOR_TINY_SPEC_H_
#define DETOUR_TESTS_COORDINATOR_TINY_SPEC_H_

#include <string>

#include "common/spec.h"
#include "detour/v1/spec.pb.h"

namespace detour {

inline v1::JobSpec TinySpec(const std::string& name) {
  v1::JobSpec spec;
  spec.set_name(name);
  spec.mutable_model()->set_preset("tiny");
  spec.set_iterations(10);
  return *NormalizeJobSpec(spec);
}

}  // namespace detour

#endif  // DETOUR_TESTS_COORDINATOR_TINY_SPEC_H_
