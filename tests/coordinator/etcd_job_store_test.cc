// The job store on etcd (EtcdJobBackend) against real etcd members: records
// survive into a second store, writes on a stale revision are refused, ids
// stay unique across stores, a killed member changes nothing, and a lost
// quorum makes writes fail clearly without corrupting a record.
#include "coordinator/etcd/etcd_job_backend.h"

#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/spec.h"
#include "coordinator/coordinator.h"
#include "coordinator/job_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/coordinator/etcd_cluster.h"
#include "tests/e2e/process.h"
#include "tests/coordinator/tiny_spec.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

class EtcdJobStoreTest : public ::testing::Test {
 protected:
  void StartCluster(int members) {
    if (testing::FindEtcdBinary().empty()) GTEST_SKIP() << testing::kNoEtcd;
    absl::Status started = cluster_.Start(members);
    ASSERT_TRUE(started.ok()) << started;
  }
  void SetUp() override { StartCluster(1); }

  std::unique_ptr<JobStore> NewStore(absl::Duration timeout = absl::Seconds(3),
                                     int64_t fence_term = 0) {
    auto backend = EtcdJobBackend::Create(cluster_.Client(timeout), "/detour/");
    EXPECT_TRUE(backend.ok()) << backend.status();
    (*backend)->FenceWrites(fence_term);
    return std::make_unique<JobStore>(std::move(*backend));
  }

  // Makes `address` the leader as an election would (a new /detour/leader),
  // and returns its term: the revision that created the key.
  int64_t Elect(EtcdClient* client, const std::string& address) {
    EXPECT_TRUE(client->DeleteRange("/detour/leader", "").ok());
    auto written = client->Put("/detour/leader", address);
    EXPECT_TRUE(written.ok()) << written.status();
    return written.ok() ? *written : 0;
  }

  testing::EtcdCluster cluster_;
};

TEST_F(EtcdJobStoreTest, JobsSurviveIntoASecondStore) {
  auto a = NewStore();
  ASSERT_EQ(*a->Load(), 0);
  auto first = a->Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  auto second = a->Create(TinySpec("b"), absl::FromUnixSeconds(1001), "stored");
  ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
  EXPECT_EQ(first->id(), "job-000001");
  EXPECT_EQ(second->id(), "job-000002");
  ASSERT_TRUE(a->Cancel(first->id(), absl::FromUnixSeconds(1002)).ok());
  ASSERT_TRUE(a->Update(second->id(), [](v1::Job* j) {
                 j->set_state(v1::JOB_STATE_RUNNING);
                 j->set_last_checkpoint("checkpoints/job-000002/iter-5");
                 j->add_history()->set_message("resumed");
               }).ok());

  auto b = NewStore();
  ASSERT_EQ(*b->Load(), 2);
  EXPECT_EQ(b->Get(first->id())->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(b->Get(second->id())->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(b->Get(second->id())->last_checkpoint(), "checkpoints/job-000002/iter-5");
  EXPECT_EQ(b->Get(second->id())->history_size(), 1);
  EXPECT_EQ(b->Create(TinySpec("c"), absl::FromUnixSeconds(1003), "stored")->id(), "job-000003");
  // The second store continues from the revisions it read.
  EXPECT_TRUE(b->Update(second->id(), [](v1::Job* j) { j->set_message("b was here"); }).ok());
}

TEST_F(EtcdJobStoreTest, AWriteOnAStaleRevisionIsAnErrorAndOverwritesNothing) {
  auto a = NewStore();
  auto b = NewStore();
  ASSERT_TRUE(a->Load().ok());
  auto job = a->Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  ASSERT_EQ(*b->Load(), 1);
  ASSERT_TRUE(a->Update(job->id(), [](v1::Job* j) { j->set_message("by a"); }).ok());
  auto lost = b->Update(job->id(), [](v1::Job* j) { j->set_message("by b"); });
  ASSERT_EQ(lost.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(lost.status().message(), HasSubstr("changed by another writer"));
  auto c = NewStore();
  ASSERT_EQ(*c->Load(), 1);
  EXPECT_EQ(c->Get(job->id())->message(), "by a");
}

// A leader's writes are fenced by its term inside etcd: once the leader key
// is gone or another's, a write on the current revision (which the
// compare-and-swap alone would let through) is refused, and so is a create.
TEST_F(EtcdJobStoreTest, ADeposedLeadersWritesAreRefusedByEtcd) {
  auto client = cluster_.Client();
  const int64_t term_a = Elect(client.get(), "a:1");
  ASSERT_GT(term_a, 0);
  auto a = NewStore(absl::Seconds(3), term_a);
  ASSERT_EQ(*a->Load(), 0);
  auto job = a->Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_TRUE(a->Update(job->id(), [](v1::Job* j) { j->set_message("by a"); }).ok());

  // a's lease ends: the key is gone, and no one leads yet.
  ASSERT_TRUE(client->DeleteRange("/detour/leader", "").ok());
  auto gone = a->Update(job->id(), [](v1::Job* j) { j->set_message("a, deposed"); });
  ASSERT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_THAT(gone.status().message(), HasSubstr("fenced"));
  EXPECT_THAT(gone.status().message(), HasSubstr("/detour/leader is gone"));

  // b is elected; a, paused until now, still holds the current revision.
  const int64_t term_b = Elect(client.get(), "b:1");
  ASSERT_GT(term_b, term_a);
  auto late = a->Update(job->id(), [](v1::Job* j) { j->set_message("a, late"); });
  ASSERT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
  EXPECT_THAT(late.status().message(), HasSubstr(job->id()));
  EXPECT_THAT(late.status().message(),
              HasSubstr(absl::StrCat("now holds term ", term_b, ", ours was ", term_a)));
  auto created = a->Create(TinySpec("a2"), absl::FromUnixSeconds(1001), "stored");
  ASSERT_EQ(created.status().code(), absl::StatusCode::kFailedPrecondition) << created.status();
  EXPECT_THAT(created.status().message(), HasSubstr("no longer leads"));

  auto b = NewStore(absl::Seconds(3), term_b);
  ASSERT_EQ(*b->Load(), 1);
  EXPECT_EQ(b->Get(job->id())->message(), "by a");
  ASSERT_TRUE(b->Update(job->id(), [](v1::Job* j) { j->set_message("by b"); }).ok());
  auto next = b->Create(TinySpec("b"), absl::FromUnixSeconds(1002), "stored");
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->id(), "job-000002");  // a's refused create took no number

  auto reloaded = NewStore();
  ASSERT_EQ(*reloaded->Load(), 2);
  EXPECT_EQ(reloaded->Get(job->id())->message(), "by b");
}

// The daemon's wiring: an elected coordinator fences its writes with its
// term, so once another coordinator holds the leader key its writes fail.
TEST_F(EtcdJobStoreTest, AnElectedCoordinatorsWritesAreFencedByItsTerm) {
  CoordinatorOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.metrics_port = -1;
  const testing::TempDir data("coordinator_fenced");
  options.data_dir = data.path();
  options.etcd.endpoints = cluster_.endpoints();
  options.leader_ttl = absl::Seconds(30);
  auto coordinator = Coordinator::Start(options);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto job =
      (*coordinator)->jobs().Create(TinySpec("fenced"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok()) << job.status();
  // Another leader, as if this one's lease had run out while it was paused
  // (its keep-alive thread has not noticed yet: the TTL is long).
  auto client = cluster_.Client();
  ASSERT_GT(Elect(client.get(), "elsewhere:1"), 0);
  auto refused = (*coordinator)->jobs().Cancel(job->id(), absl::FromUnixSeconds(1001));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(refused.status().message(), HasSubstr("fenced"));
  auto reloaded = NewStore();
  ASSERT_EQ(*reloaded->Load(), 1);
  EXPECT_NE(reloaded->Get(job->id())->state(), v1::JOB_STATE_CANCELLED);
  // Its lease is not the key's any more: it would step down; end it here.
  (*coordinator)->Drain(absl::Seconds(1));
}

TEST_F(EtcdJobStoreTest, IdsStayUniqueAcrossStoresCreatingAtOnce) {
  constexpr int kStores = 3, kJobsEach = 8;
  std::vector<std::unique_ptr<JobStore>> stores;
  for (int i = 0; i < kStores; ++i) {
    stores.push_back(NewStore());
    ASSERT_TRUE(stores.back()->Load().ok());
  }
  std::vector<std::vector<std::string>> ids(kStores);
  std::vector<std::thread> threads;
  for (int i = 0; i < kStores; ++i) {
    threads.emplace_back([&, i] {
      for (int n = 0; n < kJobsEach; ++n) {
        auto job = stores[i]->Create(TinySpec("x"), absl::Now(), "stored");
        EXPECT_TRUE(job.ok()) << job.status();
        if (job.ok()) ids[i].push_back(job->id());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  std::set<std::string> unique;
  for (const auto& list : ids) unique.insert(list.begin(), list.end());
  EXPECT_EQ(unique.size(), static_cast<size_t>(kStores * kJobsEach));
  auto reloaded = NewStore();
  EXPECT_EQ(*reloaded->Load(), kStores * kJobsEach);
}

TEST_F(EtcdJobStoreTest, ARecordOverEtcdsLimitIsRefusedClearly) {
  auto store = NewStore();
  ASSERT_TRUE(store->Load().ok());
  auto job = store->Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  auto big =
      store->Update(job->id(), [](v1::Job* j) { j->set_message(std::string(2 << 20, 'x')); });
  ASSERT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.status().message(), HasSubstr(job->id()));
  EXPECT_THAT(big.status().message(), HasSubstr("at most 1572864"));
  auto reloaded = NewStore();
  ASSERT_EQ(*reloaded->Load(), 1);
  EXPECT_EQ(reloaded->Get(job->id())->message(), "stored");
}

TEST_F(EtcdJobStoreTest, UnreadableRecordsAreSkippedAndLeftWhereTheyAre) {
  auto client = cluster_.Client();
  ASSERT_TRUE(client->Put("/detour/jobs/job-000007", "{not json").ok());
  ASSERT_TRUE(client->Put("/detour/jobs/job-000008", "{\"id\": \"job-000001\"}").ok());
  auto store = NewStore();
  ASSERT_EQ(*store->Load(), 0);
  EXPECT_EQ((*client->Get("/detour/jobs/job-000007"))->value, "{not json");
  // The counter knows nothing of them, yet no new job takes their ids.
  for (int i = 0; i < 9; ++i) {
    auto job = store->Create(TinySpec("x"), absl::Now(), "stored");
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_NE(job->id(), "job-000007");
    EXPECT_NE(job->id(), "job-000008");
  }
}

TEST_F(EtcdJobStoreTest, LoadsInPagesBeyondOnePage) {
  auto store = NewStore();
  ASSERT_TRUE(store->Load().ok());
  for (int i = 0; i < 300; ++i) ASSERT_TRUE(store->Create(TinySpec("x"), absl::Now(), "s").ok());
  auto reloaded = NewStore();
  EXPECT_EQ(*reloaded->Load(), 300);
  EXPECT_EQ(reloaded->List(v1::JOB_STATE_UNSPECIFIED).front().id(), "job-000300");
}

// The daemon's wiring: a coordinator with `etcd` options keeps its jobs
// there, not under its data_dir.
TEST_F(EtcdJobStoreTest, ACoordinatorOnEtcdServesTheJobsAnotherStored) {
  auto store = NewStore();
  ASSERT_TRUE(store->Load().ok());
  auto job = store->Create(TinySpec("elsewhere"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  CoordinatorOptions options;
  options.listen = HostPort{"127.0.0.1", 0};
  options.metrics_port = -1;
  const testing::TempDir data("coordinator_on_etcd");
  options.data_dir = data.path();
  options.etcd.endpoints = cluster_.endpoints();
  auto coordinator = Coordinator::Start(options);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  EXPECT_EQ((*coordinator)->jobs().Get(job->id())->spec().name(), "elsewhere");
  ASSERT_TRUE((*coordinator)->jobs().Cancel(job->id(), absl::FromUnixSeconds(1001)).ok());
  (*coordinator)->Drain(absl::Seconds(1));
  EXPECT_FALSE(std::filesystem::exists(options.data_dir + "/jobs/" + job->id() + ".json"));
  auto reloaded = NewStore();
  ASSERT_EQ(*reloaded->Load(), 1);
  EXPECT_EQ(reloaded->Get(job->id())->state(), v1::JOB_STATE_CANCELLED);
}

class EtcdJobStoreClusterTest : public EtcdJobStoreTest {
 protected:
  void SetUp() override { StartCluster(3); }
};

TEST_F(EtcdJobStoreClusterTest, AKilledMemberChangesNothing) {
  // A generous deadline: killing the raft leader costs an election (a bound,
  // not a measure of speed).
  auto store = NewStore(absl::Seconds(15));
  ASSERT_TRUE(store->Load().ok());
  auto job = store->Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  cluster_.Kill(0);  // the member the client asks first
  auto updated = store->Update(job->id(), [](v1::Job* j) { j->set_message("after the kill"); });
  ASSERT_TRUE(updated.ok()) << updated.status();
  ASSERT_TRUE(store->Create(TinySpec("b"), absl::FromUnixSeconds(1001), "stored").ok());
  auto reloaded = NewStore();
  ASSERT_EQ(*reloaded->Load(), 2);
  EXPECT_EQ(reloaded->Get(job->id())->message(), "after the kill");
}

// Two of three members gone: writes fail with an error that says so, within
// the call's deadline; the stored record is the last one written. With the
// quorum back, the same store writes again (its failed write may have
// landed after all: the store recognises its own value) and nothing is lost.
TEST_F(EtcdJobStoreClusterTest, QuorumLostWritesFailClearlyAndNothingIsCorrupted) {
  auto store = NewStore(absl::Seconds(2));
  ASSERT_TRUE(store->Load().ok());
  auto job = store->Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  ASSERT_TRUE(store->Update(job->id(), [](v1::Job* j) { j->set_message("before"); }).ok());
  cluster_.Kill(1);
  cluster_.Kill(2);
  auto failed = store->Update(job->id(), [](v1::Job* j) { j->set_message("during"); });
  ASSERT_FALSE(failed.ok());
  EXPECT_TRUE(failed.status().code() == absl::StatusCode::kDeadlineExceeded ||
              failed.status().code() == absl::StatusCode::kUnavailable)
      << failed.status();
  EXPECT_THAT(failed.status().message(), HasSubstr(job->id()));
  EXPECT_THAT(failed.status().message(), HasSubstr("etcd Txn"));
  EXPECT_FALSE(store->Create(TinySpec("b"), absl::FromUnixSeconds(1001), "stored").ok());

  ASSERT_TRUE(cluster_.Restart(1).ok());
  ASSERT_TRUE(cluster_.Restart(2).ok());
  absl::Status last = absl::UnknownError("not tried");
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    last = store->Update(job->id(), [](v1::Job* j) { j->set_message("after"); }).status();
    if (last.ok()) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_TRUE(last.ok()) << last;
  auto reloaded = NewStore();
  ASSERT_EQ(*reloaded->Load(), 1);
  EXPECT_EQ(reloaded->Get(job->id())->message(), "after");
  EXPECT_EQ(reloaded->Get(job->id())->spec().name(), "a");
}

TEST(EtcdJobBackend, ThePrefixMustBeADirectory) {
  EtcdOptions options;
  options.endpoints = {"127.0.0.1:1"};
  for (const char* bad : {"", "detour/", "/detour", "/"}) {
    auto backend = EtcdJobBackend::Create(*EtcdClient::Create(options), bad);
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace detour
