// Who belongs to a running job, and the evidence that one of them is gone:
// the live members (worker -> stage) of the current membership epoch, every
// worker the job ever had (its registration and its planning node index),
// suspicions raised by failed sends and peers' reports, the links between
// members found cut, the workers lost in the current iteration, the
// back-off of workers that could not join, and the members excluded for
// sending bad frames.
//
// No I/O, no clock of its own: the job runner passes the registry's view and
// the time, so a test can feed both. Thread-compatible (the runner's thread).
#ifndef DETOUR_COORDINATOR_RUNNER_MEMBERSHIP_H_
#define DETOUR_COORDINATOR_RUNNER_MEMBERSHIP_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/spec.pb.h"

namespace detour {

// A link between two live members that one of them could not use while the
// other still talked to the coordinator.
struct LinkCut {
  std::string reporter;  // could not reach `peer`
  std::string peer;
  std::string why;
};

class RunnerMembership {
 public:
  // Live members: worker id -> stage.
  const std::map<std::string, int>& members() const { return members_; }
  bool IsMember(const std::string& id) const { return members_.count(id) > 0; }
  size_t size() const { return members_.size(); }
  void Set(const std::string& id, int stage) { members_[id] = stage; }
  // Removes `id` from the members (its suspicions stay until cleared).
  // Returns its stage, or -1 when it was not a member.
  int Remove(const std::string& id);

  // The membership epoch: bumped by every loss, join and move.
  uint64_t epoch() const { return epoch_; }
  void set_epoch(uint64_t epoch) { epoch_ = epoch; }
  void BumpEpoch() { ++epoch_; }

  // Every worker the job had, by id, and the planning node order (a worker
  // keeps its index for the job's life, lost or not).
  const std::map<std::string, v1::WorkerInfo>& infos() const { return infos_; }
  std::map<std::string, v1::WorkerInfo>& mutable_infos() { return infos_; }
  const std::vector<std::string>& node_order() const { return node_order_; }
  std::vector<std::string>& mutable_node_order() { return node_order_; }
  bool HasNode(const std::string& id) const;
  // Records `w` and gives it a node index when it has none yet.
  void Admit(const v1::WorkerInfo& w);

  // Evidence that a member may be gone (a send failed, a peer could not
  // reach it). It is lost when the suspicion outlives the reconnect grace.
  void Suspect(const std::string& id, const std::string& why, absl::Time now);
  void ClearSuspicion(const std::string& id) { suspects_.erase(id); }
  // Suspicions or reports that Judge has still to weigh.
  bool HasSuspects() const {
    return !suspects_.empty() || !unjudged_reports_.empty() || ExclusionPending();
  }

  // Member `reporter` could not reach member `peer` (PeerUnreachable).
  // Judge weighs it: a second reporter, or a peer without an open session,
  // makes the peer suspect; against a peer whose session with the
  // coordinator stays open for kLinkConfirm after the report, one reporter
  // is evidence about the link between the two, not about the peer: the
  // link is cut. (A killed worker's session closes within that time, so
  // its peers' reports still make it suspect at once.)
  void ReportUnreachable(const std::string& reporter, const std::string& peer,
                         const std::string& why, absl::Time now);
  static constexpr absl::Duration kLinkConfirm = absl::Seconds(1);
  // Links Judge found cut since the last call.
  std::vector<LinkCut> TakeNewCuts();
  // Every link found cut between members, as ordered pairs (a < b).
  std::set<std::pair<std::string, std::string>> cut_links() const;
  // The report that cut `link` (a < b); null when it is not cut.
  const LinkCut* CutReport(const std::pair<std::string, std::string>& link) const;
  // `id` left the job: its reports and its cut links go.
  void ForgetLinks(const std::string& id);
  // `link` (a < b) answered again: it is no longer cut.
  void RestoreLink(const std::pair<std::string, std::string>& link) { cut_reports_.erase(link); }

  // The members that are gone, with the reason, judged from the registry's
  // view (`registry`, every worker it lists, lost ones included): not
  // registered any more, lost (no heartbeat for `silence`), a session closed
  // for longer than `grace`, or a suspicion older than `grace`. Peers'
  // reports become cut links or suspicions (ReportUnreachable). A member
  // registered anew since it joined becomes suspect (it may have restarted
  // without the job; one that holds the job says so with a JobStatus, which
  // clears the suspicion). Does not remove anyone.
  std::vector<std::pair<std::string, std::string>> Judge(
      const std::vector<v1::WorkerInfo>& registry, absl::Time now, absl::Duration grace,
      absl::Duration silence);

  // Member `reporter` dropped a tensor frame of member `sender` for its
  // values (BadFrame). `sends` says whether the iteration's plan has
  // `sender` send that frame to `reporter` (PlanSends). One report is
  // enough: the receiver is the only witness of a point-to-point frame. What
  // one member's reports can do is bounded: each reporter gets one member
  // excluded per job; a reporter that reports a second member is excluded
  // itself (one member seeing bad frames from two senders is the more
  // likely fault). Returns the member to exclude, and why, or nullopt with
  // why the report was refused. `what` is the reporter's text (escaped and
  // cut to 200 bytes here).
  struct Exclusion {
    std::string member;
    std::string why;
  };
  std::optional<Exclusion> ReportBadFrame(const std::string& reporter, const std::string& sender,
                                          bool sends, const std::string& what,
                                          std::string* refused);
  // Whether `routes` (microbatch -> route) have `sender` send a
  // `direction` frame of microbatch `mb` to `receiver`, or, for an
  // all-reduce input, whether both are live members of one stage.
  bool PlanSends(const std::map<uint32_t, v1::Route>& routes, const std::string& sender,
                 const std::string& receiver, v1::Direction direction, uint32_t mb) const;
  // `id` is excluded from the job: Judge finds it gone at once, and it is
  // not taken as a joiner again before `now` + kExcludeBackoff.
  static constexpr absl::Duration kExcludeBackoff = absl::Minutes(10);
  void Exclude(const std::string& id, const std::string& why, absl::Time now);
  bool Excluded(const std::string& id, absl::Time now) const;
  // An excluded worker is still a member (Judge has not found it gone).
  bool ExclusionPending() const;

  // Workers lost during the current iteration (cleared when one starts, and
  // when the job pauses: the iteration in flight is aborted then).
  const std::set<std::string>& lost_this_iteration() const { return lost_this_iteration_; }
  void NoteLost(const std::vector<std::string>& ids);
  void StartIteration() { lost_this_iteration_.clear(); }
  void IterationAborted() { lost_this_iteration_.clear(); }

  // Why the last member was lost (for the failure message of a job without
  // elastic training).
  const std::string& loss_reason() const { return loss_reason_; }
  void set_loss_reason(std::string why) { loss_reason_ = std::move(why); }

  // How long a worker that could not join, or that no plan could reach,
  // is not taken again.
  static constexpr absl::Duration kJoinBackoff = absl::Seconds(60);
  // A worker that could not join is not tried again before `until`.
  void BackOff(const std::string& id, absl::Time until) { join_backoff_[id] = until; }
  // Workers not to take as joiners now: members, those lost this iteration
  // and those backing off.
  std::set<std::string> NotJoinable(absl::Time now) const;

  // Workers the job misses per stage: the spec's counts (data nodes for
  // stage 0, replicas for the others) minus `have[s]`.
  static std::map<int, int> Deficit(const v1::PipelineSpec& pipeline, const std::vector<int>& have);

 private:
  void JudgeReports(const std::map<std::string, const v1::WorkerInfo*>& registry, absl::Time now);

  std::map<std::string, int> members_;
  uint64_t epoch_ = 0;
  std::map<std::string, v1::WorkerInfo> infos_;
  std::vector<std::string> node_order_;
  std::map<std::string, std::pair<absl::Time, std::string>> suspects_;
  struct Report {
    absl::Time when;
    std::string why;
  };
  // peer -> reporter -> the first report (every report, judged or not).
  std::map<std::string, std::map<std::string, Report>> reports_;
  std::set<std::string> unjudged_reports_;  // peers with reports Judge has still to weigh
  // Cut links (a < b) and the report that cut each.
  std::map<std::pair<std::string, std::string>, LinkCut> cut_reports_;
  std::vector<LinkCut> new_cuts_;
  std::set<std::string> lost_this_iteration_;
  std::string loss_reason_;
  std::map<std::string, absl::Time> join_backoff_;
  // Excluded workers: until when, and why (Judge's reason while a member).
  std::map<std::string, std::pair<absl::Time, std::string>> excluded_;
  std::map<std::string, std::string> excluded_by_;  // reporter -> the member it got excluded
  std::set<std::string> exclusion_pending_;         // excluded, still members
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_MEMBERSHIP_H_
