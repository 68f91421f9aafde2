#include "common/timing.h"

#include "gtest/gtest.h"

namespace detour {
namespace {

TEST(SumBusy, SplitsPipelineAndKfacWork) {
  v1::TimingReport report;
  auto add = [&](v1::TaskTiming::Kind kind, double seconds) {
    v1::TaskTiming* t = report.add_tasks();
    t->set_kind(kind);
    t->set_duration_s(seconds);
  };
  add(v1::TaskTiming::KIND_FORWARD, 1);
  add(v1::TaskTiming::KIND_BACKWARD, 2);
  add(v1::TaskTiming::KIND_LOSS, 0.5);
  add(v1::TaskTiming::KIND_BUBBLE, 0.25);
  add(v1::TaskTiming::KIND_BUBBLE, 0.5);
  add(v1::TaskTiming::KIND_ALLREDUCE, 4);  // network, neither
  add(v1::TaskTiming::KIND_OPTIMIZER, 8);  // the step, neither
  const BusySeconds busy = SumBusy(report);
  EXPECT_DOUBLE_EQ(busy.pipeline, 3.5);
  EXPECT_DOUBLE_EQ(busy.kfac, 0.75);
  EXPECT_FALSE(IsPipelineTask(v1::TaskTiming::KIND_BUBBLE));
}

}  // namespace
}  // namespace detour
