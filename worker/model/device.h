// Whether the LibTorch this program runs on can compute on a --device: a
// worker checks at start-up, so `--device=cuda` with a LibTorch built without
// CUDA (Debian's is) refuses to start instead of failing its first job.
// Stateless; thread-safe.
#ifndef DETOUR_WORKER_MODEL_DEVICE_H_
#define DETOUR_WORKER_MODEL_DEVICE_H_

#include <string>

#include "absl/status/status.h"

namespace detour::model {

// OK for "cpu", and for "cuda" when LibTorch sees a CUDA device. Otherwise
// FAILED_PRECONDITION when this LibTorch has no CUDA support at all (a
// setting that a restart cannot mend), UNAVAILABLE when it has but no GPU is
// visible to the process (driver not loaded yet, CUDA_VISIBLE_DEVICES, the
// device cgroup, no GPU requested by the pod); INVALID_ARGUMENT for any
// other name.
absl::Status CheckDevice(const std::string& device);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_DEVICE_H_
