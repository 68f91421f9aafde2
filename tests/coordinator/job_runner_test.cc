// The job runner's elastic decisions without processes or sockets: a fake
// host whose job store and worker registry are the coordinator's own, and
// fake workers that answer the control protocol at once, on the runner's
// thread (docs/RUNTIME.md §"Elastic training" describes each exchange). A
// test scripts the faults — a worker dies when a plan reaches it, a spare
// registers, workers report after a coordinator restart — and reads the
// decisions from the job record, its history and the messages sent.
#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/checkpoint_manifest.h"
#include "common/clock.h"
#include "common/metrics/metrics.h"
#include "common/model_config.h"
#include "common/spec.h"
#include "coordinator/job_store.h"
#include "coordinator/link_matrix.h"
#include "coordinator/runner_elastic.h"
#include "coordinator/runner_iteration.h"
#include "coordinator/runner_links.h"
#include "coordinator/runner_part.h"
#include "coordinator/runner_stage_loss.h"
#include "coordinator/timing_estimates.h"
#include "coordinator/worker_registry.h"
#include "tests/e2e/process.h"

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// One fake worker's view of the job.
struct FakeWorker {
  std::string id;
  std::string token;
  std::string job_id;  // of the plan it runs
  double speed = 1;
  bool alive = true;
  bool mute = false;  // takes plans but never answers them
  int stage = -1;     // -1: holds no stage
  uint64_t checksum = 0;
  uint64_t iteration = 0;
  uint64_t epoch = 0;
  bool stepped = false;
  bool waiting_step = false;                // in an iteration whose step it has not applied
  std::map<uint32_t, v1::Route> routes;     // this iteration's, amendments applied
  std::vector<std::string> first_of_stage;  // replica group heads, by stage
};

// A worker dies when the plan of `iteration` reaches it: `worker`, or when
// that is empty the node microbatch 0's route visits at `route_stage`.
struct KillOnPlan {
  std::string worker;
  uint64_t iteration = 0;
  int route_stage = -1;
  bool done = false;  // once: a worker that comes back lives on
};

// `reporter` cannot reach `peer` when the plan of `iteration` arrives: it
// reports PeerUnreachable instead of its norm (once; the plan that runs the
// iteration again gets its norm).
struct UnreachableOnPlan {
  std::string reporter;
  std::string peer;
  uint64_t iteration = 0;
  bool done = false;
  bool bad_frame = false;                             // a BadFrame about the peer's frame instead
  v1::Direction direction = v1::DIRECTION_ALLREDUCE;  // of the bad frame (microbatch 0)
};

// The runner's surroundings: the coordinator's own JobStore and
// WorkerRegistry, and workers that live in this object.
class FakeCluster : public RunnerHost {
 public:
  explicit FakeCluster(const std::string& dir)
      : store_(dir + "/data"),
        registry_(absl::Seconds(60), absl::Seconds(1)),
        estimates_(nullptr),
        metrics_(&metrics_registry_) {
    options_.checkpoint_root = dir + "/checkpoints";
    options_.assign_timeout = absl::Seconds(30);
    options_.iteration_timeout = absl::Seconds(30);
  }

  void set_runner(JobRunner* runner) {
    absl::MutexLock lock(&mu_);
    runner_ = runner;
  }

  // Registers `id` with an open session (an idle worker; one that died
  // comes back as a fresh process).
  void AddWorker(const std::string& id, double speed = 1.0) {
    v1::RegisterRequest r;
    r.set_worker_id(id);
    r.set_region("local");
    r.set_speed(speed);
    r.set_memory_slots(3);
    r.set_address(absl::StrCat(id, ".test:1"));
    auto response = registry_.Register(r, clock_->Now());
    ASSERT_TRUE(response.ok()) << response.status();
    registry_.SessionOpened(response->session_token(), clock_->Now());
    absl::MutexLock lock(&mu_);
    FakeWorker& w = workers_[id];
    w = FakeWorker();
    w.id = id;
    w.token = response->session_token();
    w.speed = speed;
  }

  // The worker stops answering and its session closes.
  void Kill(const std::string& id) {
    std::string token;
    {
      absl::MutexLock lock(&mu_);
      workers_[id].alive = false;
      token = workers_[id].token;
    }
    registry_.SessionEnded(token, clock_->Now());
  }

  // A heartbeat from `id` naming `job` ("" = idle), as the worker sends on
  // its session.
  void Beat(const std::string& id, const std::string& job) {
    std::string token;
    {
      absl::MutexLock lock(&mu_);
      token = workers_[id].token;
    }
    v1::Heartbeat beat;
    beat.set_seq(1);
    beat.set_job_id(job);
    ASSERT_TRUE(registry_.Heartbeat(token, beat, clock_->Now()).ok());
  }

  // The runner and the registry read `clock` (the real one by default).
  void UseClock(const Clock* clock) { clock_ = clock; }

  // The worker stays registered with its session open but never answers a
  // plan (a stalled process).
  void Mute(const std::string& id) {
    absl::MutexLock lock(&mu_);
    workers_[id].mute = true;
  }

  void ReportUnreachableWhenPlanArrives(const std::string& reporter, const std::string& peer,
                                        uint64_t iteration) {
    absl::MutexLock lock(&mu_);
    unreachable_.push_back({reporter, peer, iteration});
  }
  // When the plan of `iteration` reaches `reporter`, it reports `sender`'s
  // all-reduce input as holding NaN instead of sending its norm.
  void ReportBadFrameWhenPlanArrives(const std::string& reporter, const std::string& sender,
                                     uint64_t iteration,
                                     v1::Direction direction = v1::DIRECTION_ALLREDUCE) {
    absl::MutexLock lock(&mu_);
    unreachable_.push_back({reporter, sender, iteration, false, true, direction});
  }

  // Messages ignored as coming from outside the job.
  double OutsiderMessages(const std::string& kind = "") {
    if (metrics_.outsider_messages == nullptr) return -1;
    double n = 0;
    for (const char* k : {"error", "grad_norm", "peer_unreachable", "bad_frame"}) {
      if (!kind.empty() && kind != k) continue;
      if (auto c = metrics_.outsider_messages->WithLabels({k}); c.ok()) n += (*c)->Value();
    }
    return n;
  }

  // Every route of every plan sent, by (iteration, epoch).
  std::map<std::pair<uint64_t, uint64_t>, std::vector<v1::Route>> Routes() {
    absl::MutexLock lock(&mu_);
    return routes_;
  }

  void KillWhenPlanArrives(const std::string& worker, uint64_t iteration) {
    absl::MutexLock lock(&mu_);
    kills_.push_back({worker, iteration});
  }
  // `id` (dead) registers again, a new process, when `iteration`'s plan is
  // first sent.
  void ReviveWhenPlanArrives(const std::string& id, uint64_t iteration) {
    absl::MutexLock lock(&mu_);
    revivals_[iteration] = id;
  }
  // The worker of `stage` on microbatch 0's route dies with `iteration`'s plan.
  void KillOnRouteWhenPlanArrives(int stage, uint64_t iteration) {
    absl::MutexLock lock(&mu_);
    kills_.push_back({"", iteration, stage});
  }

  // A worker that holds `stage` of the job with the given checksum (the
  // state a coordinator restart finds).
  void Hold(const std::string& id, int stage, uint64_t checksum) {
    absl::MutexLock lock(&mu_);
    workers_[id].stage = stage;
    workers_[id].checksum = checksum;
  }

  // ... and is in `iteration` of `epoch`, waiting for its step (the old
  // coordinator died before sending it).
  void HoldInIteration(const std::string& id, int stage, uint64_t checksum, uint64_t iteration,
                       uint64_t epoch) {
    Hold(id, stage, checksum);
    absl::MutexLock lock(&mu_);
    FakeWorker& w = workers_[id];
    w.iteration = iteration;
    w.epoch = epoch;
    w.stepped = false;
    w.waiting_step = true;
  }

  // Step messages sent while the job record did not hold them
  // (Job.pending_step).
  int StepsNotInRecord() {
    absl::MutexLock lock(&mu_);
    return steps_not_in_record_;
  }

  // Steps each worker applied, as (worker, iteration, squared norm).
  std::vector<std::tuple<std::string, uint64_t, double>> Steps() {
    absl::MutexLock lock(&mu_);
    return steps_;
  }

  std::vector<v1::WorkerInfo> Infos(const std::vector<std::string>& ids) {
    std::vector<v1::WorkerInfo> out;
    for (const v1::WorkerInfo& w : registry_.List(true)) {
      if (std::find(ids.begin(), ids.end(), w.worker_id()) != ids.end()) out.push_back(w);
    }
    return out;
  }

  // What link probes find: every link answers with `rtt` and `rate`,
  // but for the (from, to) pairs set here.
  struct FakeLink {
    double rtt = 0.02;
    double rate = 1e8;
    std::string error;
  };
  void SetLink(const std::string& from, const std::string& to, FakeLink link) {
    absl::MutexLock lock(&mu_);
    links_[{from, to}] = std::move(link);
  }
  // From probe round `round` on, the link from `from` to `to` answers as
  // `link` says.
  void SetLinkFromRound(const std::string& from, const std::string& to, uint64_t round,
                        FakeLink link) {
    absl::MutexLock lock(&mu_);
    later_links_[{from, to}] = {round, std::move(link)};
  }

  // After each step every worker reports its forward transfers (to the next
  // node of each of its routes) as taking `seconds`, plus the link's round
  // trip (its FakeLink's rtt: the way there and the acknowledgement's way
  // back) when `plus_round_trip`; 0 = no transfers.
  void ReportTransfers(double seconds, bool plus_round_trip = false) {
    absl::MutexLock lock(&mu_);
    transfer_seconds_ = seconds;
    transfer_plus_round_trip_ = plus_round_trip;
  }

  // The checkpoints assignments told workers to restore, in order.
  std::vector<std::string> Restored() {
    absl::MutexLock lock(&mu_);
    return restored_;
  }
  // The runners' metrics, as scraped.
  std::string Scrape() { return metrics_registry_.Serialize(); }

  // Messages the runner sent, by kind (the oneof's field name).
  int Sent(const std::string& kind) {
    absl::MutexLock lock(&mu_);
    return sent_count_[kind];
  }
  std::vector<v1::LinkProbe> Probes() {
    absl::MutexLock lock(&mu_);
    return probes_;
  }
  // The worker each of Probes() was sent to, and the iteration of the last
  // plan sent before it (0 before any).
  std::vector<std::string> ProbedBy() {
    absl::MutexLock lock(&mu_);
    return probed_by_;
  }
  std::vector<uint64_t> ProbedAfter() {
    absl::MutexLock lock(&mu_);
    return probed_after_;
  }
  std::vector<uint64_t> PlannedIterations() {
    absl::MutexLock lock(&mu_);
    return planned_iterations_;
  }
  int StageOf(const std::string& id) {
    absl::MutexLock lock(&mu_);
    return workers_[id].stage;
  }

  // RunnerHost.
  JobStore& jobs() override { return store_; }
  WorkerRegistry& registry() override { return registry_; }
  const JobManagerOptions& options() const override { return options_; }
  JobManagerOptions* mutable_options() { return &options_; }
  TimingEstimates& estimates() override { return estimates_; }
  RunnerMetrics& runner_metrics() override { return metrics_; }
  const Clock& clock() const override { return *clock_; }

  absl::Status Send(const std::string& worker, const v1::CoordinatorMessage& m) override {
    std::vector<std::pair<std::string, v1::WorkerMessage>> replies;
    JobRunner* runner = nullptr;
    bool poke = false;
    std::string revive;
    bool step_in_record = false;
    if (m.has_step()) {
      auto job = store_.Get(m.step().job_id());
      step_in_record = job.ok() && job->has_pending_step() &&
                       job->pending_step().iteration() == m.step().iteration() &&
                       job->pending_step().squared_norm() == m.step().squared_norm() &&
                       job->pending_step().epoch() == m.step().epoch();
    }
    {
      absl::MutexLock lock(&mu_);
      if (m.has_step() && !step_in_record) ++steps_not_in_record_;
      runner = runner_;
      auto it = workers_.find(worker);
      if (it == workers_.end() || !it->second.alive) {
        return absl::UnavailableError(absl::StrCat(worker, " has no open session"));
      }
      ++sent_count_[m.GetDescriptor()->FindFieldByNumber(m.kind_case())->name()];
      poke = Answer(it->second, m, &replies);
      if (auto r = revivals_.find(m.has_plan() ? m.plan().iteration() : 0);
          m.has_plan() && r != revivals_.end()) {
        revive = r->second;
        revivals_.erase(r);
      }
    }
    if (!revive.empty()) AddWorker(revive);
    if (poke) {
      std::string token;
      {
        absl::MutexLock lock(&mu_);
        token = workers_[worker].token;
      }
      registry_.SessionEnded(token, clock_->Now());
    }
    if (runner != nullptr) {
      for (auto& [from, reply] : replies) runner->Post(from, reply);
      if (poke) runner->Poke();
    }
    return absl::OkStatus();
  }

  std::vector<v1::WorkerInfo> ReserveIdle(const std::string& job, size_t count,
                                          const std::set<std::string>& exclude) override {
    std::vector<v1::WorkerInfo> taken;
    absl::MutexLock lock(&mu_);
    for (const v1::WorkerInfo& w : registry_.List(false)) {
      if (taken.size() >= count) break;
      const FakeWorker& f = workers_[w.worker_id()];
      if (!f.alive || f.stage >= 0 || reserved_.count(w.worker_id()) ||
          exclude.count(w.worker_id())) {
        continue;
      }
      reserved_.insert(w.worker_id());
      taken.push_back(w);
    }
    return taken;
  }
  void Unreserve(const std::string& job, const std::string& worker) override {
    absl::MutexLock lock(&mu_);
    reserved_.erase(worker);
  }
  void Release(const std::string& job) override {
    absl::MutexLock lock(&mu_);
    reserved_.clear();
  }

 private:
  // The worker's answer to `m`, as the real worker's runtime gives it.
  // Returns true when the worker dies on this message (its session closes).
  bool Answer(FakeWorker& w, const v1::CoordinatorMessage& m,
              std::vector<std::pair<std::string, v1::WorkerMessage>>* replies)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto reply = [&](const std::string& from) -> v1::WorkerMessage& {
      replies->emplace_back(from, v1::WorkerMessage());
      return replies->back().second;
    };
    switch (m.kind_case()) {
      case v1::CoordinatorMessage::kAssignment: {
        const v1::StageAssignment& a = m.assignment();
        spec_ = a.spec();
        if (!a.restore_from().empty()) restored_.push_back(a.restore_from());
        w.stage = static_cast<int>(a.stage());
        w.epoch = a.epoch();
        w.routes.clear();
        // Fresh or restored parameters: the same for every replica of a
        // stage; a donor's state replaces them (kSendState).
        w.checksum = 1000 + a.stage();
        v1::StageReady* ready = reply(w.id).mutable_stage_ready();
        ready->set_job_id(a.job_id());
        ready->set_stage(a.stage());
        return false;
      }
      case v1::CoordinatorMessage::kSendState: {
        FakeWorker& to = workers_[m.send_state().to()];
        to.checksum = w.checksum;
        v1::StateReceived* got = reply(to.id).mutable_state_received();
        got->set_job_id(m.send_state().job_id());
        got->set_stage(static_cast<uint32_t>(to.stage));
        got->set_parameter_checksum(w.checksum);
        return false;
      }
      case v1::CoordinatorMessage::kPlan: {
        const v1::IterationPlan& p = m.plan();
        planned_iterations_.push_back(p.iteration());
        for (KillOnPlan& k : kills_) {
          if (k.done) continue;
          std::string victim = k.worker;
          for (const v1::Route& r : p.routes()) {
            if (victim.empty() && r.microbatch() == 0) {
              for (int i = 0; i < r.stages_size(); ++i) {
                if (static_cast<int>(r.stages(i)) == k.route_stage) victim = r.nodes(i);
              }
            }
          }
          if (victim == w.id && k.iteration == p.iteration()) {
            k.done = true;
            w.alive = false;
            return true;
          }
        }
        w.job_id = p.job_id();
        w.iteration = p.iteration();
        w.epoch = p.epoch();
        w.stepped = false;
        w.waiting_step = true;
        w.routes.clear();
        for (const v1::Route& r : p.routes()) w.routes[r.microbatch()] = r;
        w.first_of_stage.clear();
        for (const v1::ReplicaGroup& g : p.replica_groups()) {
          if (w.first_of_stage.size() <= g.stage()) w.first_of_stage.resize(g.stage() + 1);
          w.first_of_stage[g.stage()] = g.nodes().empty() ? "" : g.nodes(0);
        }
        checkpoint_ = p.checkpoint();
        routes_[{p.iteration(), p.epoch()}] = {p.routes().begin(), p.routes().end()};
        if (w.mute) return false;
        for (UnreachableOnPlan& u : unreachable_) {
          if (u.done || u.reporter != w.id || u.iteration != p.iteration()) continue;
          u.done = true;
          if (u.bad_frame) {
            v1::BadFrame* bad = reply(w.id).mutable_bad_frame();
            bad->set_job_id(p.job_id());
            bad->set_iteration(p.iteration());
            bad->set_sender(u.peer);
            bad->set_direction(u.direction);
            bad->set_epoch(p.epoch());
            bad->set_message("it holds NaN");
            return false;
          }
          v1::PeerUnreachable* report = reply(w.id).mutable_peer_unreachable();
          report->set_job_id(p.job_id());
          report->set_iteration(p.iteration());
          report->set_peer(u.peer);
          report->set_message("connection timed out");
          return false;
        }
        Norm(w, reply(w.id));
        return false;
      }
      case v1::CoordinatorMessage::kMembership: {
        const v1::MembershipChange& c = m.membership();
        w.epoch = c.epoch();
        v1::MembershipAck* ack = reply(w.id).mutable_membership_ack();
        ack->set_job_id(c.job_id());
        ack->set_iteration(c.iteration());
        ack->set_epoch(c.epoch());
        return false;  // nothing ran yet: every crossing microbatch runs again
      }
      case v1::CoordinatorMessage::kReroute: {
        const v1::RouteAmendment& a = m.reroute();
        w.epoch = a.epoch();
        for (const v1::Route& r : a.routes()) w.routes[r.microbatch()] = r;
        if (!w.stepped) Norm(w, reply(w.id));  // reduced again among the survivors
        return false;
      }
      case v1::CoordinatorMessage::kStep: {
        const v1::StepCommand& s = m.step();
        // The worker's runtime drops a step that is not for the iteration
        // it waits in (RuntimeStep::OnStep).
        if (!w.waiting_step || s.iteration() != w.iteration || s.epoch() != w.epoch) return false;
        w.stepped = true;
        w.waiting_step = false;
        steps_.emplace_back(w.id, s.iteration(), s.squared_norm());
        w.checksum = w.checksum * 31 + s.iteration() + 1;
        v1::IterationResult* r = reply(w.id).mutable_result();
        r->set_job_id(s.job_id());
        r->set_iteration(s.iteration());
        r->set_stage(static_cast<uint32_t>(w.stage));
        r->set_epoch(s.epoch());
        r->set_parameter_checksum(w.checksum);
        if (w.stage == 0) {
          for (const auto& [mb, route] : w.routes) {
            if (route.data_node() == w.id) r->add_microbatches(mb);
          }
          r->set_loss_sum(2.5 * r->microbatches_size());
          r->set_tokens(100u * r->microbatches_size());
        }
        if (checkpoint_ && w.stage < static_cast<int>(w.first_of_stage.size()) &&
            w.first_of_stage[w.stage] == w.id) {
          v1::CheckpointFile* f = r->mutable_checkpoint();
          f->set_stage(static_cast<uint32_t>(w.stage));
          f->set_file(absl::StrCat("stage-", w.stage, ".bin"));
        }
        if (transfer_seconds_ > 0) {
          v1::TimingReport* t = reply(w.id).mutable_timing();
          t->set_job_id(s.job_id());
          t->set_iteration(s.iteration());
          t->set_node(w.id);
          for (const auto& [mb, route] : w.routes) {
            for (int i = 0; i + 1 < route.nodes_size(); ++i) {
              if (route.nodes(i) != w.id) continue;
              v1::TransferTiming* x = t->add_transfers();
              x->set_peer(route.nodes(i + 1));
              x->set_forward(true);
              auto link = links_.find({w.id, route.nodes(i + 1)});
              const double rtt = link != links_.end() ? link->second.rtt : FakeLink().rtt;
              x->set_duration_s(transfer_seconds_ + (transfer_plus_round_trip_ ? rtt : 0));
            }
          }
        }
        return false;
      }
      case v1::CoordinatorMessage::kCommit: {
        WriteManifest(m.commit());
        v1::CheckpointCommitted* c = reply(w.id).mutable_checkpoint_committed();
        c->set_job_id(m.commit().job_id());
        c->set_iteration(m.commit().iteration());
        c->set_dir(m.commit().dir());
        return false;
      }
      case v1::CoordinatorMessage::kProbe: {
        const v1::LinkProbe& p = m.probe();
        probes_.push_back(p);
        probed_by_.push_back(w.id);
        probed_after_.push_back(planned_iterations_.empty() ? 0 : planned_iterations_.back());
        v1::LinkReport* r = reply(w.id).mutable_link_report();
        r->set_job_id(p.job_id());
        r->set_round(p.round());
        for (const v1::Peer& peer : p.peers()) {
          if (peer.worker_id() == w.id) continue;
          auto it = links_.find({w.id, peer.worker_id()});
          FakeLink link = it != links_.end() ? it->second : FakeLink();
          auto later = later_links_.find({w.id, peer.worker_id()});
          if (later != later_links_.end() && p.round() >= later->second.first) {
            link = later->second.second;
          }
          v1::LinkMeasurement* l = r->add_links();
          l->set_peer(peer.worker_id());
          if (!link.error.empty()) {
            l->set_error(link.error);
            continue;
          }
          l->set_rtt_seconds(link.rtt);
          if (p.bulk_max_bytes() > 0) l->set_bandwidth_bytes_per_s(link.rate);
        }
        return false;
      }
      case v1::CoordinatorMessage::kAbort:
        w.routes.clear();
        w.waiting_step = false;
        return false;
      case v1::CoordinatorMessage::kCancel:
        w.stage = -1;
        w.routes.clear();
        return false;
      default: return false;
    }
  }

  // What the workers' manifest writer leaves: the checkpoint's iteration
  // (stage files are not needed by the coordinator).
  void WriteManifest(const v1::CommitCheckpoint& commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    model::CheckpointManifest manifest;
    manifest.iteration = commit.iteration();
    auto config = model::ModelConfigFromShape(spec_.model());
    ASSERT_TRUE(config.ok()) << config.status();
    manifest.model = *config;
    manifest.num_stages = static_cast<int>(spec_.pipeline().num_stages());
    std::error_code ec;
    std::filesystem::create_directories(commit.dir(), ec);
    ASSERT_TRUE(model::WriteManifest(commit.dir(), manifest).ok());
  }

  void Norm(const FakeWorker& w, v1::WorkerMessage& out) {
    v1::GradientNorm* n = out.mutable_grad_norm();
    n->set_job_id(w.job_id);
    n->set_iteration(w.iteration);
    n->set_stage(static_cast<uint32_t>(w.stage));
    n->set_squared_norm(1.0);
    n->set_epoch(w.epoch);
  }

  const Clock* clock_ = &Clock::Real();
  JobStore store_;
  WorkerRegistry registry_;
  JobManagerOptions options_;
  TimingEstimates estimates_;
  metrics::Registry metrics_registry_;
  RunnerMetrics metrics_;

  absl::Mutex mu_;
  JobRunner* runner_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::map<std::string, FakeWorker> workers_ ABSL_GUARDED_BY(mu_);
  std::vector<KillOnPlan> kills_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::string> revivals_ ABSL_GUARDED_BY(mu_);  // iteration -> worker
  std::vector<UnreachableOnPlan> unreachable_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, uint64_t>, std::vector<v1::Route>> routes_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> reserved_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> sent_count_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::LinkProbe> probes_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> probed_by_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> probed_after_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, FakeLink> links_ ABSL_GUARDED_BY(mu_);
  std::vector<std::tuple<std::string, uint64_t, double>> steps_ ABSL_GUARDED_BY(mu_);
  int steps_not_in_record_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::pair<std::string, std::string>, std::pair<uint64_t, FakeLink>> later_links_
      ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> planned_iterations_ ABSL_GUARDED_BY(mu_);
  bool checkpoint_ ABSL_GUARDED_BY(mu_) = false;
  double transfer_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  bool transfer_plus_round_trip_ ABSL_GUARDED_BY(mu_) = false;
  v1::JobSpec spec_ ABSL_GUARDED_BY(mu_);                   // of the last assignment
  std::vector<std::string> restored_ ABSL_GUARDED_BY(mu_);  // restore_from of assignments
};

// A small job: the tiny model, `stages` stages, one data node, `replicas`
// per other stage, routes visiting all stages unless `skip` > 0.
v1::JobSpec Spec(int stages, int replicas, double skip, int iterations) {
  v1::JobSpec spec;
  spec.set_name("runner-test");
  spec.set_iterations(static_cast<uint64_t>(iterations));
  spec.mutable_model()->set_preset("tiny");
  v1::PipelineSpec* p = spec.mutable_pipeline();
  p->set_num_stages(static_cast<uint32_t>(stages));
  p->set_data_nodes(1);
  p->set_replicas_per_stage(static_cast<uint32_t>(replicas));
  p->set_microbatches_per_data_node(4);
  p->set_samples_per_microbatch(1);
  p->set_skip_ratio(skip);
  if (skip == 0) p->set_scheduler(v1::SCHEDULER_FULL);
  spec.mutable_checkpoint()->set_disabled(true);
  spec.mutable_elastic()->set_reconnect_grace_ms(100);
  spec.mutable_elastic()->set_pause_timeout_s(60);
  return spec;
}

// Pins stage s to the workers of `stages[s]`.
void Pin(v1::JobSpec* spec, const std::vector<std::vector<std::string>>& stages) {
  v1::PipelineSpec* p = spec->mutable_pipeline();
  p->clear_assignment();
  for (const auto& nodes : stages) {
    v1::StageNodes* s = p->add_assignment();
    for (const std::string& id : nodes) s->add_nodes(id);
  }
}

class JobRunnerTest : public ::testing::Test {
 protected:
  void SetUp() override { cluster_ = std::make_unique<FakeCluster>(dir_); }
  void TearDown() override {
    runner_.reset();
    cluster_.reset();
  }

  // Stores the job and starts a runner on `workers`.
  void Start(v1::JobSpec spec, const std::vector<std::string>& workers,
             JobRunner::StartMode mode = JobRunner::StartMode::kFresh) {
    auto normalized = NormalizeJobSpec(std::move(spec));
    ASSERT_TRUE(normalized.ok()) << normalized.status();
    if (mode == JobRunner::StartMode::kFresh) {
      auto job = cluster_->jobs().Create(*normalized, absl::Now(), "submitted");
      ASSERT_TRUE(job.ok()) << job.status();
      job_id_ = job->id();
    }
    runner_ = std::make_unique<JobRunner>(cluster_.get(), job_id_, *normalized,
                                          cluster_->Infos(workers), mode);
    cluster_->set_runner(runner_.get());
    runner_->Start();
  }

  // What the store held when the old coordinator died: a running job
  // (job_id_), its stages ({d0}, {a1, a2}, {b}) and epoch 4, and what `more`
  // adds.
  void StoreRunningJob(const v1::JobSpec& normalized,
                       const std::function<void(v1::Job*)>& more = nullptr) {
    auto created = cluster_->jobs().Create(normalized, absl::Now(), "submitted");
    ASSERT_TRUE(created.ok());
    job_id_ = created->id();
    ASSERT_TRUE(cluster_->jobs()
                    .Update(job_id_,
                            [&](v1::Job* j) {
                              j->set_state(v1::JOB_STATE_RUNNING);
                              j->set_epoch(4);
                              for (const auto& nodes : std::vector<std::vector<std::string>>{
                                       {"d0"}, {"a1", "a2"}, {"b"}}) {
                                auto* s = j->add_stages();
                                for (const std::string& id : nodes) s->add_nodes(id);
                              }
                              if (more) more(j);
                            })
                    .ok());
  }

  // The step the old coordinator was sending: iteration 3 of epoch 4, a
  // squared norm of 2.25.
  static void StepOfIteration3(v1::Job* j) {
    j->mutable_pending_step()->set_iteration(3);
    j->mutable_pending_step()->set_squared_norm(2.25);
    j->mutable_pending_step()->set_epoch(4);
  }

  // `id` reports holding `stage` after `completed` iterations, as a worker
  // does when its session reopens (JobStatus).
  void ReportHolding(const std::string& id, int stage, uint64_t completed, uint64_t epoch,
                     bool in_iteration = false, uint64_t checksum = 0) {
    v1::WorkerMessage m;
    v1::JobStatus* s = m.mutable_job_status();
    s->set_job_id(job_id_);
    s->set_stage(static_cast<uint32_t>(stage));
    s->set_completed_iterations(completed);
    s->set_in_iteration(in_iteration);
    s->set_parameter_checksum(checksum);
    s->set_epoch(epoch);
    runner_->Post(id, m);
  }

  v1::Job Job() {
    auto job = cluster_->jobs().Get(job_id_);
    EXPECT_TRUE(job.ok()) << job.status();
    return job.ok() ? *job : v1::Job();
  }

  // Waits until `done` holds of the stored job (at most `limit`).
  template <typename Pred>
  bool AwaitJob(Pred done, absl::Duration limit = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + limit;
    while (absl::Now() < deadline) {
      if (done(Job())) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  v1::Job AwaitEnd() {
    EXPECT_TRUE(AwaitJob([](const v1::Job& j) { return JobStore::IsFinal(j.state()); }))
        << "the job did not end:\n"
        << Job().DebugString();
    return Job();
  }

  // A pipeline d0 -> a -> b of 4 iterations, re-planned after each, over
  // links of round trip `rtt_d0_a` and `rtt_a_b` (both ways; rate 5e7),
  // whose forward transfers take their round trip plus `beyond`: the
  // bandwidths the runner published at the end, by link.
  std::map<std::pair<std::string, std::string>, v1::JobLink> RunTransfersBeyondRoundTrips(
      double rtt_d0_a, double rtt_a_b, double beyond) {
    for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
    for (auto [from, to, rtt] :
         {std::make_tuple("d0", "a", rtt_d0_a), std::make_tuple("a", "d0", rtt_d0_a),
          std::make_tuple("a", "b", rtt_a_b), std::make_tuple("b", "a", rtt_a_b)}) {
      cluster_->SetLink(from, to, {rtt, 5e7, ""});
    }
    cluster_->mutable_options()->replan_every = 1;
    cluster_->ReportTransfers(beyond, /*plus_round_trip=*/true);
    v1::JobSpec spec = Spec(3, 1, 0.0, 4);
    Pin(&spec, {{"d0"}, {"a"}, {"b"}});
    Start(spec, {"d0", "a", "b"});
    const v1::Job job = AwaitEnd();
    EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
    std::map<std::pair<std::string, std::string>, v1::JobLink> out;
    const std::optional<v1::GetLinksResponse> links = runner_->Links();
    EXPECT_TRUE(links.has_value());
    if (!links.has_value()) return out;
    for (const v1::JobLink& l : links->links()) out[{l.from(), l.to()}] = l;
    return out;
  }

  static int Count(const v1::Job& job, v1::JobHistoryEvent::Kind kind) {
    int n = 0;
    for (const auto& e : job.history()) n += e.kind() == kind;
    return n;
  }
  static std::string History(const v1::Job& job) {
    std::vector<std::string> lines;
    for (const auto& e : job.history()) {
      lines.push_back(absl::StrCat(v1::JobHistoryEvent::Kind_Name(e.kind()), " ", e.message()));
    }
    return absl::StrJoin(lines, "\n");
  }

  const testing::TempDir temp_{"job_runner_test"};  // outlives the runner
  const std::string dir_ = temp_.path();
  FakeClock fake_clock_{absl::Now()};  // outlives the runner (TearDown)
  std::unique_ptr<FakeCluster> cluster_;
  std::unique_ptr<JobRunner> runner_;
  std::string job_id_;
};

TEST_F(JobRunnerTest, TrainsEveryIterationAndReleasesTheWorkers) {
  for (const char* id : {"d0", "a", "b", "c"}) cluster_->AddWorker(id);
  Start(Spec(4, 1, 0.0, 5), {"d0", "a", "b", "c"});
  const v1::Job job = AwaitEnd();
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  EXPECT_EQ(job.progress().loss(), 2.5);
  EXPECT_EQ(job.progress().members(), 4u);
  EXPECT_EQ(cluster_->Sent("assignment"), 4);
  EXPECT_EQ(cluster_->Sent("plan"), 5 * 4);
  EXPECT_EQ(cluster_->Sent("step"), 5 * 4);
  EXPECT_EQ(cluster_->Sent("cancel"), 4) << "every worker is released at the end";
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
}

// A replica dies when the plan of iteration 2 reaches it: the survivors get
// a new epoch, every microbatch that crossed it runs again on other routes,
// and the job ends with one worker fewer and no iteration lost.
TEST_F(JobRunnerTest, WorkerLostMidIterationIsRoutedAround) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 6);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillOnRouteWhenPlanArrives(1, 2);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 6u);
  EXPECT_EQ(job.progress().members(), 4u);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("(stage 1) lost: its session closed"));
  EXPECT_THAT(History(job), HasSubstr("iteration 2 epoch 1: re-planned"));
  EXPECT_GT(job.progress().microbatches_rerun(), 0u);
  EXPECT_EQ(job.progress().microbatches_dropped(), 0u);
  EXPECT_GE(cluster_->Sent("membership"), 4);
  ASSERT_EQ(job.stages_size(), 3);
  EXPECT_EQ(job.stages(1).nodes_size(), 1);
}

// After the loss above, an idle worker is taken at the next iteration
// boundary and joins the stage that lacks a replica with its live
// replica's state (the donor streams it; the checksums agree).
TEST_F(JobRunnerTest, IdleWorkerJoinsWithAReplicasState) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 8);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillWhenPlanArrives("b1", 3);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_JOINED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker spare joined stage 2 at iteration 4 with the "
                                      "state of b2"));
  EXPECT_EQ(cluster_->Sent("send_state"), 1);
  EXPECT_EQ(job.progress().members(), 5u);
  EXPECT_EQ(cluster_->StageOf("spare"), -1) << "released at the end";
}

// The full pipeline cannot skip a stage: losing the only worker of stage 2
// pauses the job at that iteration until a worker registers. With
// elastic.on_stage_loss REINITIALIZE (asked for), it then joins with fresh
// parameters (no replica, no checkpoint) and the job goes on; the loss is
// recorded all the same.
TEST_F(JobRunnerTest, StageWithoutWorkersPausesUntilOneJoins) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_REINITIALIZE);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 1);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  v1::Job paused = Job();
  ASSERT_EQ(paused.state(), v1::JOB_STATE_RUNNING) << paused.message() << "\n" << History(paused);
  EXPECT_THAT(paused.message(), HasSubstr("paused: stage 2 has no worker left"));
  EXPECT_EQ(paused.progress().iteration(), 1u);
  cluster_->AddWorker("late");
  runner_->Poke();
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker late joined stage 2 at iteration 1 (fresh "
                                      "parameters"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_CONTINUED), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("STAGE_LOSS_REINITIALIZE: a worker that joins it starts "
                                      "from fresh parameters"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 0) << History(job);
  EXPECT_THAT(cluster_->Scrape(),
              HasSubstr("detour_coordinator_stage_losses_total{action=\"reinitialize\"} 1\n"));
}

// The default (elastic.on_stage_loss ROLLBACK): the only worker of stage 2
// dies at iteration 5; a worker that registers fills the stage, and the
// whole job goes back to its newest checkpoint (after 4 iterations) before
// it trains again: every stage restores it, iterations 4 and on run again.
// It used to go on with stage 2 restored alone or from fresh parameters
// while the other stages kept theirs, visible only in the history.
TEST_F(JobRunnerTest, StageLossRollsTheWholeJobBackToItsNewestCheckpoint) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 8);
  spec.mutable_checkpoint()->set_disabled(false);
  spec.mutable_checkpoint()->set_every_iterations(2);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 5);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  EXPECT_THAT(Job().message(), HasSubstr("stage 2 has no worker left"));
  cluster_->AddWorker("late");
  runner_->Poke();
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("stage 2 lost its last replica (worker b) and its state; "
                                      "elastic.on_stage_loss STAGE_LOSS_ROLLBACK"));
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("rolled back from iteration 5 to checkpoint"));
  EXPECT_THAT(History(job), HasSubstr("(iteration 4) on 3 workers"));
  EXPECT_THAT(History(job), Not(HasSubstr("fresh parameters")));
  // The joiner's assignment, then all three members' restore the checkpoint.
  const std::vector<std::string> restored = cluster_->Restored();
  ASSERT_EQ(restored.size(), 4u);
  for (const std::string& dir : restored) EXPECT_EQ(dir, restored.back());
  const std::vector<uint64_t> planned = cluster_->PlannedIterations();
  ASSERT_GE(planned.size(), 2u);
  // Each plan is counted once per worker it reaches (3).
  EXPECT_EQ(std::count(planned.begin(), planned.end(), 4u), 2 * 3) << "iteration 4 ran again";
  EXPECT_EQ(job.progress().iteration(), 8u);
  EXPECT_THAT(cluster_->Scrape(),
              HasSubstr("detour_coordinator_stage_losses_total{action=\"rollback\"} 1\n"));
}

// ROLLBACK without a checkpoint: the whole job starts again at iteration 0
// with the seeded parameters in every stage (one model version), and says so.
TEST_F(JobRunnerTest, StageLossWithoutACheckpointRollsBackToIterationZero) {
  for (const char* id : {"d0", "a", "b", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 3);
  Start(spec, {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("the whole job starts again at iteration 0 with fresh "
                                      "parameters (there is no checkpoint)"));
  EXPECT_THAT(History(job), HasSubstr("rolled back from iteration 3 to iteration 0 (no "
                                      "checkpoint: fresh parameters in every stage) on 3 workers"));
  const std::vector<uint64_t> planned = cluster_->PlannedIterations();
  EXPECT_EQ(std::count(planned.begin(), planned.end(), 0u), 2 * 3) << "iteration 0 ran again";
  EXPECT_EQ(cluster_->Sent("assignment"), 3 + 1 + 3);
  EXPECT_EQ(job.progress().iteration(), 5u);
}

// ROLLBACK, and the only worker of stage 2 is lost in iteration 2 (cut off
// from the coordinator): the job pauses, with no other worker to fill the
// stage. The lost worker itself comes back idle (it dropped its part) and
// fills it; the job rolls back and completes. A worker lost in the
// iteration a job paused in used to be kept out of the job until that
// iteration ended, which a paused job's never does: it failed when the
// pause timed out.
TEST_F(JobRunnerTest, AWorkerLostInThePausedIterationMayFillItsStageAgain) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  spec.mutable_elastic()->set_pause_timeout_s(20);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 2);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << History(Job());
  EXPECT_THAT(Job().message(), HasSubstr("stage 2 has no worker left"));
  cluster_->AddWorker("b");  // back, idle
  runner_->Poke();
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b joined stage 2 at iteration 2"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
}

// PAUSE: the stage's last worker is lost (its session closes) at iteration
// 2; an idle worker is there but may not take the stage from fresh
// parameters. The lost worker comes back holding the stage at the job's
// iteration: it takes its stage again and the job goes on from there.
TEST_F(JobRunnerTest, StageLossPausedUntilItsHolderComesBack) {
  for (const char* id : {"d0", "a", "b", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 6);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_PAUSE);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 2);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << History(Job());
  EXPECT_THAT(Job().message(), HasSubstr("stage 2 has no worker left"));
  runner_->Poke();  // the spare is idle all along: it is not taken
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(cluster_->Sent("assignment"), 3) << History(Job());
  // b's process survived: it registers again and reports the stage it holds.
  cluster_->AddWorker("b");
  cluster_->Hold("b", 2, 1002);
  ReportHolding("b", 2, 2, 0);
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("STAGE_LOSS_PAUSE: the job pauses until a worker holding "
                                      "its state (b) comes back"));
  EXPECT_THAT(History(job), HasSubstr("worker b came back holding stage 2's state at iteration 2"));
  EXPECT_EQ(cluster_->Sent("assignment"), 3) << "nobody rebuilt a stage";
  EXPECT_EQ(cluster_->StageOf("spare"), -1);
  EXPECT_EQ(job.progress().iteration(), 6u);
  EXPECT_THAT(cluster_->Scrape(),
              HasSubstr("detour_coordinator_stage_losses_total{action=\"pause\"} 1\n"));
}

// PAUSE, and the stage's last worker is excluded for a bad forward frame
// (b reports a's activation of microbatch 0): the job pauses, and a coming
// back with the stage's state is not taken back; the job fails when the
// pause times out instead of training on with the excluded worker.
TEST_F(JobRunnerTest, AnExcludedHolderOfAPausedStageIsNotTakenBack) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 6);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_PAUSE);
  spec.mutable_elastic()->set_pause_timeout_s(3);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->ReportBadFrameWhenPlanArrives("b", "a", 2, v1::DIRECTION_FORWARD);
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return Count(j, v1::JobHistoryEvent::KIND_PAUSED) == 1 || JobStore::IsFinal(j.state());
  })) << History(Job());
  ASSERT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << History(Job());
  EXPECT_THAT(History(Job()), HasSubstr("worker a (stage 1) lost: excluded: b received"));
  ReportHolding("a", 1, 2, 0);
  const v1::Job job = AwaitEnd();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), Not(HasSubstr("worker a came back"))) << History(job);
}

// The coordinator restarted while the job ran: the runner re-attaches to
// the workers that report the job (JobStatus), aborts the iteration that was
// in flight and continues from the iterations they completed. A worker that
// does not come back within the wait is lost, not waited for.
TEST_F(JobRunnerTest, ReattachesAfterACoordinatorRestart) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 7);
  cluster_->mutable_options()->assign_timeout = absl::Seconds(2);  // a2 never reports
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  // What the store held when the old coordinator died: a running job, its
  // stages, its epoch.
  StoreRunningJob(*normalized);
  cluster_->Hold("d0", 0, 7);
  cluster_->Hold("a1", 1, 8);
  cluster_->Hold("b", 2, 9);
  cluster_->Kill("a2");  // never reports back
  // The workers report what they hold once their sessions reopen.
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage] :
       std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a1", 1}, {"b", 2}}) {
    ReportHolding(id, stage, 3, 4);
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("re-attached 3 workers after a coordinator restart; "
                                      "continuing at iteration 3"));
  EXPECT_THAT(History(job), HasSubstr("worker a2 did not come back"));
  EXPECT_EQ(job.epoch(), 5u) << "a new epoch after the restart";
  EXPECT_EQ(cluster_->Sent("assignment"), 0) << "the workers keep their stages";
  EXPECT_EQ(cluster_->Sent("abort"), 3);
  const std::vector<uint64_t> planned = cluster_->PlannedIterations();
  ASSERT_FALSE(planned.empty());
  EXPECT_EQ(planned.front(), 3u);
  EXPECT_EQ(job.progress().iteration(), 7u);
}

// A worker back after the restart whose heartbeat names no part of the job
// (the old coordinator told it to drop the job before it died) is not
// waited for until --assign_timeout: the others re-attach at once, and a
// job whose workers all came back empty-handed fails at once, saying so.
TEST_F(JobRunnerTest, ReattachDoesNotWaitForWorkersBackWithoutTheJob) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->assign_timeout = absl::Hours(1);
  auto normalized = NormalizeJobSpec(Spec(3, 2, 0.0, 7));
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  for (const bool any_holds : {true, false}) {
    SCOPED_TRACE(any_holds ? "three still hold the job" : "none holds it");
    StoreRunningJob(*normalized);
    if (any_holds) {
      cluster_->Hold("d0", 0, 7);
      cluster_->Hold("a1", 1, 8);
      cluster_->Hold("b", 2, 9);
    }
    cluster_->Beat("a2", "");
    const absl::Time start = absl::Now();
    Start(*normalized, {}, JobRunner::StartMode::kReattach);
    if (any_holds) {
      for (const auto& [id, stage] :
           std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a1", 1}, {"b", 2}}) {
        cluster_->Beat(id, job_id_);
        ReportHolding(id, stage, 3, 4);
      }
    } else {
      for (const char* id : {"d0", "a1", "b"}) cluster_->Beat(id, "");
    }
    const v1::Job job = AwaitEnd();
    EXPECT_LT(absl::Now() - start, absl::Minutes(1)) << "waited for --assign_timeout";
    if (!any_holds) {
      ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << History(job);
      EXPECT_THAT(job.message(),
                  HasSubstr("no worker of the job came back holding its part (a1, a2, b, d0 came "
                            "back without it)"));
      continue;
    }
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
    EXPECT_THAT(History(job), HasSubstr("re-attached 3 workers after a coordinator restart"));
    EXPECT_THAT(History(job), HasSubstr("worker a2 came back after the coordinator restarted "
                                        "without its part of the job"));
    EXPECT_EQ(job.progress().iteration(), 7u);
  }
}

// The old coordinator died between its step messages of iteration 3: d0
// and a1 applied the step (4 iterations done), a2 and b wait for it. The
// runner sends a2 and b the step the record holds, checks that a2 now
// matches its replica a1, and goes on at iteration 4. Without the stored
// step the job fails, naming what is missing.
TEST_F(JobRunnerTest, ReattachSendsTheStepTheOldCoordinatorDiedSending) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 7);
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  for (const bool stored_step : {true, false}) {
    SCOPED_TRACE(stored_step ? "the record holds the step" : "no step in the record");
    StoreRunningJob(*normalized, [&](v1::Job* j) {
      if (stored_step) StepOfIteration3(j);
    });
    // a2's parameters before the step; a1 applied it (FakeCluster's step:
    // checksum * 31 + iteration + 1).
    const uint64_t before = 8, after = before * 31 + 4;
    cluster_->Hold("d0", 0, 7);
    cluster_->Hold("a1", 1, after);
    cluster_->HoldInIteration("a2", 1, before, 3, 4);
    cluster_->HoldInIteration("b", 2, 9, 3, 4);
    Start(*normalized, {}, JobRunner::StartMode::kReattach);
    for (const auto& [id, stage, done] : std::vector<std::tuple<std::string, int, uint64_t>>{
             {"d0", 0, 4}, {"a1", 1, 4}, {"a2", 1, 3}, {"b", 2, 3}}) {
      ReportHolding(id, stage, done, 4, /*in_iteration=*/done == 3,
                    id == "a1"   ? after
                    : id == "a2" ? before
                                 : 0);
    }
    const v1::Job job = AwaitEnd();
    if (!stored_step) {
      ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << History(job);
      EXPECT_THAT(job.message(), HasSubstr("the workers stopped at different iterations (3 and 4) "
                                           "and the record holds no step of iteration 3"));
      continue;
    }
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
    EXPECT_THAT(History(job), HasSubstr("re-attached 4 workers after a coordinator restart; "
                                        "continuing at iteration 4 (2 of them first applied the "
                                        "step of iteration 3"));
    const auto steps = cluster_->Steps();
    ASSERT_GE(steps.size(), 2u);
    EXPECT_EQ(steps[0], std::make_tuple(std::string("a2"), uint64_t{3}, 2.25));
    EXPECT_EQ(steps[1], std::make_tuple(std::string("b"), uint64_t{3}, 2.25));
    const std::vector<uint64_t> planned = cluster_->PlannedIterations();
    ASSERT_FALSE(planned.empty());
    EXPECT_EQ(planned.front(), 4u);
    EXPECT_EQ(job.progress().iteration(), 7u);
    EXPECT_FALSE(job.has_pending_step()) << "cleared with the progress of its iteration";
  }
}

// A laggard that does not apply the stored step within --assign_timeout
// (here: its runtime drops it, being in another iteration than it reported)
// leaves the job; the others go on at iteration 4. The new epoch is above
// every epoch in play, though the stored one lags the workers'.
TEST_F(JobRunnerTest, ReattachDropsALaggardThatDoesNotApplyTheStep) {
  for (const char* id : {"d0", "a1", "a2", "b"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->assign_timeout = absl::Seconds(2);
  auto normalized = NormalizeJobSpec(Spec(3, 2, 0.0, 7));
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  StoreRunningJob(*normalized, [](v1::Job* j) {
    j->set_epoch(3);  // its last stage-list write was lost
    StepOfIteration3(j);
  });
  cluster_->Hold("d0", 0, 7);
  cluster_->Hold("a1", 1, 8);
  cluster_->HoldInIteration("a2", 1, 8, 2, 4);  // drops the step of iteration 3
  cluster_->HoldInIteration("b", 2, 9, 3, 4);
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage, done] : std::vector<std::tuple<std::string, int, uint64_t>>{
           {"d0", 0, 4}, {"a1", 1, 4}, {"a2", 1, 3}, {"b", 2, 3}}) {
    ReportHolding(id, stage, done, 4, /*in_iteration=*/done == 3);
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker a2 did not apply the step of iteration 3"));
  EXPECT_THAT(History(job), HasSubstr("re-attached 3 workers after a coordinator restart; "
                                      "continuing at iteration 4 (1 of them first applied"));
  EXPECT_EQ(job.epoch(), 5u) << "above the workers' 4, not the stored 3 + 1";
  ASSERT_EQ(job.stages(1).nodes_size(), 1);
  EXPECT_EQ(job.stages(1).nodes(0), "a1");
}

// Every step message goes out after the job record holds it: a coordinator
// that dies between two of them leaves its successor the step to finish
// with.
TEST_F(JobRunnerTest, EveryStepIsInTheRecordBeforeAWorkerGetsIt) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  Start(Spec(3, 1, 0.0, 4), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(cluster_->Sent("step"), 12);
  EXPECT_EQ(cluster_->StepsNotInRecord(), 0);
}

// A graceful stop of the coordinator (JobManager::Shutdown detaches every
// runner): the job stays RUNNING with its stages recorded and its workers
// untold, and a runner started on the same store re-attaches to them and
// finishes the job, as after a crash. It used to end FAILED ("coordinator
// stopped while the job was running") with every worker told to drop it.
TEST_F(JobRunnerTest, DetachLeavesTheJobRunningForTheNextCoordinator) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 100000);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([](const v1::Job& j) {
    return j.progress().iteration() >= 3 || JobStore::IsFinal(j.state());
  })) << History(Job());
  runner_->Detach();
  runner_->RequestStop(JobEnd{v1::JOB_STATE_FAILED, "a later stop changes nothing"});
  runner_.reset();
  cluster_->set_runner(nullptr);
  v1::Job left = Job();
  ASSERT_EQ(left.state(), v1::JOB_STATE_RUNNING) << left.message() << "\n" << History(left);
  ASSERT_EQ(left.stages_size(), 3);
  EXPECT_FALSE(left.has_end_time());
  EXPECT_EQ(cluster_->Sent("cancel"), 0) << "the workers keep their stages";
  const uint64_t done = left.progress().iteration();
  ASSERT_LT(done, 100000u);

  // The next coordinator: a runner re-attaching to what the store holds,
  // with a short job left so that the test ends.
  ASSERT_TRUE(cluster_->jobs()
                  .Update(job_id_, [&](v1::Job* j) { j->mutable_spec()->set_iterations(done + 3); })
                  .ok());
  spec.set_iterations(done + 3);
  auto normalized = NormalizeJobSpec(spec);
  ASSERT_TRUE(normalized.ok()) << normalized.status();
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage] :
       std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a", 1}, {"b", 2}}) {
    ReportHolding(id, stage, done, left.epoch());
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_REATTACHED), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), done + 3);
  EXPECT_EQ(cluster_->Sent("assignment"), 3) << "only the first runner assigned stages";
}

// PAUSE when the holder never comes back: the job fails once
// elastic.pause_timeout_s has passed, naming what it waited for; never_join
// does not fail it sooner (the holder's return is no replacement).
TEST_F(JobRunnerTest, StageLossPauseFailsWhenTheHolderDoesNotComeBack) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 6);
  spec.mutable_elastic()->set_on_stage_loss(v1::STAGE_LOSS_PAUSE);
  spec.mutable_elastic()->set_never_join(true);
  spec.mutable_elastic()->set_pause_timeout_s(1);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->KillWhenPlanArrives("b", 2);
  Start(spec, {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_FAILED) << History(job);
  EXPECT_THAT(job.message(), HasSubstr("timed out waiting for workers to join (stage 2 has no "
                                       "worker left)"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
  EXPECT_EQ(job.progress().iteration(), 2u);
}

// Routes that skip stages go on around a stage left without workers; at the
// next iteration boundary a spare replica of stage 1 or 3 moves there (a
// move into an empty stage always pays), and the job ends with every stage
// held.
TEST_F(JobRunnerTest, SpareReplicaMovesIntoAnEmptyStage) {
  const std::vector<std::string> all = {"d0", "a1", "a2", "b1", "b2", "c1", "c2"};
  for (const std::string& id : all) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(4, 2, 0.25, 8);  // routes visit 3 of 4 stages
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}, {"c1", "c2"}});
  cluster_->KillWhenPlanArrives("b1", 2);
  cluster_->KillWhenPlanArrives("b2", 2);
  Start(spec, all);
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("stage 2 has no worker left: every route skips it"));
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_REASSIGNED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("to stage 2"));
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_PAUSED), 0) << History(job);
  ASSERT_EQ(job.stages_size(), 4);
  EXPECT_EQ(job.stages(1).nodes_size() + job.stages(3).nodes_size(), 3);
  EXPECT_EQ(job.stages(2).nodes_size(), 1);
  EXPECT_EQ(job.progress().iteration(), 8u);
}

// Elastic training off: the first loss fails the job, naming the worker.
TEST_F(JobRunnerTest, LossFailsAJobWithoutElasticTraining) {
  for (const char* id : {"d0", "a1", "a2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(2, 2, 0.0, 5);
  spec.mutable_elastic()->set_disabled(true);
  Pin(&spec, {{"d0"}, {"a1", "a2"}});
  cluster_->KillWhenPlanArrives("a1", 1);
  Start(spec, {"d0", "a1", "a2"});
  const v1::Job job = AwaitEnd();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.message(), HasSubstr("worker a1 lost (its session closed"));
}

// --- the runner's clock -----------------------------------------------------

// The runner judges deadlines by its host's clock: a worker that takes the
// plan and never answers times the iteration out once the clock passes the
// iteration timeout (30 s here), and not before, however long it waits.
TEST_F(JobRunnerTest, AnUnansweredPlanTimesOutOnTheRunnersClock) {
  FakeClock& clock = fake_clock_;
  cluster_->UseClock(&clock);
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->Mute("b");
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return !cluster_->PlannedIterations().empty(); }));
  absl::SleepFor(absl::Milliseconds(1200));  // more than two of the loop's wait slices
  EXPECT_EQ(Job().state(), v1::JOB_STATE_RUNNING) << Job().message();
  clock.Advance(absl::Seconds(31));
  // Well before 30 real seconds: the clock, not the wall, timed it out.
  ASSERT_TRUE(
      AwaitJob([](const v1::Job& j) { return JobStore::IsFinal(j.state()); }, absl::Seconds(10)));
  const v1::Job job = Job();
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(job.message(), HasSubstr("timed out waiting for"));
}

// A worker whose session closed is lost only once the reconnect grace has
// passed on the runner's clock (60 s here); until then the job waits for it,
// then routes around it and finishes.
TEST_F(JobRunnerTest, AClosedSessionIsLostOnlyAfterTheGraceOnTheRunnersClock) {
  FakeClock& clock = fake_clock_;
  cluster_->UseClock(&clock);
  cluster_->mutable_options()->iteration_timeout = absl::Minutes(10);
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 4);
  spec.mutable_elastic()->set_reconnect_grace_ms(60000);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillWhenPlanArrives("b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return cluster_->PlannedIterations().size() >= 10; }));
  absl::SleepFor(absl::Milliseconds(1200));
  v1::Job waiting = Job();
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Count(waiting, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(waiting);
  clock.Advance(absl::Seconds(61));
  ASSERT_TRUE(
      AwaitJob([](const v1::Job& j) { return JobStore::IsFinal(j.state()); }, absl::Seconds(10)))
      << History(Job());
  const v1::Job job = Job();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b1 (stage 2) lost: its session closed 1m1s ago"));
  EXPECT_EQ(job.progress().iteration(), 4u);
}

// --- link faults ------------------------------------------------------------

// True when a route of `routes` sends between `a` and `b` (either way,
// the last hop's activation going back to the data node included).
bool UsesLink(const std::vector<v1::Route>& routes, const std::string& a, const std::string& b) {
  auto is = [&](const std::string& x, const std::string& y) {
    return (x == a && y == b) || (x == b && y == a);
  };
  for (const v1::Route& r : routes) {
    const int n = r.nodes_size();
    for (int i = 0; i + 1 < n; ++i) {
      if (is(r.nodes(i), r.nodes(i + 1))) return true;
    }
    if (n > 1 && is(r.nodes(n - 1), r.nodes(0))) return true;
  }
  return false;
}

// a1 cannot reach b1 while b1 still talks to the coordinator: the link is
// cut, not the worker. The iteration runs again under a new epoch with
// routes that avoid a1 - b1, nobody is evicted, and every later plan keeps
// avoiding the pair.
TEST_F(JobRunnerTest, ACutLinkIsRoutedAroundWithoutEvictingEither) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 5);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(job.progress().iteration(), 5u);
  EXPECT_EQ(job.progress().members(), 5u);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("link a1 - b1 cut: a1 could not reach b1 (connection "
                                      "timed out) while b1 still talks to the coordinator"));
  EXPECT_THAT(History(job),
              HasSubstr("iteration 1: link(s) a1 - b1 cut; the iteration runs again"));
  EXPECT_EQ(job.progress().microbatches_dropped(), 0u);
  int after = 0;
  for (const auto& [key, routes] : cluster_->Routes()) {
    const auto [iteration, epoch] = key;
    if (iteration < 1 || (iteration == 1 && epoch == 0)) continue;
    ++after;
    EXPECT_FALSE(UsesLink(routes, "a1", "b1")) << "iteration " << iteration << " epoch " << epoch;
  }
  EXPECT_EQ(after, 4) << "iteration 1 again, then 2, 3 and 4";
}

// With one worker per stage no plan avoids a cut a - b: the reported side
// leaves the job as a lost worker does (and backs off from joining again);
// an idle worker takes its stage and the job finishes.
TEST_F(JobRunnerTest, AnUnavoidableCutLinkRemovesTheUnreachableSide) {
  for (const char* id : {"d0", "a", "b", "spare"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->ReportUnreachableWhenPlanArrives("a", "b", 1);
  Start(spec, {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b (stage 2) lost: unreachable from a (connection "
                                      "timed out) and no plan avoids the link"));
  EXPECT_THAT(History(job), HasSubstr("worker spare joined stage 2"));
  EXPECT_EQ(job.progress().iteration(), 4u);
}

// Two members cannot reach b1: the evidence is about b1, which is lost and
// routed around as before; no link is cut.
TEST_F(JobRunnerTest, TwoReportersAgainstAWorkerMakeItLost) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "b1", 1);
  cluster_->ReportUnreachableWhenPlanArrives("a2", "b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("worker b1 (stage 2) lost: a1 and a2 could not reach it"));
  EXPECT_EQ(job.progress().iteration(), 4u);
}

// A member reports a replica's all-reduce input as holding NaN: the sender
// leaves the job as a lost worker would (the event says it was excluded and
// why), the iteration runs again among the survivors and the job succeeds
// instead of failing on a non-finite gradient; the sender is not taken
// back. A report about a member that sends the reporter nothing in the
// plan (d0 about b1, of another stage) excludes nobody.
TEST_F(JobRunnerTest, AMemberThatSendsBadFramesIsExcludedAndTheJobGoesOn) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportBadFrameWhenPlanArrives("a2", "a1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return !cluster_->PlannedIterations().empty(); }));
  for (uint64_t iteration = 0; iteration < 4; ++iteration) {  // whichever is in flight
    v1::WorkerMessage forged;
    forged.mutable_bad_frame()->set_job_id(job_id_);
    forged.mutable_bad_frame()->set_iteration(iteration);
    forged.mutable_bad_frame()->set_sender("b1");
    forged.mutable_bad_frame()->set_direction(v1::DIRECTION_ALLREDUCE);
    runner_->Post("d0", forged);
  }
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  EXPECT_THAT(History(job),
              HasSubstr("worker a1 (stage 1) lost: excluded: a2 received a frame from it with "
                        "values no honest training sends (it holds NaN)"));
  EXPECT_EQ(job.progress().iteration(), 4u);
  for (const auto& [key, routes] : cluster_->Routes()) {
    if (key.first < 2) continue;
    for (const v1::Route& r : routes) {
      for (const std::string& n : r.nodes()) EXPECT_NE(n, "a1") << "iteration " << key.first;
    }
  }
}

// A member excluded for its bad frames keeps talking about the job (a
// JobError, a report against its accuser, a NaN norm): the job neither
// fails nor loses anyone else, and the messages are counted by kind. b1
// turns mute once a1 is gone, so the job waits while they arrive.
TEST_F(JobRunnerTest, MessagesFromAnExcludedMemberAreIgnoredAndCounted) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 2, 0.0, 1000);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportBadFrameWhenPlanArrives("a2", "a1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  ASSERT_TRUE(AwaitJob(
      [](const v1::Job& j) { return Count(j, v1::JobHistoryEvent::KIND_WORKER_LOST) == 1; }));
  cluster_->Mute("b1");
  v1::WorkerMessage error;
  error.mutable_error()->set_job_id(job_id_);
  error.mutable_error()->set_message("forged failure");
  v1::WorkerMessage report;
  report.mutable_bad_frame()->set_job_id(job_id_);
  report.mutable_bad_frame()->set_sender("a2");
  report.mutable_bad_frame()->set_direction(v1::DIRECTION_ALLREDUCE);
  v1::WorkerMessage norm;
  norm.mutable_grad_norm()->set_job_id(job_id_);
  norm.mutable_grad_norm()->set_squared_norm(std::numeric_limits<double>::quiet_NaN());
  for (uint64_t iteration = 0; iteration < 1000; iteration += 100) {
    report.mutable_bad_frame()->set_iteration(iteration);
    runner_->Post("a1", report);
  }
  runner_->Post("a1", error);
  runner_->Post("a1", norm);
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return cluster_->OutsiderMessages() == 12; },
                       absl::Seconds(20)))
      << cluster_->OutsiderMessages();
  EXPECT_EQ(cluster_->OutsiderMessages("bad_frame"), 10);
  EXPECT_EQ(cluster_->OutsiderMessages("error"), 1);
  const v1::Job job = Job();
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 1) << History(job);
  runner_->RequestStop(JobEnd{v1::JOB_STATE_CANCELLED, "the test is done"});
  EXPECT_EQ(AwaitEnd().state(), v1::JOB_STATE_CANCELLED);
}

// A registered worker that was never part of the job sends it a JobError,
// a NaN gradient norm and a report against a member while the job waits for
// b's norm (b is mute): all are dropped and counted, and the forged error
// neither fails the job nor costs it a worker.
TEST_F(JobRunnerTest, MessagesFromWorkersTheJobNeverHadAreIgnoredAndCounted) {
  for (const char* id : {"d0", "a", "b", "stranger"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 4);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}});
  cluster_->Mute("b");
  Start(spec, {"d0", "a", "b"});
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return !cluster_->PlannedIterations().empty(); }));
  v1::WorkerMessage error;
  error.mutable_error()->set_job_id(job_id_);
  error.mutable_error()->set_message("forged failure");
  v1::WorkerMessage norm;
  norm.mutable_grad_norm()->set_job_id(job_id_);
  norm.mutable_grad_norm()->set_squared_norm(std::numeric_limits<double>::quiet_NaN());
  v1::WorkerMessage report;
  report.mutable_peer_unreachable()->set_job_id(job_id_);
  report.mutable_peer_unreachable()->set_peer("a");
  for (int i = 0; i < 3; ++i) runner_->Post("stranger", error);
  runner_->Post("stranger", norm);
  runner_->Post("stranger", report);
  ASSERT_TRUE(AwaitJob([&](const v1::Job&) { return cluster_->OutsiderMessages() == 5; },
                       absl::Seconds(20)))
      << cluster_->OutsiderMessages();
  absl::SleepFor(absl::Milliseconds(1200));  // a loss check and a link confirmation later
  const v1::Job job = Job();
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 0) << History(job);
  EXPECT_EQ(cluster_->OutsiderMessages(), 5);
}

}  // namespace
// Before the first plan every worker probes every other; the planner's
// matrix (what GetLinks shows) holds what they measured: half the round
// trip as latency, the bulk rate as bandwidth, and a failed probe's error.
TEST_F(JobRunnerTest, ProbesAtStartMeasureEveryLinkForTheFirstPlan) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  cluster_->SetLink("a", "b", {0.2, 5e6, ""});
  cluster_->SetLink("b", "a", {0, 0, "connect: timed out"});
  // The region table (all three are in region "local"): 40 ms, 2 GB/s.
  cluster_->mutable_options()->network.set_intra_region_latency_ms(40);
  cluster_->mutable_options()->network.set_intra_region_bandwidth_gbytes_per_s(2);
  Start(Spec(3, 1, 0.0, 2), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("link probes: 5 of 6 links answered (5 with a bulk rate)"));
  EXPECT_THAT(History(job), HasSubstr("one-way latency 10.0-100.0 ms, bandwidth 5.0-100.0 MB/s"));
  // At the start a latency round to all three, each asked about the other
  // two, then two bulk rounds (the interval is 60 s: nothing more), in each
  // of which every worker probes one other and takes one other's probes,
  // a -> b, b -> d0, d0 -> a, then a -> d0, b -> a, d0 -> b.
  EXPECT_EQ(cluster_->Sent("probe"), 9);
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  ASSERT_EQ(probes.size(), 9u);
  std::map<std::string, int> named, taken;  // in the bulk rounds
  for (size_t i = 0; i < probes.size(); ++i) {
    SCOPED_TRACE(probes[i].ShortDebugString());
    if (i < 3) {
      EXPECT_EQ(probes[i].bulk_max_bytes(), 0u);
      EXPECT_EQ(probes[i].peers_size(), 2);  // the other two
      // Nothing measured yet: the table's figures for both.
      ASSERT_EQ(probes[i].expected_size(), 2);
      EXPECT_DOUBLE_EQ(probes[i].expected(1).rtt_s(), 0.08);
      EXPECT_DOUBLE_EQ(probes[i].expected(1).bandwidth_bytes_per_s(), 2e9);
      EXPECT_EQ(probes[i].accept_from_size(), 0);
      EXPECT_EQ(probes[i].round(), probes[0].round());
      continue;
    }
    EXPECT_EQ(probes[i].bulk_max_bytes(), uint64_t{32} << 20);
    ASSERT_EQ(probes[i].peers_size(), 1);
    ASSERT_EQ(probes[i].accept_from_size(), 1);
    // What the planner expects of the link goes with it, for the worker's
    // check of its socket limits: what the latency round measured, and
    // the region table's figures for what it did not (b -> a failed).
    ASSERT_EQ(probes[i].expected_size(), 1);
    const v1::LinkExpectation& x = probes[i].expected(0);
    EXPECT_EQ(x.peer(), probes[i].peers(0).worker_id());
    EXPECT_DOUBLE_EQ(x.bandwidth_bytes_per_s(), 2e9);  // no rate measured yet: the table's
    const bool b_to_a = x.peer() == "a" && probes[i].accept_from(0) == "d0";
    if (b_to_a) {
      EXPECT_DOUBLE_EQ(x.rtt_s(), 0.08);  // 2 x 40 ms, the table's
    } else {
      EXPECT_GT(x.rtt_s(), 0);
      EXPECT_NE(x.rtt_s(), 0.08);  // measured by the fakes' pings
    }
    EXPECT_NE(probes[i].peers(0).worker_id(), probes[i].accept_from(0));
    named[probes[i].peers(0).worker_id()]++;
    taken[probes[i].accept_from(0)]++;
    // A slot's three requests share a round, one round after another.
    EXPECT_EQ(probes[i].round(), probes[0].round() + 1 + (i - 3) / 3);
  }
  // Every worker is probed by both others, and probes both.
  const std::map<std::string, int> twice = {{"a", 2}, {"b", 2}, {"d0", 2}};
  EXPECT_EQ(named, twice);
  EXPECT_EQ(taken, twice);
  // The bulk rounds share link_probe_budget (their needs, 15.2 s, are
  // less), each slot by its need against what is left when it starts: the
  // first holds a -> b (1 s + 60 x 200 ms = 13 s), the second none over
  // 2.2 s (b -> a did not answer: 1 s). As the fakes answer at once, the
  // second gets what the first left.
  EXPECT_NEAR(probes[3].budget_ms(), 20000 * 13 / 15.2, 200);
  EXPECT_NEAR(probes[6].budget_ms(), 20000, 200);
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  EXPECT_EQ(links->probe_rounds(), 3u);
  ASSERT_EQ(links->links_size(), 6);
  for (const v1::JobLink& l : links->links()) {
    SCOPED_TRACE(l.ShortDebugString());
    if (l.from() == "b" && l.to() == "a") {
      // Not measured: the region table's figures, and why.
      EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_REGION_TABLE);
      EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_REGION_TABLE);
      EXPECT_EQ(l.probe_error(), "connect: timed out");
      EXPECT_FALSE(l.has_latency_measured());
      continue;
    }
    EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_PROBE);
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE);
    EXPECT_TRUE(l.has_latency_measured());
    const bool slow = l.from() == "a" && l.to() == "b";
    EXPECT_DOUBLE_EQ(l.latency_seconds(), slow ? 0.1 : 0.01);
    EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s(), slow ? 5e6 : 1e8);
  }
}

// The bulk rounds' schedule: every ordered pair of workers exactly once; in
// a slot a worker sends to at most one and takes from at most one, and no
// pair is probed both ways at once.
TEST(ProbeScheduleTest, EveryLinkOnceOneProbeInAndOutAndNoPairBothWays) {
  for (size_t n = 0; n <= 9; ++n) {
    SCOPED_TRACE(n);
    std::vector<std::string> ids;
    for (size_t i = 0; i < n; ++i) ids.push_back(absl::StrCat("w", i));
    const auto slots = RunnerLinks::ProbeSchedule(ids);
    EXPECT_EQ(slots.size(), n < 2 ? 0 : (n % 2 == 0 ? n : n - 1));
    std::set<std::pair<std::string, std::string>> probed;
    for (const auto& slot : slots) {
      std::set<std::string> senders, takers;
      std::set<std::pair<std::string, std::string>> pairs;
      for (const auto& [from, to] : slot) {
        EXPECT_NE(from, to);
        EXPECT_TRUE(senders.insert(from).second) << from;
        EXPECT_TRUE(takers.insert(to).second) << to;
        EXPECT_TRUE(pairs.insert(std::minmax(from, to)).second) << from << " <-> " << to;
        EXPECT_TRUE(probed.insert({from, to}).second) << from << " -> " << to;
      }
    }
    EXPECT_EQ(probed.size(), n * (n - 1));
  }
}

// Over long round trips a TCP window takes long to open: the bulk rounds'
// budget grows with the round trips the latency round measured (1 s and 60
// round trips per link, the neediest link of each slot of pairs).
TEST_F(JobRunnerTest, TheBulkRoundsBudgetGrowsWithTheRoundTrips) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  cluster_->SetLink("a", "b", {1.0, 5e6, ""});
  cluster_->SetLink("a", "d0", {0.5, 5e6, ""});
  Start(Spec(3, 1, 0.0, 2), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  ASSERT_GE(probes.size(), 9u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(probes[i].bulk_max_bytes(), 0u);
    EXPECT_EQ(probes[i].budget_ms(), 5000u);
  }
  // Two slots: a -> b (1 s + 60 x 1.0 s = 61 s) with b -> d0, d0 -> a
  // (2.2 s each), then a -> d0 (31 s) with b -> a, d0 -> b: 92 s in all,
  // shared by need.
  EXPECT_THAT(History(job), HasSubstr("(bulk budget 92 s for the round trips)"));
  ASSERT_EQ(probes.size(), 9u);
  for (size_t i = 3; i < 9; ++i) EXPECT_EQ(probes[i].budget_ms(), probes[3 * (i / 3)].budget_ms());
  // What a slot ends early leaves goes to the later one: at least its share,
  // at most all that is left.
  EXPECT_GE(probes[3].budget_ms(), 61000u - 100);
  EXPECT_GE(probes[6].budget_ms(), 31000u - 100);
  EXPECT_LE(probes[6].budget_ms(), 92000u);
}

// A lost worker's measured links go with it: when it comes back and joins
// again, the planner has the region table's figures for its links (until a
// probe measures them), not what was measured of the process that died.
TEST_F(JobRunnerTest, ALostWorkersMeasuredLinksAreForgotten) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  for (const char* id : {"d0", "a1", "a2", "b2"}) {
    cluster_->SetLink("b1", id, {0.2, 5e6, ""});
    cluster_->SetLink(id, "b1", {0.2, 5e6, ""});
  }
  v1::JobSpec spec = Spec(3, 2, 0.0, 6);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->KillWhenPlanArrives("b1", 1);    // routed around
  cluster_->ReviveWhenPlanArrives("b1", 3);  // the same id, a new process
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  ASSERT_THAT(History(job), HasSubstr("worker b1 joined stage 2"));
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  int with_b1 = 0;
  for (const v1::JobLink& l : links->links()) {
    SCOPED_TRACE(l.ShortDebugString());
    if (l.from() != "b1" && l.to() != "b1") {
      EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_PROBE);
      continue;
    }
    ++with_b1;
    EXPECT_EQ(l.latency_source(), v1::JobLink::SOURCE_REGION_TABLE);
    EXPECT_NE(l.latency_seconds(), 0.1);
  }
  EXPECT_EQ(with_b1, 8);  // to and from d0, a1, a2 and b2
}

// Reports are bounded: a round trip or rate out of bounds, a peer the
// worker was not asked about, and reports of an old round are ignored.
TEST(LinkMatrixTest, IgnoresWhatWasNotAskedAndWhatIsOutOfBounds) {
  LinkMatrix m;
  v1::LinkReport r;
  r.set_round(1);
  auto add = [&](const std::string& peer, double rtt, double rate) {
    v1::LinkMeasurement* l = r.add_links();
    l->set_peer(peer);
    l->set_rtt_seconds(rtt);
    l->set_bandwidth_bytes_per_s(rate);
  };
  add("b", 0.04, 2e8);
  add("c", -1, 1e20);           // both out of bounds
  add("x", 0.01, 1e6);          // not asked about
  add("b", 0.5, 1);             // the same peer twice
  add("d", std::nan(""), 1e6);  // NaN round trip, a good rate
  const absl::Time now = absl::Now();
  const LinkMatrix::Applied a = m.AddReport("a", r, {"b", "c", "d"}, now);
  EXPECT_EQ(a.answered, std::vector<std::string>({"b"}));
  EXPECT_EQ(a.rejected, 4);
  EXPECT_EQ(a.measured.latencies, 1);
  EXPECT_DOUBLE_EQ(a.measured.min_latency_s, 0.02);
  EXPECT_DOUBLE_EQ(a.measured.max_latency_s, 0.02);
  EXPECT_EQ(a.measured.rates, 2);  // b's and d's
  EXPECT_DOUBLE_EQ(a.measured.min_rate, 1e6);
  EXPECT_DOUBLE_EQ(a.measured.max_rate, 2e8);
  const LinkMatrix::Entry* b = m.Find({"a", "b"});
  ASSERT_NE(b, nullptr);
  EXPECT_DOUBLE_EQ(*b->latency_s, 0.02);
  EXPECT_DOUBLE_EQ(*b->bandwidth, 2e8);
  const LinkMatrix::Entry* c = m.Find({"a", "c"});
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->latency_s.has_value());
  EXPECT_FALSE(c->bandwidth.has_value());
  EXPECT_EQ(m.Find({"a", "x"}), nullptr);
  ASSERT_NE(m.Find({"a", "d"}), nullptr);
  EXPECT_FALSE(m.Find({"a", "d"})->latency_s.has_value());
  EXPECT_DOUBLE_EQ(*m.Find({"a", "d"})->bandwidth, 1e6);
  // A fit to the job's traffic replaces the bandwidth, not the latency.
  m.Fitted({"a", "b"}, 3e8, now);
  EXPECT_DOUBLE_EQ(*m.Find({"a", "b"})->bandwidth, 3e8);
  EXPECT_EQ(m.Find({"a", "b"})->bandwidth_source, v1::JobLink::SOURCE_TRAFFIC);
  EXPECT_EQ(m.Find({"a", "b"})->latency_source, v1::JobLink::SOURCE_PROBE);
  m.Forget("b");
  EXPECT_EQ(m.Find({"a", "b"}), nullptr);
}

// While the job runs, a latency round is followed by one bulk slot of the
// start's schedule when link_probe_bulk_interval has passed (here: 1 ms),
// slot after slot in turn, each over the links the last iteration did not
// cross: every worker probes at most one peer and takes at most one other's
// probes, within a budget of the slot's need, and what the probes find
// replaces what the start measured. A full pipeline d0 -> a -> b -> c (the
// loss back to d0) leaves a <-> c and b <-> d0 to the probes: of the four
// slots over a, b, c, d0 the two of k = 2 (a -> c, b -> d0 and back).
TEST_F(JobRunnerTest, WhileTheJobRunsBulkSlotsFollowLatencyRoundsSlotAfterSlot) {
  for (const char* id : {"d0", "a", "b", "c"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->link_probe_interval = absl::Milliseconds(1);
  cluster_->mutable_options()->link_probe_bulk_interval = absl::Milliseconds(1);
  cluster_->SetLink("a", "c", {0.2, 5e6, ""});
  // Rounds 1-5 are the start's (a latency round and four slots).
  cluster_->SetLinkFromRound("a", "c", 6, {0.2, 7e6, ""});
  v1::JobSpec spec = Spec(4, 1, 0.0, 24);
  Pin(&spec, {{"d0"}, {"a"}, {"b"}, {"c"}});
  Start(spec, {"d0", "a", "b", "c"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  std::map<uint64_t, std::vector<v1::LinkProbe>> rounds;
  std::map<uint64_t, std::set<std::pair<std::string, std::string>>> probed;
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  const std::vector<std::string> by = cluster_->ProbedBy();
  ASSERT_EQ(probes.size(), by.size());
  for (size_t i = 0; i < probes.size(); ++i) {
    rounds[probes[i].round()].push_back(probes[i]);
    for (const v1::Peer& peer : probes[i].peers()) {
      probed[probes[i].round()].insert({by[i], peer.worker_id()});
    }
  }
  ASSERT_GE(rounds.size(), 9u);  // the start's five, then two of each kind at least
  const std::set<std::pair<std::string, std::string>> there = {{"a", "c"}, {"b", "d0"}};
  const std::set<std::pair<std::string, std::string>> back = {{"c", "a"}, {"d0", "b"}};
  bool after_latency = false;
  int bulk_rounds = 0;
  for (const auto& [round, requests] : rounds) {
    if (round <= 5) continue;
    SCOPED_TRACE(round);
    const bool bulk = requests.front().bulk_max_bytes() > 0;
    // A bulk slot only right after a latency round (not every latency round
    // is followed by one: the bulk interval, 1 ms, may not have passed).
    if (bulk) {
      EXPECT_TRUE(after_latency);
    }
    after_latency = !bulk;
    for (const v1::LinkProbe& p : requests) EXPECT_EQ(p.bulk_max_bytes() > 0, bulk);
    if (!bulk) {
      ASSERT_EQ(requests.size(), 4u);
      for (const v1::LinkProbe& p : requests) EXPECT_EQ(p.peers_size(), 3);
      continue;
    }
    // Two probe, two take: the slots in turn, the one with a -> c first;
    // each has its need as its budget: 1 s + 60 round trips of its slowest
    // link (a -> c 200 ms, the others 20 ms).
    ASSERT_EQ(requests.size(), 4u);
    const bool first = ++bulk_rounds % 2 == 1;
    EXPECT_EQ(probed[round], first ? there : back);
    EXPECT_NEAR(requests.front().budget_ms(), first ? 13000 : 2200, 2);
    for (const v1::LinkProbe& p : requests) {
      EXPECT_EQ(p.bulk_max_bytes(), uint64_t{32} << 20);
      EXPECT_EQ(p.peers_size() + p.accept_from_size(), 1) << p.ShortDebugString();
    }
  }
  EXPECT_GE(bulk_rounds, 2);
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  int seen = 0;
  for (const v1::JobLink& l : links->links()) {
    if (l.from() != "a" || l.to() != "c") continue;
    ++seen;
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE);
    EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s(), 7e6);  // a bulk slot while it ran
  }
  EXPECT_EQ(seen, 1);
}

// The running bulk slots leave out the links the last iteration crossed
// (every hop both ways, the loss back to the data node, the replicas of a
// stage among themselves), and a link's fit to the job's transfers stops
// once no transfer crosses it: what a slot measured of it stays.
TEST_F(JobRunnerTest, RunningBulkSlotsLeaveOutTheLinksTheLastIterationCrossed) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->link_probe_interval = absl::Milliseconds(1);
  cluster_->mutable_options()->link_probe_bulk_interval = absl::Milliseconds(1);
  cluster_->mutable_options()->replan_every = 1;
  cluster_->ReportTransfers(0.05);
  v1::JobSpec spec = Spec(3, 2, 0.0, 30);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  using Link = std::pair<std::string, std::string>;
  const auto routes = cluster_->Routes();
  auto crossed = [&](uint64_t iteration) {
    std::set<Link> out = {{"a1", "a2"}, {"a2", "a1"}, {"b1", "b2"}, {"b2", "b1"}};
    for (const auto& [key, rs] : routes) {
      if (key.first != iteration) continue;
      for (const v1::Route& r : rs) {
        std::vector<std::string> ring(r.nodes().begin(), r.nodes().end());
        ring.push_back(r.data_node());
        for (size_t i = 0; i + 1 < ring.size(); ++i) {
          out.insert({ring[i], ring[i + 1]});
          out.insert({ring[i + 1], ring[i]});
        }
      }
    }
    return out;
  };
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  const std::vector<std::string> by = cluster_->ProbedBy();
  const std::vector<uint64_t> after = cluster_->ProbedAfter();
  ASSERT_EQ(probes.size(), by.size());
  ASSERT_EQ(probes.size(), after.size());
  std::map<Link, uint64_t> probed;  // by the running slots: after which iteration, last
  for (size_t i = 25; i < probes.size(); ++i) {  // the start sent 25
    if (probes[i].bulk_max_bytes() == 0) continue;
    SCOPED_TRACE(probes[i].ShortDebugString());
    // The plan of iteration after[i] was the last one sent.
    const std::set<Link> carried = crossed(after[i]);
    for (const v1::Peer& peer : probes[i].peers()) {
      EXPECT_FALSE(carried.count({by[i], peer.worker_id()})) << by[i] << " -> " << peer.worker_id();
      // Sent before iteration after[i] + 1, answered during it, published
      // at the boundary after it: the last boundary is before iteration 29.
      if (after[i] + 1 < 29) probed[{by[i], peer.worker_id()}] = after[i];
    }
  }
  EXPECT_FALSE(probed.empty());
  // A link no iteration crossed after its last probe keeps what the probe
  // measured: no fit to old transfers overwrote it (what Links() shows was
  // published at the last boundary, before iteration 29).
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  int kept = 0;
  for (const v1::JobLink& l : links->links()) {
    auto p = probed.find({l.from(), l.to()});
    if (p == probed.end()) continue;
    bool crossed_since = false;
    for (uint64_t it = p->second; it < 29; ++it) crossed_since |= crossed(it).count(p->first) > 0;
    if (crossed_since) continue;
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE) << l.ShortDebugString();
    ++kept;
  }
  EXPECT_GT(kept, 0);
}

// A link's bandwidth is refitted from the job's transfers less their round
// trip: a transfer is timed until the peer's acknowledgement, which comes
// back over the reverse link. Two links whose transfers take the same time
// beyond their (very different) round trips are fitted the same rate.
TEST_F(JobRunnerTest, TransfersAreFittedLessTheirRoundTrip) {
  auto links = RunTransfersBeyondRoundTrips(0.4, 0.02, 0.05);
  const v1::JobLink& far = links[{"d0", "a"}];
  const v1::JobLink& near = links[{"a", "b"}];
  ASSERT_EQ(far.bandwidth_source(), v1::JobLink::SOURCE_TRAFFIC) << far.ShortDebugString();
  ASSERT_EQ(near.bandwidth_source(), v1::JobLink::SOURCE_TRAFFIC) << near.ShortDebugString();
  // Less one way only, d0 -> a read (0.01 + 0.05) / (0.2 + 0.05) = 0.24 of
  // a -> b.
  EXPECT_NEAR(far.bandwidth_bytes_per_s() / near.bandwidth_bytes_per_s(), 1.0, 1e-6);
}

// A transfer that took its round trip and next to nothing more was bound by
// the round trip: its bytes' time is within the round trip's jitter, and
// the link keeps the bandwidth its probes measured.
TEST_F(JobRunnerTest, ARoundTripBoundTransferLeavesTheLinksBandwidthAlone) {
  // 0.3 s + 10 ms: the bytes took 3 % of it.
  auto links = RunTransfersBeyondRoundTrips(0.3, 0.3, 0.01);
  for (const auto& link : {std::make_pair("d0", "a"), std::make_pair("a", "b")}) {
    const v1::JobLink& l = links[link];
    EXPECT_EQ(l.bandwidth_source(), v1::JobLink::SOURCE_PROBE) << l.ShortDebugString();
    EXPECT_DOUBLE_EQ(l.bandwidth_bytes_per_s(), 5e7) << l.ShortDebugString();
  }
}

// A cut link is re-probed by the latency rounds while the job runs; once
// its reporter reaches the peer again in a round sent after the cut, the
// link is restored (history LINK_RESTORED) and the job goes on.
TEST_F(JobRunnerTest, ACutLinkThatAnswersItsProbeAgainIsRestored) {
  for (const char* id : {"d0", "a1", "a2", "b1", "b2"}) cluster_->AddWorker(id);
  cluster_->mutable_options()->link_probe_interval = absl::Milliseconds(1);
  v1::JobSpec spec = Spec(3, 2, 0.0, 6);
  Pin(&spec, {{"d0"}, {"a1", "a2"}, {"b1", "b2"}});
  cluster_->ReportUnreachableWhenPlanArrives("a1", "b1", 1);
  Start(spec, {"d0", "a1", "a2", "b1", "b2"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_WORKER_LOST), 0) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_CUT), 1) << History(job);
  ASSERT_EQ(Count(job, v1::JobHistoryEvent::KIND_LINK_RESTORED), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("link a1 -> b1 answered its probe again"));
  // Bulk slots only every link_probe_bulk_interval (5 minutes): none while
  // this job ran. The start sent 5 latency requests and 5 x 4 in its slots.
  const std::vector<v1::LinkProbe> probes = cluster_->Probes();
  ASSERT_GT(probes.size(), 25u);
  for (size_t i = 25; i < probes.size(); ++i) EXPECT_EQ(probes[i].bulk_max_bytes(), 0u) << i;
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  for (const v1::JobLink& l : links->links()) EXPECT_FALSE(l.cut()) << l.ShortDebugString();
}

namespace {

// --- RunnerStageLoss on its own ----------------------------------------------------

// The drive loop's services to a part on its own: assignments are built and
// counted, and every worker sent one reports its stage built at the next
// wait. A wait with nothing to wait for ends the job, so nothing wedges.
class FakeLoop : public RunnerLoop {
 public:
  explicit FakeLoop(const std::string& job_id) : job_id_(job_id) {}

  RunnerEvent Wait(absl::Time, const std::function<std::string()>& describe, bool, bool) override {
    RunnerEvent ev;
    if (building_.empty()) {
      ev.end = JobEnd{v1::JOB_STATE_FAILED, absl::StrCat("nothing to wait for: ", describe())};
      return ev;
    }
    for (const std::string& id : building_) {
      v1::WorkerMessage m;
      m.mutable_stage_ready()->set_job_id(job_id_);
      ev.messages.emplace_back(id, m);
    }
    building_.clear();
    return ev;
  }
  bool StopRequested() const override { return false; }
  void RemoveMember(const std::string&, const std::string&, uint64_t) override {}
  v1::CoordinatorMessage AssignmentFor(const std::string& id, int stage, uint64_t start,
                                       const std::string&,
                                       const std::string& restore_from) override {
    building_.push_back(id);
    starts.push_back(start);
    v1::CoordinatorMessage m;
    v1::StageAssignment* a = m.mutable_assignment();
    a->set_job_id(job_id_);
    a->set_worker_id(id);
    a->set_stage(static_cast<uint32_t>(stage));
    a->set_start_iteration(start);
    a->set_restore_from(restore_from);
    return m;
  }

  std::vector<uint64_t> starts;  // start_iteration of each assignment built

 private:
  const std::string job_id_;
  std::vector<std::string> building_;
};

// The stage-loss part over the state a runner holds after its first plan:
// a full pipeline of d0, a and b (one worker per stage) at iteration 3.
class RunnerStageLossTest : public JobRunnerTest {
 protected:
  void SetUp() override {
    JobRunnerTest::SetUp();
    for (const char* id : {"d0", "a", "b", "late"}) cluster_->AddWorker(id);
  }
  void TearDown() override {
    Reset();
    JobRunnerTest::TearDown();
  }
  void Reset() {
    loss_.reset();
    iteration_.reset();
    elastic_.reset();
    loop_.reset();
    shared_.reset();
  }

  void Build(v1::StageLossAction action, bool never_join = false) {
    Reset();
    v1::JobSpec spec = Spec(3, 1, 0.0, 8);
    spec.mutable_elastic()->set_on_stage_loss(action);
    spec.mutable_elastic()->set_never_join(never_join);
    Pin(&spec, {{"d0"}, {"a"}, {"b"}});
    auto normalized = NormalizeJobSpec(std::move(spec));
    ASSERT_TRUE(normalized.ok()) << normalized.status();
    auto job = cluster_->jobs().Create(*normalized, absl::Now(), "submitted");
    ASSERT_TRUE(job.ok()) << job.status();
    job_id_ = job->id();
    shared_ = std::make_unique<RunnerShared>(cluster_.get(), job_id_, *normalized);
    loop_ = std::make_unique<FakeLoop>(job_id_);
    for (const v1::WorkerInfo& w : cluster_->Infos({"d0", "a", "b"})) {
      shared_->membership.Admit(w);
    }
    for (const auto& [id, stage] :
         std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a", 1}, {"b", 2}}) {
      shared_->membership.Set(id, stage);
    }
    ASSERT_TRUE(shared_->plan.BuildCostModel().ok());
    shared_->plan.RebuildAssignment();
    shared_->next_iteration = 3;
    elastic_ = std::make_unique<RunnerElastic>(shared_.get(), loop_.get());
    iteration_ = std::make_unique<RunnerIteration>(shared_.get(), loop_.get(), elastic_.get());
    loss_ = std::make_unique<RunnerStageLoss>(shared_.get(), loop_.get(), elastic_.get(),
                                              iteration_.get());
  }

  // b, stage 2's only worker, leaves the membership as a lost member does.
  void LoseB() {
    ASSERT_EQ(shared_->membership.Remove("b"), 2);
    shared_->membership.BumpEpoch();
    shared_->plan.RebuildAssignment();
  }

  // `id` fills stage `stage` as a joiner does (RunnerElastic::Join).
  void Fill(const std::string& id, int stage) {
    shared_->membership.Admit(cluster_->Infos({id}).at(0));
    ASSERT_TRUE(shared_->plan.BuildCostModel().ok());
    shared_->membership.Set(id, stage);
    shared_->membership.BumpEpoch();
    shared_->plan.RebuildAssignment();
  }

  v1::JobStatus Holding(int stage, uint64_t completed) {
    v1::JobStatus s;
    s.set_job_id(job_id_);
    s.set_stage(static_cast<uint32_t>(stage));
    s.set_completed_iterations(completed);
    return s;
  }

  std::unique_ptr<RunnerShared> shared_;
  std::unique_ptr<FakeLoop> loop_;
  std::unique_ptr<RunnerElastic> elastic_;
  std::unique_ptr<RunnerIteration> iteration_;
  std::unique_ptr<RunnerStageLoss> loss_;
};

TEST_F(RunnerStageLossTest, EachActionRecordsTheLossOnceWithWhatItWillDo) {
  const std::vector<std::pair<v1::StageLossAction, std::string>> cases = {
      {v1::STAGE_LOSS_ROLLBACK,
       "STAGE_LOSS_ROLLBACK: once every stage has a worker, the whole job starts again at "
       "iteration 0 with fresh parameters (there is no checkpoint)"},
      {v1::STAGE_LOSS_PAUSE,
       "STAGE_LOSS_PAUSE: the job pauses until a worker holding its state (b) comes back, for "
       "up to 60 s; then it fails"},
      {v1::STAGE_LOSS_REINITIALIZE,
       "STAGE_LOSS_REINITIALIZE: a worker that joins it starts from fresh parameters while the "
       "other stages keep theirs"}};
  for (const auto& [action, what] : cases) {
    Build(action);
    LoseB();
    loss_->Lost(2, "b", 3);
    loss_->Lost(2, "b", 3);  // recorded already
    const v1::Job job = Job();
    EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_STAGE_LOST), 1) << History(job);
    EXPECT_THAT(History(job), HasSubstr(absl::StrCat("stage 2 lost its last replica (worker b) "
                                                     "and its state; elastic.on_stage_loss ",
                                                     what)));
    EXPECT_THAT(shared_->lost_stages, ElementsAre(2));
  }
  const std::string scraped = cluster_->Scrape();
  for (const char* action : {"rollback", "pause", "reinitialize"}) {
    EXPECT_THAT(scraped, HasSubstr(absl::StrCat("detour_coordinator_stage_losses_total{action=\"",
                                                action, "\"} 1\n")));
  }
}

TEST_F(RunnerStageLossTest, NothingIsRecordedForAJobWithoutElasticTraining) {
  Build(v1::STAGE_LOSS_PAUSE);
  shared_->spec.mutable_elastic()->set_disabled(true);
  LoseB();
  EXPECT_FALSE(loss_->KeepHolder(2, "b"));
  loss_->Lost(2, "b", 3);
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_STAGE_LOST), 0) << History(Job());
  EXPECT_THAT(shared_->lost_stages, IsEmpty());
}

// PAUSE: only the lost holder, with an open session and at the job's
// iteration, takes its stage back; the others are ignored.
TEST_F(RunnerStageLossTest, OnlyThePausedStagesHolderComesBackAndOnlyInStep) {
  Build(v1::STAGE_LOSS_ROLLBACK);
  LoseB();
  EXPECT_FALSE(loss_->KeepHolder(2, "b")) << "a rollback keeps no holder";

  Build(v1::STAGE_LOSS_PAUSE);
  LoseB();
  EXPECT_TRUE(loss_->KeepHolder(2, "b"));
  loss_->Lost(2, "b", 3);
  EXPECT_FALSE(loss_->KeepHolder(2, "b")) << "the stage's loss is recorded already";
  cluster_->Kill("b");
  loss_->Readmit("a", Holding(2, 3));  // not the holder
  loss_->Readmit("b", Holding(2, 2));  // an iteration behind the job
  loss_->Readmit("b", Holding(1, 3));  // another stage
  loss_->Readmit("b", Holding(2, 3));  // its session is closed
  EXPECT_FALSE(shared_->membership.IsMember("b"));
  EXPECT_THAT(shared_->lost_stages, ElementsAre(2));
  const int aborts = cluster_->Sent("abort");

  cluster_->AddWorker("b");  // the process kept the state and registers again
  const uint64_t epoch = shared_->membership.epoch();
  loss_->Readmit("b", Holding(2, 3));
  ASSERT_TRUE(shared_->membership.IsMember("b"));
  EXPECT_EQ(shared_->membership.members().at("b"), 2);
  EXPECT_THAT(shared_->lost_stages, IsEmpty());
  EXPECT_EQ(shared_->membership.epoch(), epoch + 1);
  EXPECT_EQ(cluster_->Sent("abort"), aborts + 3) << "the iteration starts again with b";
  EXPECT_THAT(History(Job()), HasSubstr("worker b came back holding stage 2's state at "
                                        "iteration 3"));
  ASSERT_EQ(Job().stages_size(), 3);
  EXPECT_THAT(Job().stages(2).nodes(), ElementsAre("b"));
  loss_->Readmit("b", Holding(2, 3));
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_WORKER_JOINED), 1) << "once";
  EXPECT_FALSE(loss_->Recover().has_value());
  EXPECT_TRUE(loop_->starts.empty()) << "nobody rebuilds a stage";
}

// ROLLBACK once the lost stage has a worker again: every member rebuilds
// its stage at the iteration rolled back to (0 without a checkpoint).
TEST_F(RunnerStageLossTest, RollbackRebuildsEveryStageOnceTheLostOneHasAWorker) {
  Build(v1::STAGE_LOSS_ROLLBACK);
  LoseB();
  loss_->Lost(2, "b", 3);
  Fill("late", 2);
  const uint64_t epoch = shared_->membership.epoch();
  const std::optional<JobEnd> end = loss_->Recover();
  ASSERT_FALSE(end.has_value()) << end->message;
  EXPECT_THAT(loop_->starts, ElementsAre(0, 0, 0));
  EXPECT_EQ(shared_->next_iteration, 0u);
  EXPECT_THAT(shared_->lost_stages, IsEmpty());
  EXPECT_EQ(shared_->membership.epoch(), epoch + 1);
  const v1::Job job = Job();
  EXPECT_EQ(Count(job, v1::JobHistoryEvent::KIND_ROLLED_BACK), 1) << History(job);
  EXPECT_THAT(History(job), HasSubstr("rolled back from iteration 3 to iteration 0 (no "
                                      "checkpoint: fresh parameters in every stage) on 3 "
                                      "workers"));
  EXPECT_FALSE(loss_->Recover().has_value());
  EXPECT_EQ(loop_->starts.size(), 3u) << "nothing lost is left to roll back";
}

// A lost stage without a worker pauses the job (here it fails at once:
// never_join forbids the replacement a rollback needs); REINITIALIZE does
// not wait at the boundary at all.
TEST_F(RunnerStageLossTest, ALostStageWithoutAWorkerPausesUnlessItIsReinitialized) {
  Build(v1::STAGE_LOSS_ROLLBACK, /*never_join=*/true);
  LoseB();
  loss_->Lost(2, "b", 3);
  std::optional<JobEnd> end = loss_->Recover();
  ASSERT_TRUE(end.has_value());
  EXPECT_EQ(end->state, v1::JOB_STATE_FAILED);
  EXPECT_THAT(end->message, HasSubstr("stage 2 lost its state; waiting for a worker to roll back "
                                      "with and elastic.never_join forbids replacements"));
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_PAUSED), 1) << History(Job());
  EXPECT_TRUE(loop_->starts.empty());

  Build(v1::STAGE_LOSS_REINITIALIZE, /*never_join=*/true);
  LoseB();
  loss_->Lost(2, "b", 3);
  end = loss_->Recover();
  EXPECT_FALSE(end.has_value()) << end->message;
  EXPECT_EQ(Count(Job(), v1::JobHistoryEvent::KIND_PAUSED), 0) << History(Job());
  EXPECT_THAT(shared_->lost_stages, ElementsAre(2)) << "a joiner reinitializes it";
}

}  // namespace

}  // namespace detour
