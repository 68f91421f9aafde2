#include "worker/transport/tcp_tuning.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/log.h"

namespace detour {
namespace {

// Enough for any real buffer limit (the kernel keeps them in an int).
constexpr int64_t kMaxSysctlValue = int64_t{1} << 40;

std::string Mb(double bytes_per_s) { return absl::StrFormat("%.0f MB/s", bytes_per_s / 1e6); }
std::string Ms(absl::Duration d) {
  const double ms = absl::ToDoubleMilliseconds(d);
  return ms < 1000 ? absl::StrFormat("%.3g ms", ms) : absl::StrFormat("%.3g s", ms / 1e3);
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  std::string text;
  char buffer[256];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > 4096) return absl::InvalidArgumentError(absl::StrCat(path, ": too long"));
  }
  return text;
}

// One limit: its file's values into `out`, or the default kept and a problem
// noted.
void ReadLimit(const std::string& proc_sys, const char* name, int count, int64_t* out,
               std::vector<std::string>* problems) {
  const std::string path = absl::StrCat(proc_sys, "/", name);
  absl::StatusOr<std::string> text = ReadSmallFile(path);
  absl::StatusOr<std::vector<int64_t>> values =
      text.ok() ? ParseSysctlInts(*text, count, path)
                : absl::StatusOr<std::vector<int64_t>>(text.status());
  if (!values.ok()) {
    if (problems != nullptr) {
      problems->push_back(absl::StrCat(values.status().message(), " (assuming the default)"));
    }
    return;
  }
  for (int i = 0; i < count; ++i) out[i] = (*values)[i];
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> ParseSysctlInts(absl::string_view text, int count,
                                                     absl::string_view what) {
  std::vector<absl::string_view> words =
      absl::StrSplit(text, absl::ByAnyChar(" \t\n\r"), absl::SkipEmpty());
  if (static_cast<int>(words.size()) != count) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected ", count, " number",
                                                   count == 1 ? "" : "s", ", found ", words.size(),
                                                   " words"));
  }
  std::vector<int64_t> values;
  for (absl::string_view word : words) {
    int64_t v = 0;
    // SimpleAtoi accepts a sign; sysctl values here never have one.
    if (!absl::ascii_isdigit(static_cast<unsigned char>(word[0])) || !absl::SimpleAtoi(word, &v) ||
        v > kMaxSysctlValue) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": \"", word.substr(0, 32), "\" is not a size in bytes"));
    }
    values.push_back(v);
  }
  return values;
}

TcpLimits ReadTcpLimits(const std::string& proc_sys, std::vector<std::string>* problems) {
  TcpLimits limits;
  ReadLimit(proc_sys, "net/core/wmem_max", 1, &limits.wmem_max, problems);
  ReadLimit(proc_sys, "net/core/rmem_max", 1, &limits.rmem_max, problems);
  ReadLimit(proc_sys, "net/ipv4/tcp_wmem", 3, limits.tcp_wmem, problems);
  ReadLimit(proc_sys, "net/ipv4/tcp_rmem", 3, limits.tcp_rmem, problems);
  return limits;
}

size_t StripeChunkBytes(size_t total, int stripes, size_t max_chunk, size_t threshold) {
  constexpr size_t kPage = 4096;
  max_chunk = std::max(kPage, max_chunk);
  const uint64_t lanes = static_cast<uint64_t>(std::max(stripes, 1));
  if (stripes <= 1 || total < threshold) return max_chunk;
  // Less than a longest chunk per stripe: short chunks, more of them than
  // the stripes if the tensor allows, so that every stripe can take some.
  if (total / lanes < max_chunk) {
    return static_cast<size_t>(std::clamp<uint64_t>(kMinStripeChunkBytes, kPage, max_chunk));
  }
  const uint64_t share = total / lanes + (total % lanes != 0);
  const uint64_t per_stripe = share / max_chunk + (share % max_chunk != 0);
  const uint64_t chunks = lanes * std::max<uint64_t>(1, per_stripe);
  const uint64_t chunk = (total + chunks - 1) / chunks;
  const uint64_t rounded = (chunk + kPage - 1) / kPage * kPage;
  return static_cast<size_t>(std::clamp<uint64_t>(rounded, kPage, max_chunk));
}

StripePlan PlanStripes(const LinkHint& hint, const TcpLimits& limits, int max_connections) {
  max_connections = std::clamp(max_connections, 1, kMaxDirectStripes);
  StripePlan plan;
  plan.send_buffer = std::max(limits.tcp_wmem[2], 2 * limits.wmem_max);
  plan.receive_buffer = std::max(limits.tcp_rmem[2], 2 * limits.rmem_max);
  const double rtt_s = absl::ToDoubleSeconds(hint.rtt);
  if (!(rtt_s > 0) || !(hint.rate_bytes_per_s > 0) || !std::isfinite(hint.rate_bytes_per_s)) {
    return plan;  // unknown: one connection, autotuning
  }
  const double buffer =
      static_cast<double>(std::max<int64_t>(1, std::min(plan.send_buffer, plan.receive_buffer)));
  plan.per_connection_rate = kUsableBufferFraction * buffer / rtt_s;
  // The bytes in flight to plan for: the bandwidth-delay product, with headroom.
  const double in_flight = kStripeHeadroom * hint.rate_bytes_per_s * rtt_s;
  const double wanted = std::ceil(in_flight / (kUsableBufferFraction * buffer));
  plan.connections = static_cast<int>(std::clamp(wanted, 1.0, double(max_connections)));
  plan.total_rate = plan.per_connection_rate * plan.connections;
  // What each connection's buffer must hold for its share of the link.
  const double need = in_flight / plan.connections / kUsableBufferFraction;
  auto request = [need](int64_t autotune_max, int64_t core_max) -> int64_t {
    if (need <= static_cast<double>(autotune_max) || 2 * core_max <= autotune_max) return 0;
    return std::min<int64_t>(core_max, static_cast<int64_t>(std::ceil(need / 2)));
  };
  plan.sndbuf_request = request(limits.tcp_wmem[2], limits.wmem_max);
  plan.rcvbuf_request = request(limits.tcp_rmem[2], limits.rmem_max);
  return plan;
}

std::vector<std::string> TcpLimitWarnings(const LinkHint& hint, const TcpLimits& limits,
                                          const StripePlan& plan) {
  std::vector<std::string> lines;
  const double rtt_s = absl::ToDoubleSeconds(hint.rtt);
  if (!(rtt_s > 0) || !(hint.rate_bytes_per_s > 0)) return lines;
  // The buffer one connection needs to carry the whole rate alone.
  const int64_t one =
      static_cast<int64_t>(std::ceil(hint.rate_bytes_per_s * rtt_s / kUsableBufferFraction));
  struct Side {
    const char* core;
    const char* tcp;
    int64_t core_max, autotune_max, buffer;
  };
  const Side sides[2] = {
      {"net.core.wmem_max", "net.ipv4.tcp_wmem", limits.wmem_max, limits.tcp_wmem[2],
       plan.send_buffer},
      {"net.core.rmem_max", "net.ipv4.tcp_rmem", limits.rmem_max, limits.tcp_rmem[2],
       plan.receive_buffer},
  };
  for (const Side& side : sides) {
    const double rate = kUsableBufferFraction * static_cast<double>(side.buffer) / rtt_s;
    if (rate >= hint.rate_bytes_per_s) continue;
    const std::string setting = side.autotune_max >= 2 * side.core_max
                                    ? absl::StrCat(side.tcp, "'s max of ", side.autotune_max)
                                    : absl::StrCat(side.core, "=", side.core_max);
    const std::string used = plan.total_rate >= hint.rate_bytes_per_s
                                 ? absl::StrCat(plan.connections, " connections are used")
                                 : absl::StrCat("even ", plan.connections,
                                                " connections carry only ", Mb(plan.total_rate));
    lines.push_back(absl::StrCat(setting, " caps one connection at ", Mb(rate), " over a ",
                                 Ms(hint.rtt), " round trip (expected ", Mb(hint.rate_bytes_per_s),
                                 "); ", used, "; raise ", side.core, " and ", side.tcp,
                                 "'s max to ", one, " for one connection (", side.core, "=", one,
                                 ", ", side.tcp, "=\"", std::min<int64_t>(4096, side.autotune_max),
                                 " ", std::min<int64_t>(131072, one), " ", one, "\")"));
  }
  return lines;
}

bool ListsBbr(absl::string_view available) {
  for (absl::string_view word :
       absl::StrSplit(available, absl::ByAnyChar(" \t\n\r"), absl::SkipEmpty())) {
    if (word == "bbr") return true;
  }
  return false;
}

bool BbrUsable(const std::string& proc_sys) {
  static std::once_flag once;
  static bool usable = false;
  std::call_once(once, [&proc_sys] {
    absl::StatusOr<std::string> available =
        ReadSmallFile(absl::StrCat(proc_sys, "/net/ipv4/tcp_available_congestion_control"));
    if (available.ok() && ListsBbr(*available)) {
      usable = true;
      return;
    }
    // Not loaded yet: a privileged process loads tcp_bbr on first use.
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    usable = ::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, "bbr", 3) == 0;
    ::close(fd);
  });
  return usable;
}

std::vector<std::string> DirectTransportTuningReport(LinkHint hint, bool use_bbr,
                                                     const std::string& proc_sys) {
  if (!(hint.rate_bytes_per_s > 0)) hint.rate_bytes_per_s = kDefaultLinkRateBytesPerS;
  if (hint.rtt <= absl::ZeroDuration()) hint.rtt = kDefaultReportRtt;
  std::vector<std::string> problems;
  const TcpLimits limits = ReadTcpLimits(proc_sys, &problems);
  const StripePlan plan = PlanStripes(hint, limits);
  std::vector<std::string> lines;
  for (std::string& p : problems) lines.push_back(absl::StrCat("direct transport: ", p));
  lines.push_back(absl::StrCat(
      "direct transport: socket buffers net.core.wmem_max=", limits.wmem_max,
      " net.core.rmem_max=", limits.rmem_max, " net.ipv4.tcp_wmem max=", limits.tcp_wmem[2],
      " net.ipv4.tcp_rmem max=", limits.tcp_rmem[2], "; for ", Mb(hint.rate_bytes_per_s), " over ",
      Ms(hint.rtt), ": ", plan.connections, " connection", plan.connections == 1 ? "" : "s", " of ",
      Mb(plan.per_connection_rate), " each, SO_SNDBUF ",
      plan.sndbuf_request > 0 ? absl::StrCat(plan.sndbuf_request) : std::string("autotuned"),
      ", SO_RCVBUF ",
      plan.rcvbuf_request > 0 ? absl::StrCat(plan.rcvbuf_request) : std::string("autotuned"),
      "; congestion control ",
      !use_bbr ? "the system's default (BBR turned off)"
               : (BbrUsable(proc_sys) ? "bbr" : "the system's default (no BBR here)")));
  for (std::string& w : TcpLimitWarnings(hint, limits, plan)) {
    lines.push_back(absl::StrCat("direct transport: ", w));
  }
  return lines;
}

std::vector<std::string> LogDirectTransportTuning(LinkHint hint, bool use_bbr) {
  std::vector<std::string> lines = DirectTransportTuningReport(hint, use_bbr);
  static std::once_flag once;
  std::call_once(once, [&lines] {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].find(" caps one connection") != std::string::npos ||
          lines[i].find("assuming the default") != std::string::npos) {
        LogWarning(lines[i]);
      } else {
        LogInfo(lines[i]);
      }
    }
  });
  return lines;
}

}  // namespace detour
