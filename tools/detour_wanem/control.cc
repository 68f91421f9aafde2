#include "tools/detour_wanem/control.h"

#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace detour::wanem {
namespace {

using Kind = ControlCommand::Kind;

absl::Status Bad(absl::string_view why) { return absl::InvalidArgumentError(why); }

struct CommandName {
  const char* name;
  Kind kind;
};
constexpr CommandName kCommands[] = {
    {"set", Kind::kSet},   {"cut", Kind::kCut},     {"restore", Kind::kRestore},
    {"show", Kind::kShow}, {"stats", Kind::kStats}, {"nodes", Kind::kNodes},
    {"ping", Kind::kPing}, {"quit", Kind::kQuit},
};

absl::StatusOr<std::vector<int>> ResolveNode(absl::string_view name, const LinkTable& table) {
  std::vector<int> out;
  if (name == "*") {
    for (int i = 0; i < table.size(); ++i) out.push_back(i);
    return out;
  }
  const int i = table.FindNode(name);
  if (i < 0) {
    return Bad(absl::StrFormat("unknown node '%s' (nodes: %s%s)",
                               absl::CHexEscape(name.substr(0, 64)), table.node(0).id,
                               table.size() > 1 ? ", ..." : ""));
  }
  out.push_back(i);
  return out;
}

// Reads SRC DST [both] from words[1..]; returns how many words it used.
absl::StatusOr<size_t> ParsePair(const std::vector<absl::string_view>& words,
                                 const LinkTable& table, ControlCommand* cmd) {
  if (words.size() < 3) {
    return Bad(absl::StrFormat("%s needs SRC DST (node ids or *)", words[0]));
  }
  auto src = ResolveNode(words[1], table);
  if (!src.ok()) return src.status();
  auto dst = ResolveNode(words[2], table);
  if (!dst.ok()) return dst.status();
  const bool both = words.size() > 3 && words[3] == "both";
  for (int s : *src) {
    for (int d : *dst) {
      if (s == d) continue;
      cmd->links.emplace_back(s, d);
      if (both) cmd->links.emplace_back(d, s);
    }
  }
  if (cmd->links.empty()) {
    return Bad(absl::StrFormat("%s %s: a node has no link to itself", words[1], words[2]));
  }
  return both ? 4 : 3;
}

absl::Status ParseNumber(absl::string_view key, absl::string_view value, double lo, double hi,
                         std::optional<double>* out) {
  if (out->has_value()) return Bad(absl::StrFormat("%s given twice", key));
  double v = 0;
  if (value.empty() || !absl::SimpleAtod(value, &v) || !std::isfinite(v)) {
    return Bad(
        absl::StrFormat("%s=%s is not a number", key, absl::CHexEscape(value.substr(0, 32))));
  }
  if (v < lo || v > hi) {
    return Bad(absl::StrFormat("%s=%s is outside [%g, %g]", key, value, lo, hi));
  }
  *out = v;
  return absl::OkStatus();
}

absl::Status ParseKeyValue(absl::string_view word, LinkUpdate* u) {
  const size_t eq = word.find('=');
  if (eq == absl::string_view::npos) {
    return Bad(absl::StrFormat("'%s' is not key=value", absl::CHexEscape(word.substr(0, 64))));
  }
  const absl::string_view key = word.substr(0, eq);
  const absl::string_view value = word.substr(eq + 1);
  if (key == "delay_ms") return ParseNumber(key, value, 0, 60000, &u->delay_ms);
  if (key == "jitter_ms") return ParseNumber(key, value, 0, 60000, &u->jitter_ms);
  if (key == "rate_mbytes") return ParseNumber(key, value, 0, 100000, &u->rate_mbytes);
  if (key == "loss") return ParseNumber(key, value, 0, 1, &u->loss);
  if (key == "queue_kb") {
    if (u->queue_kb.has_value()) return Bad("queue_kb given twice");
    int64_t v = 0;
    if (!absl::SimpleAtoi(value, &v)) {
      return Bad(absl::StrFormat("queue_kb=%s is not a whole number",
                                 absl::CHexEscape(value.substr(0, 32))));
    }
    if (v < 0 || v > 1048576)
      return Bad(absl::StrFormat("queue_kb=%s is outside [0, 1048576]", value));
    u->queue_kb = v;
    return absl::OkStatus();
  }
  if (key == "reorder") {
    if (u->reorder.has_value()) return Bad("reorder given twice");
    if (value != "0" && value != "1") {
      return Bad(
          absl::StrFormat("reorder=%s must be 0 or 1", absl::CHexEscape(value.substr(0, 32))));
    }
    u->reorder = value == "1";
    return absl::OkStatus();
  }
  return Bad(absl::StrFormat(
      "unknown parameter '%s' (expected delay_ms, jitter_ms, rate_mbytes, loss, queue_kb, reorder)",
      absl::CHexEscape(key.substr(0, 64))));
}

std::string LinkName(const LinkTable& t, int s, int d) {
  return absl::StrCat(t.node(s).id, " ", t.node(d).id);
}

}  // namespace

absl::StatusOr<ControlCommand> ParseControlLine(absl::string_view line, const LinkTable& table) {
  if (line.size() > kMaxControlLineBytes) {
    return Bad(
        absl::StrFormat("line is %d bytes, the limit is %d", line.size(), kMaxControlLineBytes));
  }
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  for (char c : line) {
    if (static_cast<unsigned char>(c) < 0x20 && c != '\t') {
      return Bad("line holds a control character");
    }
  }
  std::vector<absl::string_view> words =
      absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
  if (words.empty()) return Bad("empty command");
  ControlCommand cmd;
  bool found = false;
  for (const CommandName& c : kCommands) {
    if (words[0] == c.name) {
      cmd.kind = c.kind;
      found = true;
    }
  }
  if (!found) {
    return Bad(absl::StrFormat(
        "unknown command '%s' (expected set, cut, restore, show, stats, nodes, ping, quit)",
        absl::CHexEscape(words[0].substr(0, 64))));
  }
  size_t used = 1;
  switch (cmd.kind) {
    case Kind::kSet:
    case Kind::kCut:
    case Kind::kRestore: {
      auto n = ParsePair(words, table, &cmd);
      if (!n.ok()) return n.status();
      used = *n;
      break;
    }
    case Kind::kShow:
    case Kind::kStats:
      if (words.size() == 1) {
        for (int s = 0; s < table.size(); ++s) {
          for (int d = 0; d < table.size(); ++d) {
            if (s != d) cmd.links.emplace_back(s, d);
          }
        }
      } else {
        auto n = ParsePair(words, table, &cmd);
        if (!n.ok()) return n.status();
        used = *n;
      }
      break;
    default: break;
  }
  if (cmd.kind == Kind::kSet) {
    if (used == words.size()) {
      return Bad(
          "set needs at least one key=value (delay_ms, jitter_ms, rate_mbytes, loss, "
          "queue_kb, reorder)");
    }
    for (size_t i = used; i < words.size(); ++i) {
      absl::Status s = ParseKeyValue(words[i], &cmd.update);
      if (!s.ok()) return s;
    }
  } else if (used < words.size()) {
    return Bad(absl::StrFormat("%s: unexpected argument '%s'", words[0],
                               absl::CHexEscape(words[used].substr(0, 64))));
  }
  return cmd;
}

std::string ExecuteControl(const ControlCommand& cmd, LinkTable* table) {
  std::string out;
  switch (cmd.kind) {
    case Kind::kSet:
      for (auto [s, d] : cmd.links) {
        Link& link = table->link(s, d);
        LinkParams p = link.params();
        const LinkUpdate& u = cmd.update;
        if (u.delay_ms) p.delay_ms = *u.delay_ms;
        if (u.jitter_ms) p.jitter_ms = *u.jitter_ms;
        if (u.rate_mbytes) p.rate_bytes_per_s = *u.rate_mbytes * 1e6;
        if (u.loss) p.loss = *u.loss;
        if (u.queue_kb) p.queue_bytes = *u.queue_kb * 1024;
        if (u.reorder) p.reorder = *u.reorder;
        link.SetParams(p);
      }
      break;
    case Kind::kCut:
    case Kind::kRestore:
      for (auto [s, d] : cmd.links) {
        Link& link = table->link(s, d);
        LinkParams p = link.params();
        p.cut = cmd.kind == Kind::kCut;
        link.SetParams(p);
      }
      break;
    case Kind::kShow:
      for (auto [s, d] : cmd.links) {
        const Link& link = table->link(s, d);
        const LinkParams& p = link.params();
        absl::StrAppendFormat(
            &out, "%s delay_ms=%g jitter_ms=%g rate_mbytes=%g loss=%g queue_kb=%d%s reorder=%d%s\n",
            LinkName(*table, s, d), p.delay_ms, p.jitter_ms, p.rate_bytes_per_s / 1e6, p.loss,
            link.QueueLimitBytes() / 1024, p.queue_bytes == 0 ? "(auto)" : "", p.reorder ? 1 : 0,
            p.cut ? " cut" : "");
      }
      break;
    case Kind::kStats:
      for (auto [s, d] : cmd.links) {
        const LinkStats& st = table->link(s, d).stats();
        if (st.admitted_packets + st.dropped_cut + st.dropped_loss + st.dropped_queue == 0) {
          continue;
        }
        absl::StrAppendFormat(&out,
                              "%s delivered_packets=%d delivered_bytes=%d admitted_packets=%d "
                              "dropped_loss=%d dropped_cut=%d dropped_queue=%d\n",
                              LinkName(*table, s, d), st.delivered_packets, st.delivered_bytes,
                              st.admitted_packets, st.dropped_loss, st.dropped_cut,
                              st.dropped_queue);
      }
      break;
    case Kind::kNodes:
      for (int i = 0; i < table->size(); ++i) {
        const WanNode& n = table->node(i);
        absl::StrAppendFormat(&out, "%s %s %s\n", n.id, n.region, FormatIpv4(n.address));
      }
      break;
    case Kind::kPing:
    case Kind::kQuit: break;
  }
  return out;
}

ControlReply HandleControlLine(absl::string_view line, LinkTable* table) {
  ControlReply reply;
  auto cmd = ParseControlLine(line, *table);
  if (!cmd.ok()) {
    reply.text = absl::StrCat("error: ", cmd.status().message(), "\n");
    return reply;
  }
  reply.text = ExecuteControl(*cmd, table);
  reply.text += "ok\n";
  reply.quit = cmd->kind == Kind::kQuit;
  return reply;
}

}  // namespace detour::wanem
