#include "worker/model/evaluate.h"

#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/model/text_data.h"
#include "worker/model/torch_status.h"

namespace detour::model {

std::vector<int> SpreadRoute(int num_stages, double fraction) {
  int visited = static_cast<int>(std::lround(num_stages * fraction));
  if (visited < 1) visited = 1;
  if (visited > num_stages) visited = num_stages;
  std::vector<int> route = {0};
  const int others = visited - 1;
  for (int i = 0; i < others; ++i) {
    // Centres of `others` equal buckets over 1..S-1.
    const double pos = 1.0 + (i + 0.5) * (num_stages - 1) / others;
    route.push_back(static_cast<int>(std::floor(pos)));
  }
  return route;
}

absl::StatusOr<EvalResult> Perplexity(const std::vector<Stage*>& stages,
                                      const TokenSequence& tokens, const EvalOptions& options) {
  std::vector<int> route = options.route;
  if (route.empty()) {
    for (size_t s = 0; s < stages.size(); ++s) route.push_back(static_cast<int>(s));
  }
  if (route[0] != 0) {
    return absl::InvalidArgumentError("evaluation route must start at stage 0");
  }
  std::vector<bool> seen(stages.size(), false);
  for (int s : route) {
    if (s < 0 || s >= static_cast<int>(stages.size()) || stages[s] == nullptr || seen[s]) {
      return absl::InvalidArgumentError(
          absl::StrCat("evaluation route: stage ", s, " is unknown or repeated"));
    }
    seen[s] = true;
  }
  const int ctx = stages[0]->config().context_length;
  const int64_t available = NumSamples(static_cast<int64_t>(tokens.size()), ctx);
  if (available <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("evaluation text of ", tokens.size(), " tokens is shorter than one sample"));
  }
  const int64_t n =
      options.max_samples > 0 && options.max_samples < available ? options.max_samples : available;
  const int batch = options.batch_size > 0 ? options.batch_size : 8;
  EvalResult result;
  double nll = 0;
  for (int64_t start = 0; start < n; start += batch) {
    const int64_t b = std::min<int64_t>(batch, n - start);
    ASSIGN_OR_RETURN(at::Tensor data,
                     GuardTorch("evaluation batch", [&]() -> absl::StatusOr<at::Tensor> {
                       at::Tensor t = at::empty({b, ctx + 1}, at::TensorOptions().dtype(at::kLong));
                       auto acc = t.accessor<int64_t, 2>();
                       for (int64_t k = 0; k < b; ++k) {
                         // Evenly spread over the available samples.
                         const int64_t sample = (start + k) * available / n;
                         CopySample(tokens, sample, ctx, &acc[k][0]);
                       }
                       return t;
                     }));
    at::Tensor x = data.narrow(1, 0, ctx).contiguous();
    const at::Tensor targets = data.narrow(1, 1, ctx).contiguous();
    for (int s : route) {
      ASSIGN_OR_RETURN(x, stages[s]->Infer(x));
    }
    ASSIGN_OR_RETURN(auto loss, stages[0]->InferLoss(x, targets));
    nll += loss.first;
    result.tokens += loss.second;
    result.samples += b;
  }
  result.mean_nll = nll / static_cast<double>(result.tokens);
  result.perplexity = std::exp(result.mean_nll);
  return result;
}

}  // namespace detour::model
