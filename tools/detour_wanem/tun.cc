#include "tools/detour_wanem/tun.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace detour::wanem {
namespace {

absl::Status Errno(const TunConfig& c, const std::string& step) {
  const int e = errno;
  return absl::Status(e == EPERM || e == EACCES ? absl::StatusCode::kPermissionDenied
                                                : absl::StatusCode::kFailedPrecondition,
                      absl::StrCat("netns ", c.netns, ": ", step, ": ", std::strerror(e)));
}

// Closes its fd when it goes out of scope unless released.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

void SetName(ifreq* ifr, const std::string& name) {
  std::memset(ifr, 0, sizeof(*ifr));
  std::strncpy(ifr->ifr_name, name.c_str(), IFNAMSIZ - 1);
}

absl::Status SetUp(int sock, const TunConfig& c, const std::string& dev) {
  ifreq ifr;
  SetName(&ifr, dev);
  if (ioctl(sock, SIOCGIFFLAGS, &ifr) < 0) return Errno(c, "read flags of " + dev);
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  if (ioctl(sock, SIOCSIFFLAGS, &ifr) < 0) return Errno(c, "bring up " + dev);
  return absl::OkStatus();
}

absl::StatusOr<int> ConfigureInside(const TunConfig& c) {
  Fd tun(::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC));
  if (tun.get() < 0) return Errno(c, "open /dev/net/tun");
  ifreq ifr;
  SetName(&ifr, c.device);
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  if (ioctl(tun.get(), TUNSETIFF, &ifr) < 0) return Errno(c, "create TUN " + c.device);

  Fd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) return Errno(c, "socket");
  SetName(&ifr, c.device);
  auto* sin = reinterpret_cast<sockaddr_in*>(&ifr.ifr_addr);
  sin->sin_family = AF_INET;
  sin->sin_addr.s_addr = htonl(c.address);
  if (ioctl(sock.get(), SIOCSIFADDR, &ifr) < 0) return Errno(c, "set address of " + c.device);
  SetName(&ifr, c.device);
  sin = reinterpret_cast<sockaddr_in*>(&ifr.ifr_netmask);
  sin->sin_family = AF_INET;
  sin->sin_addr.s_addr = htonl(~(0xffffffffu >> c.prefix_len));
  if (ioctl(sock.get(), SIOCSIFNETMASK, &ifr) < 0) return Errno(c, "set netmask of " + c.device);
  SetName(&ifr, c.device);
  ifr.ifr_mtu = c.mtu;
  if (ioctl(sock.get(), SIOCSIFMTU, &ifr) < 0) return Errno(c, "set MTU of " + c.device);
  absl::Status s = SetUp(sock.get(), c, c.device);
  if (s.ok()) s = SetUp(sock.get(), c, "lo");
  if (!s.ok()) return s;
  return tun.release();
}

}  // namespace

absl::StatusOr<int> OpenTunInNetns(const TunConfig& c) {
  if (c.device.empty() || c.device.size() >= IFNAMSIZ) {
    return absl::InvalidArgumentError(
        absl::StrCat("TUN device name '", c.device, "' must have 1 to ", IFNAMSIZ - 1, " bytes"));
  }
  Fd home(::open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC));
  if (home.get() < 0) return Errno(c, "open /proc/self/ns/net");
  const std::string path = "/run/netns/" + c.netns;
  Fd target(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (target.get() < 0) return Errno(c, "open " + path + " (made by `ip netns add`?)");
  if (setns(target.get(), CLONE_NEWNET) < 0) return Errno(c, "enter");
  absl::StatusOr<int> fd = ConfigureInside(c);
  if (setns(home.get(), CLONE_NEWNET) < 0) {
    // Staying in a node's namespace would put the control socket and every
    // later device in the wrong place: nothing sensible can continue.
    const absl::Status back = Errno(c, "return to the original namespace");
    if (fd.ok()) ::close(*fd);
    return back;
  }
  return fd;
}

}  // namespace detour::wanem
