// A running job's measured links (docs/RUNTIME.md §"Measured links"): before
// the first plan every worker probes every other over the tensor transport
// (LinkProbe: latency, then bandwidth link by link), and the planner plans on
// what they measured; while the job runs, a cheap latency round every
// link_probe_interval keeps the matrix current and re-probes links found
// cut: one that answers is restored (history LINK_RESTORED). Bandwidths of
// links the job uses are refitted from its own transfers (RunnerPlanner);
// every link_probe_bulk_interval one bulk slot re-measures those its last
// iteration's routes did not cross, slot after slot in turn.
// The matrix is published for GetLinks after every change. A part of
// JobRunner (runner_part.h); the runner's thread only, but Published().
#ifndef DETOUR_COORDINATOR_RUNNER_LINKS_H_
#define DETOUR_COORDINATOR_RUNNER_LINKS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/region_links.h"
#include "coordinator/link_matrix.h"
#include "coordinator/runner_part.h"
#include "detour/v1/job_service.pb.h"
#include "detour/v1/plan.pb.h"

namespace detour {

class RunnerLinks : private RunnerPart {
 public:
  RunnerLinks(RunnerShared* shared, RunnerLoop* loop);

  // Before the first plan: every reserved worker probes every other, first
  // a latency round, all at once, then the bulk rounds in slots
  // (ProbeSchedule: each worker sends to one peer and takes one other's
  // probes at a time, and no link carries probes both ways at once), within
  // options().link_probe_budget or longer where the measured round trips
  // need it (BulkBudget), plus slack for the reports; the cost model is
  // built afterwards with what they measured. Workers that do not answer
  // keep the region table's figures. Off with link_probe = false.
  void ProbeAtStart();

  // The bulk rounds' schedule over `ids`: slots of directed links (from,
  // to), every ordered pair in exactly one slot; in a slot each id sends to
  // at most one and takes probes from at most one, and no pair is probed
  // both ways (the reverse direction carries the probe's acknowledgements:
  // data queued there delays them, and a window opened by delayed
  // acknowledgements reads a fraction of the link). Slot k sends from the
  // i-th id to the (i + k)-th (mod n), k = 1..n-1; for an even n the slot
  // k = n/2 would pair ids both ways and is split into its two directions.
  static std::vector<std::vector<std::pair<std::string, std::string>>> ProbeSchedule(
      const std::vector<std::string>& ids);
  // Of `links`, in their order, the most that one slot takes under
  // ProbeSchedule's rules (each worker sends to one peer and takes one
  // other's probes, no pair both ways): a link that would break one is
  // left for a later slot.
  static std::vector<std::pair<std::string, std::string>> OneSlotOf(
      const std::vector<std::pair<std::string, std::string>>& links);
  // At an iteration boundary: a latency round when link_probe_interval has
  // passed since the last round (and none is outstanding); when
  // link_probe_bulk_interval had passed since the last bulk probes as it was
  // sent, at the next boundary after it (none outstanding) the next bulk
  // slot of ProbeSchedule's in turn, its links the job's traffic does not
  // measure (SendBulkSlot); what rounds brought is laid into the cost model;
  // cut links that answered are restored.
  // `routes`: those of the iteration just run (the job's traffic).
  void AtBoundary(const std::map<uint32_t, v1::Route>& routes);
  // A cut link that no plan avoids (RunnerPlanner::CrossedCut), before its
  // reported side leaves the job: one failed transfer may be a connection
  // that broke (a reset, a handshake that timed out on a busy link), not the
  // path. Asks the reporter to probe the peer (a latency round of that link
  // alone, 5 s, after any round in flight) and returns true when the peer
  // answered: the link is restored (LINK_RESTORED) and plans may use it.
  // False, and nothing asked, without link probes, when either side is no
  // member, or when the same link was restored so in the last 10 minutes
  // and has been cut again. False with `*end` set when the job was stopped
  // or a member reported an error while it waited: nobody is to leave for
  // the unfinished check.
  bool ConfirmCut(const std::pair<std::string, std::string>& link, std::optional<JobEnd>* end);
  // A LinkReport from `worker` (from the runner's Wait).
  void OnReport(const std::string& worker, const v1::LinkReport& report);
  // Publishes the matrix as the planner sees it now.
  void Publish();

  // The last published matrix (any thread); nullopt before the first.
  std::optional<v1::GetLinksResponse> Published() const;

 private:
  // Sends round `round_` to every worker of `asked` (each asked about the
  // peers it maps to) and of `accept` (each taking probes from the ids it
  // maps to); a worker with no peer to probe is not waited for.
  void SendRound(const std::map<std::string, std::vector<v1::Peer>>& asked,
                 const std::map<std::string, std::vector<std::string>>& accept, uint64_t bulk_bytes,
                 absl::Duration budget);
  // The same, each worker of `workers` asked about all the others.
  void SendRoundToAll(const std::map<std::string, v1::Peer>& workers, uint64_t bulk_bytes,
                      absl::Duration budget);
  std::map<std::string, v1::Peer> MemberPeerMap() const;
  // What the planner expects of the link from `from` to `to`: the matrix's
  // measurements, else the region table's figures where the job's network
  // gives them (not the uniform network assumed for undescribed regions);
  // nullopt when neither says anything. `table`: the job's network's region
  // table, indexed once per round by the caller.
  std::optional<v1::LinkExpectation> Expectation(const std::string& from, const std::string& to,
                                                 const RegionLinks& table) const;
  // The links the job's traffic crosses, both ways: every hop of `routes`,
  // each route's last node and its data node (the loss), and the members of
  // each stage among themselves (their gradients).
  std::set<std::pair<std::string, std::string>> CarriedLinks(
      const std::map<uint32_t, v1::Route>& routes) const;
  // Of `slot`, the links neither cut nor `carried`.
  std::vector<std::pair<std::string, std::string>> UncarriedLinks(
      const std::vector<std::pair<std::string, std::string>>& slot,
      const std::set<std::pair<std::string, std::string>>& carried) const;
  // Sends the next slot (of ProbeSchedule over `members`, in turn) that has
  // links neither cut nor `carried`, as one bulk round over those links, its
  // budget their need (SlotNeed), at most 30 s (the next round waits for its
  // reports). Nothing when no slot has any. Links with no rate from a probe
  // or the job's transfers, that no running slot has asked about yet, go
  // first, out of turn, as many in one slot as its rules allow (OneSlotOf).
  void SendBulkSlot(const std::map<std::string, v1::Peer>& members,
                    const std::set<std::pair<std::string, std::string>>& carried);
  // Restores the cut links whose reporter reached the peer in a round sent
  // after the cut (history LINK_RESTORED), and gives the planner the rest.
  void RestoreAnswered();
  // Waits for the round in flight's reports until its deadline; the job's
  // end when it was stopped or a member reported an error meanwhile.
  std::optional<JobEnd> AwaitRound();
  // What a slot needs (its neediest link, LinkProbeNeed of the round trips
  // the matrix has), and the bulk rounds' budget: what the slots need
  // together, at least link_probe_budget, at most kMaxBulkBudget.
  absl::Duration SlotNeed(const std::vector<std::pair<std::string, std::string>>& slot) const;
  absl::Duration BulkBudget(
      const std::vector<std::vector<std::pair<std::string, std::string>>>& slots) const;

  uint64_t round_ = 0;
  // Workers of the round in flight that have not answered, and whom each
  // was asked about.
  std::set<std::string> waiting_;
  std::map<std::string, std::set<std::string>> asked_;
  LinkMatrix::Ranges measured_;  // by the round in flight's reports
  absl::Time round_deadline_ = absl::InfinitePast();
  absl::Time last_round_ = absl::InfinitePast();
  // A bulk slot follows the latency round sent last; when the last bulk
  // probes were sent (the start's, then the running slots'); the members
  // the slots were last scheduled over, and the slot the next one starts
  // from.
  bool bulk_due_ = false;
  absl::Time last_bulk_ = absl::InfinitePast();
  std::vector<std::string> bulk_ids_;
  size_t next_bulk_slot_ = 0;
  // Links a running bulk slot of this schedule has asked about (each
  // unrated one is put first once).
  std::set<std::pair<std::string, std::string>> bulk_asked_;
  bool dirty_ = false;  // reports not yet in the cost model
  // (from, to) -> the newest round in which the link answered.
  std::map<std::pair<std::string, std::string>, uint64_t> answered_;
  // Cut links -> the newest round sent when the runner first saw them cut:
  // only an answer to a later round restores them.
  std::map<std::pair<std::string, std::string>, uint64_t> cut_round_;
  // Cut links ConfirmCut restored -> when.
  std::map<std::pair<std::string, std::string>, absl::Time> confirmed_;

  mutable absl::Mutex published_mu_;
  std::optional<v1::GetLinksResponse> published_ ABSL_GUARDED_BY(published_mu_);
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_RUNNER_LINKS_H_
