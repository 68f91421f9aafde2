// Fuzzes the stage-file container parser (worker/model/stage_file.h; no
// LibTorch, so it runs under ASan/UBSan): arbitrary bytes. Nothing may
// crash; an accepted file must have consistent records and encode back to
// exactly the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "worker/model/stage_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  auto records = detour::model::DecodeStageFile(bytes, "fuzz/stage-0.bin");
  if (!records.ok()) return 0;
  for (const auto& r : *records) {
    uint64_t numel = 1;
    for (int64_t d : r.shape) {
      if (d < 0) std::abort();
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * detour::model::StageDTypeBytes(static_cast<uint8_t>(r.dtype)) != r.data.size()) {
      std::abort();
    }
  }
  if (detour::model::EncodeStageFile(*records) != bytes) std::abort();
  return 0;
}
