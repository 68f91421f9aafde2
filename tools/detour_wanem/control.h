// The forwarder's control protocol: one command per line on its Unix socket,
// answered by zero or more data lines and then `ok` or `error: <reason>`.
//
//   set SRC DST [both] key=value...   change link parameters
//   cut SRC DST [both]                drop everything on the link(s)
//   restore SRC DST [both]            undo cut
//   show [SRC DST [both]]             parameters of the link(s)
//   stats [SRC DST [both]]            counters of the link(s) that saw traffic
//   nodes                             id, region, address of every node
//   ping                              liveness
//   quit                              stop the forwarder
//
// SRC and DST are node ids or `*` (every node); `both` adds the reverse
// direction. Keys: delay_ms [0, 60000], jitter_ms [0, 60000], rate_mbytes
// (1e6 bytes/s) [0, 100000] with 0 = unlimited, loss [0, 1], queue_kb
// (1024 bytes) [0, 1048576] with 0 = automatic, reorder 0|1. Parsing and
// executing are pure functions of the line and the LinkTable, tested without
// a socket (tests/wanem/control_test.cc). Thread-compatible.
#ifndef DETOUR_TOOLS_DETOUR_WANEM_CONTROL_H_
#define DETOUR_TOOLS_DETOUR_WANEM_CONTROL_H_

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tools/detour_wanem/link_table.h"

namespace detour::wanem {

inline constexpr size_t kMaxControlLineBytes = 1024;

struct LinkUpdate {
  std::optional<double> delay_ms;
  std::optional<double> jitter_ms;
  std::optional<double> rate_mbytes;
  std::optional<double> loss;
  std::optional<int64_t> queue_kb;
  std::optional<bool> reorder;
};

struct ControlCommand {
  enum class Kind { kSet, kCut, kRestore, kShow, kStats, kNodes, kPing, kQuit };
  Kind kind = Kind::kPing;
  // The ordered (src, dst) pairs the command applies to, self-pairs excluded.
  std::vector<std::pair<int, int>> links;
  LinkUpdate update;  // kSet only
};

// Parses one line (without its newline) against the table's node names.
// INVALID_ARGUMENT with a specific reason: unknown command, node or key, a
// number that is not one or out of its range, a key given twice, a missing
// or extra argument, a line over kMaxControlLineBytes.
absl::StatusOr<ControlCommand> ParseControlLine(absl::string_view line, const LinkTable& table);

// Applies a parsed command; returns the data lines, each ending in '\n'
// (empty for commands that only change state).
std::string ExecuteControl(const ControlCommand& command, LinkTable* table);

struct ControlReply {
  std::string text;  // data lines, then "ok\n" or "error: ...\n"
  bool quit = false;
};
// Parse + execute, with the error turned into the protocol's error line.
ControlReply HandleControlLine(absl::string_view line, LinkTable* table);

}  // namespace detour::wanem

#endif  // DETOUR_TOOLS_DETOUR_WANEM_CONTROL_H_
