// The bubble planner's pure phases on their own (bubble_phases.h): gaps,
// fitting, the refresh window's decision and the tasks' order. The whole
// pass is guarded by bubble_planner_test's property test.
#include "coordinator/planner/bubble_phases.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace detour::planner {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

BusyInterval Busy(double s, double e, BusyInterval::Kind kind = BusyInterval::Kind::kForward) {
  BusyInterval b;
  b.start_s = s;
  b.end_s = e;
  b.kind = kind;
  return b;
}

TEST(BubblePhasesTest, GapsAreTheFreeTimeBeforeTheEnd) {
  NodeTimeline tl;
  tl.busy = {Busy(4, 6), Busy(1, 2), Busy(5, 7)};  // unsorted, overlapping
  EXPECT_THAT(Gaps(tl, 10), ElementsAre(Pair(0, 1), Pair(2, 4), Pair(7, 10)));
  EXPECT_THAT(Gaps(tl, 3), ElementsAre(Pair(0, 1), Pair(2, 3)));
  EXPECT_THAT(Gaps(NodeTimeline(), 2), ElementsAre(Pair(0, 2)));
  EXPECT_TRUE(Gaps(NodeTimeline(), 0).empty());
}

TEST(BubblePhasesTest, ItemsFitInOrderEachWithinOneGap) {
  const std::vector<Gap> gaps = {{0, 1}, {2, 4}, {7, 10}};
  EXPECT_TRUE(FitsInOrder(gaps, 0, {1, 2, 3}));
  EXPECT_FALSE(FitsInOrder(gaps, 0, {1, 2, 3, 0.5})) << "nothing is left after 10";
  EXPECT_FALSE(FitsInOrder(gaps, 0.5, {1, 2, 3})) << "the first item moves to the second gap";
  EXPECT_FALSE(FitsInOrder(gaps, 0, {4})) << "an item never spans two gaps";
  EXPECT_TRUE(FitsSomeGap(gaps, 3, 3));
  EXPECT_FALSE(FitsSomeGap(gaps, 8, 3));
}

TEST(BubblePhasesTest, PipelineBusyCountsPipelineWorkBeforeTheEnd) {
  NodeTimeline tl;
  tl.busy = {Busy(0, 2), Busy(3, 4, BusyInterval::Kind::kOther),
             Busy(5, 9, BusyInterval::Kind::kBackward)};
  EXPECT_DOUBLE_EQ(PipelineBusy(tl, 10), 6);
  EXPECT_DOUBLE_EQ(PipelineBusy(tl, 7), 4);
}

TEST(BubblePhasesTest, TheWindowDecidesWhetherWorkIsPlacedAndMustFinish) {
  // No K-FAC work: nothing happens.
  WindowDecision d = DecideWindow(false, std::nullopt, 5, false, 0, true, 0);
  EXPECT_FALSE(d.place);
  EXPECT_EQ(d.age, 0u);
  // Bubbles, adaptive interval: place every iteration, a second refresh
  // joins the one in flight, nothing is forced to finish.
  d = DecideWindow(true, 3, 5, false, 0, true, 1);
  EXPECT_TRUE(d.place);
  EXPECT_EQ(d.age, 3u);
  EXPECT_FALSE(d.final_iteration);
  EXPECT_TRUE(d.next_joins);
  EXPECT_FALSE(DecideWindow(true, 3, 5, false, 0, true, 2).next_joins) << "two are in flight";
  // A fixed interval of 3: the next refresh joins in the window's last
  // iteration, which must finish the front.
  d = DecideWindow(true, 4, 5, false, 3, true, 1);
  EXPECT_FALSE(d.final_iteration);
  EXPECT_FALSE(d.next_joins);
  d = DecideWindow(true, 3, 5, false, 3, true, 1);
  EXPECT_TRUE(d.final_iteration);
  EXPECT_TRUE(d.next_joins);
  // A checkpoint closes the window: everything finishes, nothing joins.
  d = DecideWindow(true, 5, 5, true, 0, true, 1);
  EXPECT_TRUE(d.final_iteration);
  EXPECT_FALSE(d.next_joins);
  // Serial placement: work is placed only in the final iteration, which
  // with an adaptive interval is every iteration.
  d = DecideWindow(true, std::nullopt, 7, false, 0, false, 0);
  EXPECT_EQ(d.age, 1u);
  EXPECT_TRUE(d.final_iteration);
  EXPECT_TRUE(d.place);
  EXPECT_FALSE(d.next_joins);
  d = DecideWindow(true, 6, 7, false, 4, false, 1);
  EXPECT_FALSE(d.place) << "serial, fixed interval, mid-window";
}

TEST(BubblePhasesTest, TasksAreOrderedByNodeSerialStartRefreshKind) {
  auto task = [](const char* node, bool serial, double start, uint64_t refresh,
                 v1::BubbleTask::Kind kind) {
    v1::BubbleTask t;
    t.set_node(node);
    t.set_serial(serial);
    t.set_planned_start_s(start);
    t.set_refresh(refresh);
    t.set_kind(kind);
    return t;
  };
  std::vector<v1::BubbleTask> tasks = {
      task("b", false, 1, 1, v1::BubbleTask::KIND_CURVATURE_A),
      task("a", true, 0, 1, v1::BubbleTask::KIND_INVERT_A),
      task("a", false, 2, 2, v1::BubbleTask::KIND_CURVATURE_A),
      task("a", false, 2, 1, v1::BubbleTask::KIND_INVERT_B),
      task("a", false, 2, 1, v1::BubbleTask::KIND_CURVATURE_B),
  };
  OrderTasks({"a", "b"}, &tasks);
  std::vector<std::string> order;
  for (const v1::BubbleTask& t : tasks) {
    order.push_back(absl::StrCat(t.node(), t.serial() ? "s" : "g", t.refresh(), ":",
                                 v1::BubbleTask::Kind_Name(t.kind())));
  }
  EXPECT_THAT(order,
              ElementsAre("ag1:KIND_CURVATURE_B", "ag1:KIND_INVERT_B", "ag2:KIND_CURVATURE_A",
                          "as1:KIND_INVERT_A", "bg1:KIND_CURVATURE_A"));
}

}  // namespace
}  // namespace detour::planner
