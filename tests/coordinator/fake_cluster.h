// The job runner's surroundings without processes or sockets, for its unit
// tests: a fake host whose job store and worker registry are the
// coordinator's own, and fake workers that answer the control protocol at
// once, on the runner's thread (docs/RUNTIME.md §"Elastic training" describes
// each exchange). A test scripts the faults — a worker dies when a plan
// reaches it, a spare registers, workers report after a coordinator restart —
// and reads the decisions from the job record, its history and the messages
// sent (JobRunnerTest, the fixture below).
#ifndef DETOUR_TESTS_COORDINATOR_FAKE_CLUSTER_H_
#define DETOUR_TESTS_COORDINATOR_FAKE_CLUSTER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/metrics/metrics.h"
#include "common/spec.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_store.h"
#include "coordinator/timing_estimates.h"
#include "coordinator/worker_registry.h"
#include "detour/v1/activation_service.pb.h"
#include "tests/e2e/process.h"

namespace detour::testing {

struct FakeWorker {
  std::string id;
  std::string token;
  std::string job_id;  // of the plan it runs
  double speed = 1;
  bool alive = true;
  bool mute = false;  // takes plans but never answers them
  // Takes link probe requests sent after the plan of this iteration but
  // never reports on them (a probe that hangs).
  std::optional<uint64_t> probes_silent_after;
  int stage = -1;  // -1: holds no stage
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

  // `id` never reports on the link probes it is asked for once the runner
  // has sent a plan of `iteration` or later.
  void SilenceProbesAfterPlan(const std::string& id, uint64_t iteration) {
    absl::MutexLock lock(&mu_);
    workers_[id].probes_silent_after = iteration;
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

  absl::Status Send(const std::string& worker, const v1::CoordinatorMessage& m) override;

  std::vector<v1::WorkerInfo> ReserveIdle(const std::string& job, size_t count,
                                          const std::set<std::string>& exclude) override;
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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // What the workers' manifest writer leaves: the checkpoint's iteration
  // (stage files are not needed by the coordinator).
  void WriteManifest(const v1::CommitCheckpoint& commit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Norm(const FakeWorker& w, v1::WorkerMessage& out);

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
v1::JobSpec Spec(int stages, int replicas, double skip, int iterations);

// Pins stage s to the workers of `stages[s]`.
void Pin(v1::JobSpec* spec, const std::vector<std::vector<std::string>>& stages);

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

}  // namespace detour::testing

#endif  // DETOUR_TESTS_COORDINATOR_FAKE_CLUSTER_H_
