#include "worker/control_client.h"

#include <algorithm>
#include <iterator>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/net/grpc_status.h"
#include "common/net/leader_redirect.h"
#include "common/net/server.h"
#include "common/status.h"

namespace detour {
namespace {

// Errors that retrying cannot fix.
bool IsPermanent(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnimplemented: return true;
    default: return false;
  }
}

// The addresses of Options::coordinator (checked by the caller; an
// unparsable list is used as one address, whose calls then fail).
std::vector<std::string> Addresses(const std::string& coordinator) {
  auto list = ParseCoordinatorList(coordinator, "coordinator");
  if (!list.ok() || list->empty()) return {coordinator};
  return *std::move(list);
}

// Stubs kept for addresses followers named that are not in the list, at most.
constexpr size_t kMaxStubs = 2 * kMaxCoordinatorAddresses;

}  // namespace

ControlClient::ControlClient(Options options, Hooks hooks)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      addresses_(Addresses(options_.coordinator)),
      current_(addresses_[0]) {}

v1::ControlService::Stub* ControlClient::StubFor(const std::string& address) {
  auto it = stubs_.find(address);
  if (it != stubs_.end()) return it->second.get();
  if (stubs_.size() >= kMaxStubs) {
    for (auto s = stubs_.begin(); s != stubs_.end();) {
      const bool listed =
          std::find(addresses_.begin(), addresses_.end(), s->first) != addresses_.end();
      s = listed || s->first == current_ ? std::next(s) : stubs_.erase(s);
    }
  }
  auto stub = v1::ControlService::NewStub(MakeChannel(address, options_.security));
  return stubs_.emplace(address, std::move(stub)).first->second.get();
}

std::string ControlClient::coordinator() const {
  absl::MutexLock lock(&mu_);
  return current_;
}

ControlClient::~ControlClient() { Stop(); }

std::string ControlClient::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

void ControlClient::SetCurrentJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  current_job_ = job_id;
}

absl::Status ControlClient::RegisterOnce(v1::RegisterResponse* response, bool* redirected) {
  *redirected = false;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  context.set_wait_for_ready(false);
  v1::RegisterRequest request = options_.registration;
  v1::ControlService::Stub* stub = nullptr;
  std::string address;
  {
    absl::MutexLock lock(&mu_);
    // Keep the id across re-registrations so the coordinator sees the same
    // worker coming back.
    if (request.worker_id().empty()) request.set_worker_id(worker_id_);
    address = current_;
    stub = StubFor(address);
  }
  absl::Status status = FromGrpcStatus(stub->Register(&context, request, response));
  if (!absl::IsUnavailable(status) && !absl::IsDeadlineExceeded(status)) return status;
  absl::MutexLock lock(&mu_);
  if (std::optional<std::string> leader = LeaderFromTrailers(context);
      leader.has_value() && *leader != address) {
    current_ = *leader;
    *redirected = true;
  } else if (addresses_.size() > 1) {
    next_index_ = (next_index_ + 1) % addresses_.size();
    current_ = addresses_[next_index_];
  }
  return Annotate(status, address);
}

absl::Status ControlClient::RegisterWithRetry(absl::Time give_up) {
  absl::Duration backoff = options_.initial_backoff;
  int redirections = 0;
  for (int attempt = 1;; ++attempt) {
    v1::RegisterResponse response;
    bool redirected = false;
    absl::Status status = RegisterOnce(&response, &redirected);
    if (status.ok()) {
      {
        absl::MutexLock lock(&mu_);
        worker_id_ = response.worker_id();
        token_ = response.session_token();
        heartbeat_interval_ =
            absl::Milliseconds(std::max<uint32_t>(50, response.heartbeat_interval_ms()));
      }
      if (!fence_.Admit(response.leader_term())) {
        LogWarning("coordinator ", coordinator(), " accepted the registration in term ",
                   response.leader_term(), ", older than term ", fence_.newest(),
                   " seen before; its messages will be dropped");
      }
      LogInfo(
          "registered with coordinator ", coordinator(), " as ", response.worker_id(),
          " (heartbeat every ", response.heartbeat_interval_ms(), " ms",
          response.leader_term() > 0 ? absl::StrCat(", leader term ", response.leader_term()) : "",
          ")");
      if (hooks_.on_registered) hooks_.on_registered(response.worker_id());
      return absl::OkStatus();
    }
    if (IsPermanent(status)) {
      return Annotate(
          status, absl::StrCat("coordinator ", options_.coordinator, " refused the registration"));
    }
    // A follower named the leader: ask it at once, a few times in a row at
    // most (leaders naming each other while an election settles).
    if (redirected && ++redirections <= 3) {
      LogInfo("coordinator redirected the registration to the leader at ", coordinator());
      --attempt;
      continue;
    }
    redirections = 0;
    // Retry until the deadline, the last wait cut short to end exactly there.
    absl::Duration wait = backoff;
    if (give_up != absl::InfiniteFuture()) {
      const absl::Duration left = give_up - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat("coordinator ", options_.coordinator,
                                                        " unreachable; gave up after ", attempt,
                                                        " attempts (", status.message(), ")"));
      }
      wait = std::min(wait, left);
    }
    LogWarning("coordinator ", options_.coordinator, " unreachable (",
               absl::StatusCodeToString(status.code()), ": ", status.message(), "); attempt ",
               attempt, ", retrying in ", absl::FormatDuration(wait));
    if (stopping_.WaitForNotificationWithTimeout(wait)) {
      return absl::CancelledError("stopped while registering");
    }
    // With several coordinators a failover is under way: the next leader is
    // elected within a lease, and a long wait would only add to the pause.
    backoff = std::min(backoff * 2, addresses_.size() > 1
                                        ? std::min(options_.max_backoff, absl::Seconds(1))
                                        : options_.max_backoff);
  }
}

absl::Status ControlClient::Start() {
  const absl::Time give_up = options_.connect_timeout > absl::ZeroDuration()
                                 ? absl::Now() + options_.connect_timeout
                                 : absl::InfiniteFuture();
  absl::Status registered = RegisterWithRetry(give_up);
  if (!registered.ok()) return registered;
  absl::MutexLock lock(&mu_);
  if (stop_requested_) return absl::CancelledError("stopped while registering");
  session_thread_ = std::thread([this] { SessionLoop(); });
  return absl::OkStatus();
}

void ControlClient::SessionLoop() {
  while (!stopping_.HasBeenNotified()) {
    absl::Status ended = RunSession();
    if (hooks_.on_connection_change) hooks_.on_connection_change(false);
    if (stopping_.HasBeenNotified()) break;
    LogWarning("session with coordinator ended: ", ended.ToString(), "; registering again");
    // A restarted coordinator does not know our token: register again.
    absl::Status again = RegisterWithRetry(absl::InfiniteFuture());
    if (!again.ok()) {
      if (!stopping_.HasBeenNotified()) {
        LogError("cannot register again: ", again.message());
        // Permanent refusal: wait a little and keep trying; the operator sees
        // the errors and the coordinator marks this worker lost meanwhile.
        stopping_.WaitForNotificationWithTimeout(options_.max_backoff);
      }
    }
  }
}

absl::Duration ControlClient::StallTimeout() const {
  if (options_.write_stall_timeout > absl::ZeroDuration()) return options_.write_stall_timeout;
  return std::max(3 * heartbeat_interval_, options_.rpc_timeout);
}

absl::Status ControlClient::RunSession() {
  grpc::ClientContext context;
  std::string token;
  absl::Duration interval;
  absl::Duration stall;
  {
    absl::MutexLock lock(&mu_);
    token = token_;
    interval = heartbeat_interval_;
    stall = StallTimeout();
  }
  v1::ControlService::Stub* stub = nullptr;
  {
    absl::MutexLock lock(&mu_);
    stub = StubFor(current_);
  }
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream =
      stub->Session(&context);
  {
    absl::MutexLock lock(&mu_);
    session_open_ = true;
    outbox_.clear();
    outbox_bytes_ = 0;
    heartbeat_due_ = true;  // the first one at once
    writer_stop_ = false;
    writer_done_ = false;
    write_failed_ = false;
    write_started_ = absl::InfiniteFuture();
  }
  absl::Notification reader_done;
  std::thread reader([&] {
    v1::CoordinatorMessage message;
    while (stream->Read(&message)) {
      if (!fence_.Admit(message.leader_term())) {
        // A deposed leader's: never obeyed. Logged sparsely (it may send
        // many before it learns it lost its lease).
        const uint64_t refused = fence_.refused();
        if (refused == 1 || refused % 100 == 0) {
          LogWarning("dropped a message of leader term ", message.leader_term(),
                     ": a newer leader (term ", fence_.newest(), ") drives this worker (", refused,
                     " dropped so far)");
        }
        continue;
      }
      if (hooks_.on_message) hooks_.on_message(message);
    }
    reader_done.Notify();
  });
  std::thread writer([&] { WriterLoop(stream.get(), token); });

  // The heartbeat clock and the stall watch: nothing here waits on the
  // stream.
  absl::Status why = absl::OkStatus();
  bool cancel = false;
  size_t dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    auto wake = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_requested_ || write_failed_; };
    while (true) {
      mu_.AwaitWithTimeout(absl::Condition(&wake), interval);
      if (write_failed_) {
        why = absl::UnavailableError("session write failed");
        break;
      }
      if (stop_requested_) break;
      const absl::Time now = absl::Now();
      if (write_started_ != absl::InfiniteFuture() && now - write_started_ > stall) {
        why = absl::DeadlineExceededError(
            absl::StrCat("a write to the coordinator has been blocked for ",
                         absl::FormatDuration(now - write_started_), " (limit ",
                         absl::FormatDuration(stall), ")"));
        cancel = true;
        break;
      }
      heartbeat_due_ = true;  // coalesces with one not yet written
    }
    writer_stop_ = true;
    heartbeat_due_ = false;
    if (why.ok()) {
      // Stopping: what the runtime queued (a last result, an error) goes
      // out first, for at most rpc_timeout.
      if (!mu_.AwaitWithTimeout(absl::Condition(&writer_done_), options_.rpc_timeout)) {
        cancel = true;
      }
    }
    session_open_ = false;
    dropped = outbox_.size();
    outbox_.clear();
    outbox_bytes_ = 0;
  }
  if (dropped > 0) {
    LogWarning("session with coordinator closing: ", dropped, " queued messages dropped");
  }
  // Cancelling frees a writer stuck in a write.
  if (cancel) context.TryCancel();
  writer.join();
  // After WritesDone the coordinator ends the stream; do not wait forever on
  // one that is hung.
  if (!why.ok() || !reader_done.WaitForNotificationWithTimeout(options_.rpc_timeout)) {
    context.TryCancel();
  }
  reader.join();
  grpc::Status finished = stream->Finish();
  if (why.ok() && !finished.ok()) why = FromGrpcStatus(finished);
  return why;
}

void ControlClient::WriterLoop(
    grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream,
    const std::string& token) {
  bool announced = false;
  while (true) {
    v1::WorkerMessage message;
    bool beat = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return heartbeat_due_ || !outbox_.empty() || writer_stop_;
      };
      mu_.Await(absl::Condition(&ready));
      if (heartbeat_due_) {
        heartbeat_due_ = false;
        beat = true;
        message.set_session_token(token);
        message.mutable_heartbeat()->set_seq(++heartbeat_seq_);
        message.mutable_heartbeat()->set_job_id(current_job_);
      } else if (!outbox_.empty()) {
        message = std::move(outbox_.front());
        outbox_.pop_front();
        outbox_bytes_ -= std::min(outbox_bytes_, message.ByteSizeLong());
      } else {  // stopping, and everything queued is written
        break;
      }
      write_started_ = absl::Now();
    }
    const bool written = stream->Write(message);
    {
      absl::MutexLock lock(&mu_);
      write_started_ = absl::InfiniteFuture();
      if (!written) {
        write_failed_ = true;
        writer_done_ = true;
        return;
      }
    }
    if (beat) {
      if (!announced) {
        announced = true;
        if (hooks_.on_connection_change) hooks_.on_connection_change(true);
      }
      if (hooks_.on_heartbeat_sent) hooks_.on_heartbeat_sent();
    }
  }
  stream->WritesDone();
  absl::MutexLock lock(&mu_);
  writer_done_ = true;
}

absl::Status ControlClient::Send(v1::WorkerMessage message) {
  absl::MutexLock lock(&mu_);
  if (!session_open_) return absl::UnavailableError("no session with the coordinator");
  message.set_session_token(token_);
  const size_t bytes = message.ByteSizeLong();
  if (outbox_.size() >= options_.max_outbox_messages ||
      outbox_bytes_ + bytes > options_.max_outbox_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the outbox to the coordinator is full (", outbox_.size(), " messages, ",
                     outbox_bytes_, " bytes; limits ", options_.max_outbox_messages, " and ",
                     options_.max_outbox_bytes, "): the session is stalled"));
  }
  outbox_bytes_ += bytes;
  outbox_.push_back(std::move(message));
  return absl::OkStatus();
}

void ControlClient::Stop() {
  std::thread session;
  {
    absl::MutexLock lock(&mu_);
    stop_requested_ = true;
    session = std::move(session_thread_);
  }
  if (!stopping_.HasBeenNotified()) stopping_.Notify();
  if (session.joinable()) session.join();
}

}  // namespace detour
