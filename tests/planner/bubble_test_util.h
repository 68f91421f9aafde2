// Shared helpers of the K-FAC bubble planner's tests
// (bubble_planner_test.cc, bubble_planner_property_test.cc): a layer's
// costs, a K-FAC spec and a bubble task's name.
#ifndef DETOUR_TESTS_PLANNER_BUBBLE_TEST_UTIL_H_
#define DETOUR_TESTS_PLANNER_BUBBLE_TEST_UTIL_H_

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/kfac_workload.h"
#include "detour/v1/spec.pb.h"

namespace detour::planner::testing {

inline KfacLayerCost Cost(double a, double b, double inv, double precondition = 0,
                          double sync = 0) {
  KfacLayerCost c;
  c.curvature_a_s = a;
  c.curvature_b_s = b;
  c.invert_a_s.assign(7, inv);
  c.invert_b_s.assign(7, inv);
  c.precondition_s = precondition;
  c.sync_s = sync;
  return c;
}

inline v1::KfacSpec Spec(double slack = 0, uint32_t interval = 0, uint32_t curvature_mbs = 1) {
  v1::KfacSpec k;
  k.set_slack(slack);
  k.set_refresh_interval(interval);
  k.set_curvature_microbatches(curvature_mbs);
  k.set_placement(v1::KFAC_PLACEMENT_BUBBLES);
  return k;
}

inline std::string BubbleTaskName(const v1::BubbleTask& t) {
  return absl::StrCat(v1::BubbleTask::Kind_Name(t.kind()), " layer ", t.layer(), " ", t.module(),
                      " mb ", t.microbatch(), " part ", t.part(), "/", t.num_parts(), " refresh ",
                      t.refresh());
}

}  // namespace detour::planner::testing

#endif  // DETOUR_TESTS_PLANNER_BUBBLE_TEST_UTIL_H_
