#include "worker/model/stage_file.h"

#include <cstring>
#include <limits>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace detour::model {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "stage files are little-endian; a big-endian host would need byte swaps");

constexpr absl::string_view kMagic("DTRSTG01", 8);

template <typename T>
void Put(T value, std::string* out) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out->append(bytes, sizeof(T));
}

// Reads fixed-size fields from the front of `rest`; false when too short.
class Cursor {
 public:
  explicit Cursor(absl::string_view bytes) : rest_(bytes) {}
  template <typename T>
  bool Get(T* out) {
    if (rest_.size() < sizeof(T)) return false;
    std::memcpy(out, rest_.data(), sizeof(T));
    rest_.remove_prefix(sizeof(T));
    return true;
  }
  bool Take(uint64_t n, absl::string_view* out) {
    if (rest_.size() < n) return false;
    *out = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return true;
  }
  size_t left() const { return rest_.size(); }

 private:
  absl::string_view rest_;
};

}  // namespace

size_t StageDTypeBytes(uint8_t dtype) {
  switch (static_cast<StageDType>(dtype)) {
    case StageDType::kFloat32: return 4;
    case StageDType::kFloat64: return 8;
    case StageDType::kFloat16: return 2;
    case StageDType::kBFloat16: return 2;
    case StageDType::kInt64: return 8;
    case StageDType::kInt32: return 4;
  }
  return 0;
}

std::string EncodeStageFile(const std::vector<StageTensorRecord>& records) {
  size_t total = kMagic.size() + 4;
  for (const auto& r : records)
    total += 4 + r.name.size() + 2 + 8 * r.shape.size() + 8 + r.data.size();
  std::string out;
  out.reserve(total);
  out.append(kMagic.data(), kMagic.size());
  Put<uint32_t>(static_cast<uint32_t>(records.size()), &out);
  for (const auto& r : records) {
    Put<uint32_t>(static_cast<uint32_t>(r.name.size()), &out);
    out += r.name;
    Put<uint8_t>(static_cast<uint8_t>(r.dtype), &out);
    Put<uint8_t>(static_cast<uint8_t>(r.shape.size()), &out);
    for (int64_t d : r.shape) Put<int64_t>(d, &out);
    Put<uint64_t>(r.data.size(), &out);
    out.append(r.data.data(), r.data.size());
  }
  return out;
}

absl::StatusOr<std::vector<StageTensorRecord>> DecodeStageFile(absl::string_view bytes,
                                                               const std::string& what) {
  auto bad = [&](const std::string& where, const std::string& why) {
    return absl::DataLossError(absl::StrCat(what, ": ", where, where.empty() ? "" : ": ", why));
  };
  using L = StageFileLimits;
  if (bytes.size() < kMagic.size() || bytes.substr(0, kMagic.size()) != kMagic) {
    return bad("", "not a detour stage file (no DTRSTG01 header)");
  }
  Cursor in(bytes.substr(kMagic.size()));
  uint32_t count = 0;
  if (!in.Get(&count)) return bad("", "truncated before the tensor count");
  // Every record takes at least 14 bytes: a count beyond that is a lie.
  if (count > L::kMaxTensors || count > in.left() / 14) {
    return bad("", absl::StrCat(count, " tensors announced in ", bytes.size(), " bytes"));
  }
  std::vector<StageTensorRecord> records;
  records.reserve(count);
  std::set<absl::string_view> names;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string where = absl::StrCat("tensor ", i);
    StageTensorRecord r;
    uint32_t name_bytes = 0;
    absl::string_view name;
    if (!in.Get(&name_bytes)) return bad(where, "truncated");
    if (name_bytes == 0 || name_bytes > L::kMaxNameBytes) {
      return bad(where, absl::StrCat("name of ", name_bytes, " bytes"));
    }
    if (!in.Take(name_bytes, &name)) return bad(where, "truncated in its name");
    r.name = std::string(name);
    const std::string named = absl::StrCat(where, " (", absl::CHexEscape(r.name), ")");
    uint8_t dtype = 0, ndim = 0;
    if (!in.Get(&dtype) || !in.Get(&ndim)) return bad(named, "truncated");
    const size_t element = StageDTypeBytes(dtype);
    if (element == 0) return bad(named, absl::StrCat("unknown dtype ", int{dtype}));
    if (ndim > L::kMaxDims) return bad(named, absl::StrCat(int{ndim}, " dimensions"));
    r.dtype = static_cast<StageDType>(dtype);
    uint64_t numel = 1;
    for (uint8_t d = 0; d < ndim; ++d) {
      int64_t dim = 0;
      if (!in.Get(&dim)) return bad(named, "truncated in its shape");
      if (dim < 0) return bad(named, absl::StrCat("negative dimension ", dim));
      const uint64_t u = static_cast<uint64_t>(dim);
      if (u != 0 && numel > std::numeric_limits<uint64_t>::max() / element / u) {
        return bad(named, "shape overflows");
      }
      numel *= u;
      r.shape.push_back(dim);
    }
    uint64_t data_bytes = 0;
    if (!in.Get(&data_bytes)) return bad(named, "truncated before its data size");
    if (data_bytes != numel * element) {
      return bad(named, absl::StrCat(data_bytes, " data bytes for ", numel, " elements of ",
                                     element, " bytes"));
    }
    if (!in.Take(data_bytes, &r.data)) {
      return bad(named, absl::StrCat("truncated: ", data_bytes, " data bytes announced, ",
                                     in.left(), " left"));
    }
    records.push_back(std::move(r));
    if (!names.insert(records.back().name).second) return bad(named, "appears twice");
  }
  if (in.left() != 0) return bad("", absl::StrCat(in.left(), " bytes after the last tensor"));
  return records;
}

}  // namespace detour::model
