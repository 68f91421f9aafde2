#include "worker/runtime/work_queue.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace detour {
namespace {

// Records what ran, in order.
class WorkQueueTest : public ::testing::Test {
 protected:
  void Control(const std::string& name) {
    q_.PushControl([this, name] { ran_.push_back(name); });
  }
  void Work(const std::string& name, uint64_t iteration, uint32_t mb, int hop, bool backward,
            uint64_t epoch = 0) {
    WorkQueue::Pipeline w;
    w.iteration = iteration;
    w.microbatch = mb;
    w.hop = hop;
    w.backward = backward;
    w.epoch = epoch;
    q_.PushPipeline(w, [this, name] { ran_.push_back(name); });
  }
  // Pops and runs until nothing can run.
  void Drain() {
    WorkQueue::Fn fn;
    while (q_.Pop(&fn)) fn();
  }
  bool PopOne() {
    WorkQueue::Fn fn;
    if (!q_.Pop(&fn)) return false;
    fn();
    return true;
  }

  WorkQueue q_;
  std::vector<std::string> ran_;
};

// Routes of iteration 7: mb 0 visits stages 0,1,2; mb 1 visits 0,2,1 (its
// stage 1 is a swap); both are 3 hops long, so hop 3 is the loss.
std::map<uint32_t, std::vector<int>> Stages() { return {{0, {0, 1, 2}}, {1, {0, 2, 1}}}; }

TEST_F(WorkQueueTest, ControlRunsBeforePipelineWork) {
  q_.BeginIteration(7, Stages(), 3, sim::QueuePolicy::kArrival);
  Work("fwd", 7, 0, 1, false);
  Control("plan");
  Drain();
  EXPECT_EQ(ran_, (std::vector<std::string>{"plan", "fwd"}));
}

TEST_F(WorkQueueTest, ArrivalOrderIsFifoWhateverTheKind) {
  q_.BeginIteration(7, Stages(), 3, sim::QueuePolicy::kArrival);
  Work("fwd0", 7, 0, 1, false);
  Work("loss1", 7, 1, 3, false);
  Work("bwd1", 7, 1, 2, true);
  Drain();
  EXPECT_EQ(ran_, (std::vector<std::string>{"fwd0", "loss1", "bwd1"}));
}

TEST_F(WorkQueueTest, BackwardFirstPutsLossAndBackwardAhead) {
  q_.BeginIteration(7, Stages(), 3, sim::QueuePolicy::kBackwardFirst);
  Work("fwd0", 7, 0, 1, false);
  Work("loss1", 7, 1, 3, false);
  Work("bwd1", 7, 1, 2, true);
  Work("fwd1", 7, 1, 1, false);
  Drain();
  EXPECT_EQ(ran_, (std::vector<std::string>{"loss1", "bwd1", "fwd0", "fwd1"}));
}

// One slot: the second start waits until the first microbatch's backward on
// this node returns the slot, while later work that needs none runs.
TEST_F(WorkQueueTest, ForwardsWaitForAFreeSlot) {
  q_.BeginIteration(7, Stages(), 1, sim::QueuePolicy::kArrival);
  Work("start0", 7, 0, 0, false);
  Work("start1", 7, 1, 0, false);
  ASSERT_TRUE(PopOne());
  EXPECT_EQ(q_.free_slots(), 0);
  EXPECT_FALSE(q_.HasRunnable());  // start1 waits
  Work("bwd0", 7, 0, 0, true);
  ASSERT_TRUE(PopOne());
  EXPECT_EQ(ran_.back(), "bwd0");
  EXPECT_FALSE(q_.HasRunnable());
  q_.Release(7, 0);  // the backward finished
  EXPECT_EQ(q_.free_slots(), 1);
  ASSERT_TRUE(PopOne());
  EXPECT_EQ(ran_.back(), "start1");
  // Releasing a microbatch that holds no slot changes nothing.
  q_.Release(7, 0);
  EXPECT_EQ(q_.free_slots(), 0);
}

// A visit below the route's frontier (a swap) never waits: that is what
// keeps plans deadlock-free; a visit above it does.
TEST_F(WorkQueueTest, SwapVisitsDoNotNeedASlot) {
  q_.BeginIteration(7, Stages(), 1, sim::QueuePolicy::kArrival);
  Work("start0", 7, 0, 0, false);
  ASSERT_TRUE(PopOne());
  Work("mb0_stage2", 7, 0, 2, false);  // above the frontier: waits
  Work("mb1_stage1", 7, 1, 2, false);  // stage 1 after stage 2: a swap
  Drain();
  EXPECT_EQ(ran_, (std::vector<std::string>{"start0", "mb1_stage1"}));
  EXPECT_EQ(q_.free_slots(), 0);
}

// Work of another iteration (early frames, stale ones) is always eligible:
// the runtime buffers or drops it.
TEST_F(WorkQueueTest, OtherIterationsAreNotGated) {
  q_.BeginIteration(7, Stages(), 1, sim::QueuePolicy::kArrival);
  Work("start0", 7, 0, 0, false);
  ASSERT_TRUE(PopOne());
  Work("next_iteration", 8, 0, 1, false);
  Drain();
  EXPECT_EQ(ran_.back(), "next_iteration");
}

// A microbatch frozen around a lost worker: its queued work goes and its
// slot comes back; its re-run (a newer epoch) takes a slot again, the old
// route's late tensors never do.
TEST_F(WorkQueueTest, FrozenMicrobatchesReturnTheirSlot) {
  q_.BeginIteration(7, Stages(), 1, sim::QueuePolicy::kArrival);
  Work("start0", 7, 0, 0, false);
  ASSERT_TRUE(PopOne());
  EXPECT_EQ(q_.free_slots(), 0);
  Work("start1", 7, 1, 0, false);  // waits for the slot
  Work("bwd0", 7, 0, 1, true);
  q_.DropMicrobatch(7, 0);
  EXPECT_EQ(q_.free_slots(), 1);
  Drain();
  EXPECT_EQ(ran_, (std::vector<std::string>{"start0", "start1"}));  // bwd0 went
  q_.Release(7, 1);
  q_.SetRoute(0, {0, 2}, 1);
  Work("old_route", 7, 0, 1, false, 0);  // epoch 0: no slot, runs (to be dropped)
  Work("rerun", 7, 0, 0, false, 1);
  Drain();
  EXPECT_EQ(ran_.size(), 4u);
  EXPECT_EQ(q_.free_slots(), 0);  // the re-run's start holds it
}

// A duplicate forward of a microbatch holding a slot takes no second one.
TEST_F(WorkQueueTest, DuplicatesTakeNoSecondSlot) {
  q_.BeginIteration(7, Stages(), 2, sim::QueuePolicy::kArrival);
  Work("start0", 7, 0, 0, false);
  Work("start0_again", 7, 0, 0, false);
  Drain();
  EXPECT_EQ(q_.free_slots(), 1);
}

TEST_F(WorkQueueTest, DropPipelineKeepsControlWork) {
  q_.BeginIteration(7, Stages(), 3, sim::QueuePolicy::kArrival);
  Work("fwd", 7, 0, 1, false);
  Control("cancel");
  q_.DropPipeline();
  Drain();
  EXPECT_EQ(ran_, (std::vector<std::string>{"cancel"}));
  EXPECT_TRUE(q_.empty());
}

}  // namespace
}  // namespace detour
