#include "worker/runtime/iteration_tracker.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace detour {

IterationTracker::IterationTracker(const v1::IterationPlan& plan, std::string me)
    : me_(std::move(me)), iteration_(plan.iteration()), epoch_(plan.epoch()) {
  for (const v1::Route& r : plan.routes()) {
    Mb& m = mbs_[r.microbatch()];
    SetRoute(m, r);
    plan_order_.push_back(r.microbatch());
  }
}

void IterationTracker::SetRoute(Mb& m, const v1::Route& route) {
  m = Mb{};
  m.route = route;
  for (int p = 0; p < route.nodes_size(); ++p) {
    if (route.nodes(p) == me_) {
      m.position = p;
      break;
    }
  }
}

bool IterationTracker::Finished(const Mb& m) const { return m.position < 0 || m.backward; }

const v1::Route* IterationTracker::route(uint32_t mb) const {
  auto it = mbs_.find(mb);
  if (it == mbs_.end() || it->second.frozen) return nullptr;
  return &it->second.route;
}

std::vector<uint32_t> IterationTracker::Own() const {
  std::vector<uint32_t> own;
  for (uint32_t mb : plan_order_) {
    const Mb& m = mbs_.at(mb);
    if (!m.frozen && m.route.data_node() == me_) own.push_back(mb);
  }
  return own;
}

std::map<uint32_t, std::vector<int>> IterationTracker::RouteStages() const {
  std::map<uint32_t, std::vector<int>> stages;
  for (const auto& [mb, m] : mbs_) {
    if (m.frozen) continue;
    stages[mb].assign(m.route.stages().begin(), m.route.stages().end());
  }
  return stages;
}

IterationTracker::Incoming IterationTracker::Accept(const v1::FrameHeader& h) {
  Incoming in;
  auto it = mbs_.find(h.microbatch());
  if (it == mbs_.end()) return in;
  Mb& m = it->second;
  if (m.frozen || h.epoch() != m.route.epoch()) {
    in.verdict = h.epoch() > m.route.epoch() ? Verdict::kEarly : Verdict::kStale;
    return in;
  }
  const v1::Route& r = m.route;
  const int hop = static_cast<int>(h.hop());
  const int n = r.nodes_size();
  // This node's hop, and from the node the route has send it: a forward
  // comes from the node before (the loss's from the last node), a backward
  // from the node after (the last node's from the data node, which ran the
  // loss). Another member's copy is not taken, even before the real one.
  bool expected;
  if (h.direction() == v1::DIRECTION_FORWARD) {
    expected = hop > 0 && hop <= n && h.sender() == r.nodes(hop - 1) &&
               (hop < n ? r.nodes(hop) == me_ : r.data_node() == me_);
  } else if (h.direction() == v1::DIRECTION_BACKWARD) {
    expected = hop >= 0 && hop < n && r.nodes(hop) == me_ &&
               h.sender() == (hop + 1 < n ? r.nodes(hop + 1) : r.data_node());
  } else {
    expected = false;
  }
  if (!expected) return in;
  const std::string key = absl::StrCat(h.direction(), "/", hop);
  if (!m.applied.insert(key).second) return in;  // a second copy
  in.verdict = Verdict::kRun;
  in.hop = hop;
  in.loss = h.direction() == v1::DIRECTION_FORWARD && hop == r.nodes_size();
  return in;
}

void IterationTracker::ForwardRan(uint32_t mb) {
  auto it = mbs_.find(mb);
  if (it != mbs_.end()) it->second.forward = true;
}

void IterationTracker::LossRan(uint32_t mb, double loss, uint64_t tokens) {
  auto it = mbs_.find(mb);
  if (it == mbs_.end()) return;
  it->second.loss = true;
  it->second.loss_value = loss;
  it->second.tokens = tokens;
}

void IterationTracker::BackwardRan(uint32_t mb, int hop) {
  auto it = mbs_.find(mb);
  if (it == mbs_.end()) return;
  it->second.backward = true;
  ++visits_;
  (void)hop;
}

std::optional<uint32_t> IterationTracker::FirstBackwardOwed() const {
  for (const auto& [mb, m] : mbs_) {  // ascending
    if (!m.frozen && !Finished(m)) return mb;
  }
  return std::nullopt;
}

bool IterationTracker::ForwardDone(uint32_t mb) const {
  auto it = mbs_.find(mb);
  return it != mbs_.end() && it->second.forward;
}

bool IterationTracker::BackwardDone(uint32_t mb) const {
  auto it = mbs_.find(mb);
  return it != mbs_.end() && it->second.backward;
}

std::vector<uint32_t> IterationTracker::Completed() const {
  std::vector<uint32_t> done;
  for (const auto& [mb, m] : mbs_) {
    if (!m.frozen && m.position == 0 && m.backward) done.push_back(mb);
  }
  return done;
}

double IterationTracker::completed_loss() const {
  double sum = 0;
  for (const auto& [mb, m] : mbs_) {
    if (!m.frozen && m.position == 0 && m.backward) sum += m.loss_value;
  }
  return sum;
}

uint64_t IterationTracker::completed_tokens() const {
  uint64_t sum = 0;
  for (const auto& [mb, m] : mbs_) {
    if (!m.frozen && m.position == 0 && m.backward) sum += m.tokens;
  }
  return sum;
}

int IterationTracker::live_microbatches() const {
  int live = 0;
  for (const auto& [mb, m] : mbs_) live += m.frozen ? 0 : 1;
  return live;
}

bool IterationTracker::LocalWorkDone() const {
  if (awaiting_amendment_) return false;
  for (const auto& [mb, m] : mbs_) {
    if (!m.frozen && !Finished(m)) return false;
  }
  return true;
}

IterationTracker::Frozen IterationTracker::Freeze(const std::set<std::string>& lost,
                                                  uint64_t epoch) {
  Frozen out;
  lost_.insert(lost.begin(), lost.end());
  epoch_ = epoch;
  awaiting_amendment_ = true;
  for (auto& [mb, m] : mbs_) {
    bool crosses = false;
    for (const std::string& n : m.route.nodes()) crosses |= lost_.count(n) > 0;
    if (!crosses && !m.frozen) continue;
    // A microbatch whose backward reached its data node here is complete:
    // nothing of it is lost.
    if (!m.frozen && m.position == 0 && m.backward) {
      out.completed.push_back(mb);
      continue;
    }
    if (!m.frozen) {
      m.frozen = true;
      out.microbatches.push_back(mb);
    }
    // Cumulative over the iteration's freezes: the coordinator decides from
    // the last epoch's acks alone.
    if (m.backward || m.loss) out.backward_ran.push_back(mb);
  }
  return out;
}

absl::Status IterationTracker::Amend(uint64_t epoch, const std::vector<v1::Route>& routes) {
  if (epoch != epoch_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "route amendment of epoch ", epoch, " while the membership is at epoch ", epoch_));
  }
  for (const v1::Route& r : routes) {
    auto it = mbs_.find(r.microbatch());
    if (it == mbs_.end() || !it->second.frozen) {
      return absl::InvalidArgumentError(
          absl::StrCat("amended route for microbatch ", r.microbatch(), ", which is not frozen"));
    }
    if (r.epoch() != epoch) {
      return absl::InvalidArgumentError(absl::StrCat("amended route for microbatch ",
                                                     r.microbatch(), " has epoch ", r.epoch(),
                                                     ", not ", epoch));
    }
    for (const std::string& n : r.nodes()) {
      if (lost_.count(n)) {
        return absl::InvalidArgumentError(absl::StrCat("amended route for microbatch ",
                                                       r.microbatch(), " crosses lost worker ", n));
      }
    }
    if (it->second.backward || it->second.loss) {
      return absl::FailedPreconditionError(
          absl::StrCat("microbatch ", r.microbatch(),
                       " cannot run again: its backward ran here already "
                       "(its gradient would count twice)"));
    }
  }
  for (const v1::Route& r : routes) SetRoute(mbs_[r.microbatch()], r);
  awaiting_amendment_ = false;
  return absl::OkStatus();
}

std::vector<std::string> PlanSendTargets(const v1::IterationPlan& plan, const std::string& me,
                                         const std::vector<std::string>& group) {
  std::set<std::string> targets(group.begin(), group.end());
  for (const v1::Route& r : plan.routes()) {
    const int n = r.nodes_size();
    for (int i = 0; i < n; ++i) {
      if (r.nodes(i) != me) continue;
      targets.insert(i + 1 < n ? r.nodes(i + 1) : r.data_node());
      targets.insert(i > 0 ? r.nodes(i - 1) : r.nodes(n - 1));
    }
  }
  targets.erase(me);
  return {targets.begin(), targets.end()};
}

}  // namespace detour
