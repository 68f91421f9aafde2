#include "coordinator/job_store.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/match.h"
#include "common/files.h"
#include "common/log.h"
#include "common/spec.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

namespace fs = std::filesystem;
using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp ToProto(absl::Time t) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(t));
}

}  // namespace

JobStore::JobStore(std::string data_dir) : JobStore(std::move(data_dir), WriteFileAtomically) {}

JobStore::JobStore(std::string data_dir, FileWriter writer)
    : dir_((fs::path(data_dir) / "jobs").string()), writer_(std::move(writer)) {}

bool JobStore::IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

namespace {

// Renames `path` to the first free `<path>.corrupt[.N]`; returns the name
// (or `path` when the rename fails: then it stays where it is).
std::string KeepAside(const std::string& path) {
  std::error_code ec;
  for (int n = 0; n < 1000; ++n) {
    const std::string aside = n == 0 ? path + ".corrupt" : absl::StrCat(path, ".corrupt.", n);
    if (fs::exists(aside, ec)) continue;
    fs::rename(path, aside, ec);
    return ec ? path : aside;
  }
  return path;
}

}  // namespace

absl::StatusOr<int> JobStore::Load() {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create job directory ", dir_, ": ", ec.message()));
  }
  int loaded = 0;
  absl::MutexLock lock(&mu_);
  for (const auto& file : fs::directory_iterator(dir_, ec)) {
    const std::string path = file.path().string();
    if (file.path().extension() != ".json") continue;
    // Numbering continues after every file, readable or not, so a new job
    // never takes the name of one kept aside.
    const std::string stem = file.path().stem().string();
    uint64_t number = 0;
    if (absl::StartsWith(stem, "job-") && absl::SimpleAtoi(stem.substr(4), &number)) {
      next_number_ = std::max(next_number_, number + 1);
    }
    auto text = ReadFileToString(path);
    v1::Job job;
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;  // written by a newer version
    std::string problem;
    if (!text.ok()) {
      problem = std::string(text.status().message());
    } else if (auto status = google::protobuf::util::JsonStringToMessage(*text, &job, options);
               !status.ok()) {
      problem = std::string(status.message());
    } else if (job.id() != stem) {
      problem = absl::StrCat("it holds job id \"", job.id(), "\", not ", stem);
    }
    if (!problem.empty()) {
      // Kept aside, never overwritten, never silently hiding another job.
      const std::string aside = KeepAside(path);
      LogWarning("job file ", path, " is unreadable (", problem, "); kept as ", aside);
      continue;
    }
    jobs_[job.id()] = std::move(job);
    ++loaded;
  }
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot list ", dir_, ": ", ec.message()));
  }
  return loaded;
}

absl::Status JobStore::Persist(const v1::Job& job) const {
  return writer_((fs::path(dir_) / (job.id() + ".json")).string(), ToJson(job));
}

absl::StatusOr<v1::Job> JobStore::Create(const v1::JobSpec& spec, absl::Time now,
                                         const std::string& message) {
  absl::MutexLock write(&write_mu_);
  v1::Job job;
  {
    absl::MutexLock lock(&mu_);
    job.set_id(absl::StrFormat("job-%06d", next_number_));
  }
  *job.mutable_spec() = spec;
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_message(message);
  *job.mutable_create_time() = ToProto(now);
  job.mutable_progress()->set_total_iterations(spec.iterations());
  // Stored before it exists for anyone: a job the disk refused is not run.
  if (absl::Status persisted = Persist(job); !persisted.ok()) return persisted;
  {
    absl::MutexLock lock(&mu_);
    ++next_number_;
    jobs_[job.id()] = job;
  }
  Notify(job);
  return job;
}

absl::StatusOr<v1::Job> JobStore::Get(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job \"", id, "\""));
  return it->second;
}

std::vector<v1::Job> JobStore::List(v1::JobState state) const {
  std::vector<v1::Job> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) {
      if (state == v1::JOB_STATE_UNSPECIFIED || job.state() == state) out.push_back(job);
    }
  }
  // Ids are zero-padded sequence numbers: reverse order is newest first.
  std::reverse(out.begin(), out.end());
  return out;
}

JobStore::Page JobStore::ListPage(v1::JobState state, const std::string& after_id, size_t max_jobs,
                                  size_t max_bytes) const {
  Page page;
  size_t bytes = 0;
  absl::MutexLock lock(&mu_);
  // Ids are zero-padded sequence numbers: walking the map backwards from
  // the first id not below `after_id` gives the older jobs, newest first.
  auto it = after_id.empty() ? jobs_.end() : jobs_.lower_bound(after_id);
  while (it != jobs_.begin()) {
    --it;
    const v1::Job& job = it->second;
    if (state != v1::JOB_STATE_UNSPECIFIED && job.state() != state) continue;
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
  // Writers take turns on the disk; readers (Get, List) never wait for it.
  absl::MutexLock write(&write_mu_);
  v1::Job updated;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job \"", id, "\""));
    updated = it->second;
  }
  mutate(&updated);
  // An ended job has nothing left to wait for: no ETA, whichever path ended it.
  if (IsFinal(updated.state())) updated.mutable_progress()->clear_eta_s();
  absl::Status persisted = Persist(updated);
  {
    // Applied even when the disk refused it: the API must show what is true
    // now (e.g. the job failing because its record cannot be written).
    absl::MutexLock lock(&mu_);
    jobs_[id] = updated;
  }
  Notify(updated);
  if (!persisted.ok()) {
    LogError("job ", id, ": cannot write its record (", persisted.message(),
             "); the change is kept in memory only");
    return persisted;
  }
  return updated;
}

absl::StatusOr<v1::Job> JobStore::Cancel(const std::string& id, absl::Time now) {
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
    job->set_message("cancelled by request");
    *job->mutable_end_time() = ToProto(now);
  });
  if (job.ok() && already_final) {
    return absl::FailedPreconditionError(absl::StrCat("job ", id, " already ended"));
  }
  return job;
}

uint64_t JobStore::AddListener(const std::string& id, Listener listener) {
  absl::MutexLock lock(&listeners_mu_);
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
  for (const auto& [id, job] : jobs_) ++counts[job.state()];
  return counts;
}

}  // namespace detour
