#include "worker/runtime/bubble_schedule.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace detour {

std::string BubbleSchedule::Name(const v1::BubbleTask& t) {
  std::string name = absl::AsciiStrToLower(v1::BubbleTask::Kind_Name(t.kind()).substr(5));
  absl::StrAppend(&name, "(layer ", t.layer());
  if (!t.module().empty()) absl::StrAppend(&name, " ", t.module());
  if (IsCurvature(t)) absl::StrAppend(&name, " mb ", t.microbatch());
  if (t.num_parts() > 1) absl::StrAppend(&name, " part ", t.part() + 1, "/", t.num_parts());
  absl::StrAppend(&name, ", refresh ", t.refresh(), ")");
  return name;
}

bool BubbleSchedule::IsCurvature(const v1::BubbleTask& t) {
  return t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
         t.kind() == v1::BubbleTask::KIND_CURVATURE_B;
}

bool BubbleSchedule::IsInversion(const v1::BubbleTask& t) {
  return t.kind() == v1::BubbleTask::KIND_INVERT_A || t.kind() == v1::BubbleTask::KIND_INVERT_B;
}

absl::Status BubbleSchedule::Take(const v1::IterationPlan& plan, const std::string& me,
                                  bool replicated, std::vector<uint32_t>* capture) {
  tasks_.clear();
  sync_layers_.clear();
  std::vector<v1::BubbleTask> in_gaps, serial;
  std::map<uint32_t, bool> routed;
  for (const v1::Route& r : plan.routes()) routed[r.microbatch()] = true;
  for (const v1::BubbleTask& t : plan.bubble_tasks()) {
    if (t.node() != me) continue;
    if (!kfac_) {
      return absl::InvalidArgumentError(
          absl::StrCat("the plan gives K-FAC task ", Name(t), " to a job without K-FAC"));
    }
    if (static_cast<int>(t.layer()) < layer_begin_ || static_cast<int>(t.layer()) >= layer_end_) {
      return absl::InvalidArgumentError(absl::StrCat("K-FAC task ", Name(t),
                                                     " names a layer this stage (", layer_begin_,
                                                     "-", layer_end_ - 1, ") does not hold"));
    }
    // Parts: 0 = unsplit (plans from before parts); at most one per unit.
    const uint32_t parts = std::max<uint32_t>(1, t.num_parts());
    if (t.part() >= parts) {
      return absl::InvalidArgumentError(
          absl::StrCat("K-FAC task ", Name(t), ": part ", t.part(), " of ", parts));
    }
    size_t units = 0;
    const int module = kfac::ModuleIndex(t.module());
    switch (t.kind()) {
      case v1::BubbleTask::KIND_CURVATURE_A:
      case v1::BubbleTask::KIND_CURVATURE_B:
        units = block_.CurvatureItemWeights(t.kind() == v1::BubbleTask::KIND_CURVATURE_A).size();
        break;
      case v1::BubbleTask::KIND_INVERT_A:
      case v1::BubbleTask::KIND_INVERT_B:
        if (module < 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "K-FAC task ", Name(t), " names no projection (q, k, v, o, gate, up, down)"));
        }
        units = kfac::InversionUnitWeights(t.kind() == v1::BubbleTask::KIND_INVERT_A
                                               ? block_.f_in(module)
                                               : block_.f_out(module))
                    .size();
        break;
      default: units = parts;
    }
    if (block_.shape().d_model > 0 && parts > units) {
      return absl::InvalidArgumentError(absl::StrCat("K-FAC task ", Name(t), ": ", parts,
                                                     " parts for an item of ", units, " units"));
    }
    switch (t.kind()) {
      case v1::BubbleTask::KIND_CURVATURE_A:
      case v1::BubbleTask::KIND_CURVATURE_B:
        if (!routed.count(t.microbatch())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "K-FAC task ", Name(t), " names a microbatch the plan has no route for"));
        }
        if (std::find(capture->begin(), capture->end(), t.microbatch()) == capture->end()) {
          capture->push_back(t.microbatch());
        }
        break;
      case v1::BubbleTask::KIND_SYNC_FACTORS:
        if (replicated) sync_layers_.push_back(static_cast<int>(t.layer()));
        continue;
      case v1::BubbleTask::KIND_INVERT_A:
      case v1::BubbleTask::KIND_INVERT_B: break;
      case v1::BubbleTask::KIND_PRECONDITION: continue;  // part of every K-FAC step
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("unknown K-FAC task kind ", static_cast<int>(t.kind())));
    }
    (t.serial() ? serial : in_gaps).push_back(t);
  }
  tasks_.assign(in_gaps.begin(), in_gaps.end());
  tasks_.insert(tasks_.end(), serial.begin(), serial.end());
  std::sort(sync_layers_.begin(), sync_layers_.end());
  sync_layers_.erase(std::unique(sync_layers_.begin(), sync_layers_.end()), sync_layers_.end());
  return absl::OkStatus();
}

bool BubbleSchedule::SyncsLayer(int layer) const {
  return std::binary_search(sync_layers_.begin(), sync_layers_.end(), layer);
}

bool BubbleSchedule::Ready(const v1::BubbleTask& t, const IterationTracker& tracker,
                           bool waiting_step) const {
  if (IsCurvature(t)) {
    const bool input = t.kind() == v1::BubbleTask::KIND_CURVATURE_A
                           ? tracker.ForwardDone(t.microbatch())
                           : tracker.BackwardDone(t.microbatch());
    if (!input) return false;
    // A factor sums its microbatches in plan order, whatever the timing:
    // runs given the same plans compute the same bits.
    for (const v1::BubbleTask& o : tasks_) {
      if (&o == &t) break;
      if (o.kind() == t.kind() && o.layer() == t.layer()) return false;
    }
    if (t.refresh() == 0) return true;
    auto done = finalized_refresh_.find(static_cast<int>(t.layer()));
    if (done != finalized_refresh_.end() && done->second + 1 >= t.refresh()) return true;
    for (const v1::BubbleTask& o : tasks_) {
      if (IsInversion(o) && o.layer() == t.layer() && o.refresh() < t.refresh()) return false;
    }
    return true;
  }
  for (const v1::BubbleTask& o : tasks_) {
    if (IsCurvature(o) && o.layer() == t.layer() && o.refresh() <= t.refresh()) return false;
    // An inversion's parts in order; the next refresh's inversions of a
    // layer after the previous refresh's (its first one finalises the
    // factors that those still read).
    if (o.kind() == t.kind() && o.layer() == t.layer() && o.module() == t.module() &&
        o.refresh() == t.refresh() && o.part() < t.part()) {
      return false;
    }
    if (IsInversion(o) && o.layer() == t.layer() && o.refresh() < t.refresh()) return false;
  }
  return !SyncsLayer(static_cast<int>(t.layer())) || waiting_step;
}

const v1::BubbleTask* BubbleSchedule::Next(const IterationTracker& tracker, bool pipeline_done,
                                           bool waiting_step) const {
  for (const v1::BubbleTask& t : tasks_) {
    if (t.serial() && !pipeline_done) continue;
    if (Ready(t, tracker, waiting_step)) return &t;
  }
  return nullptr;
}

BubbleSchedule::Drain BubbleSchedule::NextToDrain(
    const IterationTracker& tracker, bool waiting_step,
    const std::function<bool(const v1::BubbleTask&)>& wanted, const v1::BubbleTask** task) const {
  const v1::BubbleTask* left = nullptr;
  const v1::BubbleTask* next = nullptr;
  const v1::BubbleTask* inversion = nullptr;
  for (const v1::BubbleTask& t : tasks_) {
    const bool want = wanted(t);
    if (want && left == nullptr) left = &t;
    if (!Ready(t, tracker, waiting_step)) continue;
    if (want && next == nullptr) next = &t;
    if (IsInversion(t) && inversion == nullptr) inversion = &t;
  }
  if (left == nullptr) return Drain::kDone;
  if (next == nullptr) next = inversion;
  if (next == nullptr) {
    *task = left;
    return Drain::kStuck;
  }
  *task = next;
  return Drain::kTask;
}

v1::BubbleTask BubbleSchedule::Remove(const v1::BubbleTask* task) {
  auto pos = std::find_if(tasks_.begin(), tasks_.end(),
                          [task](const v1::BubbleTask& t) { return &t == task; });
  v1::BubbleTask t = *pos;
  tasks_.erase(pos);
  return t;
}

void BubbleSchedule::Inverted(const v1::BubbleTask& t) {
  uint64_t& done = finalized_refresh_[static_cast<int>(t.layer())];
  done = std::max(done, t.refresh());
}

void BubbleSchedule::DropMicrobatch(uint32_t mb) {
  tasks_.remove_if(
      [mb](const v1::BubbleTask& t) { return IsCurvature(t) && t.microbatch() == mb; });
}

}  // namespace detour
