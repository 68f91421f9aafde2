// Bytes of heap in use, for tests that compare what two ways of computing
// keep allocated. Under AddressSanitizer malloc is ASan's and glibc's
// mallinfo2 reports nothing, so the sanitizer's allocator is asked instead
// (tools/checks.sh asan-full).
#ifndef DETOUR_TESTS_HEAP_IN_USE_H_
#define DETOUR_TESTS_HEAP_IN_USE_H_

#include <malloc.h>

#include "tests/sanitized.h"

#ifdef DETOUR_TEST_ASAN
#include <sanitizer/allocator_interface.h>
#endif

namespace detour::testing {

inline double HeapBytesInUse() {
#ifdef DETOUR_TEST_ASAN
  return static_cast<double>(__sanitizer_get_current_allocated_bytes());
#else
  struct mallinfo2 mi = ::mallinfo2();
  return static_cast<double>(mi.uordblks + mi.hblkhd);
#endif
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_HEAP_IN_USE_H_
