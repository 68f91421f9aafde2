#include "coordinator/service_discovery.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/json.h"

namespace detour {
namespace {

std::string Group(const std::string& target,
                  const std::vector<std::pair<std::string, std::string>>& labels) {
  std::string out = absl::StrCat("{\"targets\":[", JsonQuote(target), "],\"labels\":{");
  for (size_t i = 0; i < labels.size(); ++i) {
    absl::StrAppend(&out, i > 0 ? "," : "", JsonQuote(labels[i].first), ":",
                    JsonQuote(labels[i].second));
  }
  out += "}}";
  return out;
}

std::string StateName(v1::WorkerState state) {
  return absl::AsciiStrToLower(v1::WorkerState_Name(state).substr(13));  // "WORKER_STATE_"
}

}  // namespace

std::string ServiceDiscoveryJson(const std::string& coordinator_target,
                                 const std::vector<v1::WorkerInfo>& workers) {
  std::vector<std::string> groups;
  if (!coordinator_target.empty()) {
    groups.push_back(Group(coordinator_target, {{"role", "coordinator"}}));
  }
  for (const v1::WorkerInfo& w : workers) {
    if (w.metrics_address().empty()) continue;
    groups.push_back(
        Group(w.metrics_address(), {{"role", "worker"},
                                    {"__meta_detour_worker_id", w.worker_id()},
                                    {"__meta_detour_region", w.region()},
                                    {"__meta_detour_device", w.device()},
                                    {"__meta_detour_worker_state", StateName(w.state())}}));
  }
  std::string out = "[";
  for (size_t i = 0; i < groups.size(); ++i) absl::StrAppend(&out, i > 0 ? ",\n" : "\n", groups[i]);
  out += groups.empty() ? "]\n" : "\n]\n";
  return out;
}

}  // namespace detour
