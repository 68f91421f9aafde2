#include "worker/runtime/frame_admission.h"

#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace detour {

void FrameAdmission::Open(const Stage& stage) {
  absl::MutexLock lock(&mu_);
  stage_ = stage;
  open_ = true;
  // A stage's state: parameters and AdamW's two moments, K-FAC's sums,
  // running factors and four inverses per factor, its per-projection
  // moments; plus the archive's own bookkeeping.
  state_bytes_ =
      4 * static_cast<uint64_t>(6 * stage.flat_numel + 6 * stage.factor_numel) + (16u << 20);
  activation_bytes_ = 4;
  for (int64_t d : stage.activation_shape) activation_bytes_ *= static_cast<uint64_t>(d);
  reduce_bytes_ = 4 * static_cast<uint64_t>(stage.flat_numel + stage.factor_numel);
  routed_.clear();
  // Tensors of an earlier job keep their own accounts alive until freed.
  accounts_.clear();
}

void FrameAdmission::Close() {
  absl::MutexLock lock(&mu_);
  open_ = false;
  stage_.job_id.clear();
  stage_.state_from.clear();
}

void FrameAdmission::SetMembers(std::set<std::string> members) {
  absl::MutexLock lock(&mu_);
  members_ = std::move(members);
  // Accounts of senders no longer members go once they hold nothing.
  for (auto it = accounts_.begin(); it != accounts_.end();) {
    if (!members_.count(it->first) && it->second->load() == 0) {
      it = accounts_.erase(it);
    } else {
      ++it;
    }
  }
}

namespace {

// Adds to `routed` the pipeline frames each sender sends to `me` along
// `routes`: forwards from the node before `me` (the data node receives the
// last node's output for the loss), backwards from the node after it (the
// data node sends the loss gradient to the last node).
void CountRouted(const std::string& me, const std::vector<v1::Route>& routes,
                 std::map<std::string, uint32_t>* routed) {
  for (const v1::Route& r : routes) {
    const int n = r.nodes_size();
    if (n < 2) continue;  // stage 0 only: nothing crosses the wire
    for (int i = 0; i < n; ++i) {
      // The edge nodes(i) -> next carries the forward one way and the
      // backward the other.
      const std::string& next = i + 1 < n ? r.nodes(i + 1) : r.data_node();
      if (next == me) ++(*routed)[r.nodes(i)];
      if (r.nodes(i) == me) ++(*routed)[next];
    }
  }
}

}  // namespace

void FrameAdmission::SetRoutes(const std::string& me, const std::vector<v1::Route>& routes) {
  absl::MutexLock lock(&mu_);
  routed_.clear();
  CountRouted(me, routes, &routed_);
}

void FrameAdmission::AddRoutes(const std::string& me, const std::vector<v1::Route>& routes) {
  absl::MutexLock lock(&mu_);
  CountRouted(me, routes, &routed_);
}

uint32_t FrameAdmission::RoutedFrames(const std::string& sender) const {
  absl::MutexLock lock(&mu_);
  auto it = routed_.find(sender);
  return it == routed_.end() ? 0 : it->second;
}

uint64_t FrameAdmission::QuotaLocked(const std::string& sender) const {
  // The pipeline frames the routes known here have `sender` send to this
  // worker, and one forward and one backward per microbatch of the job
  // beyond them (the next iteration's, whose plan is not here yet, or a
  // re-run's whose amendment is not); its all-reduce inputs of this and the
  // next iteration, twice each (the survivors of a loss reduce again); the
  // stage state when it is the expected donor.
  auto it = routed_.find(sender);
  const uint64_t frames =
      (it == routed_.end() ? 0 : uint64_t{it->second}) + 2 * uint64_t{stage_.microbatches};
  uint64_t quota = frames * activation_bytes_ + 4 * reduce_bytes_;
  if (!stage_.state_from.empty() && sender == stage_.state_from) quota += state_bytes_;
  return quota;
}

uint64_t FrameAdmission::SenderQuota(const std::string& sender) const {
  absl::MutexLock lock(&mu_);
  return QuotaLocked(sender);
}

void FrameAdmission::SetPosition(uint64_t iteration, uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  stage_.iteration = iteration;
  stage_.epoch = epoch;
}

void FrameAdmission::SetIteration(uint64_t iteration) {
  absl::MutexLock lock(&mu_);
  stage_.iteration = iteration;
}

void FrameAdmission::SetEpoch(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  stage_.epoch = epoch;
}

void FrameAdmission::StateReceived() {
  absl::MutexLock lock(&mu_);
  stage_.state_from.clear();
}

uint64_t FrameAdmission::state_bytes() const {
  absl::MutexLock lock(&mu_);
  return state_bytes_;
}

FrameAdmission::Verdict FrameAdmission::Admit(const v1::FrameHeader& h) {
  auto refuse = [](absl::Status s, Refusal r = Refusal::kOther) {
    return Verdict{std::move(s), r, nullptr};
  };
  const std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
  absl::MutexLock lock(&mu_);
  if (!open_ || stage_.job_id.empty() || h.job_id() != stage_.job_id) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("this worker holds no stage of job ", h.job_id())));
  }
  // Only the job's workers may send (with TLS, the transport has checked
  // that `sender` is the certificate's name).
  if (!members_.count(h.sender()) && h.epoch() <= stage_.epoch) {
    return refuse(absl::PermissionDeniedError(absl::StrCat(
        "worker \"", absl::CHexEscape(h.sender()), "\" is not a member of job ", h.job_id())));
  }
  if (h.iteration() < stage_.iteration || h.iteration() > stage_.iteration + 1) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
                      "iteration ", h.iteration(), " is not current (", stage_.iteration, ")")),
                  Refusal::kLate);
  }
  if (h.epoch() > stage_.epoch + kMaxEpochsAhead) {
    return refuse(absl::FailedPreconditionError(
        absl::StrCat("epoch ", h.epoch(), " is too far ahead of this worker's ", stage_.epoch)));
  }
  if (h.direction() == v1::DIRECTION_ALLREDUCE) {
    // Gradients, plus K-FAC factors in iterations that sync them (the exact
    // size is checked against the plan when the tensor is used).
    if (shape.size() != 1 || shape[0] < stage_.flat_numel ||
        shape[0] > stage_.flat_numel + stage_.factor_numel || h.dtype() != v1::DTYPE_FP32) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
          "all-reduce tensor [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
          " does not match this stage's ", stage_.flat_numel, " fp32 gradients")));
    }
  } else if (h.direction() == v1::DIRECTION_STATE) {
    if (stage_.state_from.empty() || h.sender() != stage_.state_from) {
      return refuse(absl::FailedPreconditionError(
          absl::StrCat("this worker expects no stage state from ", h.sender())));
    }
    if (shape.size() != 1 || h.dtype() != v1::DTYPE_BYTES || shape[0] <= 0 ||
        static_cast<uint64_t>(shape[0]) > state_bytes_) {
      return refuse(absl::InvalidArgumentError(
          absl::StrCat("stage state [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
                       " is not a byte string of at most ", state_bytes_, " bytes")));
    }
  } else if (shape != stage_.activation_shape || h.dtype() != stage_.wire) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("activation [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
                     " does not match the job's [", absl::StrJoin(stage_.activation_shape, ","),
                     "] ", v1::DType_Name(stage_.wire))));
  }
  // Tensors received and not yet consumed (queued, kept early, buffered by
  // a stage) are bounded in bytes per sender: a peer flooding plausible
  // frames gets RESOURCE_EXHAUSTED instead of the worker's memory, and
  // exhausts only its own quota, so every other member's frames still fit.
  auto& account = accounts_[h.sender()];
  if (account == nullptr) {
    size_t newcomers = 0;
    for (const auto& [sender, a] : accounts_) newcomers += members_.count(sender) ? 0 : 1;
    if (!members_.count(h.sender()) && newcomers > kMaxNewcomerAccounts) {
      accounts_.erase(h.sender());
      return refuse(absl::ResourceExhaustedError(absl::StrCat(
                        "more than ", kMaxNewcomerAccounts,
                        " senders of a newer epoch than this worker's already hold tensors here")),
                    Refusal::kOverBudget);
    }
    account = std::make_shared<std::atomic<uint64_t>>(0);
  }
  const uint64_t bytes = h.total_bytes();
  const uint64_t quota = QuotaLocked(h.sender());
  const uint64_t held = account->load();
  // Deleters only lower the count, and every charge is made under mu_.
  if (bytes > quota || held > quota - bytes) {
    return refuse(
        absl::ResourceExhaustedError(absl::StrCat(
            "worker \"", absl::CHexEscape(h.sender()), "\" holds ", held,
            " bytes of received tensors here; ", bytes, " more would pass its quota of ", quota)),
        Refusal::kOverBudget);
  }
  account->fetch_add(bytes);
  return Verdict{absl::OkStatus(), Refusal::kNone, account};
}

}  // namespace detour
