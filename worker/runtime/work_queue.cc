#include "worker/runtime/work_queue.h"

#include <algorithm>
#include <utility>

namespace detour {

void WorkQueue::BeginIteration(uint64_t iteration, std::map<uint32_t, std::vector<int>> stages,
                               int slots, sim::QueuePolicy policy) {
  iteration_ = iteration;
  started_ = true;
  stages_ = std::move(stages);
  route_epoch_.clear();
  free_slots_ = slots;
  holders_.clear();
  policy_ = policy;
}

void WorkQueue::SetRoute(uint32_t microbatch, std::vector<int> stages, uint64_t epoch) {
  stages_[microbatch] = std::move(stages);
  route_epoch_[microbatch] = epoch;
}

void WorkQueue::DropMicrobatch(uint64_t iteration, uint32_t microbatch) {
  if (!started_ || iteration != iteration_) return;
  pipeline_.erase(std::remove_if(pipeline_.begin(), pipeline_.end(),
                                 [&](const Item& item) {
                                   return item.work.iteration == iteration &&
                                          item.work.microbatch == microbatch;
                                 }),
                  pipeline_.end());
  if (holders_.erase(microbatch) > 0) ++free_slots_;
  stages_.erase(microbatch);
  route_epoch_.erase(microbatch);
}

void WorkQueue::PushControl(Fn fn) { control_.push_back(std::move(fn)); }

void WorkQueue::PushPipeline(const Pipeline& work, Fn fn) {
  pipeline_.push_back(Item{work, seq_++, std::move(fn)});
}

sim::WorkKind WorkQueue::KindOf(const Pipeline& w) const {
  if (w.backward) return sim::WorkKind::kBackward;
  if (started_ && w.iteration == iteration_) {
    auto it = stages_.find(w.microbatch);
    if (it != stages_.end() && w.hop >= static_cast<int>(it->second.size())) {
      return sim::WorkKind::kLoss;
    }
  }
  return sim::WorkKind::kForward;
}

bool WorkQueue::NeedsSlot(const Pipeline& w) const {
  if (w.backward || !started_ || w.iteration != iteration_) return false;
  auto it = stages_.find(w.microbatch);
  if (it == stages_.end() || w.hop >= static_cast<int>(it->second.size())) return false;
  auto epoch = route_epoch_.find(w.microbatch);
  if (w.epoch != (epoch == route_epoch_.end() ? 0 : epoch->second)) return false;
  return sim::ForwardNeedsSlot(it->second, w.hop);
}

int WorkQueue::Next() const {
  int best = -1;
  sim::ReadyWork best_work;
  for (int i = 0; i < static_cast<int>(pipeline_.size()); ++i) {
    const Item& item = pipeline_[i];
    if (free_slots_ <= 0 && NeedsSlot(item.work)) continue;
    // The worker orders by arrival alone: seq stands for the ready time.
    sim::ReadyWork w;
    w.kind = KindOf(item.work);
    w.ready = static_cast<double>(item.seq);
    w.seq = item.seq;
    if (best < 0 || sim::RunsBefore(policy_, w, best_work)) {
      best = i;
      best_work = w;
    }
  }
  return best;
}

bool WorkQueue::HasRunnable() const { return !control_.empty() || Next() >= 0; }

bool WorkQueue::Pop(Fn* fn) {
  if (!control_.empty()) {
    *fn = std::move(control_.front());
    control_.pop_front();
    return true;
  }
  const int i = Next();
  if (i < 0) return false;
  Item item = std::move(pipeline_[i]);
  pipeline_.erase(pipeline_.begin() + i);
  // One slot per microbatch: a duplicate forward (the runtime drops it)
  // takes none.
  if (NeedsSlot(item.work) && holders_.insert(item.work.microbatch).second) --free_slots_;
  *fn = std::move(item.fn);
  return true;
}

void WorkQueue::Release(uint64_t iteration, uint32_t microbatch) {
  if (!started_ || iteration != iteration_) return;
  if (holders_.erase(microbatch) > 0) ++free_slots_;
}

void WorkQueue::DropPipeline() {
  pipeline_.clear();
  holders_.clear();
  stages_.clear();
  route_epoch_.clear();
  started_ = false;
  free_slots_ = 0;
}

}  // namespace detour
