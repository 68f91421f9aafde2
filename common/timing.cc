#include "common/timing.h"

namespace detour {

bool IsPipelineTask(v1::TaskTiming::Kind kind) {
  return kind == v1::TaskTiming::KIND_FORWARD || kind == v1::TaskTiming::KIND_BACKWARD ||
         kind == v1::TaskTiming::KIND_LOSS;
}

BusySeconds SumBusy(const v1::TimingReport& report) {
  BusySeconds busy;
  for (const v1::TaskTiming& t : report.tasks()) {
    if (IsPipelineTask(t.kind())) {
      busy.pipeline += t.duration_s();
    } else if (t.kind() == v1::TaskTiming::KIND_BUBBLE) {
      busy.kfac += t.duration_s();
    }
  }
  return busy;
}

}  // namespace detour
