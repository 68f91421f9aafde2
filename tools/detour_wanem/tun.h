// TUN devices inside network namespaces, for the forwarder. Linux only;
// needs CAP_NET_ADMIN and CAP_SYS_ADMIN (setns).
#ifndef DETOUR_TOOLS_DETOUR_WANEM_TUN_H_
#define DETOUR_TOOLS_DETOUR_WANEM_TUN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace detour::wanem {

struct TunConfig {
  std::string netns;     // a name under /run/netns (made by `ip netns add`)
  std::string device;    // interface name inside it, e.g. "wan0"
  uint32_t address = 0;  // host byte order
  int prefix_len = 16;   // the route to the test bed's subnet via the device
  int mtu = 1500;
};

// Enters the namespace, opens /dev/net/tun there (a TUN device belongs to the
// namespace its file was opened in, so the device is born inside it and the
// fd stays with this process), creates an IFF_TUN | IFF_NO_PI device, gives
// it the address, netmask (which installs the subnet route through it) and
// MTU, brings it and the loopback up, and returns to the caller's namespace.
// Returns the non-blocking fd; closing it deletes the device. Must run before
// other threads exist (setns changes the calling thread only). Errors name
// the namespace and the step.
absl::StatusOr<int> OpenTunInNetns(const TunConfig& config);

}  // namespace detour::wanem

#endif  // DETOUR_TOOLS_DETOUR_WANEM_TUN_H_
