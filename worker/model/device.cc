#include "worker/model/device.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include "absl/strings/str_cat.h"

namespace detour::model {

absl::Status CheckDevice(const std::string& device) {
  if (device == "cpu") return absl::OkStatus();
  if (device != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device: \"", device, "\" is not cpu or cuda"));
  }
  // LibTorch's CUDA library registers its hooks under this name when it is
  // loaded; without it the hooks are a stub that answers "no GPU".
  if (!at::CUDAHooksRegistry()->Has("CUDAHooks")) {
    return absl::FailedPreconditionError(
        "--device=cuda: this worker's LibTorch was built without CUDA (Debian's libtorch is "
        "CPU-only); run with --device=cpu, or build detour against a CUDA-enabled LibTorch "
        "(docs/OPERATIONS.md §GPUs)");
  }
  if (!at::detail::getCUDAHooks().hasCUDA()) {
    return absl::UnavailableError(
        "--device=cuda: LibTorch has CUDA but sees no GPU: is the NVIDIA driver loaded, and is a "
        "GPU visible to this process (CUDA_VISIBLE_DEVICES, the device cgroup, the pod's "
        "nvidia.com/gpu request)?");
  }
  return absl::OkStatus();
}

}  // namespace detour::model
