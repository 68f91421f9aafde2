#include "worker/model/checkpoint_v1.h"

#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/serialize/input-archive.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/model/checkpoint.h"
#include "worker/model/torch_status.h"

namespace detour::model {
namespace {

constexpr char kTensorsKey[] = "tensors";  // v1's only archive entry

}  // namespace

absl::StatusOr<std::string> ConvertV1StageFile(const std::string& v1_bytes,
                                               const std::string& what) {
  // GuardTorch turns LibTorch's exceptions into a Status; a crash inside the
  // reader is the caller's child process dying.
  auto tensors = GuardTorch(
      absl::StrCat("reading the LibTorch archive ", what),
      [&]() -> absl::StatusOr<std::vector<std::pair<std::string, at::Tensor>>> {
        torch::serialize::InputArchive archive;
        archive.load_from(v1_bytes.data(), v1_bytes.size(), at::Device(at::kCPU));
        c10::IValue value;
        if (!archive.try_read(kTensorsKey, value) || !value.isGenericDict()) {
          return absl::DataLossError(
              absl::StrCat(what, ": the archive holds no \"tensors\" dict (not a v1 stage file)"));
        }
        std::vector<std::pair<std::string, at::Tensor>> out;
        for (const auto& item : value.toGenericDict()) {
          if (!item.key().isString() || !item.value().isTensor()) {
            return absl::DataLossError(absl::StrCat(
                what, ": the \"tensors\" dict has an entry that is not string → tensor (",
                item.key().tagKind(), " → ", item.value().tagKind(), ")"));
          }
          const at::Tensor& t = item.value().toTensor();
          if (!t.defined() || t.layout() != at::kStrided) {
            return absl::DataLossError(absl::StrCat(what, ": tensor ", item.key().toStringRef(),
                                                    " is undefined or not dense"));
          }
          out.emplace_back(item.key().toStringRef(), t.detach().to(at::kCPU).contiguous());
        }
        return out;
      });
  if (!tensors.ok()) {
    // LibTorch's parse errors (c10::Error of any kind) mean the bytes are not
    // an archive it can read: corrupt data. Running out of memory stays what
    // it is.
    if (tensors.status().code() == absl::StatusCode::kResourceExhausted) return tensors.status();
    return absl::DataLossError(tensors.status().message());
  }
  auto bytes = EncodeStageTensors(*tensors);
  if (!bytes.ok()) return Annotate(bytes.status(), what);
  return bytes;
}

}  // namespace detour::model
