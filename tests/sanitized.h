// Whether this test binary is built with a sanitizer (AddressSanitizer or
// ThreadSanitizer, with GCC or Clang). A test that repeats one code path
// over many random cases may run fewer of them sanitized: the sanitized run
// looks for memory and thread errors on the path, the plain build's run
// checks the property over all the cases.
#ifndef DETOUR_TESTS_SANITIZED_H_
#define DETOUR_TESTS_SANITIZED_H_

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DETOUR_TEST_SANITIZED 1
#endif
#endif
#if (defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)) && \
    !defined(DETOUR_TEST_SANITIZED)
#define DETOUR_TEST_SANITIZED 1
#endif

namespace detour::testing {

#ifdef DETOUR_TEST_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace detour::testing

#endif  // DETOUR_TESTS_SANITIZED_H_
