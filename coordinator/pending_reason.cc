#include "coordinator/pending_reason.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace detour {
namespace {

const v1::WorkerInfo* Find(const std::vector<v1::WorkerInfo>& workers, const std::string& id) {
  for (const v1::WorkerInfo& w : workers) {
    if (w.worker_id() == id) return &w;
  }
  return nullptr;
}

bool Holds(const std::vector<v1::WorkerInfo>& workers, const std::string& id) {
  return Find(workers, id) != nullptr;
}

// "2 data nodes + 3 stages × 2 replicas": where the count comes from.
std::string NeededText(const v1::PipelineSpec& p) {
  std::string text =
      absl::StrCat(p.data_nodes(), p.data_nodes() == 1 ? " data node" : " data nodes");
  if (p.num_stages() > 1) {
    absl::StrAppend(&text, " + ", p.num_stages() - 1, p.num_stages() == 2 ? " stage" : " stages",
                    " × ", p.replicas_per_stage(),
                    p.replicas_per_stage() == 1 ? " replica" : " replicas");
  }
  return text;
}

}  // namespace

size_t WorkersNeeded(const v1::JobSpec& spec) {
  const v1::PipelineSpec& p = spec.pipeline();
  const size_t later = p.num_stages() > 0 ? p.num_stages() - 1 : 0;
  return p.data_nodes() + later * size_t{p.replicas_per_stage()};
}

std::string PendingReason(const v1::JobSpec& spec, const std::vector<v1::WorkerInfo>& registered,
                          const std::vector<v1::WorkerInfo>& free) {
  const size_t needed = WorkersNeeded(spec);
  std::set<std::string> pinned;
  for (const v1::StageNodes& g : spec.pipeline().assignment()) {
    pinned.insert(g.nodes().begin(), g.nodes().end());
  }
  if (pinned.empty()) {
    if (registered.size() < needed) {
      return absl::StrCat("waiting for workers: needs ", needed, " (", NeededText(spec.pipeline()),
                          "), ", registered.size(), " registered; it cannot start until ",
                          needed - registered.size(), " more register");
    }
    return absl::StrCat("waiting for idle workers: needs ", needed, ", ", registered.size(),
                        " registered, ", free.size(), " idle (the others hold other jobs)");
  }
  std::vector<std::string> unregistered;
  std::vector<std::string> unconnected;
  std::vector<std::string> busy;
  for (const std::string& id : pinned) {
    const v1::WorkerInfo* w = Find(registered, id);
    if (w == nullptr) {
      unregistered.push_back(id);
    } else if (!Holds(free, id)) {
      (w->session_open() ? busy : unconnected).push_back(id);
    }
  }
  std::string text = "waiting for the pinned workers (pipeline.assignment):";
  if (!unregistered.empty()) {
    absl::StrAppend(&text, " ", absl::StrJoin(unregistered, ", "),
                    unregistered.size() == 1 ? " is" : " are",
                    " not registered, so it cannot start until ",
                    unregistered.size() == 1 ? "it registers" : "they register");
  }
  if (!unconnected.empty()) {
    absl::StrAppend(&text, unregistered.empty() ? " " : "; ", absl::StrJoin(unconnected, ", "),
                    unconnected.size() == 1 ? " is" : " are",
                    " registered without an open session (connecting, or reconnecting)");
  }
  if (!busy.empty()) {
    absl::StrAppend(&text, unregistered.empty() && unconnected.empty() ? " " : "; ",
                    absl::StrJoin(busy, ", "), busy.size() == 1 ? " is" : " are",
                    " busy with another job");
  }
  if (unregistered.empty() && unconnected.empty() && busy.empty()) {
    absl::StrAppend(&text, " they are idle, but fewer than the ", needed, " the job needs");
  }
  return text;
}

}  // namespace detour
