// JobService: the client-facing API (Submit, Get, List, Watch, Cancel,
// Resume, GetLinks) over the JobStore. Thread-safe; gRPC callback API, nothing blocks a reaction.
#ifndef DETOUR_COORDINATOR_JOB_SERVICE_H_
#define DETOUR_COORDINATOR_JOB_SERVICE_H_

#include <functional>
#include <map>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "coordinator/client_auth.h"
#include "coordinator/job_store.h"
#include "coordinator/leader_gate.h"
#include "detour/v1/job_service.grpc.pb.h"

namespace detour {

class WatchReactor;

class JobServiceImpl final : public v1::JobService::CallbackService {
 public:
  // Called after a job was stored / cancelled (the JobManager drives it).
  struct Hooks {
    std::function<void(const std::string& job_id)> on_submitted;
    std::function<void(const std::string& job_id)> on_cancelled;
    // Resume: the JobManager checks and re-queues the job
    // (replicas_per_stage 0 = the job's own).
    std::function<absl::StatusOr<v1::Job>(const std::string& job_id, const std::string& checkpoint,
                                          uint32_t replicas_per_stage)>
        on_resume;
    // GetLinks: the running job's link matrix.
    std::function<absl::StatusOr<v1::GetLinksResponse>(const std::string& job_id)> on_links;
  };
  // Does not own `store`, `auth` or `gate`, which must outlive the service.
  // Every RPC first asks `gate` (null = always open) whether this
  // coordinator serves (a follower answers UNAVAILABLE naming the leader),
  // then checks its caller with `auth`.
  JobServiceImpl(JobStore* store, const ClientAuthorizer* auth, Hooks hooks,
                 const LeaderGate* gate = nullptr);
  ~JobServiceImpl() override;

  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
                                   const v1::SubmitJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* context,
                                const v1::GetJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* context,
                                 const v1::ListJobsRequest* request,
                                 v1::ListJobsResponse* response) override;
  grpc::ServerWriteReactor<v1::JobEvent>* Watch(grpc::CallbackServerContext* context,
                                                const v1::WatchJobRequest* request) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const v1::CancelJobRequest* request, v1::Job* response) override;

  grpc::ServerUnaryReactor* Resume(grpc::CallbackServerContext* context,
                                   const v1::ResumeJobRequest* request, v1::Job* response) override;
  grpc::ServerUnaryReactor* GetLinks(grpc::CallbackServerContext* context,
                                     const v1::GetLinksRequest* request,
                                     v1::GetLinksResponse* response) override;

  // Ends every open Watch stream with UNAVAILABLE (coordinator draining).
  void CloseWatches();

 private:
  friend class WatchReactor;
  JobStore* const store_;
  const ClientAuthorizer* const auth_;
  const LeaderGate* const gate_;
  const Hooks hooks_;
  absl::Mutex mu_;
  std::map<WatchReactor*, bool> watches_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_JOB_SERVICE_H_
