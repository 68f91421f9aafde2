#include "coordinator/runner_membership.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

absl::Time FromProto(const google::protobuf::Timestamp& t) {
  return absl::FromUnixNanos(google::protobuf::util::TimeUtil::TimestampToNanoseconds(t));
}

bool SameTime(const google::protobuf::Timestamp& a, const google::protobuf::Timestamp& b) {
  return a.seconds() == b.seconds() && a.nanos() == b.nanos();
}

}  // namespace

int RunnerMembership::Remove(const std::string& id) {
  auto it = members_.find(id);
  if (it == members_.end()) return -1;
  const int stage = it->second;
  members_.erase(it);
  exclusion_pending_.erase(id);
  return stage;
}

bool RunnerMembership::HasNode(const std::string& id) const {
  return std::find(node_order_.begin(), node_order_.end(), id) != node_order_.end();
}

void RunnerMembership::Admit(const v1::WorkerInfo& w) {
  infos_[w.worker_id()] = w;
  if (!HasNode(w.worker_id())) node_order_.push_back(w.worker_id());
}

void RunnerMembership::Suspect(const std::string& id, const std::string& why, absl::Time now) {
  if (!members_.count(id)) return;
  suspects_.emplace(id, std::make_pair(now, why));
}

void RunnerMembership::ReportUnreachable(const std::string& reporter, const std::string& peer,
                                         const std::string& why, absl::Time now) {
  if (reporter == peer || !members_.count(reporter) || !members_.count(peer)) return;
  reports_[peer].emplace(reporter, Report{now, why});
  unjudged_reports_.insert(peer);
}

std::vector<LinkCut> RunnerMembership::TakeNewCuts() {
  std::vector<LinkCut> cuts;
  cuts.swap(new_cuts_);
  return cuts;
}

void RunnerMembership::ForgetLinks(const std::string& id) {
  reports_.erase(id);
  unjudged_reports_.erase(id);
  for (auto& [peer, by] : reports_) by.erase(id);
  for (auto it = cut_reports_.begin(); it != cut_reports_.end();) {
    it = it->first.first == id || it->first.second == id ? cut_reports_.erase(it) : std::next(it);
  }
}

std::set<std::pair<std::string, std::string>> RunnerMembership::cut_links() const {
  std::set<std::pair<std::string, std::string>> links;
  for (const auto& [link, report] : cut_reports_) links.insert(link);
  return links;
}

const LinkCut* RunnerMembership::CutReport(const std::pair<std::string, std::string>& link) const {
  auto it = cut_reports_.find(link);
  return it == cut_reports_.end() ? nullptr : &it->second;
}

// Peers' reports against the registry's view: a cut link or a suspicion.
void RunnerMembership::JudgeReports(const std::map<std::string, const v1::WorkerInfo*>& registry,
                                    absl::Time now) {
  std::set<std::string> pending;
  for (const std::string& peer : unjudged_reports_) {
    auto reports = reports_.find(peer);
    if (reports == reports_.end() || !members_.count(peer)) continue;
    auto r = registry.find(peer);
    const bool talking = r != registry.end() && r->second->session_open() &&
                         r->second->state() != v1::WORKER_STATE_LOST;
    std::vector<std::string> reporters;
    for (const auto& [reporter, report] : reports->second) {
      if (members_.count(reporter)) reporters.push_back(reporter);
    }
    if (reporters.empty()) continue;
    const Report& first = reports->second.at(reporters.front());
    if (!talking || reporters.size() >= 2) {
      Suspect(
          peer,
          absl::StrCat(absl::StrJoin(reporters, " and "), " could not reach it (", first.why, ")"),
          first.when);
      continue;
    }
    if (now - first.when < kLinkConfirm) {
      pending.insert(peer);  // its session may be closing (a killed worker)
      continue;
    }
    const std::pair<std::string, std::string> link = std::minmax(reporters.front(), peer);
    const LinkCut cut{reporters.front(), peer, first.why};
    if (cut_reports_.emplace(link, cut).second) new_cuts_.push_back(cut);
  }
  unjudged_reports_ = std::move(pending);
}

std::vector<std::pair<std::string, std::string>> RunnerMembership::Judge(
    const std::vector<v1::WorkerInfo>& listed, absl::Time now, absl::Duration grace,
    absl::Duration silence) {
  std::map<std::string, const v1::WorkerInfo*> registry;
  for (const v1::WorkerInfo& w : listed) registry[w.worker_id()] = &w;
  JudgeReports(registry, now);
  std::vector<std::pair<std::string, std::string>> gone;
  for (const auto& [id, stage] : members_) {
    auto r = registry.find(id);
    std::string why;
    if (auto e = excluded_.find(id); e != excluded_.end() && now < e->second.first) {
      why = e->second.second;
    } else if (r == registry.end()) {
      why = "it is no longer registered";
    } else if (r->second->state() == v1::WORKER_STATE_LOST) {
      why = absl::StrCat("no heartbeat for ", absl::FormatDuration(silence));
    } else if (!r->second->session_open() &&
               now - FromProto(r->second->session_change_time()) > grace) {
      why = absl::StrCat("its session closed ",
                         absl::FormatDuration(now - FromProto(r->second->session_change_time())),
                         " ago");
    } else if (infos_.count(id) &&
               !SameTime(r->second->registered_time(), infos_.at(id).registered_time())) {
      // It registered anew: a restarted process, or one that reconnected.
      // One that still holds the job says so (JobStatus).
      Suspect(id, "it registered again without the job", now);
    }
    auto s = suspects_.find(id);
    if (why.empty() && s != suspects_.end() && now - s->second.first > grace) {
      why = s->second.second;
    }
    if (!why.empty()) gone.emplace_back(id, why);
  }
  return gone;
}

std::optional<RunnerMembership::Exclusion> RunnerMembership::ReportBadFrame(
    const std::string& reporter, const std::string& sender, bool sends, const std::string& what,
    std::string* refused) {
  if (!members_.count(reporter)) {
    *refused = "the reporter is not a member";
    return std::nullopt;
  }
  if (reporter == sender || !members_.count(sender)) {
    *refused =
        absl::StrCat("\"", absl::CHexEscape(sender.substr(0, 64)), "\" is not another live member");
    return std::nullopt;
  }
  if (!sends) {
    *refused = absl::StrCat(sender, " sends no such frame to ", reporter, " in this iteration");
    return std::nullopt;
  }
  const std::string said = absl::CHexEscape(what.substr(0, 200));
  auto earlier = excluded_by_.find(reporter);
  if (earlier != excluded_by_.end() && earlier->second != sender) {
    return Exclusion{reporter,
                     absl::StrCat("excluded: it reported bad frames from a second member (",
                                  earlier->second, ", then ", sender,
                                  "); one member seeing bad frames from two senders is "
                                  "the more likely fault")};
  }
  excluded_by_[reporter] = sender;
  return Exclusion{sender, absl::StrCat("excluded: ", reporter, " received a frame from it with ",
                                        "values no honest training sends (", said, ")")};
}

bool RunnerMembership::PlanSends(const std::map<uint32_t, v1::Route>& routes,
                                 const std::string& sender, const std::string& receiver,
                                 v1::Direction direction, uint32_t mb) const {
  if (direction == v1::DIRECTION_ALLREDUCE) {
    auto s = members_.find(sender);
    auto r = members_.find(receiver);
    return s != members_.end() && r != members_.end() && s->second == r->second;
  }
  if (direction != v1::DIRECTION_FORWARD && direction != v1::DIRECTION_BACKWARD) return false;
  auto it = routes.find(mb);
  if (it == routes.end()) return false;
  const v1::Route& route = it->second;
  const int n = route.nodes_size();
  // The edge nodes(i) -> next carries the forward; the backward goes back.
  for (int i = 0; n >= 2 && i < n; ++i) {
    const std::string& next = i + 1 < n ? route.nodes(i + 1) : route.data_node();
    const std::string& from = direction == v1::DIRECTION_FORWARD ? route.nodes(i) : next;
    const std::string& to = direction == v1::DIRECTION_FORWARD ? next : route.nodes(i);
    if (from == sender && to == receiver) return true;
  }
  return false;
}

void RunnerMembership::Exclude(const std::string& id, const std::string& why, absl::Time now) {
  excluded_[id] = {now + kExcludeBackoff, why};
  if (members_.count(id)) exclusion_pending_.insert(id);
}

bool RunnerMembership::Excluded(const std::string& id, absl::Time now) const {
  auto it = excluded_.find(id);
  return it != excluded_.end() && now < it->second.first;
}

bool RunnerMembership::ExclusionPending() const { return !exclusion_pending_.empty(); }

void RunnerMembership::NoteLost(const std::vector<std::string>& ids) {
  lost_this_iteration_.insert(ids.begin(), ids.end());
}

std::set<std::string> RunnerMembership::NotJoinable(absl::Time now) const {
  std::set<std::string> out(lost_this_iteration_.begin(), lost_this_iteration_.end());
  for (const auto& [id, s] : members_) out.insert(id);
  for (const auto& [id, until] : join_backoff_) {
    if (now < until) out.insert(id);
  }
  for (const auto& [id, e] : excluded_) {
    if (now < e.first) out.insert(id);
  }
  return out;
}

std::map<int, int> RunnerMembership::Deficit(const v1::PipelineSpec& pipeline,
                                             const std::vector<int>& have) {
  std::map<int, int> deficit;
  for (int s = 0; s < static_cast<int>(have.size()); ++s) {
    const int target = s == 0 ? static_cast<int>(pipeline.data_nodes())
                              : static_cast<int>(pipeline.replicas_per_stage());
    if (have[s] < target) deficit[s] = target - have[s];
  }
  return deficit;
}

}  // namespace detour
