// How many TCP connections the direct transport opens to one peer and which
// socket buffers and congestion control it asks for, from the link's
// expected rate and round trip and the system's socket-buffer limits.
//
// One TCP connection moves at most one window per round trip, and Linux
// bounds the window by the socket buffers: net.ipv4.tcp_wmem / tcp_rmem's
// maximum when the kernel sizes the buffers itself (autotuning), or twice
// net.core.wmem_max / rmem_max when a program sets SO_SNDBUF / SO_RCVBUF
// (the kernel doubles the request and caps it there; setting it also turns
// autotuning off for that socket). Of a buffer, about half holds data (the
// rest is the kernel's per-packet bookkeeping), so
//   one connection's rate ≈ kUsableBufferFraction × buffer / RTT
// and a link of rate R and round trip T needs
//   connections = ceil(kStripeHeadroom × R × T / (kUsableBufferFraction × buffer)).
//
// PlanStripes and the parsers are pure (no system calls); ReadTcpLimits reads
// /proc. Thread-safe (no state), except the cached BBR probe, which is
// initialised once.
#ifndef DETOUR_WORKER_TRANSPORT_TCP_TUNING_H_
#define DETOUR_WORKER_TRANSPORT_TCP_TUNING_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace detour {

// Share of a socket buffer that carries data (tcp_adv_win_scale=1; the rest
// is sk_buff overhead).
inline constexpr double kUsableBufferFraction = 0.5;
// Most connections (stripes) per peer pair; receivers refuse more.
inline constexpr int kMaxDirectStripes = 16;
// Connections and buffers are planned for this multiple of the link's
// rate: sized exactly, the connections fill a 100 MB/s, 100 ms link to only
// 0.79-0.82x of its ceiling (measured, benchmarks/wan/transfer.sh), because
// a connection's window is not always full (acknowledgements, BBR's probing,
// the last range of a striped tensor finishing alone); with half again as
// much room they reach 0.90-0.96x.
inline constexpr double kStripeHeadroom = 1.5;

// A striped session's connections take chunks from one queue, each when it
// is free; a connection's socket counts as free once less than this much
// written data waits unsent (TCP_NOTSENT_LOWAT). Without it a writer hands
// the kernel chunk after chunk until the whole send buffer (megabytes) is
// full, so a connection that a loss holds up takes as many chunks as the
// others; with it, a held-up connection stops taking them within about a
// megabyte, and the others carry the rest. At 100 MB/s a megabyte is 10 ms
// of sending: far longer than a writer thread takes to wake.
inline constexpr int64_t kStripeNotsentLowat = 1 << 20;
// The chunk of a striped tensor of less than a longest chunk per stripe
// (StripeChunkBytes).
inline constexpr uint64_t kMinStripeChunkBytes = 1 << 20;

// The socket-buffer limits of this machine, in bytes.
struct TcpLimits {
  int64_t wmem_max = 212992;  // net.core.wmem_max: cap of SO_SNDBUF
  int64_t rmem_max = 212992;  // net.core.rmem_max: cap of SO_RCVBUF
  // net.ipv4.tcp_wmem / tcp_rmem: min, default, max of autotuning.
  int64_t tcp_wmem[3] = {4096, 16384, 4194304};
  int64_t tcp_rmem[3] = {4096, 131072, 6291456};
};

// What the link to a peer is expected to carry. Zero = unknown.
struct LinkHint {
  double rate_bytes_per_s = 0;
  absl::Duration rtt = absl::ZeroDuration();
};
// Used where a peer's hint is unknown: the top of the inter-region links
// detour's clusters assume (10 Gb/s), and a long round trip for the report.
inline constexpr double kDefaultLinkRateBytesPerS = 1.16e9;
inline constexpr absl::Duration kDefaultReportRtt = absl::Milliseconds(100);

struct StripePlan {
  int connections = 1;
  // Values to pass to setsockopt(SO_SNDBUF / SO_RCVBUF); 0 = leave the
  // kernel's autotuning on (see PlanStripes for when each is chosen).
  int64_t sndbuf_request = 0;
  int64_t rcvbuf_request = 0;
  // The largest buffer one connection can get per direction (autotuning's
  // max or twice the core cap, whichever is larger), and what one
  // connection and all of them together can then carry over the hint's RTT.
  int64_t send_buffer = 0;
  int64_t receive_buffer = 0;
  double per_connection_rate = 0;  // bytes/s; 0 when the RTT is unknown
  double total_rate = 0;
};

// Parses a sysctl file's text: `count` whitespace-separated non-negative
// integers (a trailing newline, tabs and repeated spaces are fine).
// INVALID_ARGUMENT naming `what` for anything else (missing, extra, signs,
// junk, overflow).
absl::StatusOr<std::vector<int64_t>> ParseSysctlInts(absl::string_view text, int count,
                                                     absl::string_view what);
// Reads the four limits from `proc_sys` (normally /proc/sys). A file that is
// missing or unreadable keeps the kernel's documented default for that value
// and adds a line to `problems` (when not null); an unparseable one too.
TcpLimits ReadTcpLimits(const std::string& proc_sys = "/proc/sys",
                        std::vector<std::string>* problems = nullptr);

// Chooses the connections and buffers for `hint` under `limits`.
// Connections: enough that each needs no more than the largest buffer it can
// get, within 1..max_connections (1 when the hint is unknown).
// Buffers: autotuning is kept wherever it can reach what each connection
// needs, because a fixed SO_SNDBUF/SO_RCVBUF holds its memory for idle and
// slow connections alike and, on most systems (wmem_max 208 KiB against
// tcp_wmem's 4 MiB), is smaller than what autotuning would reach. Only when
// a connection needs more than autotuning's max and the core cap allows more
// (an administrator raised net.core.*mem_max but not tcp_*mem) is the buffer
// requested explicitly, at half of what it needs (the kernel doubles it),
// within the cap.
StripePlan PlanStripes(const LinkHint& hint, const TcpLimits& limits,
                       int max_connections = kMaxDirectStripes);

// The chunk length a tensor of `total` bytes is cut into when it is striped
// over `stripes` connections, a multiple of 4 KiB and at most `max_chunk`.
// When it holds at least a `max_chunk` per stripe: as many chunks for every
// stripe, the fewest that allows (64 MiB over 11 stripes is 22 chunks of
// under 3 MiB, where 16 of 4 MiB left 5 stripes with two and 6 with one, and
// the tensor waited for the ones with two). Otherwise kMinStripeChunkBytes:
// 16 MiB over 11 stripes is 16 chunks of 1 MiB, where 4 MiB chunks reached
// only 4 of the 11. The connections take the chunks from one queue as each
// is free, so more chunks than connections let the ones a loss holds up
// take fewer. A tensor below `threshold`, or one connection: `max_chunk`.
size_t StripeChunkBytes(size_t total, int stripes, size_t max_chunk, size_t threshold);

// Warnings for links whose expected rate the limits cap: one line per
// direction that caps it, naming the setting, the rate one connection gets,
// the connections used, and the value that would let one connection carry
// the rate. Empty when nothing caps it (or the hint is unknown).
std::vector<std::string> TcpLimitWarnings(const LinkHint& hint, const TcpLimits& limits,
                                          const StripePlan& plan);

// True when net.ipv4.tcp_available_congestion_control's text lists "bbr".
bool ListsBbr(absl::string_view available);
// Whether this machine lets a socket use BBR: listed as available, or (the
// module not loaded yet) a probe socket accepts it. Probed once per process.
bool BbrUsable(const std::string& proc_sys = "/proc/sys");

// The start-up report of the direct transport: the limits read, the plan for
// `hint` (rate and RTT; unknown parts take the defaults above), BBR, and the
// warnings. Every line is logged once per process by LogDirectTransportTuning
// (the first call wins); both return the lines.
std::vector<std::string> DirectTransportTuningReport(LinkHint hint, bool use_bbr = true,
                                                     const std::string& proc_sys = "/proc/sys");
std::vector<std::string> LogDirectTransportTuning(LinkHint hint, bool use_bbr = true);

}  // namespace detour

#endif  // DETOUR_WORKER_TRANSPORT_TCP_TUNING_H_
