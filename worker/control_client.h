// The worker's side of the control plane: registers with the coordinator
// (retrying with backoff while it is unreachable), keeps a Session stream
// open with periodic heartbeats, hands coordinator messages to a handler, and
// re-registers when the session breaks (e.g. the coordinator restarted).
//
// One writer thread per session owns the stream's writes: Send only queues
// (bounded), and a due heartbeat goes before any queued job message, so
// neither the job runtime nor the heartbeat timer ever waits on the stream.
// A write that stays blocked longer than write_stall_timeout (the
// coordinator stopped reading, the link stalled) cancels the session; a new
// one is registered and its heartbeats flow again. Messages still queued
// when a session ends are dropped (and logged); on Stop() the queue is
// flushed first, for at most rpc_timeout.
// Thread-safe. Owns three threads while a session is open.
#ifndef DETOUR_WORKER_CONTROL_CLIENT_H_
#define DETOUR_WORKER_CONTROL_CLIENT_H_

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/net/tls.h"
#include "detour/v1/control_service.grpc.pb.h"
#include "worker/term_fence.h"

namespace detour {

class ControlClient {
 public:
  struct Options {
    // host:port, or several comma-separated (coordinators electing a leader
    // over etcd): registration follows a follower's redirection to the
    // leader, else tries the next address.
    std::string coordinator;
    // TLS (the coordinator's certificate verified, ours presented) or plaintext.
    TransportSecurity security;
    v1::RegisterRequest registration;
    // Give up when the first registration has not succeeded by then; zero =
    // keep trying until Stop().
    absl::Duration connect_timeout = absl::ZeroDuration();
    absl::Duration initial_backoff = absl::Milliseconds(200);
    absl::Duration max_backoff = absl::Seconds(5);
    absl::Duration rpc_timeout = absl::Seconds(3);
    // Job messages queued for the session, at most (Send then answers
    // RESOURCE_EXHAUSTED): this many, and this many bytes.
    size_t max_outbox_messages = 4096;
    size_t max_outbox_bytes = size_t{64} << 20;
    // A session whose current write has been blocked this long is
    // cancelled; zero = max(3 heartbeat intervals, rpc_timeout).
    absl::Duration write_stall_timeout = absl::ZeroDuration();
  };
  struct Hooks {
    std::function<void(const v1::CoordinatorMessage&)> on_message;  // on the reader thread
    std::function<void()> on_heartbeat_sent;                        // on the writer thread
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

  // Queues a message for the current session and returns at once:
  // UNAVAILABLE when no session is open, RESOURCE_EXHAUSTED when the outbox
  // is full (the session is stalled).
  absl::Status Send(v1::WorkerMessage message);

  // Job the worker reports in heartbeats; "" = idle.
  void SetCurrentJob(const std::string& job_id);

  // Closes the session (the coordinator sees a clean end) and joins threads.
  void Stop();

  std::string worker_id() const;
  // The coordinator of the current (or last) registration.
  std::string coordinator() const;
  // The newest leader term seen; messages of older ones are dropped.
  const TermFence& fence() const { return fence_; }

 private:
  // Registers with the current coordinator. On UNAVAILABLE the next attempt
  // goes to the leader a follower named (`*redirected` set) or the next
  // address of the list.
  absl::Status RegisterOnce(v1::RegisterResponse* response, bool* redirected);
  v1::ControlService::Stub* StubFor(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status RegisterWithRetry(absl::Time give_up);
  void SessionLoop();
  // Runs one session until it breaks or Stop(); returns why it ended.
  absl::Status RunSession();
  // The session's writer thread: heartbeats first, then the outbox in
  // order; on writer_stop_ it flushes the outbox and closes its side.
  void WriterLoop(grpc::ClientReaderWriter<v1::WorkerMessage, v1::CoordinatorMessage>* stream,
                  const std::string& token);
  absl::Duration StallTimeout() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Hooks hooks_;
  const std::vector<std::string> addresses_;
  TermFence fence_;

  mutable absl::Mutex mu_;
  // Where the next registration goes; the session goes where the last one
  // succeeded.
  std::string current_ ABSL_GUARDED_BY(mu_);
  size_t next_index_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::unique_ptr<v1::ControlService::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  std::string worker_id_ ABSL_GUARDED_BY(mu_);
  std::string token_ ABSL_GUARDED_BY(mu_);
  absl::Duration heartbeat_interval_ ABSL_GUARDED_BY(mu_) = absl::Seconds(2);
  std::string current_job_ ABSL_GUARDED_BY(mu_);
  // The open session's state, shared by Send, the session thread and the
  // writer thread.
  bool session_open_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<v1::WorkerMessage> outbox_ ABSL_GUARDED_BY(mu_);
  size_t outbox_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool heartbeat_due_ ABSL_GUARDED_BY(mu_) = false;
  bool writer_stop_ ABSL_GUARDED_BY(mu_) = false;  // flush, close, exit
  bool writer_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  // When the write in flight started; InfiniteFuture when none is.
  absl::Time write_started_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool stop_requested_ ABSL_GUARDED_BY(mu_) = false;

  absl::Notification stopping_;
  // Started by Start() unless Stop() came first (Stop may run on another
  // thread while Start still registers).
  std::thread session_thread_ ABSL_GUARDED_BY(mu_);
  uint64_t heartbeat_seq_ = 0;  // writer thread of the one open session only
};

}  // namespace detour

#endif  // DETOUR_WORKER_CONTROL_CLIENT_H_
