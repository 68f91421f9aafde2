#include "coordinator/job_service.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/net/grpc_status.h"
#include "common/net/reactor_support.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/tsan.h"
#include "google/protobuf/util/time_util.h"

namespace detour {
namespace {

constexpr char kStoredMessage[] = "accepted; waiting for workers";

// List paging (job_service.proto): jobs per page by default and at most, and
// the serialized size at which a page stops, well under the 4 MiB that
// gRPC clients accept by default.
constexpr uint32_t kDefaultPageSize = 100;
constexpr uint32_t kMaxPageSize = 1000;
constexpr size_t kMaxPageBytes = size_t{3} << 20;

// A page token is the id of the last job of the previous page ("job-" and
// digits, as JobStore::Create names jobs).
bool ValidPageToken(const std::string& token) {
  constexpr absl::string_view kPrefix = "job-";
  if (token.size() <= kPrefix.size() || token.size() > 32 || !absl::StartsWith(token, kPrefix)) {
    return false;
  }
  return std::all_of(token.begin() + kPrefix.size(), token.end(),
                     [](char c) { return absl::ascii_isdigit(c); });
}

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* context, const absl::Status& s) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(s));
  return reactor;
}

// A Watch refused before it started.
class RefusedWatch : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  explicit RefusedWatch(const absl::Status& status) {
    DETOUR_HAPPENS_BEFORE(this);  // OnDone follows the Finish (common/tsan.h)
    Finish(ToGrpcStatus(status));
  }
  void OnDone() override {
    DETOUR_HAPPENS_AFTER(this);
    delete this;
  }
};

// Records a client's call in the job's history (and the log) and returns
// the event appended: nullopt only when the job is not in the store. A write
// the backend refused still took effect in memory (JobStore::Update).
std::optional<v1::JobHistoryEvent> RecordAction(JobStore* store, const std::string& job_id,
                                                const std::string& what) {
  LogInfo("job ", job_id, " ", what);
  v1::JobHistoryEvent event;
  *event.mutable_time() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
  event.set_kind(v1::JobHistoryEvent::KIND_CLIENT_ACTION);
  event.set_message(what);
  if (absl::Status s = store->AddEvent(job_id, event).status(); !s.ok()) {
    LogWarning("job ", job_id, ": recording \"", what, "\": ", s.message());
    if (absl::IsNotFound(s)) return std::nullopt;
  }
  return event;
}

// The answer to a client's action is the job as the action left it (a later
// pending reason must not replace what the action said), with the action's
// audit event in its history.
void AnswerWithAction(v1::Job* job, const std::optional<v1::JobHistoryEvent>& action) {
  if (action.has_value()) JobStore::AppendEvent(job, *action);
}

// Cancel and Resume act only on jobs the caller may manage (its own, or any
// as an admin).
absl::Status CheckManages(const JobStore& store, const Caller& caller, const std::string& job_id,
                          absl::string_view method, absl::string_view verb) {
  auto job = store.Get(job_id);
  if (!job.ok()) return job.status();
  if (caller.MayManage(job->owner())) return absl::OkStatus();
  LogWarning(method, " of job ", job_id, " by ", caller.Describe(), " refused: owned by ",
             job->owner());
  return absl::PermissionDeniedError(absl::StrCat(method, ": job ", job_id, " belongs to ",
                                                  job->owner(), "; only its owner or an admin may ",
                                                  verb, " it"));
}

v1::JobEvent EventFor(const v1::Job& job) {
  v1::JobEvent event;
  *event.mutable_job() = job;
  *event.mutable_time() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(absl::Now()));
  return event;
}

}  // namespace

// Streams a job's changes until it reaches a final state. Owned by gRPC until
// OnDone; store listeners reach it through a handle.
class WatchReactor : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  WatchReactor(JobServiceImpl* service, const std::string& job_id)
      : service_(service), handle_(std::make_shared<ReactorHandle<WatchReactor>>(this)) {
    {
      absl::MutexLock lock(&service_->mu_);
      if (service_->closing_) {
        Apply(outbox_.RequestFinish(
            grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down")));
        return;
      }
      service_->watches_[this] = true;
    }
    // The job as it is now, then each change in order: a snapshot taken
    // apart from the subscription could reach the client after a newer
    // change and take it back.
    auto handle = handle_;
    auto listener = service_->store_->Follow(job_id, [handle](const v1::Job& job) {
      handle->With([&job](WatchReactor* r) { r->Push(job); });
    });
    if (!listener.ok()) {
      Apply(outbox_.RequestFinish(ToGrpcStatus(listener.status())));
      return;
    }
    listener_ = *listener;
  }

  void Push(const v1::Job& job) {
    if (JobStore::IsFinal(job.state())) {
      Apply(outbox_.EnqueueLast(EventFor(job), grpc::Status::OK));
    } else {
      Apply(outbox_.Enqueue(EventFor(job)));
    }
  }

  void Close(grpc::Status status) { Apply(outbox_.RequestFinish(std::move(status))); }

  // gRPC orders these through its completion queue, which ThreadSanitizer
  // cannot see (common/tsan.h): a write's reaction follows its StartWrite
  // (&outbox_), OnDone every reaction and the Finish (this).
  void OnWriteDone(bool ok) override {
    DETOUR_HAPPENS_AFTER(&outbox_);
    ReactionEnd end(this);
    Apply(outbox_.WriteDone(ok));
  }
  void OnCancel() override {
    ReactionEnd end(this);
    Close(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  }

  void OnDone() override {
    DETOUR_HAPPENS_AFTER(this);
    if (listener_ != 0) service_->store_->RemoveListener(listener_);
    {
      absl::MutexLock lock(&service_->mu_);
      service_->watches_.erase(this);
    }
    handle_->Detach();
    Unref();
  }

  void AddRef() { refs_.AddRef(); }
  void Unref() {
    if (refs_.Release()) delete this;
  }

 private:
  // On any thread (the constructor, reactions, the store's listeners).
  void Apply(const ServerOutbox<v1::JobEvent>::Action& action) {
    if (action.write != nullptr) {
      DETOUR_HAPPENS_BEFORE(&outbox_);
      StartWrite(action.write);
    }
    if (action.finish) {
      DETOUR_HAPPENS_BEFORE(this);
      Finish(action.status);
    }
  }

  JobServiceImpl* const service_;
  std::shared_ptr<ReactorHandle<WatchReactor>> handle_;
  ServerOutbox<v1::JobEvent> outbox_;
  ReactorRefs refs_;
  uint64_t listener_ = 0;
};

JobServiceImpl::JobServiceImpl(JobStore* store, const ClientAuthorizer* auth, Hooks hooks,
                               const LeaderGate* gate)
    : store_(store), auth_(auth), gate_(gate), hooks_(std::move(hooks)) {}

JobServiceImpl::~JobServiceImpl() = default;

grpc::ServerUnaryReactor* JobServiceImpl::Submit(grpc::CallbackServerContext* context,
                                                 const v1::SubmitJobRequest* request,
                                                 v1::Job* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Submit"); !g.ok()) return Reply(context, g);
  }
  auto caller = auth_->Identify(*context, ClientRole::kSubmit, "Submit");
  if (!caller.ok()) return Reply(context, caller.status());
  auto spec = NormalizeJobSpec(request->spec());
  if (!spec.ok()) return Reply(context, Annotate(spec.status(), "spec"));
  auto job = store_->Create(*spec, absl::Now(), kStoredMessage, caller->name);
  if (!job.ok()) return Reply(context, job.status());
  AnswerWithAction(&*job, RecordAction(store_, job->id(),
                                       absl::StrCat("submitted by ", caller->Describe(), " (",
                                                    job->spec().name(), ")")));
  if (hooks_.on_submitted) hooks_.on_submitted(job->id());
  *response = *std::move(job);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* JobServiceImpl::Get(grpc::CallbackServerContext* context,
                                              const v1::GetJobRequest* request, v1::Job* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Get"); !g.ok()) return Reply(context, g);
  }
  if (absl::Status a = auth_->Check(*context, ClientRole::kRead, "Get"); !a.ok()) {
    return Reply(context, a);
  }
  if (request->job_id().empty()) {
    return Reply(context, absl::InvalidArgumentError("job_id: required"));
  }
  auto job = store_->Get(request->job_id());
  if (!job.ok()) return Reply(context, job.status());
  *response = *std::move(job);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* JobServiceImpl::List(grpc::CallbackServerContext* context,
                                               const v1::ListJobsRequest* request,
                                               v1::ListJobsResponse* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "List"); !g.ok()) return Reply(context, g);
  }
  if (absl::Status a = auth_->Check(*context, ClientRole::kRead, "List"); !a.ok()) {
    return Reply(context, a);
  }
  if (!v1::JobState_IsValid(request->state())) {
    return Reply(context, absl::InvalidArgumentError(
                              absl::StrCat("state: unknown value ", request->state())));
  }
  if (request->owner().size() > kMaxCallerNameBytes) {
    return Reply(context, absl::InvalidArgumentError(
                              absl::StrCat("owner: ", request->owner().size(),
                                           " bytes is longer than ", kMaxCallerNameBytes)));
  }
  const std::string& token = request->page_token();
  if (!token.empty() && !ValidPageToken(token)) {
    return Reply(context, absl::InvalidArgumentError(
                              absl::StrCat("page_token: \"", absl::CHexEscape(token.substr(0, 64)),
                                           "\" is not a next_page_token of a previous List")));
  }
  const uint32_t size =
      request->page_size() == 0 ? kDefaultPageSize : std::min(request->page_size(), kMaxPageSize);
  JobStore::Page page =
      store_->ListPage(request->state(), token, size, kMaxPageBytes, request->owner());
  for (v1::Job& job : page.jobs) *response->add_jobs() = std::move(job);
  if (page.more) response->set_next_page_token(response->jobs().rbegin()->id());
  return Reply(context, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::JobEvent>* JobServiceImpl::Watch(grpc::CallbackServerContext* context,
                                                              const v1::WatchJobRequest* request) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Watch"); !g.ok()) return new RefusedWatch(g);
  }
  if (absl::Status a = auth_->Check(*context, ClientRole::kRead, "Watch"); !a.ok()) {
    return new RefusedWatch(a);
  }
  return new WatchReactor(this, request->job_id());
}

grpc::ServerUnaryReactor* JobServiceImpl::Cancel(grpc::CallbackServerContext* context,
                                                 const v1::CancelJobRequest* request,
                                                 v1::Job* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Cancel"); !g.ok()) return Reply(context, g);
  }
  auto caller = auth_->Identify(*context, ClientRole::kSubmit, "Cancel");
  if (!caller.ok()) return Reply(context, caller.status());
  if (request->job_id().empty()) {
    return Reply(context, absl::InvalidArgumentError("job_id: required"));
  }
  if (absl::Status m = CheckManages(*store_, *caller, request->job_id(), "Cancel", "cancel");
      !m.ok()) {
    return Reply(context, m);
  }
  const std::string by = absl::StrCat("cancelled by ", caller->Describe());
  auto job = store_->Cancel(request->job_id(), absl::Now(), by);
  if (!job.ok()) return Reply(context, job.status());
  AnswerWithAction(&*job, RecordAction(store_, job->id(), by));
  if (hooks_.on_cancelled) hooks_.on_cancelled(job->id());
  *response = *std::move(job);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* JobServiceImpl::Resume(grpc::CallbackServerContext* context,
                                                 const v1::ResumeJobRequest* request,
                                                 v1::Job* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "Resume"); !g.ok()) return Reply(context, g);
  }
  auto caller = auth_->Identify(*context, ClientRole::kSubmit, "Resume");
  if (!caller.ok()) return Reply(context, caller.status());
  if (request->job_id().empty()) {
    return Reply(context, absl::InvalidArgumentError("job_id: required"));
  }
  if (absl::Status m = CheckManages(*store_, *caller, request->job_id(), "Resume", "resume");
      !m.ok()) {
    return Reply(context, m);
  }
  if (request->checkpoint().size() > SpecLimits::kMaxPathBytes) {
    return Reply(context, absl::InvalidArgumentError(
                              absl::StrCat("checkpoint: ", request->checkpoint().size(),
                                           " bytes is longer than ", SpecLimits::kMaxPathBytes)));
  }
  if (!hooks_.on_resume) return Reply(context, absl::UnimplementedError("resume is not served"));
  auto job =
      hooks_.on_resume(request->job_id(), request->checkpoint(), request->replicas_per_stage());
  if (!job.ok()) return Reply(context, job.status());
  AnswerWithAction(&*job, RecordAction(store_, job->id(),
                                       absl::StrCat("resumed by ", caller->Describe(), " from ",
                                                    job->spec().checkpoint().resume_from())));
  *response = *std::move(job);
  return Reply(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* JobServiceImpl::GetLinks(grpc::CallbackServerContext* context,
                                                   const v1::GetLinksRequest* request,
                                                   v1::GetLinksResponse* response) {
  if (gate_ != nullptr) {
    if (absl::Status g = gate_->Check(context, "GetLinks"); !g.ok()) return Reply(context, g);
  }
  if (absl::Status a = auth_->Check(*context, ClientRole::kRead, "GetLinks"); !a.ok()) {
    return Reply(context, a);
  }
  if (request->job_id().empty()) {
    return Reply(context, absl::InvalidArgumentError("job_id: required"));
  }
  if (!hooks_.on_links) return Reply(context, absl::UnimplementedError("links are not served"));
  auto links = hooks_.on_links(request->job_id());
  if (!links.ok()) return Reply(context, links.status());
  *response = *std::move(links);
  return Reply(context, absl::OkStatus());
}

void JobServiceImpl::CloseWatches() {
  std::vector<WatchReactor*> open;
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    for (auto& [reactor, unused] : watches_) {
      reactor->AddRef();
      open.push_back(reactor);
    }
  }
  for (WatchReactor* reactor : open) {
    reactor->Close(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator is shutting down"));
    reactor->Unref();
  }
}

}  // namespace detour
