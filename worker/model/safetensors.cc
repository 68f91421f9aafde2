#include "worker/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/json.h"
#include "common/status.h"

namespace detour::model {
namespace {

constexpr char kMetadataKey[] = "__metadata__";

struct DTypeInfo {
  SafetensorsDType dtype;
  const char* name;
  size_t bytes;
};
constexpr DTypeInfo kDTypes[] = {
    {SafetensorsDType::kBool, "BOOL", 1}, {SafetensorsDType::kU8, "U8", 1},
    {SafetensorsDType::kI8, "I8", 1},     {SafetensorsDType::kI16, "I16", 2},
    {SafetensorsDType::kU16, "U16", 2},   {SafetensorsDType::kF16, "F16", 2},
    {SafetensorsDType::kBF16, "BF16", 2}, {SafetensorsDType::kI32, "I32", 4},
    {SafetensorsDType::kU32, "U32", 4},   {SafetensorsDType::kF32, "F32", 4},
    {SafetensorsDType::kF64, "F64", 8},   {SafetensorsDType::kI64, "I64", 8},
    {SafetensorsDType::kU64, "U64", 8},
};

const DTypeInfo& Info(SafetensorsDType dtype) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.dtype == dtype) return d;
  }
  return kDTypes[0];  // unreachable: every enumerator is in the table
}

// Names in messages: escaped and cut, since they come from the file.
std::string Shown(absl::string_view name) {
  std::string s = absl::CEscape(name.substr(0, 200));
  if (name.size() > 200) s += "...";
  return s;
}

uint64_t ReadLe64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// Parses one tensor entry of the header; offsets are checked against the
// buffer here, the tiling afterwards.
absl::Status ParseEntry(const std::string& what, const std::string& name, const JsonValue& v,
                        uint64_t buffer_bytes, SafetensorsTensor* t, uint64_t* begin,
                        uint64_t* end) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tensor \"", Shown(name), "\": ", why));
  };
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": a tensor has an empty name"));
  }
  if (name.size() > SafetensorsLimits::kMaxNameBytes) {
    return bad(absl::StrCat("name is ", name.size(), " bytes, more than ",
                            SafetensorsLimits::kMaxNameBytes));
  }
  if (!v.is_object())
    return bad(absl::StrCat("is ", JsonValue::KindName(v.kind()), ", not an object"));
  for (const std::string& key : v.keys()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets") {
      return bad(absl::StrCat("unknown field \"", Shown(key), "\""));
    }
  }
  t->name = name;
  const JsonValue* dtype = v.Find("dtype");
  if (dtype == nullptr || !dtype->is_string()) return bad("missing or non-string dtype");
  auto dt = SafetensorsDTypeFromName(dtype->string_value());
  if (!dt.ok()) return bad(dt.status().message());
  t->dtype = *dt;

  const JsonValue* shape = v.Find("shape");
  if (shape == nullptr || !shape->is_array()) return bad("missing or non-array shape");
  if (shape->items().size() > SafetensorsLimits::kMaxDims) {
    return bad(absl::StrCat("shape has ", shape->items().size(), " dimensions, more than ",
                            SafetensorsLimits::kMaxDims));
  }
  // numel × element size must fit the buffer; anything larger is refused
  // before it can overflow.
  for (size_t i = 0; i < shape->items().size(); ++i) {
    uint64_t d = 0;
    if (!shape->items()[i].AsUint64(&d) || d > static_cast<uint64_t>(INT64_MAX)) {
      return bad(absl::StrCat("shape[", i, "] is not a non-negative integer"));
    }
    t->shape.push_back(static_cast<int64_t>(d));
  }
  // numel × element size must fit the buffer; anything larger is refused
  // before the product can overflow.
  uint64_t bytes = Info(t->dtype).bytes;
  if (std::find(t->shape.begin(), t->shape.end(), 0) != t->shape.end()) {
    bytes = 0;
  } else {
    for (int64_t d : t->shape) {
      if (static_cast<uint64_t>(d) > buffer_bytes / bytes) {
        return bad(absl::StrCat(Info(t->dtype).name, " [", absl::StrJoin(t->shape, ", "),
                                "] needs more bytes than the buffer's ", buffer_bytes));
      }
      bytes *= static_cast<uint64_t>(d);
    }
  }

  const JsonValue* offsets = v.Find("data_offsets");
  if (offsets == nullptr || !offsets->is_array() || offsets->items().size() != 2 ||
      !offsets->items()[0].AsUint64(begin) || !offsets->items()[1].AsUint64(end)) {
    return bad("data_offsets is not [begin, end] with non-negative integers");
  }
  if (*begin > *end)
    return bad(absl::StrCat("data_offsets [", *begin, ", ", *end, "] is reversed"));
  if (*end > buffer_bytes) {
    return bad(absl::StrCat("data_offsets [", *begin, ", ", *end,
                            "] reach past the byte buffer of ", buffer_bytes, " bytes"));
  }
  if (*end - *begin != bytes) {
    return bad(absl::StrCat("holds ", *end - *begin, " bytes but ", Info(t->dtype).name, " [",
                            absl::StrJoin(t->shape, ", "), "] needs ", bytes));
  }
  return absl::OkStatus();
}

absl::Status ParseMetadata(const std::string& what, const JsonValue& v,
                           std::map<std::string, std::string>* out) {
  if (!v.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": __metadata__ is not an object"));
  }
  if (v.keys().size() > SafetensorsLimits::kMaxMetadataEntries) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": __metadata__ has ", v.keys().size(),
                                                   " entries, more than ",
                                                   SafetensorsLimits::kMaxMetadataEntries));
  }
  for (size_t i = 0; i < v.keys().size(); ++i) {
    const JsonValue& item = v.items()[i];
    if (!item.is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": __metadata__ \"", Shown(v.keys()[i]), "\" is not a string"));
    }
    if (item.string_value().size() > SafetensorsLimits::kMaxMetadataBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": __metadata__ \"", Shown(v.keys()[i]), "\" is longer than ",
                       SafetensorsLimits::kMaxMetadataBytes, " bytes"));
    }
    (*out)[v.keys()[i]] = item.string_value();
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view SafetensorsDTypeName(SafetensorsDType dtype) { return Info(dtype).name; }

size_t SafetensorsDTypeBytes(SafetensorsDType dtype) { return Info(dtype).bytes; }

absl::StatusOr<SafetensorsDType> SafetensorsDTypeFromName(absl::string_view name) {
  for (const DTypeInfo& d : kDTypes) {
    if (name == d.name) return d.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype \"", Shown(name), "\""));
}

uint64_t SafetensorsTensor::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

const SafetensorsTensor* SafetensorsContents::Find(absl::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors[it->second];
}

absl::StatusOr<SafetensorsContents> ParseSafetensors(absl::string_view bytes,
                                                     const std::string& what) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  if (bytes.size() < 8) {
    return bad(absl::StrCat("is ", bytes.size(), " bytes, too short for the 8-byte header length"));
  }
  const uint64_t n = ReadLe64(bytes.data());
  if (n > SafetensorsLimits::kMaxHeaderBytes) {
    return bad(absl::StrCat("header length ", n, " is more than the limit of ",
                            SafetensorsLimits::kMaxHeaderBytes));
  }
  if (n > bytes.size() - 8) {
    return bad(absl::StrCat("header length ", n, " reaches past the end of the file (",
                            bytes.size(), " bytes)"));
  }
  const absl::string_view header = bytes.substr(8, n);
  if (header.empty() || header[0] != '{') return bad("header does not start with '{'");
  JsonLimits limits;
  limits.max_bytes = SafetensorsLimits::kMaxHeaderBytes;
  limits.max_depth = 4;  // root → tensor → shape / offsets
  auto root = ParseJson(header, limits);
  if (!root.ok()) return bad(absl::StrCat("header: ", root.status().message()));
  if (!root->is_object()) return bad("header is not a JSON object");

  SafetensorsContents out;
  out.header_bytes = n;
  const uint64_t buffer_bytes = bytes.size() - 8 - n;
  const char* buffer = bytes.data() + 8 + n;
  struct Span {
    uint64_t begin, end;
    size_t index;
  };
  std::vector<Span> spans;
  std::vector<SafetensorsTensor> tensors;
  for (size_t i = 0; i < root->keys().size(); ++i) {
    const std::string& name = root->keys()[i];
    if (name == kMetadataKey) {
      RETURN_IF_ERROR(ParseMetadata(what, root->items()[i], &out.metadata));
      continue;
    }
    if (tensors.size() >= SafetensorsLimits::kMaxTensors) {
      return bad(absl::StrCat("more than ", SafetensorsLimits::kMaxTensors, " tensors"));
    }
    SafetensorsTensor t;
    uint64_t begin = 0, end = 0;
    RETURN_IF_ERROR(ParseEntry(what, name, root->items()[i], buffer_bytes, &t, &begin, &end));
    t.data = absl::string_view(buffer + begin, end - begin);
    spans.push_back({begin, end, tensors.size()});
    tensors.push_back(std::move(t));
  }
  // The tensors must tile the buffer: sorted by offset, each starts where
  // the previous ended, the last ends at the end of the file.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  const std::string* previous = nullptr;
  for (const Span& s : spans) {
    const std::string& name = tensors[s.index].name;
    if (s.begin != at) {
      return bad(absl::StrCat(
          "tensor \"", Shown(name), "\" starts at byte ", s.begin, " of the buffer but ",
          previous == nullptr ? std::string("the buffer starts at 0")
                              : absl::StrCat("tensor \"", Shown(*previous), "\" ends at ", at),
          s.begin < at ? " (overlap)" : " (gap)"));
    }
    at = s.end;
    previous = &name;
  }
  if (at != buffer_bytes) {
    return bad(absl::StrCat("the tensors cover ", at, " bytes of the ", buffer_bytes,
                            "-byte buffer (trailing bytes)"));
  }
  for (const Span& s : spans) {
    out.index_.emplace(tensors[s.index].name, out.tensors.size());
    out.tensors.push_back(std::move(tensors[s.index]));
  }
  return out;
}

absl::StatusOr<std::string> EncodeSafetensors(const std::vector<SafetensorsTensor>& tensors,
                                              const std::map<std::string, std::string>& metadata) {
  std::set<absl::string_view> names;
  std::vector<std::string> entries;
  if (!metadata.empty()) {
    std::vector<std::string> kv;
    for (const auto& [k, v] : metadata) kv.push_back(absl::StrCat(JsonQuote(k), ":", JsonQuote(v)));
    entries.push_back(absl::StrCat("\"", kMetadataKey, "\":{", absl::StrJoin(kv, ","), "}"));
  }
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor \"", Shown(t.name), "\": ", why));
    };
    if (t.name.empty() || t.name.size() > SafetensorsLimits::kMaxNameBytes) {
      return bad("name is empty or too long");
    }
    if (t.name == kMetadataKey) return bad("name is reserved");
    if (!names.insert(t.name).second) return bad("duplicate name");
    if (t.shape.size() > SafetensorsLimits::kMaxDims) return bad("too many dimensions");
    uint64_t bytes = SafetensorsDTypeBytes(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) return bad("negative dimension");
      bytes *= static_cast<uint64_t>(d);
    }
    if (bytes != t.data.size()) {
      return bad(absl::StrCat("has ", t.data.size(), " bytes of data for ", bytes));
    }
    entries.push_back(absl::StrCat(
        JsonQuote(t.name), ":{\"dtype\":\"", SafetensorsDTypeName(t.dtype), "\",\"shape\":[",
        absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",", offset + bytes, "]}"));
    offset += bytes;
  }
  std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > SafetensorsLimits::kMaxHeaderBytes) {
    return absl::InvalidArgumentError("safetensors: header larger than the format's limit");
  }
  std::string out;
  out.reserve(8 + header.size() + offset);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) {
    out.push_back(static_cast<char>(n & 0xFF));
    n >>= 8;
  }
  out += header;
  for (const SafetensorsTensor& t : tensors) out.append(t.data.data(), t.data.size());
  return out;
}

absl::Status WriteSafetensorsFile(const std::string& path,
                                  const std::vector<SafetensorsTensor>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(std::string bytes, EncodeSafetensors(tensors, metadata));
  return WriteFileAtomically(path, bytes);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("cannot open ", path, ": ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::UnavailableError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_bytes_ = static_cast<size_t>(st.st_size);
  if (f->map_bytes_ > 0) {
    void* p = ::mmap(nullptr, f->map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot map ", path, ": ", std::strerror(err)));
    }
    f->map_ = p;
  }
  ::close(fd);
  const absl::string_view bytes(static_cast<const char*>(f->map_), f->map_bytes_);
  ASSIGN_OR_RETURN(f->contents_, ParseSafetensors(bytes, path));
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

}  // namespace detour::model
