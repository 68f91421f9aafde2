#include "coordinator/worker_registry.h"

#include <cmath>
#include <optional>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "common/net/address.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp ToProto(absl::Time t) {
  return TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(t));
}

bool ValidWorkerId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    if (!absl::ascii_isalnum(c) && c != '-' && c != '_' && c != '.') return false;
  }
  return true;
}

// What Register and Restore both ask of a worker's fields.
absl::Status CheckFields(const std::string& region, double speed, const std::string& address,
                         const std::string& metrics_address, const std::string& data_address,
                         const std::string& device, const std::string& version) {
  if (region.empty()) {
    return absl::InvalidArgumentError("region: required (e.g. \"Oregon\" or \"local\")");
  }
  if (!(speed > 0) || !std::isfinite(speed)) {
    return absl::InvalidArgumentError(absl::StrFormat("speed: %g must be > 0", speed));
  }
  // They become label values of metrics and service-discovery labels.
  for (const auto& [field, value] : {std::pair<const char*, const std::string*>{"region", &region},
                                     {"device", &device},
                                     {"version", &version},
                                     {"address", &address},
                                     {"metrics_address", &metrics_address},
                                     {"data_address", &data_address}}) {
    if (value->size() > WorkerRegistry::kMaxFieldBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": ", value->size(), " bytes is longer than ", WorkerRegistry::kMaxFieldBytes));
    }
  }
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"address", &address},
        {"metrics_address", &metrics_address},
        {"data_address", &data_address}}) {
    if (value->empty()) continue;
    auto parsed = ParseHostPort(*value, field, /*allow_port_zero=*/false);
    if (!parsed.ok()) return parsed.status();
  }
  return absl::OkStatus();
}

}  // namespace

WorkerRegistry::WorkerRegistry(absl::Duration silence, absl::Duration heartbeat_interval)
    : silence_(silence), heartbeat_interval_(heartbeat_interval) {}

void WorkerRegistry::SetListener(std::function<void()> on_change) {
  listener_ = std::move(on_change);
}

void WorkerRegistry::SetRecordListener(std::function<void()> on_change) {
  record_listener_ = std::move(on_change);
}

void WorkerRegistry::Notify() const {
  if (listener_) listener_();
}

void WorkerRegistry::NotifyRecords() const {
  if (record_listener_) record_listener_();
}

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::Register(const v1::RegisterRequest& request,
                                                              absl::Time now) {
  auto response = RegisterLocked(request, now);
  if (response.ok()) {
    NotifyRecords();
    Notify();
  }
  return response;
}

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::RegisterLocked(
    const v1::RegisterRequest& request, absl::Time now) {
  if (!request.worker_id().empty() && !ValidWorkerId(request.worker_id())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_id: \"", request.worker_id(), "\" must be 1-64 letters, digits, '-', '_' or '.'"));
  }
  const double speed = request.speed() == 0 ? 1.0 : request.speed();
  RETURN_IF_ERROR(CheckFields(request.region(), speed, request.address(), request.metrics_address(),
                              request.data_address(), request.device(), request.version()));

  absl::MutexLock lock(&mu_);
  std::string id = request.worker_id();
  if (id.empty()) {
    do {
      id = absl::StrCat("w", next_worker_number_++);
    } while (workers_.count(id));
  } else if (auto it = workers_.find(id); it != workers_.end()) {
    if (it->second.info.state() != v1::WORKER_STATE_LOST && it->second.connected) {
      return absl::AlreadyExistsError(absl::StrFormat(
          "worker id %s is registered and its session is open (last heartbeat %.1f s ago); "
          "pick another --worker_id or stop the other worker",
          id, absl::ToDoubleSeconds(now - it->second.last_heartbeat)));
    }
    // A lost worker coming back, or one that restarted: the stale
    // registration and its token go.
    const double silent = absl::ToDoubleSeconds(now - it->second.last_heartbeat);
    if (it->second.restored) {
      LogInfo(absl::StrFormat(
          "worker %s registers again with this leader, %.1f s after its record was taken from "
          "the previous leader's: its id was kept for it",
          id, silent));
    } else if (it->second.info.state() == v1::WORKER_STATE_LOST) {
      LogInfo(absl::StrFormat(
          "worker %s registers again after %.1f s without a heartbeat: it had been marked lost, "
          "so the jobs it was in no longer count on it",
          id, silent));
    } else {
      LogInfo(absl::StrFormat(
          "worker %s registers again (its session had ended; last heartbeat %.1f s ago): it "
          "restarted or reconnected",
          id, silent));
    }
    token_to_worker_.erase(it->second.token);
  }
  if (!workers_.count(id) && workers_.size() >= kMaxWorkers) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the registry holds ", kMaxWorkers, " workers; no room for ", id));
  }
  Entry entry;
  entry.info.set_worker_id(id);
  entry.info.set_region(request.region());
  entry.info.set_speed(speed);
  entry.info.set_memory_slots(request.memory_slots() == 0 ? 3 : request.memory_slots());
  entry.info.set_address(request.address());
  entry.info.set_metrics_address(request.metrics_address());
  entry.info.set_data_address(request.data_address());
  entry.info.set_device(request.device().empty() ? "cpu" : request.device());
  entry.info.set_version(request.version());
  entry.info.set_state(v1::WORKER_STATE_IDLE);
  *entry.info.mutable_registered_time() = ToProto(now);
  *entry.info.mutable_session_change_time() = ToProto(now);
  *entry.info.mutable_last_heartbeat_time() = ToProto(now);
  // Tokens only need to be unguessable enough to catch mix-ups between
  // registrations, not to authenticate (the control plane runs on a trusted
  // network; see docs/OPERATIONS.md).
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  entry.token = absl::StrFormat("%s-%d-%016x", id, next_token_++, rng());
  entry.last_heartbeat = now;
  token_to_worker_[entry.token] = id;

  v1::RegisterResponse response;
  response.set_worker_id(id);
  response.set_session_token(entry.token);
  response.set_heartbeat_interval_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(heartbeat_interval_)));
  workers_[id] = std::move(entry);
  return response;
}

absl::StatusOr<std::string> WorkerRegistry::Heartbeat(const std::string& token,
                                                      const v1::Heartbeat& beat, absl::Time now) {
  std::string id;
  bool changed = false;
  std::optional<absl::Duration> was_lost;  // the silence of a lost worker heard again
  {
    absl::MutexLock lock(&mu_);
    auto t = token_to_worker_.find(token);
    if (t == token_to_worker_.end()) {
      return absl::UnauthenticatedError("unknown session token; register again");
    }
    Entry& entry = workers_.at(t->second);
    if (entry.info.state() == v1::WORKER_STATE_LOST) was_lost = now - entry.last_heartbeat;
    const v1::WorkerState state =
        beat.job_id().empty() ? v1::WORKER_STATE_IDLE : v1::WORKER_STATE_BUSY;
    // The first heartbeat since registration is a change too: only then
    // may the worker be reserved (JobManager::ReserveIdle), and a job waiting
    // for workers to join waits for this notification.
    changed = entry.info.heartbeats() == 0 || entry.info.job_id() != beat.job_id() ||
              entry.info.state() != state;
    entry.last_heartbeat = now;
    *entry.info.mutable_last_heartbeat_time() = ToProto(now);
    entry.info.set_heartbeats(entry.info.heartbeats() + 1);
    entry.info.set_job_id(beat.job_id());
    entry.info.set_state(state);
    ++total_heartbeats_;
    id = t->second;
  }
  if (was_lost.has_value()) {
    LogInfo(absl::StrFormat(
        "worker %s heartbeats again after %.1f s of silence: it had been marked lost, so the "
        "jobs it was in no longer count on it",
        id, absl::ToDoubleSeconds(*was_lost)));
  }
  if (was_lost.has_value()) NotifyRecords();
  if (changed) Notify();
  return id;
}

absl::StatusOr<std::string> WorkerRegistry::WorkerForToken(const std::string& token) const {
  absl::MutexLock lock(&mu_);
  auto t = token_to_worker_.find(token);
  if (t == token_to_worker_.end()) {
    return absl::UnauthenticatedError("unknown session token; register again");
  }
  return t->second;
}

void WorkerRegistry::SessionOpened(const std::string& token, absl::Time now) {
  SetSession(token, true, now);
}

void WorkerRegistry::SessionEnded(const std::string& token, absl::Time now) {
  SetSession(token, false, now);
}

void WorkerRegistry::SetSession(const std::string& token, bool open, absl::Time now) {
  {
    absl::MutexLock lock(&mu_);
    auto t = token_to_worker_.find(token);
    if (t == token_to_worker_.end()) return;
    Entry& entry = workers_.at(t->second);
    entry.connected = open;
    entry.info.set_session_open(open);
    *entry.info.mutable_session_change_time() = ToProto(now);
  }
  Notify();
}

void WorkerRegistry::ForgiveSilence(absl::Time now) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, entry] : workers_) {
    if (entry.info.state() != v1::WORKER_STATE_LOST) entry.last_heartbeat = now;
  }
}

std::vector<std::string> WorkerRegistry::MarkSilentWorkersLost(absl::Time now) {
  bool forgot = false;
  std::vector<std::string> lost = MarkSilentLocked(now, &forgot);
  if (!lost.empty() || forgot) NotifyRecords();
  if (!lost.empty()) Notify();
  return lost;
}

std::vector<std::string> WorkerRegistry::MarkSilentLocked(absl::Time now, bool* forgot) {
  std::vector<std::string> lost;
  absl::MutexLock lock(&mu_);
  for (auto it = workers_.begin(); it != workers_.end();) {
    Entry& entry = it->second;
    if (entry.info.state() != v1::WORKER_STATE_LOST && now - entry.last_heartbeat > silence_) {
      entry.info.set_state(v1::WORKER_STATE_LOST);
      lost.push_back(it->first);
    }
    if (entry.info.state() == v1::WORKER_STATE_LOST && now - entry.last_heartbeat > 10 * silence_) {
      token_to_worker_.erase(entry.token);
      it = workers_.erase(it);
      *forgot = true;
      continue;
    }
    ++it;
  }
  return lost;
}

std::vector<v1::WorkerInfo> WorkerRegistry::Records() const {
  std::vector<v1::WorkerInfo> out;
  absl::MutexLock lock(&mu_);
  out.reserve(workers_.size());
  for (const auto& [id, entry] : workers_) {
    v1::WorkerInfo record = entry.info;
    record.clear_last_heartbeat_time();
    record.clear_heartbeats();
    record.clear_job_id();
    record.clear_session_open();
    record.clear_session_change_time();
    if (record.state() != v1::WORKER_STATE_LOST) record.set_state(v1::WORKER_STATE_IDLE);
    out.push_back(std::move(record));
  }
  return out;
}

absl::Status WorkerRegistry::CheckRecord(const v1::WorkerInfo& record) {
  if (!ValidWorkerId(record.worker_id())) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id: \"", record.worker_id().substr(0, 80),
                     "\" must be 1-64 letters, digits, '-', '_' or '.'"));
  }
  RETURN_IF_ERROR(CheckFields(record.region(), record.speed(), record.address(),
                              record.metrics_address(), record.data_address(), record.device(),
                              record.version()));
  if (record.state() != v1::WORKER_STATE_IDLE && record.state() != v1::WORKER_STATE_BUSY &&
      record.state() != v1::WORKER_STATE_LOST) {
    return absl::InvalidArgumentError(
        absl::StrCat("state: ", static_cast<int>(record.state()), " is not a worker's state"));
  }
  if (record.memory_slots() == 0) {
    return absl::InvalidArgumentError("memory_slots: 0; a registered worker has at least 1");
  }
  return absl::OkStatus();
}

int WorkerRegistry::Restore(const std::vector<v1::WorkerInfo>& records, absl::Time now) {
  int restored = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const v1::WorkerInfo& record : records) {
      if (absl::Status fit = CheckRecord(record); !fit.ok()) {
        LogWarning("worker record of \"", record.worker_id().substr(0, 80),
                   "\" from the previous leader not restored: ", fit.message());
        continue;
      }
      if (workers_.count(record.worker_id())) continue;
      if (workers_.size() >= kMaxWorkers) {
        LogWarning("the registry holds ", kMaxWorkers, " workers; worker record of ",
                   record.worker_id(), " from the previous leader not restored");
        continue;
      }
      Entry entry;
      entry.info = record;
      entry.info.set_state(v1::WORKER_STATE_LOST);
      entry.info.clear_heartbeats();
      entry.info.clear_job_id();
      entry.info.set_session_open(false);
      *entry.info.mutable_session_change_time() = ToProto(now);
      // Its last heartbeat is in no record: the previous leader's time is
      // not this one's clock either.
      entry.info.clear_last_heartbeat_time();
      entry.last_heartbeat = now;
      entry.restored = true;
      workers_[record.worker_id()] = std::move(entry);
      ++restored;
    }
  }
  if (restored > 0) {
    NotifyRecords();
    Notify();
  }
  return restored;
}

std::vector<v1::WorkerInfo> WorkerRegistry::List(bool include_lost) const {
  std::vector<v1::WorkerInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, entry] : workers_) {
    if (!include_lost && entry.info.state() == v1::WORKER_STATE_LOST) continue;
    out.push_back(entry.info);
  }
  return out;
}

int WorkerRegistry::Count(v1::WorkerState state) const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, entry] : workers_) n += entry.info.state() == state;
  return n;
}

uint64_t WorkerRegistry::total_heartbeats() const {
  absl::MutexLock lock(&mu_);
  return total_heartbeats_;
}

}  // namespace detour
