// One stage's gradient all-reduce among its live replicas, as book-keeping:
// who the members are in the current membership epoch, whose inputs arrived,
// and the order in which to sum them (rank order of the epoch's group, so
// every replica computes the identical sum).
//
// A round belongs to an epoch. Inputs name their sender and epoch: one from a
// non-member, from an older epoch, or a second one from the same member is
// refused (with the reason); one from a newer epoch is kept aside and used
// when this replica reaches that epoch (its own membership news may come
// after a peer's input). Restart(epoch, members) begins a new round: after a
// loss the survivors reduce again, each sending its input once more.
//
// The payload type is the caller's (the runtime uses a flat LibTorch
// tensor); no LibTorch here, no threads: the runtime's executor owns it.
#ifndef DETOUR_WORKER_RUNTIME_REPLICA_REDUCER_H_
#define DETOUR_WORKER_RUNTIME_REPLICA_REDUCER_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace detour {

template <typename Payload>
class ReplicaReducer {
 public:
  struct Input {
    Payload payload;
    int visits = 0;
  };

  // Starts a round of `epoch` among `members` (rank order; `me` among them).
  // Inputs kept aside for this epoch count at once; older ones are dropped.
  bool Restart(uint64_t epoch, std::vector<std::string> members, const std::string& me,
               std::string* why) {
    if (std::find(members.begin(), members.end(), me) == members.end()) {
      *why = absl::StrCat("worker ", me, " is not in its replica group (",
                          absl::StrJoin(members, ", "), ")");
      return false;
    }
    epoch_ = epoch;
    members_ = std::move(members);
    me_ = me;
    local_.reset();
    inputs_.clear();
    for (auto it = ahead_.begin(); it != ahead_.end();) {
      if (it->first.first < epoch_) {
        it = ahead_.erase(it);
      } else if (it->first.first == epoch_) {
        if (IsMember(it->first.second)) inputs_.emplace(it->first.second, std::move(it->second));
        it = ahead_.erase(it);
      } else {
        ++it;
      }
    }
    return true;
  }

  // This replica's own input of the round.
  void SetLocal(Payload payload, int visits) { local_ = Input{std::move(payload), visits}; }
  bool has_local() const { return local_.has_value(); }
  const Input* local() const { return local_ ? &*local_ : nullptr; }

  // A peer's input. False (with why) when refused.
  bool Offer(const std::string& from, uint64_t epoch, Payload payload, int visits,
             std::string* why) {
    if (epoch > epoch_) {
      if (ahead_.size() >= kMaxAhead) {
        *why = "too many all-reduce inputs of future epochs";
        return false;
      }
      if (!ahead_.emplace(std::make_pair(epoch, from), Input{std::move(payload), visits}).second) {
        *why = absl::StrCat("a second all-reduce input from ", from, " for epoch ", epoch);
        return false;
      }
      return true;
    }
    if (epoch < epoch_) {
      *why = absl::StrCat("all-reduce input from ", from, " of epoch ", epoch,
                          " (the group is at epoch ", epoch_, ")");
      return false;
    }
    if (from == me_ || !IsMember(from)) {
      *why = absl::StrCat("all-reduce input from ", from, ", not another member of the group (",
                          absl::StrJoin(members_, ", "), ")");
      return false;
    }
    if (!inputs_.emplace(from, Input{std::move(payload), visits}).second) {
      *why = absl::StrCat("a second all-reduce input from ", from, " in epoch ", epoch);
      return false;
    }
    return true;
  }

  // The local input and every other member's arrived.
  bool Ready() const { return local_.has_value() && inputs_.size() + 1 >= members_.size(); }

  // Inputs in rank order, the local one included (call when Ready()).
  std::vector<const Input*> InRankOrder() const {
    std::vector<const Input*> out;
    for (const std::string& m : members_) {
      if (m == me_) {
        out.push_back(&*local_);
      } else {
        auto it = inputs_.find(m);
        if (it != inputs_.end()) out.push_back(&it->second);
      }
    }
    return out;
  }

  int TotalVisits() const {
    int total = local_ ? local_->visits : 0;
    for (const auto& [id, in] : inputs_) total += in.visits;
    return total;
  }

  // The other members (where this replica sends its input).
  std::vector<std::string> Others() const {
    std::vector<std::string> others;
    for (const std::string& m : members_) {
      if (m != me_) others.push_back(m);
    }
    return others;
  }
  // Members whose input has not arrived.
  std::vector<std::string> Missing() const {
    std::vector<std::string> missing;
    for (const std::string& m : members_) {
      if (m != me_ && !inputs_.count(m)) missing.push_back(m);
    }
    return missing;
  }
  const std::vector<std::string>& members() const { return members_; }
  uint64_t epoch() const { return epoch_; }
  int rank() const {
    return static_cast<int>(std::find(members_.begin(), members_.end(), me_) - members_.begin());
  }
  // Drops the round's payloads (after the step).
  void Clear() {
    local_.reset();
    inputs_.clear();
  }

 private:
  bool IsMember(const std::string& id) const {
    return std::find(members_.begin(), members_.end(), id) != members_.end();
  }

  // Inputs of future epochs kept at most (a flood is refused).
  static constexpr size_t kMaxAhead = 8;

  uint64_t epoch_ = 0;
  std::vector<std::string> members_;
  std::string me_;
  std::optional<Input> local_;
  std::map<std::string, Input> inputs_;
  std::map<std::pair<uint64_t, std::string>, Input> ahead_;
};

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_REPLICA_REDUCER_H_
