// Our own reader and writer of the safetensors format (Hugging Face's tensor
// container; what transformers, vLLM and llama.cpp's converter read):
//
//   u64 N (little-endian)   N bytes of JSON header   byte buffer
//   header: {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [b, e]},
//            ..., "__metadata__": {"<key>": "<string>", ...}}
//
// Offsets are relative to the byte buffer; tensors are row-major,
// little-endian. No LibTorch here (hf_import.h converts to at::Tensor), so the
// parser is fuzzed in every build. A file is input from outside: the header
// length is bounded (SafetensorsLimits), the JSON parsed strictly and bounded
// (common/json.h), only known dtypes and fields are accepted, shape products
// are checked for overflow, and the tensors must tile the byte buffer exactly
// (in offset order, no gaps, no overlaps, nothing after the last), each with
// exactly dtype × shape bytes. Every failure is INVALID_ARGUMENT naming the
// file and, where there is one, the tensor.
// Thread-safe: functions have no state; a SafetensorsFile is immutable
// after Open and may be read from any thread.
#ifndef DETOUR_WORKER_MODEL_SAFETENSORS_H_
#define DETOUR_WORKER_MODEL_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace detour::model {

enum class SafetensorsDType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64
};

// "F32", "BF16", ... as the format spells them.
absl::string_view SafetensorsDTypeName(SafetensorsDType dtype);
size_t SafetensorsDTypeBytes(SafetensorsDType dtype);
// INVALID_ARGUMENT for a name the format does not define (or we do not read:
// the 8-bit float types).
absl::StatusOr<SafetensorsDType> SafetensorsDTypeFromName(absl::string_view name);

struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;  // [] is a scalar (one element)
  absl::string_view data;      // the tensor's bytes; points into the file
  uint64_t numel() const;
};

struct SafetensorsLimits {
  static constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;
  static constexpr size_t kMaxTensors = size_t{1} << 18;
  static constexpr size_t kMaxNameBytes = 1024;
  static constexpr size_t kMaxDims = 8;
  static constexpr size_t kMaxMetadataEntries = 1024;
  static constexpr size_t kMaxMetadataBytes = size_t{1} << 20;  // per value
};

// A parsed file: tensors in the order of their data (offset order), the
// string metadata, and where the byte buffer starts.
struct SafetensorsContents {
  std::vector<SafetensorsTensor> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t header_bytes = 0;  // N

  // The tensor named `name`, or null.
  const SafetensorsTensor* Find(absl::string_view name) const;

 private:
  friend absl::StatusOr<SafetensorsContents> ParseSafetensors(absl::string_view,
                                                              const std::string&);
  std::map<std::string, size_t, std::less<>> index_;
};

// Parses a whole file's bytes; the tensors' data point into `bytes`, which
// must outlive the result. `what` (the path) starts every error message.
absl::StatusOr<SafetensorsContents> ParseSafetensors(absl::string_view bytes,
                                                     const std::string& what);

// The bytes of a file holding `tensors` (laid out in the given order) and
// `metadata`. The header is padded with spaces so the byte buffer starts at
// a multiple of 8, as the reference implementation does. INVALID_ARGUMENT
// for an empty, too long or duplicate name, the name "__metadata__", a
// negative dimension, or data whose size is not dtype × shape.
absl::StatusOr<std::string> EncodeSafetensors(const std::vector<SafetensorsTensor>& tensors,
                                              const std::map<std::string, std::string>& metadata);

// EncodeSafetensors, written to `path` crash-safely (common/files.h:
// temporary file, fsync, rename, fsync of the directory).
absl::Status WriteSafetensorsFile(const std::string& path,
                                  const std::vector<SafetensorsTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata);

// A safetensors file mapped read-only into memory and parsed; tensors' data
// point into the mapping, so a large file costs address space, not memory,
// and only the tensors read are paged in. The file must not be truncated
// while open (as with any mapping). Immutable, thread-safe; not copyable.
class SafetensorsFile {
 public:
  // NOT_FOUND for a missing file, INVALID_ARGUMENT for anything that is not
  // a well-formed safetensors file (see above).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsContents& contents() const { return contents_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  SafetensorsContents contents_;
};

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_SAFETENSORS_H_
