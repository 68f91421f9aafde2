// The version and the git revision the binaries were built from, defined in
// a source CMake generates from common/version.cc.in at configure time.
#ifndef DETOUR_COMMON_VERSION_H_
#define DETOUR_COMMON_VERSION_H_

namespace detour {

extern const char kVersion[];
extern const char kGitRevision[];

}  // namespace detour

#endif  // DETOUR_COMMON_VERSION_H_
