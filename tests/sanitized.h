// Whether this test binary is built with a sanitizer (AddressSanitizer or
// ThreadSanitizer, with GCC or Clang). A test that repeats one code path
// over many random cases may run fewer of them sanitized: the sanitized run
// looks for memory and thread errors on the path, the plain build's run
// checks the property over all the cases; such a test belongs in
// tools/checks.sh's PLAIN_TOO, or CI runs it only sanitized (its `plain`
// step runs the plain build's tests asan-full leaves out, and these).
// DETOUR_TEST_ASAN is defined under
// AddressSanitizer (tests/heap_in_use.h asks its allocator), DETOUR_TSAN
// under ThreadSanitizer (common/tsan.h).
#ifndef DETOUR_TESTS_SANITIZED_H_
#define DETOUR_TESTS_SANITIZED_H_

#include "common/tsan.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DETOUR_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) && !defined(DETOUR_TEST_ASAN)
#define DETOUR_TEST_ASAN 1
#endif

namespace detour::testing {

#if defined(DETOUR_TEST_ASAN) || defined(DETOUR_TSAN)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace detour::testing

#endif  // DETOUR_TESTS_SANITIZED_H_
