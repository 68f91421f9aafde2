#include "coordinator/job_store.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/log.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp ToProto(absl::Time t) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(t));
}

}  // namespace

JobStore::JobStore(std::string data_dir) : JobStore(std::move(data_dir), WriteFileAtomically) {}

JobStore::JobStore(std::string data_dir, FileWriter writer)
    : JobStore(std::make_unique<FileJobBackend>(data_dir, std::move(writer))) {}

JobStore::JobStore(std::unique_ptr<JobBackend> backend) : backend_(std::move(backend)) {}

bool JobStore::IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

absl::StatusOr<int> JobStore::Load() {
  absl::MutexLock write(&write_mu_);
  auto records = backend_->LoadAll();
  if (!records.ok()) return records.status();
  absl::MutexLock lock(&mu_);
  for (JobRecord& record : *records) {
    const std::string id = record.job.id();
    jobs_[id] = std::move(record);
  }
  return static_cast<int>(records->size());
}

absl::StatusOr<v1::Job> JobStore::Create(const v1::JobSpec& spec, absl::Time now,
                                         const std::string& message, const std::string& owner) {
  absl::MutexLock write(&write_mu_);
  // Stored before it exists for anyone: a job the backend refused is not run.
  auto record = backend_->Create([&](uint64_t number) {
    v1::Job job;
    job.set_id(absl::StrFormat("job-%06d", number));
    *job.mutable_spec() = spec;
    job.set_state(v1::JOB_STATE_PENDING);
    job.set_message(message);
    job.set_owner(owner);
    *job.mutable_create_time() = ToProto(now);
    job.mutable_progress()->set_total_iterations(spec.iterations());
    return job;
  });
  if (!record.ok()) return record.status();
  {
    absl::MutexLock lock(&mu_);
    jobs_[record->job.id()] = *record;
  }
  Notify(record->job);
  return record->job;
}

absl::StatusOr<v1::Job> JobStore::Get(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) {
    // "7", "job-7" or "job7" for job-000007: the digits name the job.
    std::string hint;
    std::string digits;
    for (char c : id.substr(0, 64)) {
      if (absl::ascii_isdigit(c)) digits.push_back(c);
    }
    uint64_t number = 0;
    if (!digits.empty() && digits.size() <= 9 && absl::SimpleAtoi(digits, &number)) {
      const std::string near = absl::StrFormat("job-%06d", number);
      if (near != id && jobs_.count(near)) hint = absl::StrCat(" (did you mean ", near, "?)");
    }
    return absl::NotFoundError(
        absl::StrCat("no job \"", absl::CHexEscape(id.substr(0, 64)), "\"", hint));
  }
  return it->second.job;
}

std::vector<v1::Job> JobStore::List(v1::JobState state) const {
  std::vector<v1::Job> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, record] : jobs_) {
      const v1::Job& job = record.job;
      if (state == v1::JOB_STATE_UNSPECIFIED || job.state() == state) out.push_back(job);
    }
  }
  // Ids are zero-padded sequence numbers: reverse order is newest first.
  std::reverse(out.begin(), out.end());
  return out;
}

JobStore::Page JobStore::ListPage(v1::JobState state, const std::string& after_id, size_t max_jobs,
                                  size_t max_bytes, const std::string& owner) const {
  Page page;
  size_t bytes = 0;
  absl::MutexLock lock(&mu_);
  // Ids are zero-padded sequence numbers: walking the map backwards from
  // the first id not below `after_id` gives the older jobs, newest first.
  auto it = after_id.empty() ? jobs_.end() : jobs_.lower_bound(after_id);
  while (it != jobs_.begin()) {
    --it;
    const v1::Job& job = it->second.job;
    if (state != v1::JOB_STATE_UNSPECIFIED && job.state() != state) continue;
    if (!owner.empty() && job.owner() != owner) continue;
    if (page.jobs.size() >= std::max<size_t>(1, max_jobs)) {
      page.more = true;
      break;
    }
    // A repeated message field costs its size plus a tag and a length.
    const size_t cost = job.ByteSizeLong() + 8;
    if (!page.jobs.empty() && bytes + cost > max_bytes) {
      page.more = true;
      break;
    }
    bytes += cost;
    page.jobs.push_back(job);
  }
  return page;
}

absl::StatusOr<v1::Job> JobStore::Update(const std::string& id,
                                         const std::function<void(v1::Job*)>& mutate) {
  // Writers take turns on the backend; readers (Get, List) never wait for it.
  absl::MutexLock write(&write_mu_);
  v1::Job updated;
  int64_t read_revision = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job \"", id, "\""));
    updated = it->second.job;
    read_revision = it->second.revision;
  }
  mutate(&updated);
  // An ended job has nothing left to wait for: no ETA, whichever path ended it.
  if (IsFinal(updated.state())) updated.mutable_progress()->clear_eta_s();
  absl::StatusOr<int64_t> written = backend_->Write(updated, read_revision);
  {
    // Applied even when the backend refused it: the API must show what is
    // true now (e.g. the job failing because its record cannot be written).
    // The revision stays the one last stored.
    absl::MutexLock lock(&mu_);
    JobRecord& record = jobs_[id];
    record.job = updated;
    if (written.ok()) record.revision = *written;
  }
  Notify(updated);
  if (!written.ok()) {
    LogError("job ", id, ": cannot write its record (", written.status().message(),
             "); the change is kept in memory only");
    return written.status();
  }
  return updated;
}

absl::StatusOr<v1::Job> JobStore::Cancel(const std::string& id, absl::Time now,
                                         const std::string& message) {
  {
    auto current = Get(id);
    if (!current.ok()) return current.status();
    if (IsFinal(current->state())) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", id, " already ended (", v1::JobState_Name(current->state()), ")"));
    }
  }
  bool already_final = false;
  auto job = Update(id, [&](v1::Job* job) {
    if (IsFinal(job->state())) {  // ended between the check and the update
      already_final = true;
      return;
    }
    job->set_state(v1::JOB_STATE_CANCELLED);
    job->set_message(message);
    *job->mutable_end_time() = ToProto(now);
  });
  if (job.ok() && already_final) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " already ended"));
  }
  return job;
}

absl::StatusOr<v1::Job> JobStore::AddEvent(const std::string& id,
                                           const v1::JobHistoryEvent& event) {
  return Update(id, [&](v1::Job* job) { AppendEvent(job, event); });
}

void JobStore::AppendEvent(v1::Job* job, const v1::JobHistoryEvent& event) {
  *job->add_history() = event;
  if (job->history_size() > kMaxHistory) {
    job->mutable_history()->DeleteSubrange(0, job->history_size() - kMaxHistory);
  }
}

uint64_t JobStore::AddListener(const std::string& id, Listener listener) {
  absl::MutexLock lock(&listeners_mu_);
  const uint64_t handle = next_listener_++;
  listeners_[handle] = ListenerEntry{id, std::move(listener)};
  return handle;
}

absl::StatusOr<uint64_t> JobStore::Follow(const std::string& id, Listener listener) {
  // Every change notifies under write_mu_, so holding it orders this
  // snapshot before or after each change, and its call before theirs.
  absl::MutexLock write(&write_mu_);
  auto job = Get(id);
  if (!job.ok()) return job.status();
  absl::MutexLock lock(&listeners_mu_);
  listener(*job);
  const uint64_t handle = next_listener_++;
  listeners_[handle] = ListenerEntry{id, std::move(listener)};
  return handle;
}

void JobStore::RemoveListener(uint64_t handle) {
  absl::MutexLock lock(&listeners_mu_);
  listeners_.erase(handle);
}

void JobStore::Notify(const v1::Job& job) {
  // Listeners are called under listeners_mu_ so RemoveListener guarantees no
  // call is in progress once it returns; listeners must not call back into
  // AddListener/RemoveListener.
  absl::MutexLock lock(&listeners_mu_);
  for (auto& [handle, entry] : listeners_) {
    if (entry.job_id.empty() || entry.job_id == job.id()) entry.fn(job);
  }
}

std::map<v1::JobState, int> JobStore::CountByState() const {
  std::map<v1::JobState, int> counts;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, record] : jobs_) ++counts[record.job.state()];
  return counts;
}

}  // namespace detour
