#include "coordinator/runner_elastic.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace detour {

RunnerElastic::RunnerElastic(RunnerShared* shared, RunnerLoop* loop) : RunnerPart(shared, loop) {}

void RunnerElastic::Started() { reassign_epoch_ = epoch(); }

// The live members cannot train: abort the iteration, wait for workers to
// fill the gaps (pause_timeout_s), then run the iteration again.
std::optional<JobEnd> RunnerElastic::Pause(uint64_t iteration, const std::string& why,
                                           const std::function<bool()>& blocked) {
  link_.AbortIteration(iteration, absl::StrCat("paused: ", why));
  // The iteration in flight is over: a worker lost in it may join again
  // once it is back and idle. It is often the only one there is (all the
  // workers cut off from the leader and back), and the paused job would
  // otherwise wait for a replacement that never comes until it times out.
  membership_.IterationAborted();
  const uint32_t timeout_s = spec_.elastic().pause_timeout_s();
  // The state first: whoever sees the event also sees the paused state.
  record_.SetState(v1::JOB_STATE_RUNNING, absl::StrCat("paused: ", why, "; waiting for workers"));
  AddEvent(v1::JobHistoryEvent::KIND_PAUSED, iteration, "",
           absl::StrCat("paused at iteration ", iteration, ": ", why, "; waiting up to ", timeout_s,
                        " s for workers to join"));
  // A lost stage's holder coming back (STAGE_LOSS_PAUSE) is no replacement.
  const bool holder_may_return =
      spec_.elastic().on_stage_loss() == v1::STAGE_LOSS_PAUSE && !lost_stages_.empty();
  if (spec_.elastic().never_join() && !holder_may_return) {
    return Failed(absl::StrCat(why, " and elastic.never_join forbids replacements"));
  }
  const absl::Time deadline = Now() + absl::Seconds(timeout_s);
  auto paused = [&] { return !plan_.Infeasible().empty() || (blocked && blocked()); };
  while (paused()) {
    if (auto e = Grow(); e) return e;
    if (auto e = Reassign(); e) return e;
    if (!paused()) break;
    RunnerEvent ev = Wait(
        deadline, [&] { return absl::StrCat("workers to join (", why, ")"); },
        /*detect_loss=*/true, /*return_on_change=*/true);
    if (ev.end) return ev.end;
  }
  record_.SetState(v1::JOB_STATE_RUNNING, "training");
  AddEvent(
      v1::JobHistoryEvent::KIND_CONTINUED, iteration, "",
      absl::StrCat("continuing at iteration ", iteration, " with ", members().size(), " workers"));
  return std::nullopt;
}

// At an iteration boundary: idle workers join where the job lacks
// capacity, the empty stages first, then the stage whose new replica the
// planner predicts the shortest iteration for.
std::optional<JobEnd> RunnerElastic::Grow() {
  if (spec_.elastic().never_join() || !elastic()) return std::nullopt;
  std::map<int, int> deficit = RunnerMembership::Deficit(spec_.pipeline(), plan_.StageSizes());
  if (spec_.elastic().on_stage_loss() == v1::STAGE_LOSS_PAUSE) {
    // Only a worker holding a lost stage's state may fill it.
    for (int s : lost_stages_) deficit.erase(s);
  }
  int wanted = 0;
  for (const auto& [s, n] : deficit) wanted += n;
  if (wanted == 0) return std::nullopt;
  std::vector<v1::WorkerInfo> idle =
      host_->ReserveIdle(job_id_, wanted, membership_.NotJoinable(Now()));
  for (v1::WorkerInfo& w : idle) {
    const int stage = ChooseStage(w, deficit);
    if (auto e = Join(w, stage); e) return e;
    if (--deficit[stage] == 0) deficit.erase(stage);
  }
  return std::nullopt;
}

int RunnerElastic::ChooseStage(const v1::WorkerInfo& w, const std::map<int, int>& deficit) {
  for (const auto& [s, n] : deficit) {
    if (plan_.assignment().stage_nodes[s].empty()) return s;
  }
  if (deficit.size() == 1) return deficit.begin()->first;
  // Judge each candidate by the plan it allows (a quick route search), with
  // `w` tried in each stage; then everything is put back as it was. `w` may
  // be a worker the job had before (lost, then back and idle): it keeps its
  // entry and node index, which BuildCostModel needs for every node.
  int best = deficit.begin()->first;
  double best_time = std::numeric_limits<double>::infinity();
  const std::string id = w.worker_id();
  auto& infos = membership_.mutable_infos();
  const auto had_info = infos.find(id);
  const std::optional<v1::WorkerInfo> old_info =
      had_info != infos.end() ? std::optional<v1::WorkerInfo>(had_info->second) : std::nullopt;
  const bool had_node = membership_.HasNode(id);
  membership_.Admit(w);
  if (plan_.BuildCostModel().ok()) {
    for (const auto& [s, n] : deficit) {
      membership_.Set(id, s);
      plan_.RebuildAssignment();
      auto p = plan_.PlanLive(spec_.seed() + s, plan_.total_microbatches(), nullptr,
                              RunnerPlanner::kQuickEvaluations, std::nullopt);
      if (p.ok() && p->result.iteration_time_s < best_time) {
        best_time = p->result.iteration_time_s;
        best = s;
      }
    }
  }
  membership_.Remove(id);
  if (!had_node) membership_.mutable_node_order().pop_back();
  if (old_info.has_value()) {
    infos[id] = *old_info;
  } else {
    infos.erase(id);
  }
  plan_.BuildCostModel().IgnoreError();
  plan_.RebuildAssignment();
  return best;
}

// `w` joins stage `stage` at the next iteration: it builds the stage and
// receives a live replica's state (or the newest checkpoint's). With
// `move`, `w` is a member moving from move->from (it already left it): it
// drops that stage and takes the new one the same way.
std::optional<JobEnd> RunnerElastic::Join(const v1::WorkerInfo& w, int stage,
                                          const StageMove* move) {
  const std::string id = w.worker_id();
  membership_.Admit(w);
  if (absl::Status s = plan_.BuildCostModel(); !s.ok()) return Failed(s.message());
  const std::vector<std::string> replicas = plan_.StageMembers(stage);
  const std::string donor = replicas.empty() ? "" : replicas.front();
  membership_.Set(id, stage);
  membership_.BumpEpoch();
  plan_.RebuildAssignment();
  plan_.ForgetRoutes();
  if (move == nullptr) host_->runner_metrics().MembersChanged(1);
  plan_.KfacMembershipChanged();
  const std::string restore = donor.empty() ? checkpoints_.last() : "";
  const std::string verb = move == nullptr ? "join" : "move to";
  auto fail_join = [&](const std::string& why) -> std::optional<JobEnd> {
    // Not again for a while: a worker that cannot join would otherwise be
    // tried at every iteration.
    membership_.BackOff(id, Now() + RunnerMembership::kJoinBackoff);
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_LOST, next_iteration_, id,
             absl::StrCat("worker ", id, " could not ", verb, " stage ", stage, ": ", why));
    RemoveMember(id, why, next_iteration_);
    return std::nullopt;
  };
  const absl::Time begin = absl::Now();
  if (!link_.SendTo(id, AssignmentFor(id, stage, next_iteration_, donor, restore))) {
    return fail_join("it has no open session");
  }
  const absl::Time deadline = Now() + options().assign_timeout;
  bool ready = false;
  bool received = donor.empty();
  uint64_t checksum = 0;
  while (!ready || !received) {
    RunnerEvent ev =
        Wait(deadline, [&] { return absl::StrCat("worker ", id, " to ", verb, " stage ", stage); });
    if (ev.end) {
      if (ev.end->state == v1::JOB_STATE_FAILED && !StopRequested()) {
        return fail_join(ev.end->message);
      }
      return ev.end;
    }
    if (!ev.lost.empty()) {
      if (!membership_.IsMember(id)) return std::nullopt;  // the joiner itself
      if (!donor.empty() && !membership_.IsMember(donor)) return fail_join("its donor was lost");
    }
    for (auto& [worker, m] : ev.messages) {
      if (worker != id) continue;
      if (m.has_stage_ready() && m.stage_ready().job_id() == job_id_ && !ready) {
        ready = true;
        if (!donor.empty()) {
          v1::CoordinatorMessage send;
          send.mutable_send_state()->set_job_id(job_id_);
          send.mutable_send_state()->set_to(id);
          send.mutable_send_state()->set_epoch(epoch());
          for (const v1::Peer& p : MemberPeers(membership_)) {
            if (p.worker_id() == id) *send.mutable_send_state()->mutable_peer() = p;
          }
          link_.SendTo(donor, send);
        }
      } else if (m.has_state_received() && m.state_received().job_id() == job_id_) {
        received = true;
        checksum = m.state_received().parameter_checksum();
      }
    }
  }
  if (!donor.empty() && last_checksum_.count(stage) && checksum != last_checksum_.at(stage)) {
    return fail_join(absl::StrCat("the state it received has checksum ", checksum,
                                  ", its replicas ", last_checksum_.at(stage)));
  }
  RecordStages();
  std::string source = absl::StrCat(" with the state of ", donor);
  if (donor.empty() && lost_stages_.count(stage) &&
      spec_.elastic().on_stage_loss() == v1::STAGE_LOSS_ROLLBACK) {
    source = " (the stage's state was lost: the job rolls back before it trains)";
  } else if (donor.empty()) {
    source = restore.empty() ? " (fresh parameters: no replica or checkpoint was left)"
                             : absl::StrCat(" from checkpoint ", restore);
    // REINITIALIZE: the stage starts again here (the loss was recorded).
    lost_stages_.erase(stage);
  }
  if (move == nullptr) {
    host_->runner_metrics().WorkerJoined();
    AddEvent(v1::JobHistoryEvent::KIND_WORKER_JOINED, next_iteration_, id,
             absl::StrCat("worker ", id, " joined stage ", stage, " at iteration ", next_iteration_,
                          source));
    return std::nullopt;
  }
  host_->runner_metrics().WorkerReassigned();
  AddEvent(
      v1::JobHistoryEvent::KIND_REASSIGNED, next_iteration_, id,
      absl::StrCat("worker ", id, " moved from stage ", move->from, " to stage ", stage,
                   " at iteration ", next_iteration_, source, " in ",
                   absl::FormatDuration(absl::Trunc(absl::Now() - begin, absl::Milliseconds(1))),
                   " (", MoveReason(*move), ")"));
  return std::nullopt;
}

// At an iteration boundary after a membership change or a re-plan with
// measured speeds: moves one worker from a stage with spare replicas to
// another stage when the planner predicts a gain that repays the move
// within the horizon, or to a stage left empty (stage_reassignment.h).
std::optional<JobEnd> RunnerElastic::Reassign() {
  if (!elastic() || spec_.elastic().reassign_disabled()) return std::nullopt;
  if (epoch() == reassign_epoch_ && plan_.cost_version() == reassign_costs_) return std::nullopt;
  reassign_epoch_ = epoch();
  reassign_costs_ = plan_.cost_version();
  const uint64_t left = spec_.iterations() - next_iteration_;
  const uint64_t horizon = std::min<uint64_t>(spec_.elastic().reassign_horizon_iterations(), left);
  if (horizon == 0) return std::nullopt;
  std::vector<std::vector<std::string>> stages;
  for (int s = 0; s < plan_.assignment().num_stages(); ++s) {
    stages.push_back(plan_.StageMembers(s));
  }
  auto seconds = [this](const std::string& id, int stage) {
    const int n = plan_.cost().NodeIndex(id);
    return n < 0 ? 0.0 : plan_.cost().ForwardTime(n, stage) + plan_.cost().BackwardTime(n, stage);
  };
  std::vector<StageMove> moves = CandidateMoves(stages, seconds, /*limit=*/-1);
  if (spec_.elastic().on_stage_loss() == v1::STAGE_LOSS_PAUSE) {
    // A lost stage waits for a worker holding its state.
    moves.erase(std::remove_if(moves.begin(), moves.end(),
                               [&](const StageMove& m) { return lost_stages_.count(m.to) > 0; }),
                moves.end());
  }
  if (moves.empty()) return std::nullopt;
  // Every candidate is judged by the same quick route search.
  const uint64_t seed = spec_.seed() + next_iteration_;
  const double current = plan_.PredictIteration(seed);
  if (std::isfinite(current)) {  // workers that can train: recent moves settle first
    const size_t before = moves.size();
    moves.erase(std::remove_if(moves.begin(), moves.end(),
                               [&](const StageMove& m) {
                                 return MoveMustSettle(m, made_moves_, next_iteration_, epoch());
                               }),
                moves.end());
    if (moves.size() < before) {
      LogDebug("job ", job_id_, ": ", before - moves.size(),
               " stage move(s) wait for a recent move of their worker to settle");
    }
  }
  if (moves.size() > static_cast<size_t>(kMoveCandidates)) moves.resize(kMoveCandidates);
  if (moves.empty()) return std::nullopt;
  for (StageMove& m : moves) {
    membership_.Set(m.worker, m.to);
    plan_.RebuildAssignment();
    m.predicted_iteration_s = plan_.PredictIteration(seed);
    membership_.Set(m.worker, m.from);
    plan_.RebuildAssignment();
    m.cost_s = plan_.MoveCost(m, absl::ToDoubleSeconds(kMovePause));
  }
  std::optional<StageMove> move = ChooseMove(current, moves, horizon);
  if (!move) {
    LogDebug("job ", job_id_, ": no stage move pays within ", horizon, " iterations (",
             moves.size(), " judged)");
    return std::nullopt;
  }
  move_baseline_s_ = current;
  LogInfo("job ", job_id_, ": moving worker ", move->worker, " from stage ", move->from,
          " to stage ", move->to, " (", MoveReason(*move), ")");
  membership_.Remove(move->worker);
  plan_.RebuildAssignment();
  std::optional<JobEnd> end = Join(membership_.infos().at(move->worker), move->to, &*move);
  auto moved = members().find(move->worker);
  if (!end && moved != members().end() && moved->second == move->to) {
    made_moves_[move->worker] = MadeMove{next_iteration_, horizon, epoch()};
  }
  return end;
}

std::string RunnerElastic::MoveReason(const StageMove& m) const {
  if (m.fills_empty_stage) {
    return absl::StrFormat("stage %d had no worker; predicted iteration %.3g s", m.to,
                           m.predicted_iteration_s);
  }
  if (!std::isfinite(move_baseline_s_)) {
    return absl::StrFormat("the workers left could not train; predicted iteration %.3g s",
                           m.predicted_iteration_s);
  }
  const double gain = move_baseline_s_ - m.predicted_iteration_s;
  return absl::StrFormat(
      "predicted iteration %.3g s -> %.3g s; the move costs %.3g s, repaid in %.1f iterations",
      move_baseline_s_, m.predicted_iteration_s, m.cost_s, gain > 0 ? m.cost_s / gain : 0.0);
}

}  // namespace detour
