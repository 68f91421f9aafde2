// The worker executor's queue. Control work (coordinator messages, transfer
// results, K-FAC bookkeeping) runs first, in arrival order. Pipeline work —
// the forward, loss and backward of microbatches — runs in the order of the
// job's queue policy (common/sim/queue_policy.h), the rule the planner's
// simulator judges plans under, among the items that are eligible: a forward
// that needs a memory slot (a data node's start, or any visit above the
// route's frontier) waits until the node has one free; swap visits never
// wait, which keeps every plan deadlock-free.
//
// The queue also keeps the node's slot account for the current iteration:
// Pop takes a slot for a forward that needs one, Release returns it when
// the microbatch's backward on this node is done. Work of another iteration
// is always eligible (the runtime drops or buffers it).
//
// No LibTorch. Thread-compatible: the runtime guards it with its mutex.
#ifndef DETOUR_WORKER_RUNTIME_WORK_QUEUE_H_
#define DETOUR_WORKER_RUNTIME_WORK_QUEUE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "common/sim/queue_policy.h"

namespace detour {

class WorkQueue {
 public:
  using Fn = std::function<void()>;

  // A piece of pipeline work: its iteration, microbatch and position on the
  // route (hop); `backward` for gradients. A forward at hop == route length
  // is the loss on the data node.
  struct Pipeline {
    uint64_t iteration = 0;
    uint32_t microbatch = 0;
    int hop = 0;
    bool backward = false;
    // Route epoch of the frame (FrameHeader.epoch): work of a route that
    // was replaced never takes a slot (the runtime drops it).
    uint64_t epoch = 0;
  };

  // Starts an iteration: the stages of every microbatch's route (indexed
  // by microbatch id; empty for microbatches without one), the node's
  // activation slots and the policy. Slots held in the previous iteration
  // are forgotten.
  void BeginIteration(uint64_t iteration, std::map<uint32_t, std::vector<int>> stages, int slots,
                      sim::QueuePolicy policy);
  // A microbatch of the current iteration got a new route (re-run around a
  // lost worker) planned in `epoch`.
  void SetRoute(uint32_t microbatch, std::vector<int> stages, uint64_t epoch);
  // Forgets a microbatch of the current iteration (frozen: its route
  // crossed a lost worker): its queued work goes, its slot comes back.
  void DropMicrobatch(uint64_t iteration, uint32_t microbatch);

  void PushControl(Fn fn);
  void PushPipeline(const Pipeline& work, Fn fn);

  // Whether Pop would return something now.
  bool HasRunnable() const;
  // The next item to run, or false. Control first, then pipeline work by
  // the policy; takes a slot when the popped forward needs one.
  bool Pop(Fn* fn);
  // The backward of `microbatch` on this node finished in `iteration`:
  // returns its slot if its forward took one.
  void Release(uint64_t iteration, uint32_t microbatch);

  bool empty() const { return control_.empty() && pipeline_.empty(); }
  int free_slots() const { return free_slots_; }
  // Drops all pipeline work and the slot account (the job was abandoned);
  // control work stays.
  void DropPipeline();

 private:
  struct Item {
    Pipeline work;
    int64_t seq = 0;
    Fn fn;
  };
  sim::WorkKind KindOf(const Pipeline& w) const;
  bool NeedsSlot(const Pipeline& w) const;
  // Index of the pipeline item to run next, or -1.
  int Next() const;

  std::deque<Fn> control_;
  std::vector<Item> pipeline_;
  int64_t seq_ = 0;
  uint64_t iteration_ = 0;
  bool started_ = false;
  std::map<uint32_t, std::vector<int>> stages_;
  std::map<uint32_t, uint64_t> route_epoch_;  // absent = 0
  int free_slots_ = 0;
  std::set<uint32_t> holders_;
  sim::QueuePolicy policy_ = sim::QueuePolicy::kArrival;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_WORK_QUEUE_H_
