// Pieces of the Prometheus text exposition format 0.0.4 (docs/METRICS.md;
// promtool checks what we serve), shared by the registry and by anything that
// writes samples itself. Pure functions, thread-safe.
#ifndef DETOUR_COMMON_METRICS_EXPOSITION_H_
#define DETOUR_COMMON_METRICS_EXPOSITION_H_

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace detour::metrics {

// The Content-Type of a scrape response in this format.
inline constexpr absl::string_view kExpositionContentType =
    "text/plain; version=0.0.4; charset=utf-8";

// Shortest text that parses back to exactly `value`, in plain notation for
// decimal exponents -5..20 ("0.1", "42", "0.0005") and scientific otherwise
// ("1e+21", "1.5e-07"); "+Inf", "-Inf" and "NaN" for the special values.
std::string FormatValue(double value);

// `# HELP` text: backslash -> \\ and newline -> \n.
std::string EscapeHelp(absl::string_view help);

// Label values: backslash -> \\, double quote -> \" and newline -> \n.
std::string EscapeLabelValue(absl::string_view value);

// Appends one sample line: name{n1="v1",...,extra_name="extra_value"} value
// The braces are omitted when there are no labels. `extra_name` (e.g. "le")
// is appended after the family's labels when not empty. Label values are
// escaped here.
void AppendSample(std::string* out, absl::string_view name,
                  const std::vector<std::string>& label_names,
                  const std::vector<std::string>& label_values, absl::string_view extra_name,
                  absl::string_view extra_value, double value);

}  // namespace detour::metrics

#endif  // DETOUR_COMMON_METRICS_EXPOSITION_H_
