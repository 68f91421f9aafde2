#include "common/metrics/exposition.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "absl/strings/str_cat.h"

namespace detour::metrics {

std::string FormatValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // to_chars without a precision writes the shortest digits that round-trip.
  // Its own choice between notations prefers "5e-04" to "0.0005", so pick
  // plain notation ourselves for the exponents people read easily.
  char buf[64];
  std::to_chars_result scientific =
      std::to_chars(buf, buf + sizeof(buf) - 1, value, std::chars_format::scientific);
  if (scientific.ec != std::errc()) return absl::StrCat(value);
  *scientific.ptr = '\0';
  const char* exponent = std::strchr(buf, 'e');
  const int decimal_exponent = exponent != nullptr ? std::atoi(exponent + 1) : 0;
  if (decimal_exponent < -5 || decimal_exponent >= 21) {
    return std::string(buf, scientific.ptr);
  }
  std::to_chars_result fixed =
      std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::fixed);
  if (fixed.ec != std::errc()) return absl::StrCat(value);
  return std::string(buf, fixed.ptr);
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (char c : help) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
  return out;
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      default: out += c;
    }
  }
  return out;
}

void AppendSample(std::string* out, absl::string_view name,
                  const std::vector<std::string>& label_names,
                  const std::vector<std::string>& label_values, absl::string_view extra_name,
                  absl::string_view extra_value, double value) {
  absl::StrAppend(out, name);
  const bool has_labels = !label_names.empty() || !extra_name.empty();
  if (has_labels) {
    out->push_back('{');
    const char* separator = "";
    for (size_t i = 0; i < label_names.size() && i < label_values.size(); ++i) {
      absl::StrAppend(out, separator, label_names[i], "=\"", EscapeLabelValue(label_values[i]),
                      "\"");
      separator = ",";
    }
    if (!extra_name.empty()) {
      absl::StrAppend(out, separator, extra_name, "=\"", EscapeLabelValue(extra_value), "\"");
    }
    out->push_back('}');
  }
  absl::StrAppend(out, " ", FormatValue(value), "\n");
}

}  // namespace detour::metrics
