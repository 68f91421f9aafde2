// Evaluation: perplexity of text through all stages or through a chosen
// route of stages (inference with skipped or reordered stages — the paper's
// robustness claim). Thread-compatible: uses the stages' inference path, so
// it must not run concurrently with training on the same stages.
#ifndef DETOUR_WORKER_MODEL_EVALUATE_H_
#define DETOUR_WORKER_MODEL_EVALUATE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/stage.h"
#include "worker/model/text_data.h"

namespace detour::model {

struct EvalResult {
  double mean_nll = 0;    // nats per token
  double perplexity = 0;  // exp(mean_nll)
  int64_t tokens = 0;
  int64_t samples = 0;
};

struct EvalOptions {
  // Stages in visiting order, stage 0 first; empty = all stages in order.
  std::vector<int> route;
  // Samples per forward batch.
  int batch_size = 8;
  // Evaluate at most this many samples (evenly spread); 0 = all.
  int64_t max_samples = 0;
};

// Perplexity of `tokens` (split into samples of the stages' context length)
// through `stages` (indexed by stage number; entries not on the route may be
// null). INVALID_ARGUMENT for a bad route, FAILED_PRECONDITION for text
// shorter than one sample.
absl::StatusOr<EvalResult> Perplexity(const std::vector<Stage*>& stages,
                                      const TokenSequence& tokens, const EvalOptions& options);

// A route visiting round(fraction·S) stages (at least stage 0), in order:
// stage 0 plus non-zero stages spread evenly over 1..S-1. With fraction 0.5
// this is "half of the model" for the perplexity table.
std::vector<int> SpreadRoute(int num_stages, double fraction);

}  // namespace detour::model

#endif  // DETOUR_WORKER_MODEL_EVALUATE_H_
