// A small, strict JSON parser (RFC 8259) for files from outside: safetensors
// headers and Hugging Face config.json. Bounded by JsonLimits (input bytes,
// nesting depth, number of values), so a hostile document costs at most
// about 100 bytes of memory per value and never recurses deeper than the
// limit. Stricter than most readers where strictness is safer: duplicate
// object keys, invalid UTF-8, control characters in strings, leading zeros,
// trailing commas and anything after the document are errors.
// No LibTorch, no protobuf. JsonValue is an immutable value type;
// everything here is thread-safe.
#ifndef DETOUR_COMMON_JSON_H_
#define DETOUR_COMMON_JSON_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace detour {

struct JsonLimits {
  size_t max_bytes = size_t{100} << 20;
  int max_depth = 32;
  size_t max_values = size_t{1} << 22;
};

class JsonValue {
 public:
  enum class Kind : uint8_t { kNull, kBool, kNumber, kString, kArray, kObject };

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool bool_value() const { return bool_; }
  // The number as a double (may have rounded; see AsUint64/AsInt64).
  double number() const { return number_; }
  // Exact integer value when the number was written as an integer (no
  // fraction, no exponent) that fits; false otherwise.
  bool AsUint64(uint64_t* out) const;
  bool AsInt64(int64_t* out) const;
  // A string's decoded UTF-8 text (a number's source text).
  const std::string& string_value() const { return text_; }
  // An array's elements or an object's values (in document order).
  const std::vector<JsonValue>& items() const { return items_; }
  // An object's keys, parallel to items(); unique.
  const std::vector<std::string>& keys() const { return keys_; }
  // An object's member named `key`, or null when absent (or not an object).
  const JsonValue* Find(absl::string_view key) const;

  // "null", "a bool", "a number", ... for error messages.
  static const char* KindName(Kind kind);

 private:
  friend class JsonParser;
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string text_;
  std::vector<JsonValue> items_;
  std::vector<std::string> keys_;
};

// Parses one JSON document (surrounding whitespace allowed). INVALID_ARGUMENT
// "JSON byte <offset>: <what is wrong>" for anything malformed or beyond
// `limits`.
absl::StatusOr<JsonValue> ParseJson(absl::string_view text, const JsonLimits& limits = {});

// `s` as a JSON string literal (quotes included; control characters, quote
// and backslash escaped; other bytes copied).
std::string JsonQuote(absl::string_view s);

}  // namespace detour

#endif  // DETOUR_COMMON_JSON_H_
