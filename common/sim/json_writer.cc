#include "common/sim/json_writer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace detour::sim {

std::string JsonQuote(absl::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

void JsonWriter::Newline() {
  if (indent_ <= 0) return;
  out_ += '\n';
  out_.append(has_element_.size() * indent_, ' ');
}

void JsonWriter::BeforeValue() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!has_element_.empty()) {
    if (has_element_.back()) out_ += ',';
    has_element_.back() = true;
    Newline();
  }
}

void JsonWriter::Open(char c) {
  BeforeValue();
  out_ += c;
  has_element_.push_back(false);
}

void JsonWriter::Close(char c) {
  const bool had = !has_element_.empty() && has_element_.back();
  if (!has_element_.empty()) has_element_.pop_back();
  if (had) Newline();
  out_ += c;
}

void JsonWriter::Key(absl::string_view key) {
  BeforeValue();
  out_ += JsonQuote(key);
  out_ += indent_ > 0 ? ": " : ":";
  after_key_ = true;
}

void JsonWriter::String(absl::string_view value) {
  BeforeValue();
  out_ += JsonQuote(value);
}

void JsonWriter::Number(double value) {
  BeforeValue();
  if (!std::isfinite(value)) {
    out_ += "null";
    return;
  }
  out_ += absl::StrFormat("%.9g", value);
}

void JsonWriter::Int(int64_t value) {
  BeforeValue();
  absl::StrAppend(&out_, value);
}

void JsonWriter::Bool(bool value) {
  BeforeValue();
  out_ += value ? "true" : "false";
}

void JsonWriter::Null() {
  BeforeValue();
  out_ += "null";
}

void JsonWriter::IntArray(const std::vector<int>& values) {
  BeforeValue();
  out_ += '[';
  for (size_t i = 0; i < values.size(); ++i) absl::StrAppend(&out_, i ? ", " : "", values[i]);
  out_ += ']';
}

void JsonWriter::StringArray(const std::vector<std::string>& values) {
  BeforeValue();
  out_ += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    absl::StrAppend(&out_, i ? ", " : "", JsonQuote(values[i]));
  }
  out_ += ']';
}

}  // namespace detour::sim
