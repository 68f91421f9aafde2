#include "coordinator/worker_registry.h"

#include <cmath>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

}  // namespace

WorkerRegistry::WorkerRegistry(absl::Duration silence, absl::Duration heartbeat_interval)
    : silence_(silence), heartbeat_interval_(heartbeat_interval) {}

void WorkerRegistry::SetListener(std::function<void()> on_change) {
  listener_ = std::move(on_change);
}

void WorkerRegistry::Notify() const {
  if (listener_) listener_();
}

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::Register(const v1::RegisterRequest& request,
                                                              absl::Time now) {
  auto response = RegisterLocked(request, now);
  if (response.ok()) Notify();
  return response;
}

absl::StatusOr<v1::RegisterResponse> WorkerRegistry::RegisterLocked(
    const v1::RegisterRequest& request, absl::Time now) {
  if (!request.worker_id().empty() && !ValidWorkerId(request.worker_id())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker_id: \"", request.worker_id(), "\" must be 1-64 letters, digits, '-', '_' or '.'"));
  }
  if (request.region().empty()) {
    return absl::InvalidArgumentError("region: required (e.g. \"Oregon\" or \"local\")");
  }
  const double speed = request.speed() == 0 ? 1.0 : request.speed();
  if (!(speed > 0) || !std::isfinite(speed)) {
    return absl::InvalidArgumentError(absl::StrFormat("speed: %g must be > 0", request.speed()));
  }
  if (!request.address().empty()) {
    auto parsed = ParseHostPort(request.address(), "address", /*allow_port_zero=*/false);
    if (!parsed.ok()) return parsed.status();
  }
  if (!request.metrics_address().empty()) {
    auto parsed =
        ParseHostPort(request.metrics_address(), "metrics_address", /*allow_port_zero=*/false);
    if (!parsed.ok()) return parsed.status();
  }
  if (!request.data_address().empty()) {
    auto parsed = ParseHostPort(request.data_address(), "data_address", /*allow_port_zero=*/false);
    if (!parsed.ok()) return parsed.status();
  }
  // They become label values of metrics and service-discovery labels.
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"region", &request.region()},
        {"device", &request.device()},
        {"version", &request.version()},
        {"address", &request.address()},
        {"metrics_address", &request.metrics_address()},
        {"data_address", &request.data_address()}}) {
    if (value->size() > kMaxFieldBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": ", value->size(), " bytes is longer than ", kMaxFieldBytes));
    }
  }

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
  {
    absl::MutexLock lock(&mu_);
    auto t = token_to_worker_.find(token);
    if (t == token_to_worker_.end()) {
      return absl::UnauthenticatedError("unknown session token; register again");
    }
    Entry& entry = workers_.at(t->second);
    const v1::WorkerState state =
        beat.job_id().empty() ? v1::WORKER_STATE_IDLE : v1::WORKER_STATE_BUSY;
    changed = entry.info.job_id() != beat.job_id() || entry.info.state() != state;
    entry.last_heartbeat = now;
    *entry.info.mutable_last_heartbeat_time() = ToProto(now);
    entry.info.set_heartbeats(entry.info.heartbeats() + 1);
    entry.info.set_job_id(beat.job_id());
    entry.info.set_state(state);
    ++total_heartbeats_;
    id = t->second;
  }
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
  std::vector<std::string> lost = MarkSilentLocked(now);
  if (!lost.empty()) Notify();
  return lost;
}

std::vector<std::string> WorkerRegistry::MarkSilentLocked(absl::Time now) {
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
      continue;
    }
    ++it;
  }
  return lost;
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
