// Sums over a worker's TimingReport shared by the worker (its busy-fraction
// gauges) and the coordinator (the job's measured utilisation).
#ifndef DETOUR_COMMON_TIMING_H_
#define DETOUR_COMMON_TIMING_H_

#include "detour/v1/plan.pb.h"

namespace detour {

// Forward, backward and loss: the pipeline's own compute.
bool IsPipelineTask(v1::TaskTiming::Kind kind);

struct BusySeconds {
  double pipeline = 0;  // forward + backward + loss
  double kfac = 0;      // K-FAC bubble tasks (KIND_BUBBLE)
};
BusySeconds SumBusy(const v1::TimingReport& report);

}  // namespace detour

#endif  // DETOUR_COMMON_TIMING_H_
