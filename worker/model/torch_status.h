// The one place where LibTorch exceptions become absl::Status. Every call into
// LibTorch from this library runs inside GuardTorch so no exception crosses
// the library boundary. Internal header of detour_model.
#ifndef DETOUR_WORKER_MODEL_TORCH_STATUS_H_
#define DETOUR_WORKER_MODEL_TORCH_STATUS_H_

#include <exception>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <c10/util/ArrayRef.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace detour::model {

// Maps a caught LibTorch exception to a Status prefixed with `context`.
inline absl::Status TorchErrorToStatus(absl::string_view context, const c10::Error& e) {
  std::string msg = e.what_without_backtrace();
  // LibTorch appends a multi-line "Exception raised from ..." trail.
  const size_t trail = msg.find("\nException raised from");
  if (trail != std::string::npos) msg.resize(trail);
  const std::string text = absl::StrCat(context, ": ", msg);
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) {
    return absl::ResourceExhaustedError(text);
  }
  if (dynamic_cast<const c10::IndexError*>(&e) != nullptr ||
      dynamic_cast<const c10::ValueError*>(&e) != nullptr ||
      dynamic_cast<const c10::TypeError*>(&e) != nullptr) {
    return absl::InvalidArgumentError(text);
  }
  return absl::InternalError(text);
}

// Runs `fn` (returning absl::Status or absl::StatusOr<T>) and converts any
// exception into a Status with `context`.
template <typename Fn>
auto GuardTorch(absl::string_view context, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    return TorchErrorToStatus(context, e);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(context, ": out of host memory"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(context, ": ", e.what()));
  }
}

// "[4,128,256]"
inline std::string ShapeString(c10::IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ","), "]");
}

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_TORCH_STATUS_H_
