#include "coordinator/worker_registry.h"

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

v1::RegisterRequest Request(const std::string& id, const std::string& region = "Oregon") {
  v1::RegisterRequest r;
  r.set_worker_id(id);
  r.set_region(region);
  r.set_address("127.0.0.1:9000");
  return r;
}

TEST(WorkerRegistry, AssignsIdsAndTokens) {
  WorkerRegistry registry(absl::Seconds(10), absl::Seconds(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto a = registry.Register(Request(""), t0);
  auto b = registry.Register(Request(""), t0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->worker_id(), "w1");
  EXPECT_EQ(b->worker_id(), "w2");
  EXPECT_NE(a->session_token(), b->session_token());
  EXPECT_EQ(a->heartbeat_interval_ms(), 2000u);
  EXPECT_EQ(*registry.WorkerForToken(a->session_token()), "w1");
  EXPECT_EQ(registry.Count(v1::WORKER_STATE_IDLE), 2);
}

TEST(WorkerRegistry, LiveIdCannotBeTakenButLostOneCan) {
  WorkerRegistry registry(absl::Seconds(10), absl::Seconds(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto first = registry.Register(Request("alpha"), t0);
  ASSERT_TRUE(first.ok());
  registry.SessionOpened(first->session_token());
  auto dup = registry.Register(Request("alpha"), t0 + absl::Seconds(1));
  EXPECT_EQ(dup.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(dup.status().message(), HasSubstr("alpha"));
  // Lost after the silence; then the id may come back with a new token.
  EXPECT_TRUE(registry.MarkSilentWorkersLost(t0 + absl::Seconds(10)).empty());  // not yet
  EXPECT_EQ(registry.MarkSilentWorkersLost(t0 + absl::Seconds(11)),
            std::vector<std::string>{"alpha"});
  EXPECT_TRUE(registry.MarkSilentWorkersLost(t0 + absl::Seconds(12)).empty());  // only once
  auto again = registry.Register(Request("alpha"), t0 + absl::Seconds(12));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(registry.WorkerForToken(first->session_token()).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(registry.Count(v1::WORKER_STATE_IDLE), 1);
}

// Regression: a worker restarted within the silence window (even after a clean
// stop) was refused with ALREADY_EXISTS and exited. Once its session ended,
// its id may register again and the stale token stops working.
TEST(WorkerRegistry, RestartedWorkerReplacesItsEndedSession) {
  WorkerRegistry registry(absl::Seconds(10), absl::Seconds(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto first = registry.Register(Request("alpha"), t0);
  ASSERT_TRUE(first.ok());
  registry.SessionOpened(first->session_token());
  registry.SessionEnded(first->session_token());  // the process stopped
  auto again = registry.Register(Request("alpha"), t0 + absl::Seconds(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(again->session_token(), first->session_token());
  EXPECT_EQ(registry.WorkerForToken(first->session_token()).status().code(),
            absl::StatusCode::kUnauthenticated);
  // A stale session ending late does not disconnect the new one.
  registry.SessionOpened(again->session_token());
  registry.SessionEnded(first->session_token());
  EXPECT_EQ(registry.Register(Request("alpha"), t0 + absl::Seconds(2)).status().code(),
            absl::StatusCode::kAlreadyExists);
}

// Regression: 5200 fake registrations stayed forever. Lost workers are
// forgotten after 10 x the silence, and the registry is bounded.
TEST(WorkerRegistry, LostWorkersArePrunedAndTheRegistryIsBounded) {
  WorkerRegistry registry(absl::Seconds(1), absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (size_t i = 0; i < WorkerRegistry::kMaxWorkers; ++i) {
    ASSERT_TRUE(registry.Register(Request(absl::StrCat("fake", i)), t0).ok());
  }
  EXPECT_EQ(registry.Register(Request("one-more"), t0).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(registry.MarkSilentWorkersLost(t0 + absl::Seconds(2)).size(),
            WorkerRegistry::kMaxWorkers);
  EXPECT_EQ(registry.List(true).size(), WorkerRegistry::kMaxWorkers);  // lost, still listed
  registry.MarkSilentWorkersLost(t0 + absl::Seconds(11));
  EXPECT_TRUE(registry.List(true).empty());
  EXPECT_TRUE(registry.Register(Request("one-more"), t0 + absl::Seconds(11)).ok());
}

TEST(WorkerRegistry, HeartbeatsKeepAliveAndReviveLost) {
  WorkerRegistry registry(absl::Seconds(3), absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto r = registry.Register(Request("w"), t0);
  v1::Heartbeat beat;
  for (int i = 1; i <= 5; ++i) {
    ASSERT_TRUE(registry.Heartbeat(r->session_token(), beat, t0 + absl::Seconds(2 * i)).ok());
    EXPECT_TRUE(registry.MarkSilentWorkersLost(t0 + absl::Seconds(2 * i + 2)).empty());
  }
  EXPECT_EQ(registry.List(false)[0].heartbeats(), 5u);
  EXPECT_EQ(registry.MarkSilentWorkersLost(t0 + absl::Seconds(14)).size(), 1u);
  EXPECT_TRUE(registry.List(false).empty());
  EXPECT_EQ(registry.List(true).size(), 1u);
  beat.set_job_id("job-000001");
  ASSERT_TRUE(registry.Heartbeat(r->session_token(), beat, t0 + absl::Seconds(15)).ok());
  EXPECT_EQ(registry.List(false)[0].state(), v1::WORKER_STATE_BUSY);
  EXPECT_EQ(registry.total_heartbeats(), 6u);
}

// Jobs wait for registry events instead of polling: every change a job may
// care about reaches the listener, plain heartbeats do not.
TEST(WorkerRegistry, TellsItsListenerAboutChanges) {
  WorkerRegistry registry(absl::Seconds(3), absl::Seconds(1));
  int changes = 0;
  registry.SetListener([&] { ++changes; });
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto r = registry.Register(Request("w"), t0);
  EXPECT_EQ(changes, 1);
  registry.SessionOpened(r->session_token(), t0);
  EXPECT_EQ(changes, 2);
  EXPECT_TRUE(registry.List(false)[0].session_open());
  v1::Heartbeat beat;
  // The first heartbeat: only now may the worker be reserved for a job
  // (JobManager::ReserveIdle), so a job paused for workers must hear of it.
  ASSERT_TRUE(registry.Heartbeat(r->session_token(), beat, t0 + absl::Seconds(1)).ok());
  EXPECT_EQ(changes, 3);
  ASSERT_TRUE(registry.Heartbeat(r->session_token(), beat, t0 + absl::Milliseconds(1500)).ok());
  EXPECT_EQ(changes, 3);  // nothing changed
  beat.set_job_id("job-000001");
  ASSERT_TRUE(registry.Heartbeat(r->session_token(), beat, t0 + absl::Seconds(2)).ok());
  EXPECT_EQ(changes, 4);  // it holds a job now
  registry.SessionEnded(r->session_token(), t0 + absl::Seconds(3));
  EXPECT_EQ(changes, 5);
  EXPECT_FALSE(registry.List(false)[0].session_open());
  EXPECT_EQ(registry.MarkSilentWorkersLost(t0 + absl::Seconds(10)).size(), 1u);
  EXPECT_EQ(changes, 6);
}

// The coordinator itself was stopped: the workers' silence meanwhile is not
// theirs.
TEST(WorkerRegistry, ForgivenSilenceLosesNobody) {
  WorkerRegistry registry(absl::Seconds(3), absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  ASSERT_TRUE(registry.Register(Request("w"), t0).ok());
  registry.ForgiveSilence(t0 + absl::Seconds(30));
  EXPECT_TRUE(registry.MarkSilentWorkersLost(t0 + absl::Seconds(31)).empty());
  EXPECT_EQ(registry.MarkSilentWorkersLost(t0 + absl::Seconds(34)).size(), 1u);
}

TEST(WorkerRegistry, RejectsBadRegistrations) {
  WorkerRegistry registry(absl::Seconds(10), absl::Seconds(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  v1::RegisterRequest r = Request("bad id!");
  EXPECT_THAT(registry.Register(r, t0).status().message(), HasSubstr("worker_id"));
  r = Request("ok");
  r.set_region("");
  EXPECT_THAT(registry.Register(r, t0).status().message(), HasSubstr("region"));
  r = Request("ok");
  r.set_speed(-1);
  EXPECT_THAT(registry.Register(r, t0).status().message(), HasSubstr("speed"));
  r = Request("ok");
  r.set_address("nowhere");
  EXPECT_THAT(registry.Register(r, t0).status().message(), HasSubstr("address"));
  r = Request("ok");
  r.set_metrics_address("host:99999");
  EXPECT_THAT(registry.Register(r, t0).status().message(), HasSubstr("metrics_address"));
  // Region, device and version become label values: bounded.
  r = Request("ok");
  r.set_version(std::string(WorkerRegistry::kMaxFieldBytes + 1, 'v'));
  auto long_version = registry.Register(r, t0);
  EXPECT_EQ(long_version.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(long_version.status().message(), HasSubstr("version: 257 bytes"));
  r = Request("ok");
  r.set_metrics_address("127.0.0.1:9471");
  ASSERT_TRUE(registry.Register(r, t0).ok());
  EXPECT_EQ(registry.List(false)[0].metrics_address(), "127.0.0.1:9471");
  EXPECT_EQ(registry.Heartbeat("forged", v1::Heartbeat(), t0).status().code(),
            absl::StatusCode::kUnauthenticated);
}

// What a WorkerDirectory mirrors: the registration and whether the worker is
// lost, announced on those changes only, never for a heartbeat.
TEST(WorkerRegistry, RecordsChangeOnRegistrationLossAndForgettingOnly) {
  WorkerRegistry registry(absl::Seconds(10), absl::Seconds(2));
  int changes = 0;
  registry.SetRecordListener([&] { ++changes; });
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  auto a = registry.Register(Request("a"), t0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(changes, 1);
  v1::Heartbeat busy;
  busy.set_job_id("job-000001");
  ASSERT_TRUE(registry.Heartbeat(a->session_token(), busy, t0 + absl::Seconds(1)).ok());
  registry.SessionOpened(a->session_token(), t0 + absl::Seconds(1));
  EXPECT_EQ(changes, 1);
  std::vector<v1::WorkerInfo> records = registry.Records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].worker_id(), "a");
  EXPECT_EQ(records[0].region(), "Oregon");
  EXPECT_EQ(records[0].state(), v1::WORKER_STATE_IDLE);
  EXPECT_EQ(records[0].heartbeats(), 0u);
  EXPECT_TRUE(records[0].job_id().empty());
  EXPECT_FALSE(records[0].session_open());
  EXPECT_FALSE(records[0].has_last_heartbeat_time());
  EXPECT_TRUE(records[0].has_registered_time());
  EXPECT_TRUE(WorkerRegistry::CheckRecord(records[0]).ok());

  ASSERT_EQ(registry.MarkSilentWorkersLost(t0 + absl::Seconds(12)).size(), 1u);
  EXPECT_EQ(changes, 2);
  EXPECT_EQ(registry.Records()[0].state(), v1::WORKER_STATE_LOST);
  ASSERT_TRUE(registry.Heartbeat(a->session_token(), {}, t0 + absl::Seconds(13)).ok());
  EXPECT_EQ(changes, 3);  // heard from again
  EXPECT_TRUE(registry.MarkSilentWorkersLost(t0 + absl::Seconds(14)).empty());
  EXPECT_EQ(changes, 3);
  registry.MarkSilentWorkersLost(t0 + absl::Seconds(24));   // lost
  registry.MarkSilentWorkersLost(t0 + absl::Seconds(114));  // forgotten
  EXPECT_EQ(changes, 5);
  EXPECT_TRUE(registry.Records().empty());
}

// A new leader's registry takes the previous one's records: the workers
// await their reconnection (lost, no session), new workers do not get
// their ids, and each takes its own back by registering with it.
TEST(WorkerRegistry, RestoredWorkersKeepTheirIds) {
  WorkerRegistry before(absl::Seconds(10), absl::Seconds(2));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  ASSERT_TRUE(before.Register(Request(""), t0).ok());  // w1
  ASSERT_TRUE(before.Register(Request(""), t0).ok());  // w2
  ASSERT_TRUE(before.Register(Request("gpu"), t0).ok());

  WorkerRegistry after(absl::Seconds(10), absl::Seconds(2));
  int changes = 0;
  after.SetRecordListener([&] { ++changes; });
  const absl::Time t1 = t0 + absl::Seconds(100);
  auto taken = after.Register(Request("gpu", "Tokyo"), t1);  // came back before the load
  ASSERT_TRUE(taken.ok());
  EXPECT_EQ(after.Restore(before.Records(), t1), 2);
  EXPECT_EQ(changes, 2);
  EXPECT_EQ(after.List(/*include_lost=*/false).size(), 1u);
  const std::vector<v1::WorkerInfo> all = after.List(/*include_lost=*/true);
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].region(), "Tokyo");  // gpu: kept as it registered here
  EXPECT_EQ(all[1].worker_id(), "w1");
  EXPECT_EQ(all[1].state(), v1::WORKER_STATE_LOST);
  EXPECT_FALSE(all[1].session_open());
  EXPECT_FALSE(all[1].has_last_heartbeat_time());

  auto fresh = after.Register(Request(""), t1);
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->worker_id(), "w3");
  auto back = after.Register(Request("w2"), t1 + absl::Seconds(1));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->worker_id(), "w2");
  EXPECT_EQ(after.Count(v1::WORKER_STATE_IDLE), 3);
  // Not back within 10 x the silence: forgotten like any lost worker.
  after.MarkSilentWorkersLost(t1 + absl::Seconds(101));
  bool has_w1 = false;
  for (const v1::WorkerInfo& w : after.List(true)) has_w1 |= w.worker_id() == "w1";
  EXPECT_FALSE(has_w1);
}

TEST(WorkerRegistry, RestoreSkipsRecordsThatAreNotFit) {
  WorkerRegistry source(absl::Seconds(10), absl::Seconds(2));
  ASSERT_TRUE(source.Register(Request("ok"), absl::FromUnixSeconds(1000)).ok());
  const v1::WorkerInfo good = source.Records()[0];
  std::vector<v1::WorkerInfo> records;
  v1::WorkerInfo r = good;
  r.set_worker_id("bad id");
  EXPECT_THAT(WorkerRegistry::CheckRecord(r).message(), HasSubstr("worker_id"));
  records.push_back(r);
  r = good;
  r.set_worker_id("r1");
  r.set_device(std::string(WorkerRegistry::kMaxFieldBytes + 1, 'd'));
  EXPECT_THAT(WorkerRegistry::CheckRecord(r).message(), HasSubstr("device: 257 bytes"));
  records.push_back(r);
  r = good;
  r.set_worker_id("r2");
  r.set_address("nowhere");
  EXPECT_THAT(WorkerRegistry::CheckRecord(r).message(), HasSubstr("address"));
  records.push_back(r);
  r = good;
  r.set_worker_id("r3");
  r.set_speed(0);
  EXPECT_THAT(WorkerRegistry::CheckRecord(r).message(), HasSubstr("speed"));
  records.push_back(r);
  r = good;
  r.set_worker_id("r4");
  r.set_state(static_cast<v1::WorkerState>(42));
  EXPECT_THAT(WorkerRegistry::CheckRecord(r).message(), HasSubstr("state"));
  records.push_back(r);
  r = good;
  r.set_worker_id("r5");
  r.set_memory_slots(0);
  EXPECT_THAT(WorkerRegistry::CheckRecord(r).message(), HasSubstr("memory_slots"));
  records.push_back(r);
  records.push_back(good);
  WorkerRegistry after(absl::Seconds(10), absl::Seconds(2));
  EXPECT_EQ(after.Restore(records, absl::FromUnixSeconds(2000)), 1);
  ASSERT_EQ(after.List(true).size(), 1u);
  EXPECT_EQ(after.List(true)[0].worker_id(), "ok");
}

}  // namespace
}  // namespace detour
