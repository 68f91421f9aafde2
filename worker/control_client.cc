#include "worker/control_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/net/grpc_status.h"
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
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnimplemented:
      return true;
    default:
      return false;
  }
}

}  // namespace

ControlClient::ControlClient(Options options, Hooks hooks)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      stub_(v1::ControlService::NewStub(MakeChannel(options_.coordinator))) {}

ControlClient::~ControlClient() { Stop(); }

std::string ControlClient::worker_id() const {
  absl::MutexLock lock(&mu_);
  return worker_id_;
}

void ControlClient::SetCurrentJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  current_job_ = job_id;
}

absl::Status ControlClient::RegisterOnce(v1::RegisterResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
  context.set_wait_for_ready(false);
  v1::RegisterRequest request = options_.registration;
  {
    absl::MutexLock lock(&mu_);
    // Keep the id across re-registrations so the coordinator sees the same
    // worker coming back.
    if (request.worker_id().empty()) request.set_worker_id(worker_id_);
  }
  return FromGrpcStatus(stub_->Register(&context, request, response));
}

absl::Status ControlClient::RegisterWithRetry(absl::Time give_up) {
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    v1::RegisterResponse response;
    absl::Status status = RegisterOnce(&response);
    if (status.ok()) {
      {
        absl::MutexLock lock(&mu_);
        worker_id_ = response.worker_id();
        token_ = response.session_token();
        heartbeat_interval_ =
            absl::Milliseconds(std::max<uint32_t>(50, response.heartbeat_interval_ms()));
      }
      LogInfo("registered with coordinator ", options_.coordinator, " as ",
              response.worker_id(), " (heartbeat every ", response.heartbeat_interval_ms(),
              " ms)");
      if (hooks_.on_registered) hooks_.on_registered(response.worker_id());
      return absl::OkStatus();
    }
    if (IsPermanent(status)) {
      return Annotate(status, absl::StrCat("coordinator ", options_.coordinator,
                                           " refused the registration"));
    }
    // Retry until the deadline, the last wait cut short to end exactly there.
    absl::Duration wait = backoff;
    if (give_up != absl::InfiniteFuture()) {
      const absl::Duration left = give_up - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(absl::StrCat(
            "coordinator ", options_.coordinator, " unreachable; gave up after ", attempt,
            " attempts (", status.message(), ")"));
      }
      wait = std::min(wait, left);
    }
    LogWarning("coordinator ", options_.coordinator, " unreachable (",
               absl::StatusCodeToString(status.code()), ": ", status.message(),
               "); attempt ", attempt, ", retrying in ", absl::FormatDuration(wait));
    if (stopping_.WaitForNotificationWithTimeout(wait)) {
      return absl::CancelledError("stopped while registering");
    }
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::Status ControlClient::Start() {
  const absl::Time give_up = options_.connect_timeout > absl::ZeroDuration()
                                 ? absl::Now() + options_.connect_timeout
                                 : absl::InfiniteFuture();
  absl::Status registered = RegisterWithRetry(give_up);
  if (!registered.ok()) return registered;
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

absl::Status ControlClient::RunSession() {
  grpc::ClientContext context;
  std::string token;
  absl::Duration interval;
  {
    absl::MutexLock lock(&mu_);
    token = token_;
    interval = heartbeat_interval_;
  }
  std::unique_ptr<grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>> stream =
      stub_->Session(&context);
  {
    absl::MutexLock lock(&mu_);
    session_context_ = &context;
    stream_ = stream.get();
  }
  absl::Notification reader_done;
  std::thread reader([&] {
    v1::CoordinatorMessage message;
    while (stream->Read(&message)) {
      if (hooks_.on_message) hooks_.on_message(message);
    }
    reader_done.Notify();
  });

  bool announced = false;
  absl::Status why = absl::OkStatus();
  while (true) {
    v1::WorkerMessage beat;
    beat.set_session_token(token);
    beat.mutable_heartbeat()->set_seq(++heartbeat_seq_);
    {
      absl::MutexLock lock(&mu_);
      beat.mutable_heartbeat()->set_job_id(current_job_);
    }
    bool written;
    {
      absl::MutexLock lock(&write_mu_);
      written = stream->Write(beat);
    }
    if (!written) {
      why = absl::UnavailableError("heartbeat write failed");
      break;
    }
    if (!announced) {
      announced = true;
      if (hooks_.on_connection_change) hooks_.on_connection_change(true);
    }
    if (hooks_.on_heartbeat_sent) hooks_.on_heartbeat_sent();
    if (stopping_.WaitForNotificationWithTimeout(interval)) {
      absl::MutexLock lock(&write_mu_);
      stream->WritesDone();
      break;
    }
  }
  {
    absl::MutexLock lock(&mu_);
    session_context_ = nullptr;
    stream_ = nullptr;
  }
  // Writes that took the stream before it was cleared finish first.
  { absl::MutexLock barrier(&write_mu_); }
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

absl::Status ControlClient::Send(v1::WorkerMessage message) {
  // The write may block on flow control: it holds only write_mu_, never mu_
  // (which the heartbeat and the job runtime need). The session's teardown
  // clears stream_ under mu_ and then waits on write_mu_, so a write that
  // took the stream under mu_ finishes before the stream goes away.
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream;
  absl::ReleasableMutexLock lock(&mu_);
  if (stream_ == nullptr) return absl::UnavailableError("no session with the coordinator");
  stream = stream_;
  message.set_session_token(token_);
  absl::MutexLock write_lock(&write_mu_);
  lock.Release();
  if (!stream->Write(message)) return absl::UnavailableError("session write failed");
  return absl::OkStatus();
}

void ControlClient::Stop() {
  if (!stopping_.HasBeenNotified()) stopping_.Notify();
  if (session_thread_.joinable()) session_thread_.join();
}

}  // namespace detour
