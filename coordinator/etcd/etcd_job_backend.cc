#include "coordinator/etcd/etcd_job_backend.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"

namespace detour {
namespace {

// Records per page of LoadAll at first; a page whose answer is too large for
// the client's receive limit is asked again in smaller pages.
constexpr int64_t kFirstPageKeys = 256;
// Tries of Create when other coordinators take numbers at the same time.
constexpr int kCreateTries = 16;

bool OutcomeUnknown(const absl::Status& status) {
  return status.code() == absl::StatusCode::kDeadlineExceeded ||
         status.code() == absl::StatusCode::kUnavailable;
}

}  // namespace

absl::Status EtcdJobBackend::CheckPrefix(const std::string& prefix) {
  if (prefix.size() < 2 || prefix.front() != '/' || prefix.back() != '/' || prefix.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--store_prefix: \"", prefix, "\" must start and end with '/' (at most 256 bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<EtcdJobBackend>> EtcdJobBackend::Create(
    std::unique_ptr<EtcdClient> client, std::string prefix) {
  if (client == nullptr) return absl::InvalidArgumentError("etcd job store: no client");
  RETURN_IF_ERROR(CheckPrefix(prefix));
  return std::unique_ptr<EtcdJobBackend>(new EtcdJobBackend(std::move(client), std::move(prefix)));
}

EtcdJobBackend::EtcdJobBackend(std::unique_ptr<EtcdClient> client, std::string prefix)
    : client_(std::move(client)), prefix_(std::move(prefix)) {}

std::string EtcdJobBackend::Describe() const {
  return absl::StrCat(client_->Describe(), " under ", prefix_);
}

std::string EtcdJobBackend::JobKey(const std::string& id) const {
  return absl::StrCat(prefix_, "jobs/", id);
}

absl::StatusOr<EtcdClient::RangeResult> EtcdJobBackend::LoadPage(const std::string& from,
                                                                 int64_t revision) {
  const std::string end = EtcdPrefixEnd(prefix_ + "jobs/");
  int64_t limit = kFirstPageKeys;
  while (true) {
    auto page = client_->Range(from, end, limit, revision);
    if (page.ok() || page.status().code() != absl::StatusCode::kResourceExhausted || limit == 1) {
      return page;
    }
    limit = std::max<int64_t>(1, limit / 4);
  }
}

absl::StatusOr<std::vector<JobRecord>> EtcdJobBackend::LoadAll() {
  std::vector<JobRecord> records;
  const std::string dir = prefix_ + "jobs/";
  std::string from = dir;
  int64_t revision = 0;  // the first page's, for every later one
  while (true) {
    auto page = LoadPage(from, revision);
    if (!page.ok()) return Annotate(page.status(), absl::StrCat("loading jobs from ", Describe()));
    if (revision == 0) revision = page->revision;
    for (EtcdKeyValue& kv : page->kvs) {
      const std::string id = kv.key.substr(std::min(kv.key.size(), dir.size()));
      v1::Job job;
      google::protobuf::util::JsonParseOptions options;
      options.ignore_unknown_fields = true;  // written by a newer version
      std::string problem;
      if (auto parsed = google::protobuf::util::JsonStringToMessage(kv.value, &job, options);
          !parsed.ok()) {
        problem = std::string(parsed.message());
      } else if (job.id() != id) {
        problem = absl::StrCat("it holds job id \"", job.id(), "\", not ", id);
      }
      if (!problem.empty()) {
        LogWarning("job record ", kv.key, " in etcd is unreadable (", problem,
                   "); left where it is, its job not loaded");
        continue;
      }
      if (records.size() >= kMaxJobs) {
        return absl::ResourceExhaustedError(
            absl::StrCat("more than ", kMaxJobs, " jobs under ", dir, " in ", client_->Describe()));
      }
      records.push_back(JobRecord{std::move(job), kv.mod_revision});
    }
    if (!page->more || page->kvs.empty()) break;
    from = page->kvs.back().key + std::string(1, '\0');
  }
  return records;
}

absl::StatusOr<JobRecord> EtcdJobBackend::Create(
    const std::function<v1::Job(uint64_t number)>& make) {
  const std::string counter_key = CounterKey();
  uint64_t taken_floor = 0;  // a job with this number exists though the counter is below it
  for (int attempt = 0; attempt < kCreateTries; ++attempt) {
    ASSIGN_OR_RETURN(std::optional<EtcdKeyValue> counter, client_->Get(counter_key));
    uint64_t last = 0;
    if (counter.has_value() && !absl::SimpleAtoi(counter->value, &last)) {
      return absl::DataLossError(absl::StrCat("etcd key ", counter_key, " holds \"",
                                              counter->value.substr(0, 40), "\", not a number"));
    }
    const uint64_t number = std::max(last, taken_floor) + 1;
    JobRecord record{make(number), 0};
    const std::string key = JobKey(record.job.id());
    const std::string value = ToJson(record.job);
    etcdserverpb::TxnRequest txn;
    *txn.add_compare() = counter.has_value() ? EtcdModRevisionIs(counter_key, counter->mod_revision)
                                             : EtcdCreateRevisionIs(counter_key, 0);
    *txn.add_compare() = EtcdCreateRevisionIs(key, 0);
    *txn.add_success() = EtcdPutOp(counter_key, absl::StrCat(number));
    *txn.add_success() = EtcdPutOp(key, value);
    *txn.add_failure() = EtcdGetOp(key);
    const int64_t term = AddFence(&txn);
    auto response = client_->Txn(txn);
    if (!response.ok()) {
      return Annotate(response.status(), absl::StrCat("storing new job ", record.job.id()));
    }
    if (response->succeeded()) {
      record.revision = response->header().revision();
      return record;
    }
    RETURN_IF_ERROR(CheckFence(*response, term, absl::StrCat("new job ", record.job.id())));
    // Another coordinator took the number first, or a job already has it,
    // or the job is ours: an attempt of this call that timed out landed.
    const auto& found = response->responses(0).response_range();
    if (found.kvs_size() > 0 && found.kvs(0).value() == value) {
      record.revision = found.kvs(0).mod_revision();
      return record;
    }
    if (found.kvs_size() > 0) taken_floor = number;
  }
  return absl::AbortedError(absl::StrCat("no free job number after ", kCreateTries,
                                         " tries: others are taking them (", counter_key, ")"));
}

absl::StatusOr<int64_t> EtcdJobBackend::TryWrite(const std::string& key, const std::string& value,
                                                 int64_t read_revision,
                                                 etcdserverpb::TxnResponse* response) {
  etcdserverpb::TxnRequest txn;
  *txn.add_compare() = EtcdModRevisionIs(key, read_revision);
  *txn.add_success() = EtcdPutOp(key, value);
  *txn.add_failure() = EtcdGetOp(key);
  const int64_t term = AddFence(&txn);
  ASSIGN_OR_RETURN(*response, client_->Txn(txn));
  if (response->succeeded()) return response->header().revision();
  RETURN_IF_ERROR(CheckFence(*response, term, key));
  return 0;
}

void EtcdJobBackend::FenceWrites(int64_t term) {
  absl::MutexLock lock(&mu_);
  fence_term_ = std::max<int64_t>(0, term);
}

int64_t EtcdJobBackend::AddFence(etcdserverpb::TxnRequest* txn) {
  int64_t term = 0;
  {
    absl::MutexLock lock(&mu_);
    term = fence_term_;
  }
  if (term == 0) return 0;
  const std::string leader = LeaderKey();
  *txn->add_compare() = EtcdCreateRevisionIs(leader, term);
  *txn->add_failure() = EtcdGetOp(leader);
  return term;
}

absl::Status EtcdJobBackend::CheckFence(const etcdserverpb::TxnResponse& failed, int64_t term,
                                        absl::string_view what) const {
  if (term == 0) return absl::OkStatus();
  if (failed.responses_size() == 0) {
    return absl::InternalError(
        absl::StrCat("etcd answered a failed transaction on ", what, " without its reads"));
  }
  const auto& leader = failed.responses(failed.responses_size() - 1).response_range();
  const int64_t now = leader.kvs_size() > 0 ? leader.kvs(0).create_revision() : 0;
  if (now == term) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "fenced: ", what, " not written, this coordinator no longer leads (", LeaderKey(),
      now == 0 ? " is gone" : absl::StrCat(" now holds term ", now), ", ours was ", term, ")"));
}

absl::StatusOr<int64_t> EtcdJobBackend::Write(const v1::Job& job, int64_t read_revision) {
  const std::string key = JobKey(job.id());
  const std::string value = ToJson(job);
  etcdserverpb::TxnResponse response;
  auto written = TryWrite(key, value, read_revision, &response);
  if (!written.ok()) {
    if (OutcomeUnknown(written.status())) {
      absl::MutexLock lock(&mu_);
      unknown_writes_[job.id()] = value;
    }
    return Annotate(written.status(), absl::StrCat("job ", job.id(), ": writing its record"));
  }
  if (response.succeeded()) {
    absl::MutexLock lock(&mu_);
    unknown_writes_.erase(job.id());
    return *written;
  }
  return ResolveConflict(job, value, response);
}

absl::StatusOr<int64_t> EtcdJobBackend::ResolveConflict(const v1::Job& job,
                                                        const std::string& value,
                                                        const etcdserverpb::TxnResponse& failed) {
  const std::string key = JobKey(job.id());
  const auto& found = failed.responses(0).response_range();
  if (found.kvs_size() == 0) {
    return absl::NotFoundError(
        absl::StrCat("job ", job.id(), ": its record ", key, " is gone from etcd; not written"));
  }
  const etcdserverpb::KeyValue& stored = found.kvs(0);
  if (stored.value() == value) {
    // This very write landed from an attempt that timed out.
    absl::MutexLock lock(&mu_);
    unknown_writes_.erase(job.id());
    return stored.mod_revision();
  }
  bool ours = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = unknown_writes_.find(job.id());
    ours = it != unknown_writes_.end() && it->second == stored.value();
    if (ours) unknown_writes_.erase(it);
  }
  if (ours) {
    // Our last write landed after its call gave up: it is the revision read.
    etcdserverpb::TxnResponse again;
    ASSIGN_OR_RETURN(int64_t revision, TryWrite(key, value, stored.mod_revision(), &again));
    if (again.succeeded()) return revision;
  }
  return absl::AbortedError(absl::StrCat("job ", job.id(), ": its record ", key,
                                         " in etcd was changed by another writer (now at "
                                         "revision ",
                                         stored.mod_revision(),
                                         "; ours was read at an older one); not overwritten"));
}

}  // namespace detour
