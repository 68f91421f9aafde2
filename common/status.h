// Status helpers shared by every component. Our abseil (20220623) predates
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so they are defined once here.
#ifndef DETOUR_COMMON_STATUS_H_
#define DETOUR_COMMON_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define DETOUR_STATUS_CONCAT_INNER_(a, b) a##b
#define DETOUR_STATUS_CONCAT_(a, b) DETOUR_STATUS_CONCAT_INNER_(a, b)

// Returns from the current function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status detour_status_ = (expr);          \
    if (!detour_status_.ok()) return detour_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` — declares/assigns from a StatusOr or
// returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  DETOUR_ASSIGN_OR_RETURN_IMPL_(DETOUR_STATUS_CONCAT_(detour_statusor_, __LINE__), lhs, expr)
#define DETOUR_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

namespace detour {

// Returns `status` with `context` prefixed to its message ("context: message"),
// keeping the code and the payloads. OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view context);

}  // namespace detour

#endif  // DETOUR_COMMON_STATUS_H_
