// The worker runtime without daemons: several JobRuntimes in one process,
// tensors between them over an in-memory PeerTransport, the coordinator
// played by the test. Covers an ordinary iteration, a worker lost mid-
// iteration (fast detection by a failed transfer, freeze, re-run on the
// surviving replica, all-reduce among the survivors) and a replica joining
// with the state of a live one.
#include "worker/runtime/job_runtime.h"

#include <ATen/ATen.h>

#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/checkpoint_manifest.h"
#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/runtime/frame_admission.h"
#include "worker/runtime/runtime_part.h"

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

// Workers in one process. A "dead" worker receives nothing: transfers to it
// fail at once, as a killed peer's stream would.
class FakeNetwork {
 public:
  class Transport final : public PeerTransport {
   public:
    Transport(FakeNetwork* net) : net_(net) {}
    void SetPeers(const std::vector<PeerEndpoint>& peers) override {
      {
        absl::MutexLock lock(&mu_);
        peers_.clear();
        for (const PeerEndpoint& p : peers) peers_.insert(p.worker_id);
      }
      for (const PeerEndpoint& p : peers) net_->SawLink(p.worker_id, p.link);
    }
    void Send(const std::string& to, v1::FrameHeader header, TensorView data, Done done) override {
      {
        absl::MutexLock lock(&mu_);
        if (!peers_.count(to)) {
          done(absl::NotFoundError(absl::StrCat("no peer ", to)), 0);
          return;
        }
      }
      header.set_total_bytes(data.bytes);
      if (net_->MaybeHold(to, header, data)) {
        done(absl::OkStatus(), 0.001);
        return;
      }
      JobRuntime* peer = net_->Alive(to);
      if (peer == nullptr) {
        done(absl::UnavailableError(absl::StrCat(to, " is gone")), 0);
        return;
      }
      header.set_total_bytes(data.bytes);
      auto buffer = peer->Allocate(header);
      if (!buffer.ok()) {
        done(buffer.status(), 0);
        return;
      }
      std::memcpy(buffer->data, data.data, data.bytes);
      peer->Deliver(header, *std::move(buffer));
      done(absl::OkStatus(), 0.001);
    }
    void Close() override {}

   private:
    FakeNetwork* net_;
    absl::Mutex mu_;
    std::set<std::string> peers_ ABSL_GUARDED_BY(mu_);
  };

  // A worker named `id`; messages to the coordinator are kept per worker.
  JobRuntime* Add(const std::string& id, JobRuntimeOptions o = {}) {
    o.torch_threads = 1;
    o.transport = [this](const PeerTransportConfig&) -> std::unique_ptr<PeerTransport> {
      return std::make_unique<Transport>(this);
    };
    auto runtime = std::make_unique<JobRuntime>(
        o,
        [this, id](v1::WorkerMessage m) {
          absl::MutexLock lock(&mu_);
          inbox_[id].push_back(std::move(m));
          return absl::OkStatus();
        },
        nullptr);
    JobRuntime* raw = runtime.get();
    absl::MutexLock lock(&mu_);
    runtimes_[id] = std::move(runtime);
    return raw;
  }

  // Tensors of `direction` to `to` are held until one came for every
  // microbatch of `order`, then delivered in that order.
  void HoldThenDeliver(const std::string& to, v1::Direction direction,
                       std::vector<uint32_t> order) {
    absl::MutexLock lock(&mu_);
    holds_[{to, direction}].order = std::move(order);
  }
  bool MaybeHold(const std::string& to, const v1::FrameHeader& header, const TensorView& data) {
    std::vector<std::pair<v1::FrameHeader, std::vector<uint8_t>>> deliver;
    {
      absl::MutexLock lock(&mu_);
      auto it = holds_.find({to, header.direction()});
      if (it == holds_.end()) return false;
      Hold& h = it->second;
      const auto* bytes = static_cast<const uint8_t*>(data.data);
      h.held[header.microbatch()] = {header, std::vector<uint8_t>(bytes, bytes + data.bytes)};
      if (h.held.size() < h.order.size()) return true;
      for (uint32_t mb : h.order) deliver.push_back(std::move(h.held[mb]));
      holds_.erase(it);
    }
    JobRuntime* peer = Alive(to);
    for (auto& [header, bytes] : deliver) {
      auto buffer = peer == nullptr ? absl::UnavailableError("gone") : peer->Allocate(header);
      if (!buffer.ok()) {
        ADD_FAILURE() << "held tensor for " << to << ": " << buffer.status();
        continue;
      }
      std::memcpy(buffer->data, bytes.data(), bytes.size());
      peer->Deliver(header, *std::move(buffer));
    }
    return true;
  }

  JobRuntime* Alive(const std::string& id) {
    absl::MutexLock lock(&mu_);
    if (dead_.count(id) || !runtimes_.count(id)) return nullptr;
    return runtimes_.at(id).get();
  }
  void Kill(const std::string& id) {
    absl::MutexLock lock(&mu_);
    dead_.insert(id);
  }
  // The longest round trip any transport was told for links to `to`.
  void SawLink(const std::string& to, const LinkHint& hint) {
    absl::MutexLock lock(&mu_);
    links_to_[to] = std::max(links_to_[to], hint.rtt);
  }
  absl::Duration LinkTo(const std::string& to) {
    absl::MutexLock lock(&mu_);
    return links_to_[to];
  }

  // Waits until `from` sent a message `match` accepts; returns it.
  template <typename Match>
  std::optional<v1::WorkerMessage> Await(const std::string& from, Match match,
                                         absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&mu_);
        auto& box = inbox_[from];
        for (auto it = box.begin(); it != box.end(); ++it) {
          if (it->has_error()) {
            ADD_FAILURE() << from << ": " << it->error().message();
            box.erase(it);
            return std::nullopt;
          }
          if (match(*it)) {
            v1::WorkerMessage m = *it;
            box.erase(it);
            return m;
          }
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    ADD_FAILURE() << "no expected message from " << from;
    return std::nullopt;
  }

  // Waits for the JobError `from` reports.
  std::optional<v1::JobError> AwaitError(const std::string& from,
                                         absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      {
        absl::MutexLock lock(&mu_);
        auto& box = inbox_[from];
        for (auto it = box.begin(); it != box.end(); ++it) {
          if (!it->has_error()) continue;
          v1::JobError e = it->error();
          box.erase(it);
          return e;
        }
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    ADD_FAILURE() << "no error from " << from;
    return std::nullopt;
  }

  // How many messages `match` accepts arrive from `from` within `wait`
  // (taken out of the inbox).
  template <typename Match>
  int CountFor(const std::string& from, Match match, absl::Duration wait) {
    absl::SleepFor(wait);
    absl::MutexLock lock(&mu_);
    auto& box = inbox_[from];
    int n = 0;
    for (auto it = box.begin(); it != box.end();) {
      if (match(*it)) {
        ++n;
        it = box.erase(it);
      } else {
        ++it;
      }
    }
    return n;
  }

  void Stop() {
    std::map<std::string, std::unique_ptr<JobRuntime>> runtimes;
    {
      absl::MutexLock lock(&mu_);
      runtimes.swap(runtimes_);
    }
    for (auto& [id, r] : runtimes) r->Stop();
  }
  ~FakeNetwork() { Stop(); }

 private:
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<JobRuntime>> runtimes_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> dead_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, absl::Duration> links_to_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::deque<v1::WorkerMessage>> inbox_ ABSL_GUARDED_BY(mu_);
  struct Hold {
    std::vector<uint32_t> order;
    std::map<uint32_t, std::pair<v1::FrameHeader, std::vector<uint8_t>>> held;
  };
  std::map<std::pair<std::string, v1::Direction>, Hold> holds_ ABSL_GUARDED_BY(mu_);
};

// 2 stages: data nodes d0, d1 (stage 0), replicas r0, r1 (stage 1); four
// microbatches, two per data node.
v1::JobSpec Spec() {
  v1::JobSpec spec;
  spec.set_name("runtime");
  spec.mutable_model()->set_num_layers(2);
  spec.mutable_model()->set_d_model(32);
  spec.mutable_model()->set_num_heads(2);
  spec.mutable_model()->set_ffn_dim(64);
  spec.mutable_model()->set_context_length(16);
  spec.mutable_pipeline()->set_num_stages(2);
  spec.mutable_pipeline()->set_data_nodes(2);
  spec.mutable_pipeline()->set_replicas_per_stage(2);
  spec.mutable_pipeline()->set_microbatches_per_data_node(2);
  spec.mutable_pipeline()->set_samples_per_microbatch(2);
  spec.mutable_pipeline()->set_scheduler(v1::SCHEDULER_FULL);
  spec.set_iterations(4);
  return *NormalizeJobSpec(spec);
}

const std::map<std::string, int> kStage = {{"d0", 0}, {"d1", 0}, {"r0", 1}, {"r1", 1}};

v1::CoordinatorMessage Assignment(const std::string& id, int stage,
                                  const std::vector<std::string>& members,
                                  const std::vector<std::string>& group, uint64_t start = 0,
                                  const std::string& state_from = "", uint64_t epoch = 0) {
  v1::CoordinatorMessage m;
  v1::StageAssignment* a = m.mutable_assignment();
  a->set_job_id("job");
  *a->mutable_spec() = Spec();
  a->set_stage(stage);
  a->set_layer_begin(stage);
  a->set_layer_end(stage + 1);
  for (const std::string& p : members) {
    v1::Peer* peer = a->add_peers();
    peer->set_worker_id(p);
    peer->set_address("in-memory");
  }
  for (const std::string& g : group) a->add_replica_group(g);
  a->set_worker_id(id);
  a->set_start_iteration(start);
  a->set_state_from(state_from);
  a->set_epoch(epoch);
  return m;
}

v1::Route Route(uint32_t mb, const std::string& data, const std::string& hop, uint64_t epoch = 0) {
  v1::Route r;
  r.set_microbatch(mb);
  r.set_data_node(data);
  r.add_nodes(data);
  r.add_nodes(hop);
  r.add_stages(0);
  r.add_stages(1);
  r.set_epoch(epoch);
  return r;
}

void AddGroups(google::protobuf::RepeatedPtrField<v1::ReplicaGroup>* groups,
               const std::vector<std::string>& stage0, const std::vector<std::string>& stage1) {
  v1::ReplicaGroup* g0 = groups->Add();
  g0->set_stage(0);
  for (const auto& id : stage0) g0->add_nodes(id);
  v1::ReplicaGroup* g1 = groups->Add();
  g1->set_stage(1);
  for (const auto& id : stage1) g1->add_nodes(id);
}

class JobRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const auto& [id, s] : kStage) runtime_[id] = net_.Add(id, OptionsFor(id));
  }

  // Options of worker `id` (a test may inject a fault into one).
  virtual JobRuntimeOptions OptionsFor(const std::string&) { return {}; }

  void AssignAll() {
    const std::vector<std::string> all = {"d0", "d1", "r0", "r1"};
    for (const auto& [id, s] : kStage) {
      runtime_[id]->OnCoordinatorMessage(Assignment(
          id, s, all,
          s == 0 ? std::vector<std::string>{"d0", "d1"} : std::vector<std::string>{"r0", "r1"}));
    }
    for (const auto& [id, s] : kStage) {
      ASSERT_TRUE(net_.Await(id, [](const v1::WorkerMessage& m) { return m.has_stage_ready(); }));
    }
  }

  v1::CoordinatorMessage Plan(uint64_t iteration) {
    v1::CoordinatorMessage m;
    v1::IterationPlan* p = m.mutable_plan();
    p->set_job_id("job");
    p->set_iteration(iteration);
    *p->add_routes() = Route(0, "d0", "r0");
    *p->add_routes() = Route(1, "d0", "r1");
    *p->add_routes() = Route(2, "d1", "r0");
    *p->add_routes() = Route(3, "d1", "r1");
    AddGroups(p->mutable_replica_groups(), {"d0", "d1"}, {"r0", "r1"});
    return m;
  }

  // Collects one norm per worker of `ids` (of `epoch`) and returns the step
  // command for them (nullopt when a norm is missing).
  std::optional<v1::CoordinatorMessage> AwaitNorms(uint64_t iteration,
                                                   const std::vector<std::string>& ids,
                                                   uint64_t epoch) {
    std::map<int, double> by_stage;
    for (const std::string& id : ids) {
      auto n = net_.Await(id, [&](const v1::WorkerMessage& m) {
        return m.has_grad_norm() && m.grad_norm().epoch() == epoch;
      });
      if (!n) return std::nullopt;
      by_stage[n->grad_norm().stage()] = n->grad_norm().squared_norm();
    }
    v1::CoordinatorMessage step;
    step.mutable_step()->set_job_id("job");
    step.mutable_step()->set_iteration(iteration);
    step.mutable_step()->set_epoch(epoch);
    double sum = 0;
    for (const auto& [s, sq] : by_stage) sum += sq;
    step.mutable_step()->set_squared_norm(sum);
    return step;
  }

  // Collects one norm per worker of `ids` (of `epoch`), steps, returns the
  // results by worker.
  std::map<std::string, v1::IterationResult> Step(uint64_t iteration,
                                                  const std::vector<std::string>& ids,
                                                  uint64_t epoch) {
    const std::optional<v1::CoordinatorMessage> step = AwaitNorms(iteration, ids, epoch);
    if (!step) return {};
    for (const std::string& id : ids) runtime_[id]->OnCoordinatorMessage(*step);
    std::map<std::string, v1::IterationResult> results;
    for (const std::string& id : ids) {
      auto r = net_.Await(id, [](const v1::WorkerMessage& m) { return m.has_result(); });
      if (r) results[id] = r->result();
    }
    return results;
  }

  static std::vector<uint32_t> Mbs(const v1::IterationResult& r) {
    return {r.microbatches().begin(), r.microbatches().end()};
  }

  FakeNetwork net_;
  std::map<std::string, JobRuntime*> runtime_;
};

TEST_F(JobRuntimeTest, AnIterationTrainsAndReplicasStayIdentical) {
  AssignAll();
  for (const auto& [id, s] : kStage) runtime_[id]->OnCoordinatorMessage(Plan(0));
  auto results = Step(0, {"d0", "d1", "r0", "r1"}, 0);
  ASSERT_EQ(results.size(), 4u);
  EXPECT_THAT(Mbs(results["d0"]), ElementsAre(0, 1));
  EXPECT_THAT(Mbs(results["d1"]), ElementsAre(2, 3));
  EXPECT_EQ(results["d0"].parameter_checksum(), results["d1"].parameter_checksum());
  EXPECT_EQ(results["r0"].parameter_checksum(), results["r1"].parameter_checksum());
  EXPECT_GT(results["d0"].loss_sum(), 0);
}

// The same plan with the tensors arriving in other orders gives the same
// bits: each stage sums its microbatches' gradients in microbatch order,
// whatever order their backwards ran in. r0 takes three microbatches and
// gets their gradients in either order (with two, the order would not
// matter: float addition commutes, it does not associate).
TEST(JobRuntimeOrderTest, ArrivalOrderDoesNotChangeTheBits) {
  std::vector<std::map<std::string, uint64_t>> checksums;
  for (bool reversed : {false, true}) {
    SCOPED_TRACE(reversed);
    FakeNetwork net;
    std::map<std::string, JobRuntime*> runtime;
    const std::vector<std::string> all = {"d0", "d1", "r0", "r1"};
    for (const auto& [id, s] : kStage) runtime[id] = net.Add(id);
    for (const auto& [id, s] : kStage) {
      runtime[id]->OnCoordinatorMessage(Assignment(
          id, s, all,
          s == 0 ? std::vector<std::string>{"d0", "d1"} : std::vector<std::string>{"r0", "r1"}));
    }
    for (const auto& [id, s] : kStage) {
      ASSERT_TRUE(net.Await(id, [](const v1::WorkerMessage& m) { return m.has_stage_ready(); }));
    }
    net.HoldThenDeliver("r0", v1::DIRECTION_BACKWARD,
                        reversed ? std::vector<uint32_t>{2, 0, 1} : std::vector<uint32_t>{0, 1, 2});
    v1::CoordinatorMessage plan;
    v1::IterationPlan* p = plan.mutable_plan();
    p->set_job_id("job");
    p->set_iteration(0);
    *p->add_routes() = Route(0, "d0", "r0");
    *p->add_routes() = Route(1, "d0", "r0");
    *p->add_routes() = Route(2, "d1", "r0");
    *p->add_routes() = Route(3, "d1", "r1");
    AddGroups(p->mutable_replica_groups(), {"d0", "d1"}, {"r0", "r1"});
    for (const std::string& id : all) runtime[id]->OnCoordinatorMessage(plan);
    double sum = 0;
    for (const std::string& id : all) {
      auto n = net.Await(id, [](const v1::WorkerMessage& m) { return m.has_grad_norm(); });
      ASSERT_TRUE(n.has_value());
      sum += n->grad_norm().squared_norm() / 2;  // each stage's norm comes from both replicas
    }
    v1::CoordinatorMessage step;
    step.mutable_step()->set_job_id("job");
    step.mutable_step()->set_iteration(0);
    step.mutable_step()->set_squared_norm(sum);
    for (const std::string& id : all) runtime[id]->OnCoordinatorMessage(step);
    std::map<std::string, uint64_t>& out = checksums.emplace_back();
    for (const std::string& id : all) {
      auto r = net.Await(id, [](const v1::WorkerMessage& m) { return m.has_result(); });
      ASSERT_TRUE(r.has_value());
      out[id] = r->result().parameter_checksum();
    }
  }
  ASSERT_EQ(checksums.size(), 2u);
  EXPECT_EQ(checksums[0], checksums[1]);
}

// What a worker's link probes measured becomes its transport's link hints:
// the peers of the job's plans carry the probed round trip (the fake
// network answers every tensor in 1 ms), so the direct transport plans its
// connections on the measured link.
TEST_F(JobRuntimeTest, ProbedLinksAreTheTransportsHints) {
  const std::vector<std::string> all = {"d0", "d1", "r0", "r1"};
  for (const std::string& id : all) {
    runtime_[id]->OnRegistered(id);
    v1::CoordinatorMessage m;
    v1::LinkProbe* p = m.mutable_probe();
    p->set_job_id("job");
    p->set_round(1);
    p->set_pings(2);
    p->set_budget_ms(10000);
    for (const std::string& peer : all) {
      v1::Peer* e = p->add_peers();
      e->set_worker_id(peer);
      e->set_address(peer + ":1");
    }
    runtime_[id]->OnCoordinatorMessage(m);
  }
  for (const std::string& id : all) {
    auto report = net_.Await(id, [](const v1::WorkerMessage& m) { return m.has_link_report(); });
    ASSERT_TRUE(report.has_value());
    for (const v1::LinkMeasurement& l : report->link_report().links()) {
      EXPECT_TRUE(l.error().empty()) << id << " -> " << l.peer() << ": " << l.error();
    }
  }
  EXPECT_EQ(net_.LinkTo("r0"), absl::ZeroDuration());  // no job transport yet
  AssignAll();
  for (const std::string& id : all) runtime_[id]->OnCoordinatorMessage(Plan(0));
  ASSERT_EQ(Step(0, all, 0).size(), 4u);
  for (const std::string& id : all) {
    EXPECT_NEAR(absl::ToDoubleSeconds(net_.LinkTo(id)), 0.001, 1e-9) << id;
  }
}

// r1 dies before the iteration: transfers to it fail and are reported at
// once; the coordinator freezes the microbatches that crossed it, the
// survivors re-run them on r0, and the replicas of stage 0 still agree.
TEST_F(JobRuntimeTest, ALostReplicaIsRoutedAroundMidIteration) {
  AssignAll();
  net_.Kill("r1");
  const std::vector<std::string> alive = {"d0", "d1", "r0"};
  for (const std::string& id : alive) runtime_[id]->OnCoordinatorMessage(Plan(0));
  for (const std::string data : {"d0", "d1"}) {
    auto report = net_.Await(data, [](const v1::WorkerMessage& m) {
      return m.has_peer_unreachable() && m.peer_unreachable().peer() == "r1";
    });
    ASSERT_TRUE(report.has_value());
  }
  v1::CoordinatorMessage change;
  v1::MembershipChange* c = change.mutable_membership();
  c->set_job_id("job");
  c->set_iteration(0);
  c->set_epoch(1);
  c->add_lost("r1");
  AddGroups(c->mutable_replica_groups(), {"d0", "d1"}, {"r0"});
  for (const std::string& id : alive) runtime_[id]->OnCoordinatorMessage(change);
  for (const std::string& id : alive) {
    auto ack = net_.Await(id, [](const v1::WorkerMessage& m) { return m.has_membership_ack(); });
    ASSERT_TRUE(ack.has_value());
    EXPECT_EQ(ack->membership_ack().epoch(), 1u);
    // The frozen microbatches never reached r1: no backward ran anywhere.
    EXPECT_THAT(ack->membership_ack().backward_ran(), IsEmpty()) << id;
  }
  v1::CoordinatorMessage amend;
  v1::RouteAmendment* a = amend.mutable_reroute();
  a->set_job_id("job");
  a->set_iteration(0);
  a->set_epoch(1);
  *a->add_routes() = Route(1, "d0", "r0", 1);
  *a->add_routes() = Route(3, "d1", "r0", 1);
  for (const std::string& id : alive) runtime_[id]->OnCoordinatorMessage(amend);
  auto results = Step(0, alive, 1);
  ASSERT_EQ(results.size(), 3u);
  EXPECT_THAT(Mbs(results["d0"]), UnorderedElementsAre(0, 1));
  EXPECT_THAT(Mbs(results["d1"]), UnorderedElementsAre(2, 3));
  EXPECT_EQ(results["d0"].parameter_checksum(), results["d1"].parameter_checksum());
  EXPECT_EQ(results["r0"].epoch(), 1u);
}

// A new replica of stage 1 joins after an iteration: it receives r0's state
// and holds exactly the same parameters.
TEST_F(JobRuntimeTest, AJoiningReplicaReceivesTheLiveState) {
  AssignAll();
  for (const auto& [id, s] : kStage) runtime_[id]->OnCoordinatorMessage(Plan(0));
  auto results = Step(0, {"d0", "d1", "r0", "r1"}, 0);
  ASSERT_EQ(results.size(), 4u);
  JobRuntime* r2 = net_.Add("r2");
  const std::vector<std::string> all = {"d0", "d1", "r0", "r1", "r2"};
  r2->OnCoordinatorMessage(Assignment("r2", 1, all, {"r0", "r1", "r2"}, 1, "r0", 1));
  ASSERT_TRUE(net_.Await("r2", [](const v1::WorkerMessage& m) { return m.has_stage_ready(); }));
  v1::CoordinatorMessage send;
  send.mutable_send_state()->set_job_id("job");
  send.mutable_send_state()->set_to("r2");
  send.mutable_send_state()->set_epoch(1);
  send.mutable_send_state()->mutable_peer()->set_worker_id("r2");
  send.mutable_send_state()->mutable_peer()->set_address("in-memory");
  runtime_["r0"]->OnCoordinatorMessage(send);
  auto received =
      net_.Await("r2", [](const v1::WorkerMessage& m) { return m.has_state_received(); });
  ASSERT_TRUE(received.has_value());
  EXPECT_EQ(received->state_received().parameter_checksum(), results["r0"].parameter_checksum());
}

// Tensors from a worker the stage does not expect state from are refused
// before any memory is taken.
TEST_F(JobRuntimeTest, StateFromAnyoneElseIsRefused) {
  AssignAll();
  v1::FrameHeader h;
  h.set_job_id("job");
  h.set_direction(v1::DIRECTION_STATE);
  h.set_sender("r1");
  h.add_shape(16);
  h.set_dtype(v1::DTYPE_BYTES);
  EXPECT_EQ(runtime_["r0"]->Allocate(h).status().code(), absl::StatusCode::kFailedPrecondition);
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_epoch(1000);
  EXPECT_EQ(runtime_["r0"]->Allocate(h).status().code(), absl::StatusCode::kFailedPrecondition);
}

// Only the job's workers may send: a plausible tensor from anyone else is
// refused with PERMISSION_DENIED before memory is taken (forged
// NaN frames from an outsider were accepted). A frame of a newer epoch may
// come from a worker that joined in it.
TEST_F(JobRuntimeTest, FramesFromNonMembersAreRefused) {
  AssignAll();
  v1::FrameHeader h;
  h.set_job_id("job");
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_hop(1);
  for (int64_t d : {2, 16, 32}) h.add_shape(d);
  h.set_dtype(v1::DTYPE_FP32);
  h.set_total_bytes(2 * 16 * 32 * 4);
  h.set_sender("stranger");
  auto refused = runtime_["r0"]->Allocate(h);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("not a member of job job"));
  h.set_sender("d0");
  EXPECT_TRUE(runtime_["r0"]->Allocate(h).ok());
  h.set_sender("stranger");
  h.set_epoch(1);
  EXPECT_NE(runtime_["r0"]->Allocate(h).status().code(), absl::StatusCode::kPermissionDenied);
}

// Plausible frames that are allocated and never consumed (a flood) hit the
// sender's quota of held tensor bytes; another member's tensor is still
// taken (one member's flood refused its peers' real tensors, and the
// receiver was evicted); freeing them makes room again.
TEST_F(JobRuntimeTest, HeldReceivedTensorsAreBounded) {
  AssignAll();
  v1::FrameHeader h;
  h.set_job_id("job");
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_sender("d0");
  h.set_hop(1);
  for (int64_t d : {2, 16, 32}) h.add_shape(d);  // samples x context x d_model
  h.set_dtype(v1::DTYPE_FP32);
  h.set_total_bytes(2 * 16 * 32 * 4);
  std::vector<MutableBuffer> held;
  absl::Status last;
  for (int i = 0; i < 100000 && last.ok(); ++i) {
    auto b = runtime_["r0"]->Allocate(h);
    last = b.status();
    if (b.ok()) held.push_back(*std::move(b));
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_GT(held.size(), 8u);
  EXPECT_LT(held.size(), 100000u);
  h.set_sender("d1");
  EXPECT_TRUE(runtime_["r0"]->Allocate(h).ok()) << "d0's flood took d1's share";
  h.set_sender("d0");
  held.clear();
  EXPECT_TRUE(runtime_["r0"]->Allocate(h).ok());
}

// A frame the receiver admitted is used, however many plausible frames its
// sender flooded it with: d0 floods r0 with frames of later epochs before
// r0 has its plan, then its real forwards arrive, early too, and the
// iteration completes. (A count of early frames per sender, below the byte
// quota the admission enforces, once dropped such a real frame after its
// sender had been told it arrived: the iteration waited for it forever.)
TEST_F(JobRuntimeTest, AnAdmittedEarlyFrameIsNotDroppedForTheSendersFlood) {
  AssignAll();
  v1::FrameHeader h;
  h.set_job_id("job");
  h.set_iteration(0);
  h.set_direction(v1::DIRECTION_FORWARD);
  h.set_sender("d0");
  h.set_hop(1);
  for (int64_t d : {2, 16, 32}) h.add_shape(d);
  h.set_dtype(v1::DTYPE_FP32);
  h.set_total_bytes(2 * 16 * 32 * 4);
  // More than the 36 early frames per sender the count allowed (four per
  // microbatch of the job, two per replica, 16), fewer than d0's quota.
  constexpr int kFlood = 40;
  for (int i = 0; i < kFlood; ++i) {
    h.set_epoch(1 + i % FrameAdmission::kMaxEpochsAhead);
    h.set_microbatch(i % 4);
    auto b = runtime_["r0"]->Allocate(h);
    ASSERT_TRUE(b.ok()) << "flood frame " << i << ": " << b.status();
    std::memset(b->data, 0, b->bytes);
    runtime_["r0"]->Deliver(h, *std::move(b));
  }
  for (const std::string id : {"d0", "d1", "r1"}) runtime_[id]->OnCoordinatorMessage(Plan(0));
  // d0's and d1's forwards reach r0 while it has no plan (r0's thread keeps
  // them as early frames well within this wait; were one to come after the
  // plan, it would be taken as it comes and the test would check less).
  absl::SleepFor(absl::Milliseconds(300));
  runtime_["r0"]->OnCoordinatorMessage(Plan(0));
  auto results = Step(0, {"d0", "d1", "r0", "r1"}, 0);
  ASSERT_EQ(results.size(), 4u) << "r0 lost d0's real forward among its flood";
  EXPECT_THAT(Mbs(results["d0"]), ElementsAre(0, 1));
  EXPECT_EQ(results["r0"].parameter_checksum(), results["r1"].parameter_checksum());
}

// A member's NaN or huge activation is dropped by its receiver, which
// reports the sender to the coordinator instead of failing the job on a
// non-finite gradient (FakeNetwork::Await fails the test on a JobError).
TEST_F(JobRuntimeTest, BadValuesInAFrameAreReportedAgainstTheirSender) {
  AssignAll();
  runtime_["r0"]->OnCoordinatorMessage(Plan(0));
  auto send = [&](const std::string& from, uint32_t mb, float value) {
    v1::FrameHeader h;
    h.set_job_id("job");
    h.set_iteration(0);
    h.set_microbatch(mb);
    h.set_direction(v1::DIRECTION_FORWARD);
    h.set_sender(from);
    h.set_hop(1);
    for (int64_t d : {2, 16, 32}) h.add_shape(d);
    h.set_dtype(v1::DTYPE_FP32);
    h.set_total_bytes(2 * 16 * 32 * 4);
    auto b = runtime_["r0"]->Allocate(h);
    ASSERT_TRUE(b.ok()) << b.status();
    float* data = static_cast<float*>(b->data);
    for (int i = 0; i < 2 * 16 * 32; ++i) data[i] = 0.5f;
    data[100] = value;
    runtime_["r0"]->Deliver(h, *std::move(b));
  };
  send("d0", 0, std::numeric_limits<float>::quiet_NaN());
  send("d1", 2, 3e38f);
  struct Expected {
    std::string from;
    uint32_t mb;
    std::string what;
  };
  for (const Expected& e : {Expected{"d0", 0, "NaN"}, Expected{"d1", 2, "magnitude 3"}}) {
    auto report = net_.Await("r0", [&e](const v1::WorkerMessage& m) {
      return m.has_bad_frame() && m.bad_frame().sender() == e.from;
    });
    ASSERT_TRUE(report.has_value()) << e.from;
    EXPECT_EQ(report->bad_frame().job_id(), "job");
    EXPECT_EQ(report->bad_frame().iteration(), 0u);
    EXPECT_EQ(report->bad_frame().microbatch(), e.mb);
    EXPECT_EQ(report->bad_frame().direction(), static_cast<int>(v1::DIRECTION_FORWARD));
    EXPECT_THAT(report->bad_frame().message(), ::testing::HasSubstr(e.what));
  }
  // The finite check itself: one bad value anywhere, in any float type.
  EXPECT_TRUE(CheckFrameValues(at::ones({3, 4})).ok());
  at::Tensor t = at::zeros({1000}, at::kBFloat16);
  t[999] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(std::string(CheckFrameValues(t).message()), ::testing::HasSubstr("infinity"));
  EXPECT_TRUE(CheckFrameValues(at::full({4}, -1e19)).ok());
  EXPECT_FALSE(CheckFrameValues(at::full({4}, -1e20)).ok());
}

// A replica's all-reduce input holding NaN: the receiving replica's check of
// the sum finds it, names the replica whose input is bad and reports it
// instead of failing the job. (r1 gets no plan: the NaN input r0 takes from
// "r1" is the test's.)
TEST_F(JobRuntimeTest, ABadAllReduceInputIsReportedAgainstItsReplica) {
  AssignAll();
  // The stage's gradient count, from the admission's refusal of a wrong one.
  v1::FrameHeader h;
  h.set_job_id("job");
  h.set_iteration(0);
  h.set_direction(v1::DIRECTION_ALLREDUCE);
  h.set_sender("r1");
  h.add_shape(1);
  h.set_dtype(v1::DTYPE_FP32);
  h.set_total_bytes(4);
  const absl::Status refused = runtime_["r0"]->Allocate(h).status();
  const std::string text(refused.message());
  const size_t at = text.find("this stage's ");
  ASSERT_NE(at, std::string::npos) << refused;
  const int64_t numel = std::stoll(text.substr(at + 13));
  ASSERT_GT(numel, 0) << refused;
  h.set_shape(0, numel);
  h.set_total_bytes(4 * numel);
  auto b = runtime_["r0"]->Allocate(h);
  ASSERT_TRUE(b.ok()) << b.status();
  float* data = static_cast<float*>(b->data);
  for (int64_t i = 0; i < numel; ++i) data[i] = 0.0f;
  data[numel / 2] = std::numeric_limits<float>::quiet_NaN();
  for (const std::string id : {"d0", "d1", "r0"}) runtime_[id]->OnCoordinatorMessage(Plan(0));
  runtime_["r0"]->Deliver(h, *std::move(b));
  auto report = net_.Await("r0", [](const v1::WorkerMessage& m) { return m.has_bad_frame(); });
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->bad_frame().sender(), "r1");
  EXPECT_EQ(report->bad_frame().direction(), static_cast<int>(v1::DIRECTION_ALLREDUCE));
  EXPECT_THAT(report->bad_frame().message(), ::testing::HasSubstr("NaN"));
}

// --- the parts' own rules, through the runtime ------------------------------

// RuntimeStep: a step command of another epoch is not obeyed; the right one
// steps and reports the result.
TEST_F(JobRuntimeTest, AStepOfAnotherEpochIsDropped) {
  AssignAll();
  for (const auto& [id, s] : kStage) runtime_[id]->OnCoordinatorMessage(Plan(0));
  std::optional<v1::CoordinatorMessage> step = AwaitNorms(0, {"d0", "d1", "r0", "r1"}, 0);
  ASSERT_TRUE(step.has_value());
  v1::CoordinatorMessage stale = *step;
  stale.mutable_step()->set_epoch(7);
  runtime_["r0"]->OnCoordinatorMessage(stale);
  auto is_result = [](const v1::WorkerMessage& m) { return m.has_result(); };
  EXPECT_EQ(net_.CountFor("r0", is_result, absl::Milliseconds(300)), 0);
  runtime_["r0"]->OnCoordinatorMessage(*step);
  auto result = net_.Await("r0", is_result);
  ASSERT_TRUE(result.has_value());
  EXPECT_EQ(result->result().iteration(), 0u);
}

// RuntimeMembership: a change of an epoch already seen is ignored (one
// acknowledgement), and one that counts this worker as lost ends its job.
TEST_F(JobRuntimeTest, MembershipEpochsAreAppliedOnceAndALostWorkerStops) {
  AssignAll();
  net_.Kill("r1");
  for (const std::string id : {"d0", "d1", "r0"}) runtime_[id]->OnCoordinatorMessage(Plan(0));
  v1::CoordinatorMessage change;
  v1::MembershipChange* c = change.mutable_membership();
  c->set_job_id("job");
  c->set_iteration(0);
  c->set_epoch(1);
  c->add_lost("r1");
  AddGroups(c->mutable_replica_groups(), {"d0", "d1"}, {"r0"});
  runtime_["d0"]->OnCoordinatorMessage(change);
  runtime_["d0"]->OnCoordinatorMessage(change);
  auto is_ack = [](const v1::WorkerMessage& m) { return m.has_membership_ack(); };
  ASSERT_TRUE(net_.Await("d0", is_ack).has_value());
  EXPECT_EQ(net_.CountFor("d0", is_ack, absl::Milliseconds(300)), 0);
  c->set_epoch(2);
  c->clear_lost();
  c->add_lost("r0");
  runtime_["r0"]->OnCoordinatorMessage(change);
  auto error = net_.AwaitError("r0");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code(), static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_THAT(error->message(), ::testing::HasSubstr("counts this worker as lost"));
}

// RuntimeStateTransfer: the state is sent only between iterations (it is
// the state after the last step); asked mid-iteration, the donor fails.
TEST_F(JobRuntimeTest, StateIsNotSentMidIteration) {
  AssignAll();
  for (const auto& [id, s] : kStage) runtime_[id]->OnCoordinatorMessage(Plan(0));
  ASSERT_TRUE(AwaitNorms(0, {"r0"}, 0).has_value());
  v1::CoordinatorMessage send;
  send.mutable_send_state()->set_job_id("job");
  send.mutable_send_state()->set_to("r1");
  runtime_["r0"]->OnCoordinatorMessage(send);
  auto error = net_.AwaitError("r0");
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(error->message(), ::testing::HasSubstr("mid-iteration"));
}

// RuntimePipeline: a joining replica takes no plan before its state came.
TEST_F(JobRuntimeTest, AJoinerTakesNoPlanBeforeItsState) {
  AssignAll();
  JobRuntime* r2 = net_.Add("r2");
  const std::vector<std::string> all = {"d0", "d1", "r0", "r1", "r2"};
  r2->OnCoordinatorMessage(Assignment("r2", 1, all, {"r0", "r1", "r2"}, 0, "r0", 1));
  ASSERT_TRUE(net_.Await("r2", [](const v1::WorkerMessage& m) { return m.has_stage_ready(); }));
  r2->OnCoordinatorMessage(Plan(0));
  auto error = net_.AwaitError("r2");
  ASSERT_TRUE(error.has_value());
  EXPECT_THAT(error->message(), ::testing::HasSubstr("before the stage state from r0"));
}

// RuntimeStep: when the plan asks for a checkpoint, rank 0 of each stage
// writes its stage file and reports it; the commit writes the manifest that
// names both.
TEST_F(JobRuntimeTest, ACheckpointIsWrittenAndCommitted) {
  AssignAll();
  const std::string dir = ::testing::TempDir() + "/runtime_checkpoint_" +
                          std::to_string(absl::ToUnixNanos(absl::Now()));
  std::filesystem::create_directories(dir);
  v1::CoordinatorMessage plan = Plan(0);
  plan.mutable_plan()->set_checkpoint(true);
  plan.mutable_plan()->set_checkpoint_dir(dir);
  for (const auto& [id, s] : kStage) runtime_[id]->OnCoordinatorMessage(plan);
  auto results = Step(0, {"d0", "d1", "r0", "r1"}, 0);
  ASSERT_EQ(results.size(), 4u);
  EXPECT_TRUE(results["d0"].has_checkpoint());
  EXPECT_TRUE(results["r0"].has_checkpoint());
  EXPECT_FALSE(results["d1"].has_checkpoint());  // replicas are identical: one writes
  EXPECT_FALSE(results["r1"].has_checkpoint());
  v1::CoordinatorMessage commit;
  commit.mutable_commit()->set_job_id("job");
  commit.mutable_commit()->set_iteration(1);
  commit.mutable_commit()->set_dir(dir);
  *commit.mutable_commit()->add_files() = results["d0"].checkpoint();
  *commit.mutable_commit()->add_files() = results["r0"].checkpoint();
  runtime_["d0"]->OnCoordinatorMessage(commit);
  ASSERT_TRUE(
      net_.Await("d0", [](const v1::WorkerMessage& m) { return m.has_checkpoint_committed(); }));
  auto manifest = model::ReadManifest(dir);
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->iteration, 1u);
  ASSERT_EQ(manifest->stages.size(), 2u);
  EXPECT_EQ(manifest->stages[0].checksum, results["d0"].checkpoint().checksum());
  std::filesystem::remove_all(dir);
}

// A replica whose parameters drift (fault injection after its step) reports
// a checksum its replica does not share: what the coordinator's check sees.
class DivergingReplicaTest : public JobRuntimeTest {
 protected:
  JobRuntimeOptions OptionsFor(const std::string& id) override {
    JobRuntimeOptions o;
    if (id == "r1") {
      o.fault.kind = JobRuntimeOptions::FaultInjection::Kind::kDiverge;
      o.fault.iteration = 0;
    }
    return o;
  }
};

TEST_F(DivergingReplicaTest, ItsChecksumDiffers) {
  AssignAll();
  for (const auto& [id, s] : kStage) runtime_[id]->OnCoordinatorMessage(Plan(0));
  auto results = Step(0, {"d0", "d1", "r0", "r1"}, 0);
  ASSERT_EQ(results.size(), 4u);
  EXPECT_EQ(results["d0"].parameter_checksum(), results["d1"].parameter_checksum());
  EXPECT_NE(results["r0"].parameter_checksum(), results["r1"].parameter_checksum());
}

}  // namespace
}  // namespace detour
