#include "coordinator/job_store.h"

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/files.h"
#include "common/spec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/coordinator/tiny_spec.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

TEST(JobStore, CreateListGetCancelAndPersist) {
  const testing::TempDir temp("jobstore");
  const std::string& dir = temp.path();
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  {
    JobStore store(dir);
    ASSERT_EQ(*store.Load(), 0);
    auto a = store.Create(TinySpec("a"), t0, "stored");
    auto b = store.Create(TinySpec("b"), t0, "stored");
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->id(), "job-000001");
    EXPECT_EQ(b->id(), "job-000002");
    EXPECT_EQ(a->progress().total_iterations(), 10u);
    auto listed = store.List(v1::JOB_STATE_UNSPECIFIED);
    ASSERT_EQ(listed.size(), 2u);
    EXPECT_EQ(listed[0].id(), "job-000002");  // newest first
    auto cancelled = store.Cancel("job-000001", t0 + absl::Seconds(5));
    ASSERT_TRUE(cancelled.ok());
    EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
    EXPECT_EQ(store.Cancel("job-000001", t0).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(store.Cancel("job-9", t0).status().code(), absl::StatusCode::kNotFound);
    // An id that names a job by its number gets the job's id as a hint.
    for (const char* near : {"2", "job-2", "job2", "jb-000002"}) {
      EXPECT_EQ(store.Get(near).status().message(),
                absl::StrCat("no job \"", near, "\" (did you mean job-000002?)"));
    }
    EXPECT_EQ(store.Get("job-000003").status().message(), "no job \"job-000003\"");
    EXPECT_EQ(store.Get(std::string(100, '7')).status().message(),
              absl::StrCat("no job \"", std::string(64, '7'), "\""));
    EXPECT_EQ(store.List(v1::JOB_STATE_PENDING).size(), 1u);
  }
  // A new store over the same directory sees the same jobs and continues
  // numbering after them; a corrupt file is kept aside, not deleted.
  std::ofstream(dir + "/jobs/garbage.json") << "{not json";
  JobStore reopened(dir);
  ASSERT_EQ(*reopened.Load(), 2);
  EXPECT_EQ(reopened.Get("job-000001")->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(reopened.Get("job-000002")->spec().name(), "b");
  EXPECT_EQ(reopened.Create(TinySpec("c"), t0, "stored")->id(), "job-000003");
  EXPECT_TRUE(std::filesystem::exists(dir + "/jobs/garbage.json.corrupt"));
}

// A job file that cannot be read, or holds another job's id, is kept aside
// under a new name (never deleted, never overwritten by the next Submit, never
// hiding the real job), and numbering continues after it.
// An ended job shows no ETA, however it ended (a failed job kept
// its last "eta 120s").
TEST(JobStore, AnEndedJobHasNoEta) {
  const testing::TempDir temp("jobstore");
  const std::string& dir = temp.path();
  JobStore store(dir);
  ASSERT_EQ(*store.Load(), 0);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (const char* name : {"fails", "cancelled"}) {
    auto job = store.Create(TinySpec(name), t0, "stored");
    ASSERT_TRUE(job.ok());
    auto running = store.Update(job->id(), [](v1::Job* j) {
      j->set_state(v1::JOB_STATE_RUNNING);
      j->mutable_progress()->set_eta_s(120);
    });
    ASSERT_TRUE(running.ok());
    EXPECT_EQ(running->progress().eta_s(), 120);
    absl::StatusOr<v1::Job> ended =
        std::string(name) == "fails"
            ? store.Update(job->id(), [](v1::Job* j) { j->set_state(v1::JOB_STATE_FAILED); })
            : store.Cancel(job->id(), t0);
    ASSERT_TRUE(ended.ok()) << ended.status();
    EXPECT_EQ(ended->progress().eta_s(), 0) << name;
    EXPECT_EQ(store.Get(job->id())->progress().eta_s(), 0) << name;
  }
}

TEST(JobStore, UnreadableFilesAreKeptAsideAndNeverReused) {
  const testing::TempDir temp("jobstore");
  const std::string& dir = temp.path();
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  {
    JobStore store(dir);
    ASSERT_TRUE(store.Load().ok());
    ASSERT_TRUE(store.Create(TinySpec("a"), t0, "stored").ok());
    ASSERT_TRUE(store.Create(TinySpec("b"), t0, "stored").ok());
  }
  const std::string corrupt = "{\"id\": \"job-000002\", \"spec\": {trunc";
  std::ofstream(dir + "/jobs/job-000002.json", std::ios::trunc) << corrupt;
  std::filesystem::copy_file(dir + "/jobs/job-000001.json", dir + "/jobs/job-000007.json");
  JobStore reopened(dir);
  ASSERT_EQ(*reopened.Load(), 1);
  EXPECT_TRUE(reopened.Get("job-000001").ok());
  EXPECT_FALSE(reopened.Get("job-000002").ok());
  auto next = reopened.Create(TinySpec("c"), t0, "stored");
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->id(), "job-000008");
  std::ifstream aside(dir + "/jobs/job-000002.json.corrupt");
  std::stringstream kept;
  kept << aside.rdbuf();
  EXPECT_EQ(kept.str(), corrupt);
  EXPECT_TRUE(std::filesystem::exists(dir + "/jobs/job-000007.json.corrupt"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/jobs/job-000002.json"));
}

// Regression: with the data dir full the job trained on while the API showed
// RUNNING for ever and nothing was logged. A write the disk refuses is an
// error the caller sees, and the change still shows (in memory).
TEST(JobStore, RefusedWritesAreErrorsButStillShow) {
  const testing::TempDir temp("jobstore");
  const std::string& dir = temp.path();
  JobStore store(dir);
  ASSERT_TRUE(store.Load().ok());
  auto job = store.Create(TinySpec("a"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  // The jobs directory becomes a file: every write fails (even for root).
  std::filesystem::rename(dir + "/jobs", dir + "/jobs.moved");
  std::ofstream(dir + "/jobs") << "not a directory";
  auto updated = store.Update(job->id(), [](v1::Job* j) {
    j->set_state(v1::JOB_STATE_FAILED);
    j->set_message("cannot write the job record");
  });
  EXPECT_FALSE(updated.ok());
  EXPECT_EQ(store.Get(job->id())->state(), v1::JOB_STATE_FAILED);
  EXPECT_FALSE(store.Create(TinySpec("b"), absl::FromUnixSeconds(1001), "stored").ok());
  EXPECT_EQ(store.List(v1::JOB_STATE_UNSPECIFIED).size(), 1u);
}

TEST(JobStore, ListenersSeeChangesOfTheirJobOnly) {
  const testing::TempDir temp("jobstore");
  JobStore store(temp.path());
  ASSERT_TRUE(store.Load().ok());
  auto a = store.Create(TinySpec("a"), absl::Now(), "stored");
  auto b = store.Create(TinySpec("b"), absl::Now(), "stored");
  std::vector<v1::JobState> seen;
  const uint64_t handle =
      store.AddListener(a->id(), [&](const v1::Job& job) { seen.push_back(job.state()); });
  ASSERT_TRUE(store.Cancel(b->id(), absl::Now()).ok());
  EXPECT_TRUE(seen.empty());
  ASSERT_TRUE(store.Cancel(a->id(), absl::Now()).ok());
  EXPECT_EQ(seen, std::vector<v1::JobState>{v1::JOB_STATE_CANCELLED});
  store.RemoveListener(handle);
  ASSERT_TRUE(store.Update(a->id(), [](v1::Job* j) { j->set_message("x"); }).ok());
  EXPECT_EQ(seen.size(), 1u);
}

// Follow hands a follower the job as it is, then every change in order.
// A change made while the first call runs waits for it: the follower here
// holds its first call until the change is made (or half a second passed,
// which is what a change that waits costs) and only then records it. A
// snapshot handed over apart from the subscription was overtaken by such a
// change, and a watching client saw its events taken back and shown again.
TEST(JobStore, FollowersSeeTheJobThenEveryChangeInOrder) {
  const testing::TempDir temp("jobstore");
  JobStore store(temp.path());
  ASSERT_TRUE(store.Load().ok());
  auto job = store.Create(TinySpec("a"), absl::Now(), "stored");
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(store.Follow("job-999999", [](const v1::Job&) {}).status().code(),
            absl::StatusCode::kNotFound);
  v1::JobHistoryEvent e;
  e.set_kind(v1::JobHistoryEvent::KIND_CLIENT_ACTION);
  e.set_message("first");
  ASSERT_TRUE(store.AddEvent(job->id(), e).ok());

  absl::Mutex mu;
  std::vector<int> sizes;
  std::atomic<int> calls{0};
  absl::Notification first_call, changed;
  std::thread writer([&] {
    first_call.WaitForNotification();
    e.set_message("second");
    EXPECT_TRUE(store.AddEvent(job->id(), e).ok());
    changed.Notify();
  });
  auto handle = store.Follow(job->id(), [&](const v1::Job& j) {
    if (calls.fetch_add(1) == 0) {
      first_call.Notify();
      changed.WaitForNotificationWithTimeout(absl::Milliseconds(500));
    }
    absl::MutexLock lock(&mu);
    sizes.push_back(j.history_size());
  });
  writer.join();
  ASSERT_TRUE(handle.ok()) << handle.status();
  store.RemoveListener(*handle);
  absl::MutexLock lock(&mu);
  EXPECT_EQ(sizes, (std::vector<int>{1, 2}));
}

TEST(JobStore, UnwritableDirectoryIsAnError) {
  JobStore store("/proc/detour-cannot-exist");
  EXPECT_EQ(store.Load().status().code(), absl::StatusCode::kFailedPrecondition);
}

// Readers never wait for the disk (JobStore::Update wrote the
// record under the lock Get and List take, so one slow fsync stalled every
// API call). A writer that blocks until told holds an Update on the disk;
// meanwhile Get, List, ListPage and CountByState answer, showing the state
// before the update. Nothing here is timed: a reader that waited would hang
// until the generous deadline and fail the test.
TEST(JobStore, ReadersDoNotWaitForASlowDisk) {
  const testing::TempDir temp("jobstore_slow");
  const std::string& dir = temp.path();
  absl::Notification writing, release;
  std::atomic<bool> block{false};
  JobStore store(dir, [&](const std::string& path, const std::string& content) {
    if (block.load()) {
      writing.Notify();
      release.WaitForNotification();
    }
    return WriteFileAtomically(path, content);
  });
  ASSERT_TRUE(store.Load().ok());
  ASSERT_TRUE(store.Create(TinySpec("a"), absl::Now(), "stored").ok());
  ASSERT_TRUE(store.Create(TinySpec("b"), absl::Now(), "stored").ok());
  block = true;
  std::thread updater([&] {
    EXPECT_TRUE(store.Update("job-000001", [](v1::Job* job) { job->set_message("updated"); }).ok());
  });
  ASSERT_TRUE(writing.WaitForNotificationWithTimeout(absl::Seconds(60)));
  absl::Notification read;
  std::thread reader([&] {
    auto job = store.Get("job-000001");
    EXPECT_TRUE(job.ok());
    if (job.ok()) {
      EXPECT_EQ(job->message(), "stored");  // not yet changed
    }
    EXPECT_EQ(store.List(v1::JOB_STATE_UNSPECIFIED).size(), 2u);
    EXPECT_EQ(store.ListPage(v1::JOB_STATE_UNSPECIFIED, "", 10, 1 << 20).jobs.size(), 2u);
    EXPECT_EQ(store.CountByState()[v1::JOB_STATE_PENDING], 2);
    read.Notify();
  });
  const bool answered = read.WaitForNotificationWithTimeout(absl::Seconds(60));
  EXPECT_TRUE(answered) << "a reader waited for the blocked disk write";
  release.Notify();
  updater.join();
  reader.join();
  EXPECT_EQ(store.Get("job-000001")->message(), "updated");
}

}  // namespace
}  // namespace detour
