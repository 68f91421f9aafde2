#include "coordinator/runner_links.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace detour {
namespace {

// Pings per link and round; the smallest round trip counts.
constexpr uint32_t kPings = 3;
// Time the reports of a round may take beyond its budget.
constexpr absl::Duration kReportSlack = absl::Seconds(5);
// Budget of a latency round while the job runs.
constexpr absl::Duration kLatencyBudget = absl::Seconds(15);

}  // namespace

RunnerLinks::RunnerLinks(RunnerShared* shared, RunnerLoop* loop) : RunnerPart(shared, loop) {}

std::map<std::string, v1::Peer> RunnerLinks::MemberPeerMap() const {
  std::map<std::string, v1::Peer> out;
  for (v1::Peer& p : MemberPeers(membership_)) out[p.worker_id()] = std::move(p);
  return out;
}

void RunnerLinks::SendRound(const std::map<std::string, v1::Peer>& workers, uint64_t bulk_bytes,
                            absl::Duration budget) {
  ++round_;
  waiting_.clear();
  asked_.clear();
  v1::CoordinatorMessage m;
  v1::LinkProbe* p = m.mutable_probe();
  p->set_job_id(job_id_);
  p->set_round(round_);
  p->set_pings(kPings);
  p->set_bulk_max_bytes(bulk_bytes);
  p->set_budget_ms(static_cast<uint32_t>(std::max<int64_t>(1, absl::ToInt64Milliseconds(budget))));
  if (options().emulate_network) *p->mutable_emulate_network() = plan_.cluster();
  for (const auto& [id, peer] : workers) *p->add_peers() = peer;
  for (const auto& [id, peer] : workers) {
    if (!link_.SendTo(id, m)) continue;
    waiting_.insert(id);
    for (const auto& [other, unused] : workers) {
      if (other != id) asked_[id].insert(other);
    }
  }
  round_deadline_ = Now() + budget + kReportSlack;
  last_round_ = Now();
}

void RunnerLinks::ProbeAtStart() {
  if (!options().link_probe || membership_.infos().size() < 2) return;
  std::map<std::string, v1::Peer> workers;
  for (const auto& [id, w] : membership_.infos()) {
    v1::Peer p;
    p.set_worker_id(id);
    p.set_address(w.address());
    p.set_data_address(w.data_address());
    p.set_region(w.region());
    workers[id] = std::move(p);
  }
  const absl::Time start = absl::Now();
  SendRound(workers, options().link_probe_bytes, options().link_probe_budget);
  while (!waiting_.empty() && Now() < round_deadline_) {
    RunnerEvent ev = Wait(
        round_deadline_, [&] { return "link probes"; }, /*detect_loss=*/false);
    if (ev.end) break;  // stopped or timed out: plan on what came
  }
  size_t probed = 0, with_rate = 0, total = 0;
  double min_latency = 0, max_latency = 0, min_rate = 0, max_rate = 0;
  for (const auto& [from, peers] : asked_) {
    for (const std::string& to : peers) {
      ++total;
      const LinkMatrix::Entry* e = plan_.links().Find({from, to});
      if (e == nullptr) continue;
      if (e->latency_s && e->latency_source == v1::JobLink::SOURCE_PROBE) {
        min_latency = probed == 0 ? *e->latency_s : std::min(min_latency, *e->latency_s);
        max_latency = std::max(max_latency, *e->latency_s);
        ++probed;
      }
      if (e->bandwidth && e->bandwidth_source == v1::JobLink::SOURCE_PROBE) {
        min_rate = with_rate == 0 ? *e->bandwidth : std::min(min_rate, *e->bandwidth);
        max_rate = std::max(max_rate, *e->bandwidth);
        ++with_rate;
      }
    }
  }
  if (!waiting_.empty()) plan_.links().RoundDone(Now());  // else OnReport did
  std::string what =
      absl::StrFormat("link probes: %d of %d links answered (%d with a bulk rate) in %.1f s",
                      probed, total, with_rate, absl::ToDoubleSeconds(absl::Now() - start));
  if (probed > 0) {
    absl::StrAppendFormat(&what, "; one-way latency %.1f-%.1f ms", min_latency * 1e3,
                          max_latency * 1e3);
  }
  if (with_rate > 0) {
    absl::StrAppendFormat(&what, ", bandwidth %.1f-%.1f MB/s", min_rate / 1e6, max_rate / 1e6);
  }
  if (!waiting_.empty()) absl::StrAppend(&what, "; no report from ", waiting_.size(), " worker(s)");
  AddEvent(v1::JobHistoryEvent::KIND_LINKS_MEASURED, next_iteration_, "", what);
  waiting_.clear();
  dirty_ = false;  // the first cost model is built from the matrix
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
  for (const std::string& peer : applied.answered) answered_[{worker, peer}] = round_;
  dirty_ = dirty_ || !applied.answered.empty();
  if (waiting_.empty()) plan_.links().RoundDone(Now());
}

void RunnerLinks::AtBoundary() {
  if (!waiting_.empty() && Now() > round_deadline_) {
    LogWarning("job ", job_id_, ": link probe round ", round_, ": no report from ", waiting_.size(),
               " worker(s)");
    waiting_.clear();
    plan_.links().RoundDone(Now());
  }
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
  if (dirty_) {
    dirty_ = false;
    if (absl::Status s = plan_.RefreshLinks(); !s.ok()) {
      LogWarning("job ", job_id_, ": keeping the old cost model: ", s.message());
    }
  }
  Publish();
  const absl::Duration interval = options().link_probe_interval;
  if (!options().link_probe || interval <= absl::ZeroDuration() || !waiting_.empty() ||
      Now() - last_round_ < interval) {
    return;
  }
  const std::map<std::string, v1::Peer> members = MemberPeerMap();
  if (members.size() < 2) return;
  SendRound(members, /*bulk_bytes=*/0, std::min(kLatencyBudget, interval));
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
