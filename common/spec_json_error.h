// Explains why a spec's JSON was refused, beyond protobuf's own message:
// the line and column of a syntax error, the valid names where a string is
// no value of its enum field, and the nearest field name for an unknown
// one. Pure functions; thread-safe.
#ifndef DETOUR_COMMON_SPEC_JSON_ERROR_H_
#define DETOUR_COMMON_SPEC_JSON_ERROR_H_

#include <string>

#include "absl/strings/string_view.h"
#include "google/protobuf/descriptor.h"

namespace detour {

// The explanation for `json`, which protobuf's JSON parser refused for
// message `type` with `protobuf_error`. Falls back to `protobuf_error` when
// nothing more precise is found. Bounded: the document is read with
// common/json.h's limits and quoted values are cut to 64 bytes.
std::string ExplainSpecJsonError(absl::string_view json, const google::protobuf::Descriptor& type,
                                 absl::string_view protobuf_error);

// "line L, column C" (both from 1, columns in bytes) of byte `offset`.
std::string LineAndColumn(absl::string_view text, size_t offset);

}  // namespace detour

#endif  // DETOUR_COMMON_SPEC_JSON_ERROR_H_
