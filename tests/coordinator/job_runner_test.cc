// The job runner's elastic decisions without processes or sockets: a fake
// host whose job store and worker registry are the coordinator's own, and
// fake workers that answer the control protocol at once, on the runner's
// thread (docs/RUNTIME.md §"Elastic training" describes each exchange). A
// test scripts the faults — a worker dies when a plan reaches it, a spare
// registers, workers report after a coordinator restart — and reads the
// decisions from the job record, its history and the messages sent.
#include "coordinator/job_runner.h"

#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/metrics/metrics.h"
#include "common/spec.h"
#include "coordinator/job_store.h"
#include "coordinator/link_matrix.h"
#include "coordinator/timing_estimates.h"
#include "coordinator/worker_registry.h"
#include "tests/e2e/process.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

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
  std::map<uint32_t, v1::Route> routes;     // this iteration's, amendments applied
  std::vector<std::string> first_of_stage;  // replica group heads, by stage
};

// A worker dies when the plan of `iteration` reaches it: `worker`, or when
// that is empty the node microbatch 0's route visits at `route_stage`.
struct KillOnPlan {
  std::string worker;
  uint64_t iteration = 0;
  int route_stage = -1;
};

// `reporter` cannot reach `peer` when the plan of `iteration` arrives: it
// reports PeerUnreachable instead of its norm (once; the plan that runs the
// iteration again gets its norm).
struct UnreachableOnPlan {
  std::string reporter;
  std::string peer;
  uint64_t iteration = 0;
  bool done = false;
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

  // Registers `id` with an open session (an idle worker).
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

  // Messages ignored as coming from outside the job.
  double OutsiderMessages() {
    return metrics_.outsider_messages != nullptr ? metrics_.outsider_messages->Value() : -1;
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

  // Messages the runner sent, by kind (the oneof's field name).
  int Sent(const std::string& kind) {
    absl::MutexLock lock(&mu_);
    return sent_count_[kind];
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
    {
      absl::MutexLock lock(&mu_);
      runner = runner_;
      auto it = workers_.find(worker);
      if (it == workers_.end() || !it->second.alive) {
        return absl::UnavailableError(absl::StrCat(worker, " has no open session"));
      }
      ++sent_count_[m.GetDescriptor()->FindFieldByNumber(m.kind_case())->name()];
      poke = Answer(it->second, m, &replies);
    }
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
        for (const KillOnPlan& k : kills_) {
          std::string victim = k.worker;
          for (const v1::Route& r : p.routes()) {
            if (victim.empty() && r.microbatch() == 0) {
              for (int i = 0; i < r.stages_size(); ++i) {
                if (static_cast<int>(r.stages(i)) == k.route_stage) victim = r.nodes(i);
              }
            }
          }
          if (victim == w.id && k.iteration == p.iteration()) {
            w.alive = false;
            return true;
          }
        }
        w.job_id = p.job_id();
        w.iteration = p.iteration();
        w.epoch = p.epoch();
        w.stepped = false;
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
        w.stepped = true;
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
        return false;
      }
      case v1::CoordinatorMessage::kCommit: {
        v1::CheckpointCommitted* c = reply(w.id).mutable_checkpoint_committed();
        c->set_job_id(m.commit().job_id());
        c->set_iteration(m.commit().iteration());
        c->set_dir(m.commit().dir());
        return false;
      }
      case v1::CoordinatorMessage::kProbe: {
        const v1::LinkProbe& p = m.probe();
        v1::LinkReport* r = reply(w.id).mutable_link_report();
        r->set_job_id(p.job_id());
        r->set_round(p.round());
        for (const v1::Peer& peer : p.peers()) {
          if (peer.worker_id() == w.id) continue;
          auto it = links_.find({w.id, peer.worker_id()});
          const FakeLink link = it != links_.end() ? it->second : FakeLink();
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
      case v1::CoordinatorMessage::kAbort: w.routes.clear(); return false;
      case v1::CoordinatorMessage::kCancel:
        w.stage = -1;
        w.routes.clear();
        return false;
      default: return false;
    }
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
  std::vector<UnreachableOnPlan> unreachable_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, uint64_t>, std::vector<v1::Route>> routes_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> reserved_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> sent_count_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<std::string, std::string>, FakeLink> links_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> planned_iterations_ ABSL_GUARDED_BY(mu_);
  bool checkpoint_ ABSL_GUARDED_BY(mu_) = false;
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
  void SetUp() override {
    dir_ = testing::MakeTempDir("job_runner_test");
    cluster_ = std::make_unique<FakeCluster>(dir_);
  }
  void TearDown() override {
    runner_.reset();
    cluster_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
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

  std::string dir_;
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
// pauses the job at that iteration until a worker registers; it then joins
// with fresh parameters (no replica, no checkpoint) and the job goes on.
TEST_F(JobRunnerTest, StageWithoutWorkersPausesUntilOneJoins) {
  for (const char* id : {"d0", "a", "b"}) cluster_->AddWorker(id);
  v1::JobSpec spec = Spec(3, 1, 0.0, 5);
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
  auto created = cluster_->jobs().Create(*normalized, absl::Now(), "submitted");
  ASSERT_TRUE(created.ok());
  job_id_ = created->id();
  ASSERT_TRUE(cluster_->jobs()
                  .Update(job_id_,
                          [](v1::Job* j) {
                            j->set_state(v1::JOB_STATE_RUNNING);
                            j->set_epoch(4);
                            for (const auto& nodes : std::vector<std::vector<std::string>>{
                                     {"d0"}, {"a1", "a2"}, {"b"}}) {
                              auto* s = j->add_stages();
                              for (const std::string& id : nodes) s->add_nodes(id);
                            }
                          })
                  .ok());
  cluster_->Hold("d0", 0, 7);
  cluster_->Hold("a1", 1, 8);
  cluster_->Hold("b", 2, 9);
  cluster_->Kill("a2");  // never reports back
  // The workers report what they hold once their sessions reopen.
  Start(*normalized, {}, JobRunner::StartMode::kReattach);
  for (const auto& [id, stage] :
       std::vector<std::pair<std::string, int>>{{"d0", 0}, {"a1", 1}, {"b", 2}}) {
    v1::WorkerMessage m;
    v1::JobStatus* s = m.mutable_job_status();
    s->set_job_id(job_id_);
    s->set_stage(static_cast<uint32_t>(stage));
    s->set_completed_iterations(3);
    s->set_epoch(4);
    runner_->Post(id, m);
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
  Start(Spec(3, 1, 0.0, 2), {"d0", "a", "b"});
  const v1::Job job = AwaitEnd();
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n" << History(job);
  EXPECT_THAT(History(job), HasSubstr("link probes: 5 of 6 links answered (5 with a bulk rate)"));
  EXPECT_THAT(History(job), HasSubstr("one-way latency 10.0-100.0 ms, bandwidth 5.0-100.0 MB/s"));
  EXPECT_EQ(cluster_->Sent("probe"), 3);  // one each, at the start (interval 60 s)
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  EXPECT_EQ(links->probe_rounds(), 1u);
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
  EXPECT_GT(cluster_->Sent("probe"), 5);  // the start, then latency rounds
  const std::optional<v1::GetLinksResponse> links = runner_->Links();
  ASSERT_TRUE(links.has_value());
  for (const v1::JobLink& l : links->links()) EXPECT_FALSE(l.cut()) << l.ShortDebugString();
}

}  // namespace detour
