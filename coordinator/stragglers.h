// Stragglers (docs/RUNTIME.md §"Timings and re-planning input"): workers
// slower than their replicas, or slower than their registered speed
// predicts when the rest of the job is not. Judged at every re-plan from the
// measured forward times; the job runner calls a worker a straggler when it
// is flagged at consecutive re-plans (persistently) and records it in the
// job's history. The routing itself needs no flag: measured speeds already
// make the planner give a slow worker fewer visits.
//
// Pure functions; thread-safe.
#ifndef DETOUR_COORDINATOR_STRAGGLERS_H_
#define DETOUR_COORDINATOR_STRAGGLERS_H_

#include <string>
#include <vector>

namespace detour {

// One worker's forward time: measured (moving average), and what the cost
// model predicts for its stage at the speed the worker registered with.
struct ForwardSample {
  std::string worker;
  int stage = 0;
  double measured_s = 0;
  double predicted_s = 0;
};

struct Slowdown {
  std::string worker;
  int stage = 0;
  // How many times slower than the reference (>= the threshold).
  double factor = 0;
  // What it was compared with: the fastest other replica of its stage, or
  // "" for the job (the lower median over every worker).
  std::string replica;
};

// Each worker's slowness is measured_s / predicted_s. A worker whose stage
// has other sampled replicas is compared with the fastest of them; a worker
// without is compared with the lower median slowness of all samples (only
// when there are at least three). Returns the workers at least `threshold`
// times slower than their reference, slowest first. Samples without a
// positive, finite measurement and prediction are ignored.
std::vector<Slowdown> FindSlowdowns(const std::vector<ForwardSample>& samples, double threshold);

}  // namespace detour

#endif  // DETOUR_COORDINATOR_STRAGGLERS_H_
