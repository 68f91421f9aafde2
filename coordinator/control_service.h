// ControlService: worker registration, the per-worker Session stream
// (heartbeats in; assignments, plans and cancellations out) and ListWorkers.
// Thread-safe; gRPC callback API, nothing blocks a reaction.
#ifndef DETOUR_COORDINATOR_CONTROL_SERVICE_H_
#define DETOUR_COORDINATOR_CONTROL_SERVICE_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "coordinator/client_auth.h"
#include "coordinator/leader_gate.h"
#include "coordinator/worker_registry.h"
#include "detour/v1/control_service.grpc.pb.h"

namespace detour {

class SessionReactor;

class ControlServiceImpl final : public v1::ControlService::CallbackService {
 public:
  // Observers of control-plane events (metrics, logs). Called on gRPC threads;
  // must be quick and must not block.
  struct Hooks {
    std::function<void(const v1::WorkerInfo&)> on_register;
    std::function<void(const std::string& worker_id, const v1::Heartbeat& beat)> on_heartbeat;
    // Any non-heartbeat message from a worker (results, timings, errors).
    std::function<void(const std::string& worker_id, const v1::WorkerMessage&)> on_message;
  };

  // Does not own `registry` or `auth` (for ListWorkers), which must outlive
  // the service. With `require_worker_certificates` (TLS), Register and
  // Session accept a worker only when its verified certificate is a
  // worker's (common/net/identity.h; one without a kind only with
  // `allow_unmarked_worker_certs`) and names the worker id it registers as.
  // Every call first asks `gate` (not owned; null = always open): a
  // follower answers UNAVAILABLE naming the leader.
  ControlServiceImpl(WorkerRegistry* registry, const ClientAuthorizer* auth,
                     bool require_worker_certificates, Hooks hooks,
                     bool allow_unmarked_worker_certs = false, const LeaderGate* gate = nullptr);
  ~ControlServiceImpl() override;

  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context,
                                     const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override;
  grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* Session(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ListWorkers(grpc::CallbackServerContext* context,
                                        const v1::ListWorkersRequest* request,
                                        v1::ListWorkersResponse* response) override;

  // Queues a message on the worker's session, stamped with the leader's
  // term. NOT_FOUND when the worker has no open session; UNAVAILABLE when
  // the gate is closed (this coordinator no longer leads: nothing more is
  // sent).
  absl::Status Send(const std::string& worker_id, v1::CoordinatorMessage message);

  // Ends every session with UNAVAILABLE (coordinator draining); workers then
  // reconnect to whichever coordinator comes up.
  void CloseSessions();

  int open_sessions() const;

 private:
  friend class SessionReactor;
  WorkerRegistry* const registry_;
  const ClientAuthorizer* const auth_;
  const bool require_worker_certificates_;
  const bool allow_unmarked_worker_certs_;
  const LeaderGate* const gate_;
  const Hooks hooks_;
  mutable absl::Mutex mu_;
  // Open sessions by worker id (set once the first message authenticates).
  std::map<std::string, SessionReactor*> sessions_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_CONTROL_SERVICE_H_
