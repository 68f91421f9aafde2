// What the WAN test bed's namespace tests share: running a shell command,
// and whether this process may build a bed at all (root's capabilities,
// /dev/net/tun, iproute2). Header-only, for tests/wanem.
#ifndef DETOUR_TESTS_WANEM_WAN_TEST_SUPPORT_H_
#define DETOUR_TESTS_WANEM_WAN_TEST_SUPPORT_H_

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace detour::testing {

struct ShellResult {
  int code;
  std::string output;
};

// Runs a shell command (stdout and stderr together); every command a test
// runs carries its own `timeout`.
inline ShellResult Sh(const std::string& command) {
  ShellResult r{-1, ""};
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Whether capability `bit` is in this process's effective set.
inline bool HaveCapability(int bit) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      const unsigned long long caps = std::strtoull(line.c_str() + 7, nullptr, 16);
      return ((caps >> bit) & 1) != 0;
    }
  }
  return false;
}

// Why a test bed cannot be built here, or "".
inline std::string MissingPrivileges() {
  if (!HaveCapability(12) || !HaveCapability(21)) {
    return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) for network namespaces";
  }
  if (::access("/dev/net/tun", R_OK | W_OK) != 0) return "no /dev/net/tun";
  if (Sh("command -v ip").code != 0) return "ip is missing (tools/install_deps.sh: iproute2)";
  return "";
}

}  // namespace detour::testing

#endif  // DETOUR_TESTS_WANEM_WAN_TEST_SUPPORT_H_
