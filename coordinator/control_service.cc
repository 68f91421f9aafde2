#include "coordinator/control_service.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/net/grpc_status.h"
#include "common/net/identity.h"
#include "common/net/reactor_support.h"
#include "common/net/tls.h"
#include "common/tsan.h"

namespace detour {
namespace {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

// A Session refused before it starts (this coordinator is not the leader).
class RefusedSession : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  explicit RefusedSession(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

// One worker's Session stream. Reads are handled inline (they only touch the
// registry); writes go through an outbox. Deleted when gRPC is done with it
// and no other thread holds a reference.
class SessionReactor : public grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage> {
 public:
  // `peer_name`: the worker's verified certificate CN, if any; `peer_kind`:
  // whether that certificate is a worker's (CheckWorkerPeer).
  SessionReactor(ControlServiceImpl* service, std::optional<std::string> peer_name,
                 absl::Status peer_kind)
      : service_(service), peer_name_(std::move(peer_name)), peer_kind_(std::move(peer_kind)) {
    NextRead();
  }

  // gRPC orders these through its completion queue, which ThreadSanitizer
  // cannot see (common/tsan.h): a read's reaction follows the StartRead,
  // a write's follows the StartWrite (&incoming_, &outbox_), and OnDone
  // follows every reaction and the Finish (this).
  void OnReadDone(bool ok) override {
    DETOUR_HAPPENS_AFTER(&incoming_);
    ReactionEnd end(this);
    if (!ok) {  // the worker closed its side or went away
      Apply(outbox_.FinishAfterQueued(grpc::Status::OK));
      return;
    }
    if (!HandleMessage()) return;
    NextRead();
  }

  void OnWriteDone(bool ok) override {
    DETOUR_HAPPENS_AFTER(&outbox_);
    ReactionEnd end(this);
    Apply(outbox_.WriteDone(ok));
  }

  void OnDone() override {
    DETOUR_HAPPENS_AFTER(this);
    {
      absl::MutexLock lock(&service_->mu_);
      auto it = service_->sessions_.find(worker_id_);
      if (it != service_->sessions_.end() && it->second == this) service_->sessions_.erase(it);
    }
    // A worker whose stream ended may register again under its id at once.
    if (!token_.empty()) service_->registry_->SessionEnded(token_);
    if (!worker_id_.empty()) LogInfo("session of worker ", worker_id_, " ended");
    Unref();
  }

  void Send(v1::CoordinatorMessage message) { Apply(outbox_.Enqueue(std::move(message))); }
  void Close(grpc::Status status) { Apply(outbox_.RequestFinish(std::move(status))); }

  void AddRef() { refs_.AddRef(); }
  void Unref() {
    if (refs_.Release()) delete this;
  }

 private:
  // False when the stream is being closed.
  bool HandleMessage() {
    const absl::Time now = absl::Now();
    if (worker_id_.empty()) {
      auto id = service_->registry_->WorkerForToken(incoming_.session_token());
      if (!id.ok()) {
        Close(ToGrpcStatus(id.status()));
        return false;
      }
      if (service_->require_worker_certificates_ && peer_name_.has_value() && !peer_kind_.ok()) {
        LogWarning("refused a session for worker ", *id, ": ", peer_kind_.message());
        Close(ToGrpcStatus(peer_kind_));
        return false;
      }
      if (service_->require_worker_certificates_ && peer_name_ != *id) {
        LogWarning("refused a session for worker ", *id, " from ",
                   peer_name_ ? absl::StrCat("certificate ", *peer_name_)
                              : "a peer without a certificate");
        Close(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                           absl::StrCat("the session of worker ", *id,
                                        " must come from a certificate naming it")));
        return false;
      }
      SessionReactor* replaced = nullptr;
      {
        absl::MutexLock lock(&service_->mu_);
        if (service_->closing_) {
          Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down"));
          return false;
        }
        worker_id_ = *id;
        token_ = incoming_.session_token();
        auto& slot = service_->sessions_[worker_id_];
        if (slot != nullptr) {
          replaced = slot;
          replaced->AddRef();
        }
        slot = this;
      }
      if (replaced != nullptr) {  // the worker re-registered; drop its old stream
        replaced->Close(grpc::Status(grpc::StatusCode::ABORTED, "replaced by a newer session"));
        replaced->Unref();
      }
      service_->registry_->SessionOpened(token_);
      LogInfo("session of worker ", worker_id_, " open");
    }
    if (incoming_.has_heartbeat()) {
      auto id =
          service_->registry_->Heartbeat(incoming_.session_token(), incoming_.heartbeat(), now);
      if (!id.ok()) {
        Close(ToGrpcStatus(id.status()));
        return false;
      }
      if (service_->hooks_.on_heartbeat) service_->hooks_.on_heartbeat(*id, incoming_.heartbeat());
    } else if (service_->hooks_.on_message) {
      service_->hooks_.on_message(worker_id_, incoming_);
    }
    return true;
  }

  void NextRead() {
    DETOUR_HAPPENS_BEFORE(&incoming_);
    StartRead(&incoming_);
  }

  // On any thread (reactions, and Send/Close from the job threads).
  void Apply(const ServerOutbox<v1::CoordinatorMessage>::Action& action) {
    if (action.write != nullptr) {
      DETOUR_HAPPENS_BEFORE(&outbox_);
      StartWrite(action.write);
    }
    if (action.finish) {
      DETOUR_HAPPENS_BEFORE(this);
      Finish(action.status);
    }
  }

  ControlServiceImpl* const service_;
  const std::optional<std::string> peer_name_;
  const absl::Status peer_kind_;
  v1::WorkerMessage incoming_;
  std::string worker_id_;  // only touched by the read path and OnDone
  std::string token_;      // likewise
  ServerOutbox<v1::CoordinatorMessage> outbox_;
  ReactorRefs refs_;
};

ControlServiceImpl::ControlServiceImpl(WorkerRegistry* registry, const ClientAuthorizer* auth,
                                       bool require_worker_certificates, Hooks hooks,
                                       bool allow_unmarked_worker_certs, const LeaderGate* gate)
    : registry_(registry),
      auth_(auth),
      require_worker_certificates_(require_worker_certificates),
      allow_unmarked_worker_certs_(allow_unmarked_worker_certs),
      gate_(gate),
      hooks_(std::move(hooks)) {}

ControlServiceImpl::~ControlServiceImpl() = default;

grpc::ServerUnaryReactor* ControlServiceImpl::Register(grpc::CallbackServerContext* context,
                                                       const v1::RegisterRequest* request,
                                                       v1::RegisterResponse* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Register"); !g.ok()) return Reply(context, g);
  }
  {
    absl::MutexLock lock(&mu_);
    if (closing_) {
      return Reply(context, absl::UnavailableError("coordinator is shutting down"));
    }
  }
  v1::RegisterRequest checked = *request;
  if (require_worker_certificates_) {
    // The worker id is the certificate's identity, not a field it claims.
    std::optional<std::string> name = VerifiedPeerName(context->auth_context().get());
    if (!name.has_value()) {
      LogWarning("refused a registration without a worker certificate (claimed id \"",
                 absl::CHexEscape(request->worker_id().substr(0, 64)), "\")");
      return Reply(context, absl::UnauthenticatedError(
                                "Register needs a worker certificate from the cluster CA"));
    }
    // Only a worker's certificate: a client's or the coordinator's from the
    // same CA must not receive job specs, peers and tensors.
    if (absl::Status kind =
            CheckWorkerPeer(context->auth_context().get(), allow_unmarked_worker_certs_);
        !kind.ok()) {
      LogWarning("refused a registration: ", kind.message());
      return Reply(context, kind);
    }
    if (!request->worker_id().empty() && request->worker_id() != *name) {
      LogWarning("refused certificate ", *name, " registering as worker \"",
                 absl::CHexEscape(request->worker_id().substr(0, 64)), "\"");
      return Reply(context, absl::PermissionDeniedError(absl::StrCat(
                                "the certificate names worker ", *name, ", not \"",
                                absl::CHexEscape(request->worker_id().substr(0, 64)), "\"")));
    }
    checked.set_worker_id(*name);
  }
  auto registered = registry_->Register(checked, absl::Now());
  if (!registered.ok()) return Reply(context, registered.status());
  *response = *std::move(registered);
  if (gate_ != nullptr) response->set_leader_term(std::max<int64_t>(0, gate_->OpenTerm()));
  LogInfo("worker ", response->worker_id(), " registered (region ", request->region(), ", address ",
          request->address().empty() ? "-" : request->address(), ")");
  if (hooks_.on_register) {
    for (const v1::WorkerInfo& info : registry_->List(true)) {
      if (info.worker_id() == response->worker_id()) hooks_.on_register(info);
    }
  }
  return Reply(context, absl::OkStatus());
}

grpc::ServerBidiReactor<v1::WorkerMessage, v1::CoordinatorMessage>* ControlServiceImpl::Session(
    grpc::CallbackServerContext* context) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Session"); !g.ok()) return new RefusedSession(g);
  }
  return new SessionReactor(
      this, VerifiedPeerName(context->auth_context().get()),
      require_worker_certificates_
          ? CheckWorkerPeer(context->auth_context().get(), allow_unmarked_worker_certs_)
          : absl::OkStatus());
}

grpc::ServerUnaryReactor* ControlServiceImpl::ListWorkers(grpc::CallbackServerContext* context,
                                                          const v1::ListWorkersRequest* request,
                                                          v1::ListWorkersResponse* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "ListWorkers"); !g.ok()) return Reply(context, g);
  }
  if (absl::Status a = auth_->Check(*context, ClientRole::kRead, "ListWorkers"); !a.ok()) {
    return Reply(context, a);
  }
  for (v1::WorkerInfo& info : registry_->List(request->include_lost())) {
    *response->add_workers() = std::move(info);
  }
  return Reply(context, absl::OkStatus());
}

absl::Status ControlServiceImpl::Send(const std::string& worker_id,
                                      v1::CoordinatorMessage message) {
  if (gate_ != nullptr) {
    // Checked last thing before queueing: a leader whose lease may have
    // run out (it was paused, etcd is cut off) sends nothing more.
    const int64_t term = gate_->OpenTerm();
    if (term < 0) {
      return absl::UnavailableError(
          absl::StrCat("not sent to worker ", worker_id, ": this coordinator no longer leads"));
    }
    message.set_leader_term(term);
  }
  SessionReactor* reactor = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(worker_id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("worker ", worker_id, " has no open session"));
    }
    reactor = it->second;
    reactor->AddRef();
  }
  reactor->Send(std::move(message));
  reactor->Unref();
  return absl::OkStatus();
}

void ControlServiceImpl::CloseSessions() {
  std::vector<SessionReactor*> open;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    for (auto& [id, reactor] : sessions_) {
      reactor->AddRef();
      open.push_back(reactor);
    }
  }
  for (SessionReactor* reactor : open) {
    reactor->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down"));
    reactor->Unref();
  }
}

int ControlServiceImpl::open_sessions() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

}  // namespace detour
