// The job store over its backend interface: an in-memory fake with the
// compare-and-swap every backend must do, and the file backend's own.
#include "coordinator/job_backend.h"

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/spec.h"
#include "coordinator/file_job_backend.h"
#include "coordinator/job_store.h"
#include "coordinator/runner_record.h"
#include "common/files.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/e2e/process.h"
#include "tests/coordinator/tiny_spec.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

// Records in memory, shared by every FakeJobBackend made over the same
// Shelf (as two coordinators share one store); `refuse` fails every write.
struct Shelf {
  absl::Mutex mu;
  std::map<std::string, JobRecord> records;
  uint64_t last_number = 0;
  int64_t revision = 0;
  absl::Status refuse = absl::OkStatus();
  bool replicated = false;  // as etcd: RunnerRecord::Hold holds
};

class FakeJobBackend : public JobBackend {
 public:
  explicit FakeJobBackend(std::shared_ptr<Shelf> shelf) : shelf_(std::move(shelf)) {}
  std::string Describe() const override { return "fake"; }
  bool Replicated() const override { return shelf_->replicated; }
  absl::StatusOr<std::vector<JobRecord>> LoadAll() override {
    absl::MutexLock lock(&shelf_->mu);
    std::vector<JobRecord> out;
    for (const auto& [id, record] : shelf_->records) out.push_back(record);
    return out;
  }
  absl::StatusOr<JobRecord> Create(const std::function<v1::Job(uint64_t)>& make) override {
    absl::MutexLock lock(&shelf_->mu);
    if (!shelf_->refuse.ok()) return shelf_->refuse;
    JobRecord record{make(++shelf_->last_number), ++shelf_->revision};
    shelf_->records[record.job.id()] = record;
    return record;
  }
  absl::StatusOr<int64_t> Write(const v1::Job& job, int64_t read_revision) override {
    absl::MutexLock lock(&shelf_->mu);
    if (!shelf_->refuse.ok()) return shelf_->refuse;
    auto it = shelf_->records.find(job.id());
    if (it == shelf_->records.end()) return absl::NotFoundError(job.id());
    if (it->second.revision != read_revision) return absl::AbortedError("changed since read");
    it->second = JobRecord{job, ++shelf_->revision};
    return it->second.revision;
  }

 private:
  std::shared_ptr<Shelf> shelf_;
};

TEST(JobBackend, TwoStoresOnOneBackendNeverOverwriteEachOther) {
  auto shelf = std::make_shared<Shelf>();
  JobStore a(std::make_unique<FakeJobBackend>(shelf));
  JobStore b(std::make_unique<FakeJobBackend>(shelf));
  ASSERT_TRUE(a.Load().ok());
  auto job = a.Create(TinySpec("x"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  ASSERT_EQ(*b.Load(), 1);
  ASSERT_TRUE(a.Update(job->id(), [](v1::Job* j) { j->set_message("by a"); }).ok());
  // b read the record before a's change: its write is refused, a's stays.
  auto lost = b.Update(job->id(), [](v1::Job* j) { j->set_message("by b"); });
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(shelf->records[job->id()].job.message(), "by a");
  // Ids come from the backend: b's new job does not take a's number.
  auto other = b.Create(TinySpec("y"), absl::FromUnixSeconds(1001), "stored");
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->id(), job->id());
  // A store that reloads sees the other's change and can write again.
  JobStore c(std::make_unique<FakeJobBackend>(shelf));
  ASSERT_EQ(*c.Load(), 2);
  EXPECT_EQ(c.Get(job->id())->message(), "by a");
  EXPECT_TRUE(c.Update(job->id(), [](v1::Job* j) { j->set_message("by c"); }).ok());
}

TEST(JobBackend, RefusedWritesShowInMemoryAndTheNextWriteUsesTheStoredRevision) {
  auto shelf = std::make_shared<Shelf>();
  JobStore store(std::make_unique<FakeJobBackend>(shelf));
  auto job = store.Create(TinySpec("x"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  shelf->refuse = absl::UnavailableError("store down");
  auto refused = store.Update(job->id(), [](v1::Job* j) { j->set_state(v1::JOB_STATE_FAILED); });
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store.Get(job->id())->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(shelf->records[job->id()].job.state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(store.Create(TinySpec("y"), absl::FromUnixSeconds(1001), "stored").ok());
  EXPECT_EQ(store.List(v1::JOB_STATE_UNSPECIFIED).size(), 1u);
  shelf->refuse = absl::OkStatus();
  ASSERT_TRUE(store.Update(job->id(), [](v1::Job* j) { j->set_message("back"); }).ok());
  EXPECT_EQ(shelf->records[job->id()].job.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(shelf->records[job->id()].job.message(), "back");
}

// A job whose record cannot be written holds on a replicated store while it
// is out of reach (or the write is fenced), writing the record again until
// it lands or the runner stops; on files it fails at once, as before.
TEST(JobBackend, AJobHoldsWhileAReplicatedStoreIsOut) {
  auto shelf = std::make_shared<Shelf>();
  shelf->replicated = true;
  JobStore store(std::make_unique<FakeJobBackend>(shelf));
  auto job = store.Create(TinySpec("x"), absl::FromUnixSeconds(1000), "stored");
  ASSERT_TRUE(job.ok());
  RunnerRecord record(&store, job->id());
  auto refuse = [&](absl::Status s) {
    absl::MutexLock lock(&shelf->mu);
    shelf->refuse = std::move(s);
  };
  auto stored_message = [&] {
    absl::MutexLock lock(&shelf->mu);
    return shelf->records[job->id()].job.message();
  };
  refuse(absl::UnavailableError("etcd: no quorum"));
  absl::Status failed =
      store.Update(job->id(), [](v1::Job* j) { j->set_message("iteration 3"); }).status();
  ASSERT_EQ(failed.code(), absl::StatusCode::kUnavailable);

  // The store comes back while the job holds: the held change lands.
  int polls = 0;
  absl::Status held = record.Hold(
      failed,
      [&] {
        if (++polls == 3) refuse(absl::OkStatus());
        return false;
      },
      absl::Milliseconds(10));
  EXPECT_TRUE(held.ok()) << held;
  EXPECT_GE(polls, 3);
  EXPECT_EQ(stored_message(), "iteration 3");

  // Fenced (deposed) or out for good: it holds until the runner stops.
  for (absl::Status cause : {absl::FailedPreconditionError("fenced: no longer leads"),
                             absl::DeadlineExceededError("etcd Txn: no member answered")}) {
    refuse(cause);
    failed = store.Update(job->id(), [](v1::Job* j) { j->set_message("later"); }).status();
    polls = 0;
    held = record.Hold(
        failed, [&] { return ++polls > 5; }, absl::Milliseconds(10));
    EXPECT_EQ(held.code(), cause.code()) << held;
    EXPECT_GT(polls, 5);
  }
  EXPECT_EQ(stored_message(), "iteration 3");

  // Other errors are not held.
  polls = 0;
  held = record.Hold(absl::AbortedError("changed since read"), [&] { return ++polls > 0; });
  EXPECT_EQ(held.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(polls, 0);

  // Files: not replicated, the job fails at once.
  shelf->replicated = false;
  held = record.Hold(absl::UnavailableError("disk"), [&] { return ++polls > 0; });
  EXPECT_EQ(held.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(polls, 0);
}

TEST(FileJobBackend, AWriteOnAStaleRevisionIsRefused) {
  const testing::TempDir temp("filebackend");
  const std::string& dir = temp.path();
  FileJobBackend backend(dir, WriteFileAtomically);
  ASSERT_TRUE(backend.LoadAll().ok());
  auto created = backend.Create([](uint64_t n) {
    v1::Job job;
    job.set_id(absl::StrFormat("job-%06d", n));
    return job;
  });
  ASSERT_TRUE(created.ok());
  EXPECT_EQ(created->job.id(), "job-000001");
  v1::Job changed = created->job;
  changed.set_message("first");
  auto first = backend.Write(changed, created->revision);
  ASSERT_TRUE(first.ok());
  EXPECT_GT(*first, created->revision);
  changed.set_message("stale");
  auto stale = backend.Write(changed, created->revision);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(stale.status().message(), HasSubstr("not overwritten"));
  EXPECT_THAT(*ReadFileToString(dir + "/jobs/job-000001.json"), HasSubstr("first"));
  v1::Job unknown;
  unknown.set_id("job-000009");
  EXPECT_EQ(backend.Write(unknown, 1).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace detour
