// The container format of checkpoint stage files ("DTRSTG01"): a table of
// named tensors as raw little-endian bytes, so that reading a stage file is
// our own bounded parser and never LibTorch's archive importer (which runs
// the TorchScript unpickler and crashes on corrupt input).
//
//   "DTRSTG01"  u32 count
//   count × { u32 name_bytes, name, u8 dtype, u8 ndim, i64 dims[ndim],
//             u64 data_bytes, data }
//   and nothing after the last tensor.
//
// No LibTorch here (checkpoint.cc converts to at::Tensor), so the parser is
// fuzzed in every build. Thread-safe (no state).
#ifndef DETOUR_WORKER_MODEL_STAGE_FILE_H_
#define DETOUR_WORKER_MODEL_STAGE_FILE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace detour::model {

enum class StageDType : uint8_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt64 = 5,
  kInt32 = 6
};

// Bytes per element of a known dtype; 0 for anything else.
size_t StageDTypeBytes(uint8_t dtype);

struct StageTensorRecord {
  std::string name;
  StageDType dtype = StageDType::kFloat32;
  std::vector<int64_t> shape;
  absl::string_view data;  // numel × element bytes; points into the file's bytes
};

struct StageFileLimits {
  static constexpr size_t kMaxTensors = 1 << 20;
  static constexpr size_t kMaxNameBytes = 1024;
  static constexpr size_t kMaxDims = 8;
};

// Serializes the records (their data is copied).
std::string EncodeStageFile(const std::vector<StageTensorRecord>& records);

// Parses `bytes`; the records' data point into `bytes`, which must outlive
// them. DATA_LOSS naming `what`, the record and the problem for anything
// malformed: wrong magic, truncation anywhere, counts, names, ranks or
// shapes out of bounds (shape products checked for overflow), a data size
// that disagrees with the shape, trailing bytes, duplicate names.
absl::StatusOr<std::vector<StageTensorRecord>> DecodeStageFile(absl::string_view bytes,
                                                               const std::string& what);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_STAGE_FILE_H_
