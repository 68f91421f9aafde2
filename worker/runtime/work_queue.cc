#include "worker/runtime/work_queue.h"

#include <utility>

namespace detour {

void WorkQueue::BeginIteration(uint64_t iteration, std::map<uint32_t, std::vector<int>> stages,
                               int slots, sim::QueuePolicy policy) {
  iteration_ = iteration;
  started_ = true;
  stages_ = std::move(stages);
  free_slots_ = slots;
  holders_.clear();
  policy_ = policy;
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
  if (NeedsSlot(item.work)) {
    --free_slots_;
    holders_.insert(item.work.microbatch);
  }
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
  started_ = false;
  free_slots_ = 0;
}

}  // namespace detour
