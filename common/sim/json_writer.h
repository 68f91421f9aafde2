// A small streaming JSON writer: enough for detour-sim's reports, routes and
// Chrome traces without a dependency. Not thread-safe; owns its buffer.
//
//   JsonWriter w;
//   w.BeginObject(); w.Key("a"); w.Number(1.5); w.EndObject();
//   std::string text = w.str();
//
// Misuse (a value where a key is due, unbalanced End*) is a programming error
// and is not diagnosed beyond producing invalid JSON.
#ifndef DETOUR_COMMON_SIM_JSON_WRITER_H_
#define DETOUR_COMMON_SIM_JSON_WRITER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace detour::sim {

class JsonWriter {
 public:
  // indent = 0 writes everything on one line.
  explicit JsonWriter(int indent = 2) : indent_(indent) {}

  void BeginObject() { Open('{'); }
  void EndObject() { Close('}'); }
  void BeginArray() { Open('['); }
  void EndArray() { Close(']'); }
  void Key(absl::string_view key);
  void String(absl::string_view value);
  // Finite doubles with up to 9 significant digits; non-finite become null.
  void Number(double value);
  void Int(int64_t value);
  void Bool(bool value);
  void Null();

  // Arrays of scalars on one line, for compact route lists.
  void IntArray(const std::vector<int>& values);
  void StringArray(const std::vector<std::string>& values);

  const std::string& str() const { return out_; }

 private:
  void Open(char c);
  void Close(char c);
  void BeforeValue();
  void Newline();

  int indent_;
  std::string out_;
  // One entry per open container: whether it already has an element.
  std::vector<bool> has_element_;
  bool after_key_ = false;
};

// Quotes and escapes `s` as a JSON string.
std::string JsonQuote(absl::string_view s);

}  // namespace detour::sim

#endif  // DETOUR_COMMON_SIM_JSON_WRITER_H_
