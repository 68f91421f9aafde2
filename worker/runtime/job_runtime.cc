#include "worker/runtime/job_runtime.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "worker/model/torch_status.h"
#include "worker/runtime/link_prober.h"
#include "worker/runtime/runtime_bubbles.h"
#include "worker/runtime/runtime_membership.h"
#include "worker/runtime/runtime_part.h"
#include "worker/runtime/runtime_pipeline.h"
#include "worker/runtime/runtime_reduce.h"
#include "worker/runtime/runtime_setup.h"
#include "worker/runtime/runtime_state_transfer.h"
#include "worker/runtime/runtime_step.h"
#include "worker/runtime/stage_state.h"
#include "worker/runtime/work_queue.h"

namespace detour {

// The executor: one thread that runs all LibTorch work of the job held, in
// the order the work queue gives, and the parts (runtime_part.h) that do it.
// Transport and control callbacks only enqueue.
class JobRuntime::Impl : public RuntimeCore {
 public:
  Impl(JobRuntimeOptions options, SendFn send, JobFn set_job)
      : options_(std::move(options)),
        send_(std::move(send)),
        set_job_(std::move(set_job)),
        metrics_(options_.metrics, options_.region, options_.device),
        prober_(options_.transport ? options_.transport : GrpcPeerTransport::Factory(),
                PeerTransportConfig{options_.region,
                                    {},
                                    options_.security,
                                    options_.peer_ack_timeout,
                                    options_.peer_connect_timeout},
                send_, options_.metrics) {
    // Read on the executor, which alone changes job_id.
    job_.link_hint = [this](const std::string& peer) { return prober_.Hint(job_.job_id, peer); };
    executor_ = std::thread([this] { Loop(); });
  }

  ~Impl() override { Stop(); }

  void Stop() {
    {
      absl::MutexLock lock(&queue_mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    prober_.Stop();
    if (executor_.joinable()) executor_.join();
    Abandon();
  }

  // Work arriving while a bubble task runs: the first arrival's time measures
  // how long bubble work delays pipeline work.
  void NoteArrival() {
    if (job_.bubble_running.load(std::memory_order_acquire)) {
      int64_t none = 0;
      job_.arrived_during_bubble_ns.compare_exchange_strong(none, absl::GetCurrentTimeNanos());
    }
  }

  void Post(std::function<void()> fn) override {
    NoteArrival();
    absl::MutexLock lock(&queue_mu_);
    if (stopping_) return;
    queue_.PushControl(std::move(fn));
  }

  // Pipeline work goes through the queue's policy; all-reduce inputs and
  // state are control work (they wait for nothing).
  void Enqueue(const v1::FrameHeader& h, at::Tensor tensor) override {
    NoteArrival();
    auto fn = [this, h, tensor] { OnTensor(h, tensor); };
    absl::MutexLock lock(&queue_mu_);
    if (stopping_) return;
    if (h.direction() == v1::DIRECTION_ALLREDUCE || h.direction() == v1::DIRECTION_STATE) {
      queue_.PushControl(std::move(fn));
      return;
    }
    WorkQueue::Pipeline w;
    w.iteration = h.iteration();
    w.microbatch = h.microbatch();
    w.hop = static_cast<int>(h.hop());
    w.backward = h.direction() == v1::DIRECTION_BACKWARD;
    w.epoch = h.epoch();
    queue_.PushPipeline(w, std::move(fn));
  }

  void WithQueue(const std::function<void(WorkQueue&)>& fn) override {
    absl::MutexLock lock(&queue_mu_);
    fn(queue_);
  }

  void OnCoordinatorMessage(const v1::CoordinatorMessage& message) {
    // Link probes run beside the job, on the prober's thread.
    if (message.has_probe()) return prober_.OnProbe(message.probe());
    Post([this, message] {
      switch (message.kind_case()) {
        case v1::CoordinatorMessage::kAssignment: setup_.OnAssignment(message.assignment()); break;
        case v1::CoordinatorMessage::kPlan: pipeline_.OnPlan(message.plan()); break;
        case v1::CoordinatorMessage::kStep: step_.OnStep(message.step()); break;
        case v1::CoordinatorMessage::kCancel: OnCancel(message.cancel()); break;
        case v1::CoordinatorMessage::kCommit: step_.OnCommit(message.commit()); break;
        case v1::CoordinatorMessage::kMembership:
          membership_.OnMembership(message.membership());
          break;
        case v1::CoordinatorMessage::kReroute: membership_.OnReroute(message.reroute()); break;
        case v1::CoordinatorMessage::kSendState:
          state_transfer_.OnSendState(message.send_state());
          break;
        case v1::CoordinatorMessage::kAbort: OnAbort(message.abort()); break;
        default: LogWarning("ignoring an empty coordinator message");
      }
    });
  }

  // Thread-safe parts only (not LinkTransfer/ForgetLinks): for the
  // daemon's registration and heartbeat threads.
  RuntimeMetrics& metrics() { return metrics_; }
  LinkProber& prober() { return prober_; }

  void OnSessionOpened() {
    Post([this] {
      if (job_.job_id.empty() || job_.stage == nullptr) return;
      v1::WorkerMessage status;
      v1::JobStatus* s = status.mutable_job_status();
      s->set_job_id(job_.job_id);
      s->set_stage(job_.stage_index);
      s->set_completed_iterations(job_.completed);
      s->set_parameter_checksum(ParameterChecksum(job_.stage->Parameters()));
      s->set_in_iteration(job_.it != nullptr);
      s->set_epoch(job_.epoch);
      Send(std::move(status), /*replay=*/false);
      // What this iteration sent may be lost with the old session; the
      // coordinator ignores repeats.
      for (const v1::WorkerMessage& m : job_.replay) Send(m, /*replay=*/false);
      LogInfo("job ", job_.job_id, ": session reopened; reported stage ", job_.stage_index,
              " after ", job_.completed, " iterations and repeated ", job_.replay.size(),
              " message(s)");
    });
  }

  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) {
    if (h.direction() == v1::DIRECTION_PROBE) return prober_.Allocate(h);
    std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
    FrameAdmission::Verdict verdict = admission_.Admit(h);
    if (!verdict.ok()) {
      if (verdict.refusal == FrameAdmission::Refusal::kLate) metrics_.LateFrame();
      if (verdict.refusal == FrameAdmission::Refusal::kOverBudget) metrics_.UnexpectedFrame();
      return verdict.status;
    }
    const uint64_t bytes = h.total_bytes();
    // The sender's account is charged; it drops when the tensor's memory is
    // freed, wherever that is (or now, when the allocation fails).
    std::shared_ptr<std::atomic<uint64_t>> held = std::move(verdict.account);
    auto allocated =
        model::GuardTorch("allocating a received tensor", [&]() -> absl::StatusOr<MutableBuffer> {
          auto* memory = new uint8_t[std::max<uint64_t>(1, bytes)];
          auto tensor = std::make_shared<at::Tensor>(at::from_blob(
              memory, shape,
              [held, bytes](void* p) {
                delete[] static_cast<uint8_t*>(p);
                held->fetch_sub(bytes);
              },
              at::TensorOptions().dtype(TorchType(h.dtype()))));
          MutableBuffer b;
          b.data = tensor->data_ptr();
          b.bytes = tensor->nbytes();
          b.keepalive = tensor;
          return b;
        });
    if (!allocated.ok()) held->fetch_sub(bytes);
    return allocated;
  }

  void Deliver(const v1::FrameHeader& h, MutableBuffer buffer) {
    if (h.direction() == v1::DIRECTION_PROBE) return;  // its bytes go with `buffer`
    auto tensor = std::static_pointer_cast<at::Tensor>(buffer.keepalive);
    Enqueue(h, *tensor);
  }

  // --- RuntimeCore -----------------------------------------------------------

  void Fail(const absl::Status& status) override {
    LogError("job ", job_.job_id, ": ", status.message());
    ReportError(job_.job_id, job_.it ? job_.it->plan.iteration() : job_.completed, status);
    Abandon();
  }

  void ReportError(const std::string& job, uint64_t iteration,
                   const absl::Status& status) override {
    v1::WorkerMessage m;
    v1::JobError* e = m.mutable_error();
    e->set_job_id(job);
    e->set_iteration(iteration);
    e->set_code(static_cast<int>(status.code()));
    e->set_message(absl::StrCat("worker ", job_.me, ": ", status.message()));
    Send(std::move(m), /*replay=*/false);
  }

  // Forgets the current job: stage, peers, iteration state.
  void Abandon() override {
    admission_.Close();
    {
      // Queued pipeline work belongs to the abandoned job.
      absl::MutexLock lock(&queue_mu_);
      queue_.DropPipeline();
    }
    if (job_.transport != nullptr) job_.transport->Close();
    job_.transport.reset();
    job_.peers.clear();
    job_.it.reset();
    job_.early.clear();
    job_.replay.clear();
    job_.optimizer.reset();
    job_.kfac.reset();
    job_.bubbles.reset();
    job_.stage.reset();
    job_.train_tokens = model::TokenSequence();
    job_.reducer.Clear();
    job_.state_from.clear();
    if (!job_.job_id.empty()) metrics_.Utilization(0, 0);
    metrics_.Holding("", "");
    metrics_.ForgetLinks();
    if (!job_.job_id.empty() && set_job_) set_job_("");
    job_.job_id.clear();
  }

  void Send(v1::WorkerMessage message, bool replay) override {
    if (replay && !job_.job_id.empty()) job_.replay.push_back(message);
    absl::Status s = send_(std::move(message));
    if (!s.ok()) LogWarning("cannot reach the coordinator: ", s.message());
  }

 private:
  // Queued work always runs first (control, then pipeline work in the job's
  // queue policy, forwards within the memory slots); K-FAC bubble tasks run
  // one granule at a time only while nothing queued can run, so an arriving
  // forward or backward waits at most for the granule in progress.
  void Loop() {
    if (options_.torch_threads > 0) at::set_num_threads(options_.torch_threads);
    while (true) {
      std::function<void()> fn;
      const v1::BubbleTask* bubble = nullptr;
      {
        absl::MutexLock lock(&queue_mu_);
        if (!stopping_ && !queue_.HasRunnable())
          bubble = bubble_work_.Next();  // executor-only state
        if (bubble == nullptr) {
          auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
            return stopping_ || queue_.HasRunnable();
          };
          queue_mu_.Await(absl::Condition(&ready));
          if (stopping_) return;
          queue_.Pop(&fn);
        }
      }
      // LibTorch throws; the model layer turns its calls into Status, and
      // anything that still escapes (a call outside GuardTorch, an
      // allocation failure) fails the job here instead of reaching
      // std::terminate and killing the worker.
      try {
        if (bubble != nullptr) {
          bubble_work_.Run(bubble, /*at_step_end=*/false);
        } else {
          fn();
        }
      } catch (const std::exception& e) {
        FailEscaped(e.what());
      } catch (...) {
        FailEscaped("unknown exception");
      }
    }
  }

  void FailEscaped(const std::string& what) {
    const absl::Status status =
        absl::InternalError(absl::StrCat("unexpected exception on the executor: ", what));
    if (job_.job_id.empty()) {
      LogError(status.message());
      return;
    }
    try {
      Fail(status);
    } catch (...) {
      LogError("job ", job_.job_id, ": failing after an exception threw again");
    }
  }

  void OnTensor(const v1::FrameHeader& h, at::Tensor t) {
    if (h.job_id() != job_.job_id) return;
    if (h.direction() == v1::DIRECTION_STATE) return state_transfer_.OnState(h, t);
    pipeline_.OnTensor(h, std::move(t));
  }

  // The coordinator runs the iteration again (it restarted): forget it.
  void OnAbort(const v1::AbortIteration& abort) {
    if (abort.job_id() != job_.job_id) return;
    if (job_.it == nullptr || job_.it->plan.iteration() != abort.iteration()) return;
    LogInfo("job ", job_.job_id, ": iteration ", abort.iteration(), " aborted: ", abort.reason());
    DropIteration();
  }

  void DropIteration() {
    {
      absl::MutexLock lock(&queue_mu_);
      queue_.DropPipeline();
    }
    if (job_.stage != nullptr) {
      job_.stage->DropAll();
      job_.stage->ZeroGrad();
    }
    if (job_.kfac != nullptr) job_.kfac->DropAllCaptures();
    job_.reducer.Clear();
    job_.it.reset();
    job_.early.clear();
  }

  void OnCancel(const v1::CancelJob& cancel) {
    if (cancel.job_id() != job_.job_id) return;
    LogInfo("job ", job_.job_id, " released: ", cancel.reason());
    Abandon();
  }

  const JobRuntimeOptions options_;
  const SendFn send_;
  const JobFn set_job_;
  RuntimeMetrics metrics_;

  // Executor queue.
  absl::Mutex queue_mu_;
  WorkQueue queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::thread executor_;

  // Measures links when the coordinator asks; takes the probes peers send.
  LinkProber prober_;
  // What Allocate accepts (read on gRPC threads).
  FrameAdmission admission_;

  // Executor-only state (but for its atomics), and the parts that change it.
  RuntimeShared job_{&options_, &metrics_, &admission_};
  RuntimeBubbles bubble_work_{&job_, this};
  RuntimeReduce reduce_{&job_, this, &bubble_work_};
  RuntimePipeline pipeline_{&job_, this, &reduce_};
  RuntimeMembership membership_{&job_, this, &pipeline_, &reduce_};
  RuntimeStateTransfer state_transfer_{&job_, this};
  RuntimeStep step_{&job_, this, &bubble_work_};
  RuntimeSetup setup_{&job_, this, &set_job_};
};

JobRuntime::JobRuntime(JobRuntimeOptions options, SendFn send, JobFn set_job)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(send), std::move(set_job))) {}

JobRuntime::~JobRuntime() { Stop(); }

void JobRuntime::OnCoordinatorMessage(const v1::CoordinatorMessage& message) {
  impl_->OnCoordinatorMessage(message);
}

void JobRuntime::OnSessionOpened() { impl_->OnSessionOpened(); }

absl::StatusOr<MutableBuffer> JobRuntime::Allocate(const v1::FrameHeader& header) {
  return impl_->Allocate(header);
}

void JobRuntime::Deliver(const v1::FrameHeader& header, MutableBuffer buffer) {
  impl_->Deliver(header, std::move(buffer));
}

void JobRuntime::Stop() { impl_->Stop(); }
void JobRuntime::OnRegistered(const std::string& worker_id) {
  impl_->metrics().SetWorkerId(worker_id);
  impl_->prober().SetWorkerId(worker_id);
}
void JobRuntime::Tick(absl::Time now) { impl_->metrics().IdleCheck(now); }

}  // namespace detour
