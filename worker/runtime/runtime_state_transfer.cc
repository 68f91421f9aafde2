#include "worker/runtime/runtime_state_transfer.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "worker/runtime/stage_state.h"

namespace detour {

void RuntimeStateTransfer::OnSendState(const v1::SendState& request) {
  if (request.job_id() != job_id_ || stage_ == nullptr) return;
  if (it_ != nullptr) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat("asked to send the stage state to ", request.to(), " mid-iteration")));
  }
  auto frame =
      PackStageState(*stage_, *optimizer_, kfac_.get(), job_id_, completed_, me_, request.epoch());
  if (!frame.ok()) return Fail(frame.status());
  const uint64_t size = frame->bytes;
  metrics_.StateBytes(/*sent=*/true, size);
  if (!request.peer().worker_id().empty() && request.peer().worker_id() != me_) {
    const v1::Peer& p = request.peer();
    peers_[p.worker_id()] = Endpoint(p);
    PushPeers();
  }
  LogInfo("job ", job_id_, ": sending the stage state (", size, " bytes) to ", request.to());
  const std::string job = job_id_;
  const std::string to = request.to();
  transport_->Send(to, std::move(frame->header), std::move(frame->view),
                   [this, job, to](absl::Status s, double) {
                     if (s.ok()) return;
                     core_->Post([this, job, to, s] {
                       if (job != job_id_) return;
                       LogWarning("job ", job_id_, ": the stage state did not reach ", to, ": ",
                                  s.message());
                       ReportUnreachable(completed_, to, s);
                     });
                   });
}

void RuntimeStateTransfer::OnState(const v1::FrameHeader& h, const at::Tensor& bytes) {
  if (state_from_.empty() || h.sender() != state_from_) {
    metrics_.UnexpectedFrame();
    return;
  }
  const size_t size = bytes.nbytes();
  metrics_.StateBytes(/*sent=*/false, size);
  absl::Status s = UnpackStageState(h.sender(), bytes.data_ptr(), size, stage_.get(),
                                    optimizer_.get(), kfac_.get());
  if (!s.ok()) return Fail(s);
  LogInfo("job ", job_id_, ": received the stage state (", size, " bytes) from ", state_from_);
  state_from_.clear();
  admission_.StateReceived();
  v1::WorkerMessage m;
  v1::StateReceived* r = m.mutable_state_received();
  r->set_job_id(job_id_);
  r->set_stage(stage_index_);
  r->set_parameter_checksum(ParameterChecksum(stage_->Parameters()));
  Send(std::move(m));
}

}  // namespace detour
