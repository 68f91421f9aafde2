#include "common/spec_json_error.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/flags.h"
#include "common/json.h"

namespace detour {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

// Names listed for an enum at most (a spec's enums have a handful).
constexpr int kMaxListedValues = 32;
constexpr int kMaxDepth = 32;

std::string Quoted(absl::string_view s) {
  return absl::StrCat("\"", absl::CHexEscape(s.substr(0, 64)), s.size() > 64 ? "..." : "", "\"");
}

const FieldDescriptor* FieldOf(const Descriptor& type, const std::string& key) {
  for (int i = 0; i < type.field_count(); ++i) {
    const FieldDescriptor* f = type.field(i);
    if (f->name() == key || f->json_name() == key) return f;
  }
  return nullptr;
}

std::optional<std::string> Explain(const JsonValue& value, const Descriptor& type,
                                   const std::string& path, int depth);

// One value of field `f` (an element, for repeated fields).
std::optional<std::string> ExplainValue(const JsonValue& v, const FieldDescriptor& f,
                                        const std::string& path, int depth) {
  if (f.type() == FieldDescriptor::TYPE_ENUM && v.is_string() &&
      f.enum_type()->FindValueByName(v.string_value()) == nullptr) {
    std::vector<std::string> names;
    for (int i = 0; i < f.enum_type()->value_count() && i < kMaxListedValues; ++i) {
      const std::string& name = f.enum_type()->value(i)->name();
      if (!absl::EndsWith(name, "_UNSPECIFIED")) names.push_back(name);
    }
    return absl::StrCat(path, ": ", Quoted(v.string_value()), " is not one of ",
                        absl::StrJoin(names, ", "));
  }
  if (f.type() == FieldDescriptor::TYPE_MESSAGE && v.is_object() && !f.is_map()) {
    return Explain(v, *f.message_type(), path, depth + 1);
  }
  return std::nullopt;
}

// The first enum value or field name in `value` that `type` does not have.
std::optional<std::string> Explain(const JsonValue& value, const Descriptor& type,
                                   const std::string& path, int depth) {
  if (!value.is_object() || depth > kMaxDepth) return std::nullopt;
  for (size_t i = 0; i < value.keys().size(); ++i) {
    const std::string& key = value.keys()[i];
    const std::string where = path.empty() ? key : absl::StrCat(path, ".", key);
    const FieldDescriptor* f = FieldOf(type, key);
    if (f == nullptr) {
      std::vector<std::string> fields;
      for (int j = 0; j < type.field_count(); ++j) fields.push_back(type.field(j)->name());
      const std::string near = ClosestMatch(key, fields);
      return absl::StrCat(path.empty() ? "" : absl::StrCat(path, ": "), "unknown field ",
                          Quoted(key),
                          near.empty() ? "" : absl::StrCat(" (did you mean ", near, "?)"));
    }
    const JsonValue& v = value.items()[i];
    if (f->is_repeated() && !f->is_map() && v.is_array()) {
      for (size_t k = 0; k < v.items().size(); ++k) {
        auto e = ExplainValue(v.items()[k], *f, absl::StrCat(where, "[", k, "]"), depth);
        if (e) return e;
      }
    } else if (auto e = ExplainValue(v, *f, where, depth)) {
      return e;
    }
  }
  return std::nullopt;
}

}  // namespace

std::string LineAndColumn(absl::string_view text, size_t offset) {
  offset = std::min(offset, text.size());
  const absl::string_view before = text.substr(0, offset);
  const size_t line = static_cast<size_t>(std::count(before.begin(), before.end(), '\n')) + 1;
  const size_t last_newline = before.rfind('\n');
  const size_t column =
      last_newline == absl::string_view::npos ? offset + 1 : offset - last_newline;
  return absl::StrCat("line ", line, ", column ", column);
}

std::string ExplainSpecJsonError(absl::string_view json, const Descriptor& type,
                                 absl::string_view protobuf_error) {
  auto parsed = ParseJson(json);
  if (!parsed.ok()) {
    // "JSON byte N: what"
    absl::string_view message = parsed.status().message();
    constexpr absl::string_view kPrefix = "JSON byte ";
    const size_t colon = message.find(": ");
    size_t offset = 0;
    if (absl::StartsWith(message, kPrefix) && colon != absl::string_view::npos &&
        absl::SimpleAtoi(message.substr(kPrefix.size(), colon - kPrefix.size()), &offset)) {
      return absl::StrCat(LineAndColumn(json, offset), ": ", message.substr(colon + 2));
    }
    return std::string(message);
  }
  if (auto e = Explain(*parsed, type, "", 0)) return *e;
  return std::string(protobuf_error);
}

}  // namespace detour
