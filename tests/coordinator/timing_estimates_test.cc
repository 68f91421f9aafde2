// TimingEstimates: running means per node, stage and task kind; per link.
#include "coordinator/timing_estimates.h"

#include <map>
#include <string>

#include "gtest/gtest.h"

namespace detour {
namespace {

v1::TimingReport Report(const std::string& node, double forward_s) {
  v1::TimingReport r;
  r.set_node(node);
  v1::TaskTiming* t = r.add_tasks();
  t->set_kind(v1::TaskTiming::KIND_FORWARD);
  t->set_duration_s(forward_s);
  return r;
}

TEST(TimingEstimates, ComputeIsPerStageSoAMovedWorkerStartsAfresh) {
  TimingEstimates e(nullptr);
  e.Add(Report("w", 1.0), {}, {{"w", 4}});
  e.Add(Report("w", 2.0), {}, {{"w", 4}});
  const double on4 = (1 - TimingEstimates::kAlpha) * 1.0 + TimingEstimates::kAlpha * 2.0;
  EXPECT_DOUBLE_EQ(e.Compute("w", 4, v1::TaskTiming::KIND_FORWARD), on4);
  // Moved to stage 5 (the head: more work): nothing known there yet, and
  // its first time there does not blend with stage 4's.
  EXPECT_EQ(e.Compute("w", 5, v1::TaskTiming::KIND_FORWARD), 0);
  e.Add(Report("w", 6.0), {}, {{"w", 5}});
  EXPECT_DOUBLE_EQ(e.Compute("w", 5, v1::TaskTiming::KIND_FORWARD), 6.0);
  EXPECT_DOUBLE_EQ(e.Compute("w", 4, v1::TaskTiming::KIND_FORWARD), on4);
  // Other kinds and nodes stay apart; a node of no known stage is kept too.
  EXPECT_EQ(e.Compute("w", 4, v1::TaskTiming::KIND_BACKWARD), 0);
  e.Add(Report("x", 3.0), {}, {});
  EXPECT_DOUBLE_EQ(e.Compute("x", -1, v1::TaskTiming::KIND_FORWARD), 3.0);
  EXPECT_EQ(e.Compute("w", -1, v1::TaskTiming::KIND_FORWARD), 0);
}

TEST(TimingEstimates, TransfersLeaveAllReducePayloadsOut) {
  TimingEstimates e(nullptr);
  v1::TimingReport r;
  r.set_node("a");
  v1::TransferTiming* t = r.add_transfers();
  t->set_peer("b");
  t->set_duration_s(0.5);
  v1::TransferTiming* big = r.add_transfers();
  big->set_peer("b");
  big->set_duration_s(9.0);
  big->set_allreduce(true);
  e.Add(r, {{"b", "us-east-1"}}, {});
  EXPECT_DOUBLE_EQ(e.Transfer("a", "b"), 0.5);
  EXPECT_EQ(e.Transfer("b", "a"), 0);
}

}  // namespace
}  // namespace detour
