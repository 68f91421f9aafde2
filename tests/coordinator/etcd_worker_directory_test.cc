// The worker registry's records in etcd (EtcdWorkerDirectory) against a real
// etcd member: written on registration under one lease of the leader's,
// updated when a worker is lost, deleted when it is forgotten, taken by the
// next leader (whose registry keeps the ids), fenced by the term, gone when
// no leader keeps the lease alive, and malformed records skipped.
#include "coordinator/etcd/etcd_worker_directory.h"

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/spec.h"
#include "coordinator/coordinator.h"
#include "coordinator/worker_registry.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/coordinator/etcd_cluster.h"
#include "tests/e2e/process.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kSilence = absl::Seconds(10);
const absl::Time kT0 = absl::FromUnixSeconds(1000);

v1::RegisterRequest Request(const std::string& id, const std::string& region = "Oregon") {
  v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_region(region);
  r.set_address("127.0.0.1:9000");
  r.set_device("cuda:0");
  return r;
}

// Polls `done` until it holds or `deadline` passes (generous: a loaded
// machine).
bool Eventually(const std::function<bool()>& done, absl::Duration deadline = absl::Seconds(60)) {
  const absl::Time end = absl::Now() + deadline;
  while (absl::Now() < end) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return done();
}

// A registry mirrored by a directory, as a leading coordinator has them.
struct Leader {
  WorkerRegistry registry{kSilence, absl::Seconds(2)};
  std::unique_ptr<EtcdWorkerDirectory> directory;
  // What the directory told its meter (the store metrics' hook).
  std::atomic<int> requests{0};
  std::atomic<int> failed{0};
};

class EtcdWorkerDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::FindEtcdBinary().empty()) GTEST_SKIP() << testing::kNoEtcd;
    absl::Status started = cluster_.Start(1);
    ASSERT_TRUE(started.ok()) << started;
    client_ = cluster_.Client();
  }

  std::unique_ptr<Leader> NewLeader(absl::Duration ttl = absl::Seconds(30)) {
    auto leader = std::make_unique<Leader>();
    WorkerRegistry* registry = &leader->registry;
    Leader* metered = leader.get();
    auto directory = EtcdWorkerDirectory::Create(
        cluster_.Client(), "/detour/", ttl, [registry] { return registry->Records(); },
        [metered](absl::Time started, const absl::Status& status) {
          EXPECT_LE(started, absl::Now());
          ++metered->requests;
          if (!status.ok()) ++metered->failed;
        });
    EXPECT_TRUE(directory.ok()) << directory.status();
    if (!directory.ok()) return nullptr;
    leader->directory = std::move(*directory);
    EtcdWorkerDirectory* d = leader->directory.get();
    leader->registry.SetRecordListener([d] { d->Changed(); });
    return leader;
  }

  // Makes `address` the leader as an election would; returns its term.
  int64_t Elect(const std::string& address) {
    EXPECT_TRUE(client_->DeleteRange("/detour/leader", "").ok());
    auto written = client_->Put("/detour/leader", address);
    EXPECT_TRUE(written.ok()) << written.status();
    return written.ok() ? *written : 0;
  }

  std::optional<EtcdKeyValue> Key(const std::string& id) {
    auto kv = client_->Get("/detour/workers/" + id);
    EXPECT_TRUE(kv.ok()) << kv.status();
    return kv.ok() ? *kv : std::nullopt;
  }

  std::vector<std::string> Keys() {
    std::vector<std::string> keys;
    auto range = client_->Range("/detour/workers/", EtcdPrefixEnd("/detour/workers/"));
    EXPECT_TRUE(range.ok()) << range.status();
    if (range.ok()) {
      for (const EtcdKeyValue& kv : range->kvs) keys.push_back(kv.key);
    }
    return keys;
  }

  testing::EtcdCluster cluster_;
  std::unique_ptr<EtcdClient> client_;
};

TEST_F(EtcdWorkerDirectoryTest, RecordsFollowRegistrationLossAndForgetting) {
  auto a = NewLeader();
  ASSERT_NE(a, nullptr);
  a->directory->Lead(Elect("a:1"));
  auto w1 = a->registry.Register(Request(""), kT0);
  auto gpu = a->registry.Register(Request("gpu-7"), kT0);
  ASSERT_TRUE(w1.ok() && gpu.ok());
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));
  ASSERT_NE(a->directory->lease(), 0);
  EXPECT_EQ(Keys(), (std::vector<std::string>{"/detour/workers/gpu-7", "/detour/workers/w1"}));
  auto stored = Key("gpu-7");
  ASSERT_TRUE(stored.has_value());
  // One lease of the leader's for all of them, and no session token.
  EXPECT_EQ(stored->lease, a->directory->lease());
  EXPECT_EQ(Key("w1")->lease, a->directory->lease());
  EXPECT_THAT(stored->value, HasSubstr("cuda:0"));
  EXPECT_THAT(stored->value, ::testing::Not(HasSubstr(gpu->session_token())));

  // Heartbeats write nothing.
  const int64_t revision = stored->mod_revision;
  v1::Heartbeat busy;
  busy.set_job_id("job-000001");
  ASSERT_TRUE(a->registry.Heartbeat(gpu->session_token(), busy, kT0 + absl::Seconds(1)).ok());
  ASSERT_TRUE(a->registry.Heartbeat(gpu->session_token(), {}, kT0 + absl::Seconds(2)).ok());
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));
  EXPECT_EQ(Key("gpu-7")->mod_revision, revision);

  // Lost: the record says so. Forgotten: the key goes.
  ASSERT_EQ(a->registry.MarkSilentWorkersLost(kT0 + absl::Seconds(11)),
            std::vector<std::string>{"w1"});
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));
  EXPECT_THAT(Key("w1")->value, HasSubstr("WORKER_STATE_LOST"));
  a->registry.MarkSilentWorkersLost(kT0 + absl::Seconds(101));
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));
  EXPECT_FALSE(Key("w1").has_value());
  EXPECT_THAT(Key("gpu-7")->value, HasSubstr("WORKER_STATE_LOST"));
  a->registry.MarkSilentWorkersLost(kT0 + absl::Seconds(103));
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));
  EXPECT_TRUE(Keys().empty());
  // Every request was metered (a lease grant and the writes at least).
  EXPECT_GE(a->requests.load(), 5);
  EXPECT_EQ(a->failed.load(), 0);
}

TEST_F(EtcdWorkerDirectoryTest, TheNextLeaderKeepsTheIdsAndFencesTheOldOne) {
  auto a = NewLeader();
  ASSERT_NE(a, nullptr);
  a->directory->Lead(Elect("a:1"));
  ASSERT_TRUE(a->registry.Register(Request(""), kT0).ok());  // w1
  ASSERT_TRUE(a->registry.Register(Request(""), kT0).ok());  // w2
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));

  // A new leader (a's lease has not run out: it does not know yet).
  const int64_t term = Elect("b:1");
  auto b = NewLeader();
  ASSERT_NE(b, nullptr);
  auto loaded = b->directory->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_EQ(loaded->size(), 2u);
  const absl::Time t1 = absl::Now();
  EXPECT_EQ(b->registry.Restore(*loaded, t1), 2);
  b->directory->Lead(term);
  const std::vector<v1::WorkerInfo> listed = b->registry.List(/*include_lost=*/true);
  ASSERT_EQ(listed.size(), 2u);
  for (const v1::WorkerInfo& w : listed) {
    EXPECT_EQ(w.state(), v1::WORKER_STATE_LOST) << w.worker_id();
    EXPECT_FALSE(w.session_open());
    EXPECT_EQ(w.region(), "Oregon");
  }
  // The records go on under b's lease.
  ASSERT_TRUE(b->directory->Flush(absl::Seconds(30)));
  EXPECT_EQ(Key("w1")->lease, b->directory->lease());
  EXPECT_NE(b->directory->lease(), a->directory->lease());

  // A new worker does not get a kept id; w1 registering again gets its own.
  auto fresh = b->registry.Register(Request(""), t1);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->worker_id(), "w3");
  auto back = b->registry.Register(Request("w1"), t1 + absl::Seconds(1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->worker_id(), "w1");
  EXPECT_EQ(b->registry.Count(v1::WORKER_STATE_IDLE), 2);
  ASSERT_TRUE(b->directory->Flush(absl::Seconds(30)));
  EXPECT_EQ(Keys(), (std::vector<std::string>{"/detour/workers/w1", "/detour/workers/w2",
                                              "/detour/workers/w3"}));

  // The deposed leader's changes are refused by etcd: w2's record stays.
  const std::string w2 = Key("w2")->value;
  ASSERT_TRUE(a->registry.Register(Request("w2", "Tokyo"), kT0 + absl::Seconds(5)).ok());
  EXPECT_FALSE(a->directory->Flush(absl::Seconds(30)));
  EXPECT_EQ(Key("w2")->value, w2);
  EXPECT_GE(a->failed.load(), 1);  // the refused write, metered as an error
  EXPECT_EQ(b->failed.load(), 0);
}

TEST_F(EtcdWorkerDirectoryTest, RecordsNobodyKeepsAliveExpire) {
  auto a = NewLeader(/*ttl=*/absl::Seconds(2));
  ASSERT_NE(a, nullptr);
  a->directory->Lead(Elect("a:1"));
  ASSERT_TRUE(a->registry.Register(Request(""), kT0).ok());
  ASSERT_TRUE(a->directory->Flush(absl::Seconds(30)));
  // Kept alive past its TTL while leading.
  absl::SleepFor(absl::Seconds(5));
  EXPECT_TRUE(Key("w1").has_value());
  // No leader keeps the lease alive any more: etcd drops the record.
  a->directory->StopLeading();
  EXPECT_TRUE(Eventually([&] { return Keys().empty(); })) << Keys().size();
}

TEST_F(EtcdWorkerDirectoryTest, MalformedRecordsAreSkipped) {
  WorkerRegistry source(kSilence, absl::Seconds(2));
  ASSERT_TRUE(source.Register(Request("good"), kT0).ok());
  ASSERT_TRUE(source.Register(Request("renamed"), kT0).ok());
  const std::vector<v1::WorkerInfo> records = source.Records();
  ASSERT_EQ(records.size(), 2u);
  ASSERT_TRUE(client_->Put("/detour/workers/good", ToJson(records[0])).ok());
  // Its id is not its key's.
  ASSERT_TRUE(client_->Put("/detour/workers/other", ToJson(records[1])).ok());
  ASSERT_TRUE(client_->Put("/detour/workers/garbage", "{not json").ok());
  ASSERT_TRUE(
      client_
          ->Put("/detour/workers/huge", std::string(EtcdWorkerDirectory::kMaxRecordBytes + 1, ' '))
          .ok());
  // Parses, but its region is over the registry's limit: the registry
  // refuses it.
  v1::WorkerInfo long_region = records[0];
  long_region.set_worker_id("long");
  long_region.set_region(std::string(WorkerRegistry::kMaxFieldBytes + 1, 'x'));
  ASSERT_TRUE(client_->Put("/detour/workers/long", ToJson(long_region)).ok());
  v1::WorkerInfo bad_id = records[0];
  bad_id.set_worker_id("a b");
  ASSERT_TRUE(client_->Put("/detour/workers/a b", ToJson(bad_id)).ok());

  auto b = NewLeader();
  ASSERT_NE(b, nullptr);
  auto loaded = b->directory->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  std::vector<std::string> ids;
  for (const v1::WorkerInfo& w : *loaded) ids.push_back(w.worker_id());
  EXPECT_EQ(ids, (std::vector<std::string>{"a b", "good", "long"}));
  EXPECT_EQ(b->registry.Restore(*loaded, absl::Now()), 1);
  const std::vector<v1::WorkerInfo> listed = b->registry.List(/*include_lost=*/true);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].worker_id(), "good");
}

// The daemon's wiring: a coordinator elected after another finds that
// one's workers, awaiting reconnection, in ListWorkers with --all.
TEST_F(EtcdWorkerDirectoryTest, ANewLeaderListsThePreviousLeadersWorkers) {
  CoordinatorOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.metrics_port = -1;
  options.etcd.endpoints = cluster_.endpoints();
  options.leader_ttl = absl::Seconds(30);
  options.worker_silence = absl::Seconds(30);
  const testing::TempDir first_data("directory_first");
  options.data_dir = first_data.path();
  auto first = Coordinator::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->leading());
  ASSERT_TRUE((*first)->registry().Register(Request("gpu-1"), absl::Now()).ok());
  ASSERT_TRUE(Eventually([&] { return Key("gpu-1").has_value(); }));
  // A graceful hand-over: the records stay for the next leader.
  (*first)->Drain(absl::Seconds(1));
  const testing::TempDir second_data("directory_second");
  options.data_dir = second_data.path();
  auto second = Coordinator::Start(options);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE((*second)->leading());
  const std::vector<v1::WorkerInfo> listed = (*second)->registry().List(/*include_lost=*/true);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].worker_id(), "gpu-1");
  EXPECT_EQ(listed[0].state(), v1::WORKER_STATE_LOST);
  EXPECT_EQ(listed[0].device(), "cuda:0");
  (*second)->Drain(absl::Seconds(1));
}

}  // namespace
}  // namespace detour
