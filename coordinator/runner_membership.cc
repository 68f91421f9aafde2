#include "coordinator/runner_membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
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

std::vector<std::pair<std::string, std::string>> RunnerMembership::Judge(
    const std::vector<v1::WorkerInfo>& listed, absl::Time now, absl::Duration grace,
    absl::Duration silence) {
  std::map<std::string, const v1::WorkerInfo*> registry;
  for (const v1::WorkerInfo& w : listed) registry[w.worker_id()] = &w;
  std::vector<std::pair<std::string, std::string>> gone;
  for (const auto& [id, stage] : members_) {
    auto r = registry.find(id);
    std::string why;
    if (r == registry.end()) {
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

void RunnerMembership::NoteLost(const std::vector<std::string>& ids) {
  lost_this_iteration_.insert(ids.begin(), ids.end());
}

std::set<std::string> RunnerMembership::NotJoinable(absl::Time now) const {
  std::set<std::string> out(lost_this_iteration_.begin(), lost_this_iteration_.end());
  for (const auto& [id, s] : members_) out.insert(id);
  for (const auto& [id, until] : join_backoff_) {
    if (now < until) out.insert(id);
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
