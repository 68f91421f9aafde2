#include "coordinator/runner_links.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/link_probe_need.h"
#include "common/log.h"

namespace detour {
namespace {

// Pings per link and round; the smallest round trip counts.
constexpr uint32_t kPings = 3;
// Time the reports of a round may take beyond its budget.
constexpr absl::Duration kReportSlack = absl::Seconds(5);
// Budget of a latency round while the job runs.
constexpr absl::Duration kLatencyBudget = absl::Seconds(15);
// The start's latency round, before the bulk round (at most the bulk
// round's own budget).
constexpr absl::Duration kStartLatencyBudget = absl::Seconds(5);
// A worker measures its links one after another; the bulk round's budget is
// the most any worker's links need (LinkProbeNeed; at least
// link_probe_budget, at most kMaxBulkBudget).
constexpr absl::Duration kMaxBulkBudget = absl::Seconds(120);
// The most a bulk slot while the job runs may take.
constexpr absl::Duration kMaxRunningBulkBudget = absl::Seconds(30);
// Budget of the latency round that checks a cut link no plan avoids.
constexpr absl::Duration kConfirmBudget = absl::Seconds(5);
// A link restored by that check and cut again within this is not checked
// again: its reported side leaves the job at once.
constexpr absl::Duration kReconfirmAfter = absl::Minutes(10);

}  // namespace

RunnerLinks::RunnerLinks(RunnerShared* shared, RunnerLoop* loop) : RunnerPart(shared, loop) {}

std::map<std::string, v1::Peer> RunnerLinks::MemberPeerMap() const {
  std::map<std::string, v1::Peer> out;
  for (v1::Peer& p : MemberPeers(membership_)) out[p.worker_id()] = std::move(p);
  return out;
}

void RunnerLinks::SendRound(const std::map<std::string, std::vector<v1::Peer>>& asked,
                            const std::map<std::string, std::vector<std::string>>& accept,
                            uint64_t bulk_bytes, absl::Duration budget) {
  ++round_;
  waiting_.clear();
  asked_.clear();
  measured_ = LinkMatrix::Ranges();
  std::set<std::string> ids;
  for (const auto& [id, unused] : asked) ids.insert(id);
  for (const auto& [id, unused] : accept) ids.insert(id);
  static const std::vector<v1::Peer> kNone;
  static const std::vector<std::string> kNoIds;
  const RegionLinks table(plan_.network());
  for (const std::string& id : ids) {
    auto a = asked.find(id);
    const std::vector<v1::Peer>& peers = a == asked.end() ? kNone : a->second;
    auto from = accept.find(id);
    const std::vector<std::string>& takes = from == accept.end() ? kNoIds : from->second;
    v1::CoordinatorMessage m;
    v1::LinkProbe* p = m.mutable_probe();
    p->set_job_id(job_id_);
    p->set_round(round_);
    p->set_pings(kPings);
    p->set_bulk_max_bytes(bulk_bytes);
    p->set_budget_ms(
        static_cast<uint32_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(budget))));
    if (options().emulate_network) *p->mutable_emulate_network() = plan_.cluster();
    for (const v1::Peer& peer : peers) {
      *p->add_peers() = peer;
      // What the planner expects of the link: the worker checks its socket
      // limits against it.
      if (auto x = Expectation(id, peer.worker_id(), table)) *p->add_expected() = *std::move(x);
    }
    for (const std::string& other : takes) p->add_accept_from(other);
    if (!link_.SendTo(id, m) || peers.empty()) continue;
    waiting_.insert(id);
    for (const v1::Peer& peer : peers) asked_[id].insert(peer.worker_id());
  }
  round_deadline_ = Now() + budget + kReportSlack;
  last_round_ = Now();
}

std::optional<v1::LinkExpectation> RunnerLinks::Expectation(const std::string& from,
                                                            const std::string& to,
                                                            const RegionLinks& table) const {
  std::optional<double> rtt_s, rate;
  if (const LinkMatrix::Entry* e = plan_.links().Find({from, to}); e != nullptr) {
    if (e->latency_s) rtt_s = 2 * *e->latency_s;
    if (e->bandwidth) rate = *e->bandwidth;
  }
  const auto& infos = membership_.infos();
  auto a = infos.find(from);
  auto b = infos.find(to);
  if ((!rtt_s || !rate) && a != infos.end() && b != infos.end()) {
    const std::string& ra = a->second.region();
    const std::string& rb = b->second.region();
    std::optional<double> latency_ms, gbytes;
    // Within a region, unset figures (0) say nothing.
    if (auto link = table.Between(ra, rb)) {
      if (ra != rb || link->latency_ms > 0) latency_ms = link->latency_ms;
      if (ra != rb || link->bandwidth_gbytes_per_s > 0) gbytes = link->bandwidth_gbytes_per_s;
    }
    if (!rtt_s && latency_ms) rtt_s = 2 * *latency_ms / 1e3;
    if (!rate && gbytes) rate = *gbytes * 1e9;
  }
  if (!rtt_s && !rate) return std::nullopt;
  v1::LinkExpectation x;
  x.set_peer(to);
  // Within the bounds reports are held to (the worker holds expectations to
  // the same ones).
  if (rtt_s && std::isfinite(*rtt_s)) {
    x.set_rtt_s(std::clamp(*rtt_s, 0.0, LinkMatrix::kMaxRttSeconds));
  }
  if (rate && std::isfinite(*rate)) {
    x.set_bandwidth_bytes_per_s(std::clamp(*rate, 0.0, LinkMatrix::kMaxBytesPerS));
  }
  return x;
}

void RunnerLinks::SendRoundToAll(const std::map<std::string, v1::Peer>& workers,
                                 uint64_t bulk_bytes, absl::Duration budget) {
  std::map<std::string, std::vector<v1::Peer>> asked;
  for (const auto& [id, unused] : workers) {
    for (const auto& [other, peer] : workers) {
      if (other != id) asked[id].push_back(peer);
    }
  }
  SendRound(asked, {}, bulk_bytes, budget);
}

std::vector<std::vector<std::pair<std::string, std::string>>> RunnerLinks::ProbeSchedule(
    const std::vector<std::string>& ids) {
  const size_t n = ids.size();
  std::vector<std::vector<std::pair<std::string, std::string>>> slots;
  for (size_t k = 1; k < n; ++k) {
    if (2 * k == n) {  // i -> i + k and i + k -> i at once: a slot each way
      std::vector<std::pair<std::string, std::string>> there, back;
      for (size_t i = 0; i < k; ++i) {
        there.emplace_back(ids[i], ids[i + k]);
        back.emplace_back(ids[i + k], ids[i]);
      }
      slots.push_back(std::move(there));
      slots.push_back(std::move(back));
      continue;
    }
    std::vector<std::pair<std::string, std::string>> slot;
    for (size_t i = 0; i < n; ++i) slot.emplace_back(ids[i], ids[(i + k) % n]);
    slots.push_back(std::move(slot));
  }
  return slots;
}

std::vector<std::pair<std::string, std::string>> RunnerLinks::OneSlotOf(
    const std::vector<std::pair<std::string, std::string>>& links) {
  std::vector<std::pair<std::string, std::string>> out;
  std::set<std::string> sending, taking;
  std::set<std::pair<std::string, std::string>> chosen;
  for (const auto& link : links) {
    if (link.first == link.second || sending.count(link.first) || taking.count(link.second) ||
        chosen.count({link.second, link.first})) {
      continue;
    }
    sending.insert(link.first);
    taking.insert(link.second);
    chosen.insert(link);
    out.push_back(link);
  }
  return out;
}

std::optional<JobEnd> RunnerLinks::AwaitRound() {
  std::optional<JobEnd> end;
  while (!waiting_.empty() && Now() < round_deadline_) {
    RunnerEvent ev = Wait(
        round_deadline_, [&] { return "link probes"; }, /*detect_loss=*/false);
    if (!ev.end) continue;
    // Timed out: go on with what came. Stopped, or a member's error: the
    // caller's to act on.
    if (!ev.timed_out) end = std::move(ev.end);
    break;
  }
  if (!waiting_.empty()) plan_.links().RoundDone(Now());  // else OnReport did
  return end;
}

absl::Duration RunnerLinks::SlotNeed(
    const std::vector<std::pair<std::string, std::string>>& slot) const {
  absl::Duration most = absl::ZeroDuration();
  for (const auto& [from, to] : slot) {
    const LinkMatrix::Entry* e = plan_.links().Find({from, to});
    const bool probed =
        e != nullptr && e->latency_s.has_value() && e->latency_source == v1::JobLink::SOURCE_PROBE;
    most = std::max(
        most, LinkProbeNeed(probed ? std::optional<double>(2 * *e->latency_s) : std::nullopt));
  }
  return most;
}

absl::Duration RunnerLinks::BulkBudget(
    const std::vector<std::vector<std::pair<std::string, std::string>>>& slots) const {
  absl::Duration total = absl::ZeroDuration();
  for (const auto& slot : slots) total += SlotNeed(slot);
  return std::clamp(total, options().link_probe_budget,
                    std::max(options().link_probe_budget, kMaxBulkBudget));
}

void RunnerLinks::ProbeAtStart() {
  if (!options().link_probe || membership_.infos().size() < 2) return;
  std::map<std::string, v1::Peer> workers;
  for (const auto& [id, w] : membership_.infos()) workers[id] = PeerOf(id, w);
  const absl::Time start = absl::Now();
  const uint64_t bulk_bytes = options().link_probe_bytes;
  // Round trips first, every link at once: the bulk rounds' budget grows
  // with them.
  SendRoundToAll(workers, /*bulk_bytes=*/0,
                 bulk_bytes > 0 ? std::min(kStartLatencyBudget, options().link_probe_budget)
                                : options().link_probe_budget);
  AwaitRound();
  size_t total = 0;
  for (const auto& [from, peers] : asked_) total += peers.size();
  LinkMatrix::Ranges m = measured_;
  const size_t silent = waiting_.size();
  absl::Duration budget = absl::ZeroDuration();
  if (bulk_bytes > 0) {
    // Then bandwidth, in slots: a worker sends one probe and takes one at a
    // time, no link carries probes both ways, and each slot gets what is
    // left of the budget in proportion to its need.
    std::vector<std::string> ids;
    for (const auto& [id, unused] : workers) ids.push_back(id);
    const auto slots = ProbeSchedule(ids);
    budget = BulkBudget(slots);
    std::vector<absl::Duration> needs;
    absl::Duration needed = absl::ZeroDuration();
    for (const auto& slot : slots) {
      needs.push_back(SlotNeed(slot));
      needed += needs.back();
    }
    const absl::Time end = Now() + budget;
    for (size_t i = 0; i < slots.size() && !StopRequested() && Now() < end; ++i) {
      std::map<std::string, std::vector<v1::Peer>> asked;
      std::map<std::string, std::vector<std::string>> accept;
      for (const auto& [from, to] : slots[i]) {
        asked[from].push_back(workers[to]);
        accept[to].push_back(from);
      }
      SendRound(asked, accept, bulk_bytes, (end - Now()) * absl::FDivDuration(needs[i], needed));
      needed -= needs[i];
      AwaitRound();
      LinkMatrix::Ranges rates = measured_;
      rates.latencies = 0;  // the latency round counted the links
      m.Merge(rates);
    }
  }
  std::string what =
      absl::StrFormat("link probes: %d of %d links answered (%d with a bulk rate) in %.1f s",
                      m.latencies, total, m.rates, absl::ToDoubleSeconds(absl::Now() - start));
  if (m.latencies > 0) {
    absl::StrAppendFormat(&what, "; one-way latency %.1f-%.1f ms", m.min_latency_s * 1e3,
                          m.max_latency_s * 1e3);
  }
  if (m.rates > 0) {
    absl::StrAppendFormat(&what, ", bandwidth %.1f-%.1f MB/s", m.min_rate / 1e6, m.max_rate / 1e6);
  }
  if (budget > options().link_probe_budget) {
    absl::StrAppendFormat(&what, " (bulk budget %.0f s for the round trips)",
                          absl::ToDoubleSeconds(budget));
  }
  if (silent > 0) absl::StrAppend(&what, "; no report from ", silent, " worker(s)");
  AddEvent(v1::JobHistoryEvent::KIND_LINKS_MEASURED, next_iteration_, "", what);
  waiting_.clear();
  dirty_ = false;  // the first cost model is built from the matrix
  last_bulk_ = Now();
}

void RunnerLinks::OnReport(const std::string& worker, const v1::LinkReport& report) {
  if (report.job_id() != job_id_ || report.round() != round_ || !waiting_.count(worker)) return;
  waiting_.erase(worker);
  const LinkMatrix::Applied applied =
      plan_.links().AddReport(worker, report, asked_[worker], Now());
  if (applied.rejected > 0) {
    LogWarning("job ", job_id_, ": ignored ", applied.rejected, " link measurement(s) from ",
               worker, " (out of bounds or not asked for)");
  }
  measured_.Merge(applied.measured);
  for (const std::string& peer : applied.answered) answered_[{worker, peer}] = round_;
  dirty_ = dirty_ || !applied.answered.empty();
  if (waiting_.empty()) plan_.links().RoundDone(Now());
}

void RunnerLinks::RestoreAnswered() {
  // Cut links whose reporter reached the peer again, in a round sent after
  // the cut.
  bool restored = false;
  const std::set<std::pair<std::string, std::string>> cuts = membership_.cut_links();
  for (auto it = cut_round_.begin(); it != cut_round_.end();) {
    it = cuts.count(it->first) ? std::next(it) : cut_round_.erase(it);
  }
  for (const auto& link : cuts) {
    cut_round_.emplace(link, round_);
    const LinkCut* cut = membership_.CutReport(link);
    if (cut == nullptr) continue;
    auto answered = answered_.find({cut->reporter, cut->peer});
    if (answered == answered_.end() || answered->second <= cut_round_[link]) continue;
    const std::string message =
        absl::StrCat("link ", cut->reporter, " -> ", cut->peer,
                     " answered its probe again; routes may use it (it was cut: ", cut->why, ")");
    const std::string peer = cut->peer;
    membership_.RestoreLink(link);
    cut_round_.erase(link);
    AddEvent(v1::JobHistoryEvent::KIND_LINK_RESTORED, next_iteration_, peer, message);
    restored = true;
  }
  if (restored) {
    if (absl::Status s = plan_.SetCutLinks(membership_.cut_links()); !s.ok()) {
      LogWarning("job ", job_id_, ": restoring links: ", s.message());
    }
  }
}

bool RunnerLinks::ConfirmCut(const std::pair<std::string, std::string>& link,
                             std::optional<JobEnd>* end) {
  if (!options().link_probe) return false;
  for (auto it = confirmed_.begin(); it != confirmed_.end();) {
    it = Now() - it->second >= kReconfirmAfter ? confirmed_.erase(it) : std::next(it);
  }
  if (confirmed_.count(link)) return false;  // restored so lately, and cut again
  const LinkCut* cut = membership_.CutReport(link);
  if (cut == nullptr) return false;
  const std::string reporter = cut->reporter, peer = cut->peer;
  const std::map<std::string, v1::Peer> members = MemberPeerMap();
  if (!members.count(reporter) || !members.count(peer)) return false;
  // One in flight first: its answers are no news of the cut.
  if ((*end = AwaitRound())) return false;
  cut_round_.emplace(link, round_);
  LogInfo("job ", job_id_, ": no plan avoids the cut link ", reporter, " - ", peer, "; asking ",
          reporter, " to probe ", peer, " before ", peer, " leaves the job");
  // The peer takes probes only from those its newest request names. The
  // latency rounds to every member keep their interval from the last one.
  const absl::Time latency_round = last_round_;
  SendRound({{reporter, {members.at(peer)}}}, {{peer, {reporter}}}, /*bulk_bytes=*/0,
            kConfirmBudget);
  last_round_ = latency_round;
  *end = AwaitRound();
  waiting_.clear();  // a silent reporter was counted (RoundDone), not to be waited for again
  if (*end) return false;
  RestoreAnswered();
  Publish();
  if (membership_.CutReport(link) != nullptr) return false;
  confirmed_[link] = Now();
  return true;
}

void RunnerLinks::AtBoundary(const std::map<uint32_t, v1::Route>& routes) {
  if (!waiting_.empty() && Now() > round_deadline_) {
    LogWarning("job ", job_id_, ": link probe round ", round_, ": no report from ", waiting_.size(),
               " worker(s)");
    waiting_.clear();
    plan_.links().RoundDone(Now());
  }
  RestoreAnswered();
  if (dirty_) {
    dirty_ = false;
    if (absl::Status s = plan_.RefreshLinks(); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
    }
  }
  Publish();
  const absl::Duration interval = options().link_probe_interval;
  if (!options().link_probe || interval <= absl::ZeroDuration() || !waiting_.empty()) return;
  const bool latency_due = Now() - last_round_ >= interval;
  if (!latency_due && !bulk_due_) return;
  const std::map<std::string, v1::Peer> members = MemberPeerMap();
  if (members.size() < 2) return;
  if (bulk_due_) {
    bulk_due_ = false;
    last_bulk_ = Now();
    SendBulkSlot(members, CarriedLinks(routes));
  } else {
    SendRoundToAll(members, /*bulk_bytes=*/0, std::min(kLatencyBudget, interval));
    const absl::Duration bulk_interval = options().link_probe_bulk_interval;
    bulk_due_ = options().link_probe_bytes > 0 && bulk_interval > absl::ZeroDuration() &&
                Now() - last_bulk_ >= bulk_interval;
  }
}

std::set<std::pair<std::string, std::string>> RunnerLinks::CarriedLinks(
    const std::map<uint32_t, v1::Route>& routes) const {
  std::set<std::pair<std::string, std::string>> out;
  auto both = [&out](const std::string& a, const std::string& b) {
    if (a == b) return;
    out.emplace(a, b);
    out.emplace(b, a);
  };
  for (const auto& [mb, route] : routes) {
    for (int i = 0; i + 1 < route.nodes_size(); ++i) both(route.nodes(i), route.nodes(i + 1));
    // The loss goes back to the data node.
    if (route.nodes_size() > 0) both(route.nodes(route.nodes_size() - 1), route.data_node());
  }
  // Replicas of a stage exchange their gradients.
  std::map<int, std::vector<std::string>> by_stage;
  for (const auto& [id, stage] : membership_.members()) by_stage[stage].push_back(id);
  for (const auto& [stage, ids] : by_stage) {
    for (size_t i = 0; i < ids.size(); ++i) {
      for (size_t j = i + 1; j < ids.size(); ++j) both(ids[i], ids[j]);
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> RunnerLinks::UncarriedLinks(
    const std::vector<std::pair<std::string, std::string>>& slot,
    const std::set<std::pair<std::string, std::string>>& carried) const {
  const std::set<std::pair<std::string, std::string>> cuts = membership_.cut_links();
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& link : slot) {
    // A cut link: the latency rounds re-probe it. A carried one: the job's
    // transfers measure it, and probes would delay them.
    if (cuts.count(link) || carried.count(link)) continue;
    out.push_back(link);
  }
  return out;
}

void RunnerLinks::SendBulkSlot(const std::map<std::string, v1::Peer>& members,
                               const std::set<std::pair<std::string, std::string>>& carried) {
  std::vector<std::string> ids;
  for (const auto& [id, unused] : members) ids.push_back(id);
  if (ids != bulk_ids_) {  // another schedule: start it from its first slot
    bulk_ids_ = ids;
    next_bulk_slot_ = 0;
    bulk_asked_.clear();
  }
  const auto slots = ProbeSchedule(ids);
  // A link no bulk probe has rated yet (the start's budget ran out before
  // its probes finished: the longest links, on a large cluster) is planned
  // at the region table's rate: those no running slot has asked about go
  // first, out of turn (the turn keeps its place), gathered from every slot
  // of the schedule into as few slots as its rules allow. They are the
  // longest links, spread over most slots of the schedule, and a short job
  // has few running slots. Asked once: a link its probes cannot rate within
  // a slot's budget does not take every slot after it. (The matrix holds a
  // bandwidth only from a probe or a fit to the job's transfers.)
  std::vector<std::pair<std::string, std::string>> unrated;
  for (size_t k = 0; k < slots.size(); ++k) {
    for (const auto& link : UncarriedLinks(slots[(next_bulk_slot_ + k) % slots.size()], carried)) {
      const LinkMatrix::Entry* e = plan_.links().Find(link);
      if ((e == nullptr || !e->bandwidth.has_value()) && !bulk_asked_.count(link)) {
        unrated.push_back(link);
      }
    }
  }
  std::vector<std::pair<std::string, std::string>> links = OneSlotOf(unrated);
  // Else the next slot in turn with a link to measure.
  for (size_t tried = 0; tried < slots.size() && links.empty(); ++tried) {
    links = UncarriedLinks(slots[next_bulk_slot_++ % slots.size()], carried);
  }
  if (links.empty()) return;
  for (const auto& link : links) bulk_asked_.insert(link);
  std::map<std::string, std::vector<v1::Peer>> asked;
  std::map<std::string, std::vector<std::string>> accept;
  for (const auto& [from, to] : links) {
    asked[from].push_back(members.at(to));
    accept[to].push_back(from);
  }
  // The latency rounds keep their own pace.
  const absl::Time latency_round = last_round_;
  SendRound(asked, accept, options().link_probe_bytes,
            std::clamp(SlotNeed(links), kLinkProbeBase, kMaxRunningBulkBudget));
  last_round_ = latency_round;
}

void RunnerLinks::Publish() {
  v1::GetLinksResponse snapshot = plan_.LinkSnapshot(membership_.cut_links());
  absl::MutexLock lock(&published_mu_);
  published_ = std::move(snapshot);
}

std::optional<v1::GetLinksResponse> RunnerLinks::Published() const {
  absl::MutexLock lock(&published_mu_);
  return published_;
}

}  // namespace detour
