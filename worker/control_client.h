// The worker's side of the control plane: registers with the coordinator
// (retrying with backoff while it is unreachable), keeps a Session stream
// open with periodic heartbeats, hands coordinator messages to a handler, and
// re-registers when the session breaks (e.g. the coordinator restarted).
// Thread-safe. Owns two threads while running.
#ifndef DETOUR_WORKER_CONTROL_CLIENT_H_
#define DETOUR_WORKER_CONTROL_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "detour/v1/control_service.grpc.pb.h"

namespace detour {

class ControlClient {
 public:
  struct Options {
    std::string coordinator;  // host:port
    v1::RegisterRequest registration;
    // Give up when the first registration has not succeeded by then; zero =
    // keep trying until Stop().
    absl::Duration connect_timeout = absl::ZeroDuration();
    absl::Duration initial_backoff = absl::Milliseconds(200);
    absl::Duration max_backoff = absl::Seconds(5);
    absl::Duration rpc_timeout = absl::Seconds(3);
  };
  struct Hooks {
    std::function<void(const v1::CoordinatorMessage&)> on_message;  // on the reader thread
    std::function<void()> on_heartbeat_sent;
    std::function<void(const std::string& worker_id)> on_registered;
    std::function<void(bool connected)> on_connection_change;
  };

  ControlClient(Options options, Hooks hooks);
  ~ControlClient();

  // Blocks until the first registration succeeded (returns OK) or failed
  // for good: a permanent error from the coordinator (ALREADY_EXISTS,
  // INVALID_ARGUMENT, ...) or --connect_timeout passed (DEADLINE_EXCEEDED
  // naming the coordinator). Then keeps the session alive in the background.
  absl::Status Start();

  // Sends a message on the current session; UNAVAILABLE when none is open.
  absl::Status Send(v1::WorkerMessage message);

  // Job the worker reports in heartbeats; "" = idle.
  void SetCurrentJob(const std::string& job_id);

  // Closes the session (the coordinator sees a clean end) and joins threads.
  void Stop();

  std::string worker_id() const;

 private:
  absl::Status RegisterOnce(v1::RegisterResponse* response);
  absl::Status RegisterWithRetry(absl::Time give_up);
  void SessionLoop();
  // Runs one session until it breaks or Stop(); returns why it ended.
  absl::Status RunSession();

  const Options options_;
  const Hooks hooks_;
  std::unique_ptr<v1::ControlService::Stub> stub_;

  mutable absl::Mutex mu_;
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::string token_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  std::string current_job_ ABSL_GUARDED_BY(mu_);
  grpc::ClientContext* session_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream_
      ABSL_GUARDED_BY(mu_) = nullptr;
  // One writer at a time on the stream; taken after mu_ (never before it).
  absl::Mutex write_mu_ ABSL_ACQUIRED_AFTER(mu_);

  absl::Notification stopping_;
  std::thread session_thread_;
  uint64_t heartbeat_seq_ = 0;  // session thread only
};

}  // namespace detour

#endif  // DETOUR_WORKER_CONTROL_CLIENT_H_
