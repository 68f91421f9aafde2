#include "coordinator/etcd/etcd_worker_directory.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "coordinator/etcd/etcd_job_backend.h"
#include "google/protobuf/util/json_util.h"

namespace detour {
namespace {

// Records per page of Load.
constexpr int64_t kPageKeys = 500;
// How soon a failed write or lease grant is tried again.
constexpr absl::Duration kRetry = absl::Seconds(1);

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdWorkerDirectory>> EtcdWorkerDirectory::Create(
    std::unique_ptr<EtcdClient> client, std::string prefix, absl::Duration ttl,
    std::function<std::vector<v1::WorkerInfo>()> records, Meter meter) {
  if (client == nullptr) return absl::InvalidArgumentError("etcd worker directory: no client");
  if (!records) return absl::InvalidArgumentError("etcd worker directory: no records to mirror");
  RETURN_IF_ERROR(EtcdJobBackend::CheckPrefix(prefix));
  if (ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError(absl::StrCat("etcd worker directory: the lease's TTL ",
                                                   absl::FormatDuration(ttl), " is under 1 s"));
  }
  return std::unique_ptr<EtcdWorkerDirectory>(new EtcdWorkerDirectory(
      std::move(client), std::move(prefix), ttl, std::move(records), std::move(meter)));
}

EtcdWorkerDirectory::EtcdWorkerDirectory(std::unique_ptr<EtcdClient> client, std::string prefix,
                                         absl::Duration ttl,
                                         std::function<std::vector<v1::WorkerInfo>()> records,
                                         Meter meter)
    : client_(std::move(client)),
      prefix_(std::move(prefix)),
      ttl_(ttl),
      records_(std::move(records)),
      meter_(std::move(meter)),
      thread_([this] { Loop(); }) {}

EtcdWorkerDirectory::~EtcdWorkerDirectory() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::string EtcdWorkerDirectory::Describe() const {
  return absl::StrCat(client_->Describe(), " under ", prefix_, "workers/");
}

std::string EtcdWorkerDirectory::WorkerKey(const std::string& id) const {
  return absl::StrCat(prefix_, "workers/", id);
}

absl::StatusOr<std::vector<v1::WorkerInfo>> EtcdWorkerDirectory::Load() {
  const std::string dir = prefix_ + "workers/";
  const std::string end = EtcdPrefixEnd(dir);
  std::vector<v1::WorkerInfo> out;
  std::string from = dir;
  int64_t revision = 0;  // the first page's, for every later one
  size_t seen = 0;
  while (true) {
    const absl::Time started = absl::Now();
    auto page = client_->Range(from, end, kPageKeys, revision);
    Metered(started, page.status());
    if (!page.ok()) {
      return Annotate(page.status(), absl::StrCat("loading worker records from ", Describe()));
    }
    if (revision == 0) revision = page->revision;
    for (const EtcdKeyValue& kv : page->kvs) {
      if (++seen > kMaxRecords) {
        LogWarning("more than ", kMaxRecords, " worker records under ", dir, "; the ones from ",
                   kv.key, " on are not loaded");
        return out;
      }
      const std::string id = kv.key.substr(std::min(kv.key.size(), dir.size()));
      std::string problem;
      v1::WorkerInfo info;
      if (kv.value.size() > kMaxRecordBytes) {
        problem = absl::StrCat(kv.value.size(), " bytes, more than ", kMaxRecordBytes);
      } else {
        google::protobuf::util::JsonParseOptions options;
        options.ignore_unknown_fields = true;  // written by a newer version
        if (auto parsed = google::protobuf::util::JsonStringToMessage(kv.value, &info, options);
            !parsed.ok()) {
          problem = absl::StrCat("not a worker record: ", std::string(parsed.message()));
        } else if (info.worker_id() != id) {
          problem = absl::StrCat("it holds worker id \"", info.worker_id().substr(0, 80),
                                 "\", not its key's");
        }
      }
      if (!problem.empty()) {
        LogWarning("worker record ", kv.key.substr(0, 200), " in etcd is unreadable (",
                   problem.substr(0, 200), "); not loaded, left where it is");
        continue;
      }
      out.push_back(std::move(info));
    }
    if (!page->more || page->kvs.empty()) break;
    from = page->kvs.back().key + std::string(1, '\0');
  }
  return out;
}

void EtcdWorkerDirectory::Lead(int64_t term) {
  absl::MutexLock lock(&mu_);
  term_ = std::max<int64_t>(0, term);
  leading_changed_ = true;
  ++changes_;  // a new term writes every record
}

void EtcdWorkerDirectory::StopLeading() { Lead(0); }

void EtcdWorkerDirectory::Changed() {
  absl::MutexLock lock(&mu_);
  ++changes_;
}

int64_t EtcdWorkerDirectory::lease() const {
  absl::MutexLock lock(&mu_);
  return lease_;
}

bool EtcdWorkerDirectory::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const uint64_t target = changes_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || term_ == 0 || written_changes_ >= target;
  };
  mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
  return !stop_ && term_ != 0 && written_changes_ >= target;
}

void EtcdWorkerDirectory::Loop() {
  uint64_t handled = 0;  // changes_ as last read
  absl::Duration wait = absl::InfiniteDuration();
  while (true) {
    int64_t term = 0;
    uint64_t generation = 0;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, &handled]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || leading_changed_ || (term_ != 0 && changes_ != handled);
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
      if (stop_) return;
      if (leading_changed_) {
        // A new term writes everything again under a lease of its own; a
        // lost one leaves its lease to expire.
        leading_changed_ = false;
        lease_ = 0;
        written_.clear();
        dirty_ = true;
      }
      term = term_;
      generation = changes_;
      if (changes_ != handled) dirty_ = true;
      handled = changes_;
    }
    if (term == 0) {
      wait = absl::InfiniteDuration();
      continue;
    }
    wait = Work(term, generation);
  }
}

absl::Duration EtcdWorkerDirectory::Work(int64_t term, uint64_t generation) {
  auto log_error = [this](const absl::Status& status) {
    if (absl::Now() - last_error_log_ < absl::Seconds(10)) return;
    last_error_log_ = absl::Now();
    LogWarning("worker records in ", Describe(), ": ", status.message());
  };
  int64_t lease = 0;
  {
    absl::MutexLock lock(&mu_);
    lease = lease_;
  }
  const absl::Time now = absl::Now();
  if (lease == 0) {
    auto granted = client_->LeaseGrant(ttl_);
    Metered(now, granted.status());
    if (!granted.ok()) {
      log_error(Annotate(granted.status(), "taking a lease"));
      return kRetry;
    }
    lease = granted->id;
    written_.clear();
    dirty_ = true;
    next_keep_alive_ = now + granted->ttl / 3;
    absl::MutexLock lock(&mu_);
    lease_ = lease;
  } else if (now >= next_keep_alive_) {
    auto left = client_->LeaseKeepAliveOnce(lease);
    Metered(now, left.status());
    if (absl::IsNotFound(left.status())) {
      // Expired while etcd could not be reached: its keys are gone; a new
      // lease writes them all again.
      log_error(Annotate(left.status(), "the records' lease ended; writing them again"));
      absl::MutexLock lock(&mu_);
      lease_ = 0;
      return absl::ZeroDuration();
    }
    if (!left.ok()) {
      log_error(Annotate(left.status(), "keeping the records' lease alive"));
      next_keep_alive_ = now + std::min(kRetry, ttl_ / 6);
    } else {
      next_keep_alive_ = now + ttl_ / 3;
    }
  }
  if (dirty_) {
    const absl::Time started = absl::Now();
    absl::Status written = WriteChanges(term, lease);
    Metered(started, written);
    if (absl::IsFailedPrecondition(written)) {
      LogWarning("worker records in ", Describe(), ": ", written.message(),
                 "; no longer mirrored from here");
      absl::MutexLock lock(&mu_);
      if (term_ == term && !leading_changed_) term_ = 0;
      return absl::InfiniteDuration();
    }
    if (!written.ok()) {
      log_error(written);
      return kRetry;
    }
    dirty_ = false;
    absl::MutexLock lock(&mu_);
    written_changes_ = std::max(written_changes_, generation);
  }
  return std::max(absl::Milliseconds(1), next_keep_alive_ - absl::Now());
}

absl::Status EtcdWorkerDirectory::WriteChanges(int64_t term, int64_t lease) {
  std::map<std::string, std::string> want;
  for (const v1::WorkerInfo& record : records_()) {
    if (want.size() >= kMaxRecords) break;
    std::string value = ToJson(record);
    if (value.size() > kMaxRecordBytes) {
      LogWarning("worker ", record.worker_id(), ": its record is ", value.size(),
                 " bytes, more than ", kMaxRecordBytes, "; not written to etcd");
      continue;
    }
    want.emplace(WorkerKey(record.worker_id()), std::move(value));
  }
  // Key -> value to put, or nullopt to delete.
  std::vector<std::pair<std::string, std::optional<std::string>>> ops;
  for (const auto& [key, value] : want) {
    auto w = written_.find(key);
    if (w == written_.end() || w->second != value) ops.emplace_back(key, value);
  }
  for (const auto& [key, value] : written_) {
    if (!want.count(key)) ops.emplace_back(key, std::nullopt);
  }
  const std::string leader = prefix_ + "leader";
  for (size_t first = 0; first < ops.size(); first += kOpsPerTxn) {
    const size_t last = std::min(ops.size(), first + kOpsPerTxn);
    etcdserverpb::TxnRequest txn;
    *txn.add_compare() = EtcdCreateRevisionIs(leader, term);
    *txn.add_failure() = EtcdGetOp(leader);
    for (size_t i = first; i < last; ++i) {
      *txn.add_success() = ops[i].second.has_value()
                               ? EtcdPutOp(ops[i].first, *ops[i].second, lease)
                               : EtcdDeleteOp(ops[i].first);
    }
    ASSIGN_OR_RETURN(etcdserverpb::TxnResponse response, client_->Txn(txn));
    if (!response.succeeded()) {
      int64_t now = 0;
      if (response.responses_size() > 0 && response.responses(0).response_range().kvs_size() > 0) {
        now = response.responses(0).response_range().kvs(0).create_revision();
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "fenced: worker records not written, this coordinator no longer leads (", leader,
          now == 0 ? " is gone" : absl::StrCat(" now holds term ", now), ", ours was ", term, ")"));
    }
    for (size_t i = first; i < last; ++i) {
      if (ops[i].second.has_value()) {
        written_[ops[i].first] = *ops[i].second;
      } else {
        written_.erase(ops[i].first);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace detour
