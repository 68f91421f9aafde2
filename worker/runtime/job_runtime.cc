#include "worker/runtime/job_runtime.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/timing.h"
#include "worker/model/token_shards.h"
#include "worker/model/checkpoint.h"
#include "worker/model/hf_import.h"
#include "worker/model/engine.h"
#include "worker/model/kfac.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"
#include "worker/model/text_data.h"
#include "worker/model/torch_status.h"
#include "worker/runtime/bubble_schedule.h"
#include "worker/runtime/frame_admission.h"
#include "worker/runtime/iteration_tracker.h"
#include "worker/runtime/replica_reducer.h"
#include "worker/runtime/runtime_metrics.h"
#include "worker/runtime/stage_state.h"
#include "worker/runtime/work_queue.h"
#include "worker/transport/frame_codec.h"

namespace detour {
namespace {

at::ScalarType TorchType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP16: return at::kHalf;
    case v1::DTYPE_BF16: return at::kBFloat16;
    case v1::DTYPE_INT64: return at::kLong;
    case v1::DTYPE_BYTES: return at::kByte;
    default: return at::kFloat;
  }
}

v1::DType WireDType(const std::string& name) {
  if (name == "fp16") return v1::DTYPE_FP16;
  if (name == "bf16") return v1::DTYPE_BF16;
  return v1::DTYPE_FP32;
}

std::vector<std::string> GroupOf(const google::protobuf::RepeatedPtrField<v1::ReplicaGroup>& groups,
                                 int stage) {
  for (const v1::ReplicaGroup& g : groups) {
    if (static_cast<int>(g.stage()) == stage) return {g.nodes().begin(), g.nodes().end()};
  }
  return {};
}

}  // namespace

class JobRuntime::Impl {
 public:
  Impl(JobRuntimeOptions options, SendFn send, JobFn set_job)
      : options_(std::move(options)),
        send_(std::move(send)),
        set_job_(std::move(set_job)),
        metrics_(options_.metrics, options_.region, options_.device) {
    executor_ = std::thread([this] { Loop(); });
  }

  ~Impl() { Stop(); }

  void Stop() {
    {
      absl::MutexLock lock(&queue_mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (executor_.joinable()) executor_.join();
    Abandon();
  }

  // Work arriving while a bubble task runs: the first arrival's time measures
  // how long bubble work delays pipeline work.
  void NoteArrival() {
    if (bubble_running_.load(std::memory_order_acquire)) {
      int64_t none = 0;
      arrived_during_bubble_ns_.compare_exchange_strong(none, absl::GetCurrentTimeNanos());
    }
  }

  void Post(std::function<void()> fn) {
    NoteArrival();
    absl::MutexLock lock(&queue_mu_);
    if (stopping_) return;
    queue_.PushControl(std::move(fn));
  }

  // Pipeline work goes through the queue's policy; all-reduce inputs and
  // state are control work (they wait for nothing).
  void Enqueue(const v1::FrameHeader& h, at::Tensor tensor) {
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

  void OnCoordinatorMessage(const v1::CoordinatorMessage& message) {
    Post([this, message] {
      switch (message.kind_case()) {
        case v1::CoordinatorMessage::kAssignment: OnAssignment(message.assignment()); break;
        case v1::CoordinatorMessage::kPlan: OnPlan(message.plan()); break;
        case v1::CoordinatorMessage::kStep: OnStep(message.step()); break;
        case v1::CoordinatorMessage::kCancel: OnCancel(message.cancel()); break;
        case v1::CoordinatorMessage::kCommit: OnCommit(message.commit()); break;
        case v1::CoordinatorMessage::kMembership: OnMembership(message.membership()); break;
        case v1::CoordinatorMessage::kReroute: OnReroute(message.reroute()); break;
        case v1::CoordinatorMessage::kSendState: OnSendState(message.send_state()); break;
        case v1::CoordinatorMessage::kAbort: OnAbort(message.abort()); break;
        default: LogWarning("ignoring an empty coordinator message");
      }
    });
  }

  // Thread-safe parts only (not LinkTransfer/ForgetLinks): for the
  // daemon's registration and heartbeat threads.
  RuntimeMetrics& metrics() { return metrics_; }

  void OnSessionOpened() {
    Post([this] {
      if (job_id_.empty() || stage_ == nullptr) return;
      v1::WorkerMessage status;
      v1::JobStatus* s = status.mutable_job_status();
      s->set_job_id(job_id_);
      s->set_stage(stage_index_);
      s->set_completed_iterations(completed_);
      s->set_parameter_checksum(ParameterChecksum(stage_->Parameters()));
      s->set_in_iteration(it_ != nullptr);
      s->set_epoch(epoch_);
      Send(std::move(status), /*replay=*/false);
      // What this iteration sent may be lost with the old session; the
      // coordinator ignores repeats.
      for (const v1::WorkerMessage& m : replay_) Send(m, /*replay=*/false);
      LogInfo("job ", job_id_, ": session reopened; reported stage ", stage_index_, " after ",
              completed_, " iterations and repeated ", replay_.size(), " message(s)");
    });
  }

  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) {
    std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
    const FrameAdmission::Verdict verdict = admission_.Admit(h, received_bytes_->load());
    if (!verdict.ok()) {
      if (verdict.refusal == FrameAdmission::Refusal::kLate) metrics_.LateFrame();
      if (verdict.refusal == FrameAdmission::Refusal::kOverBudget) metrics_.UnexpectedFrame();
      return verdict.status;
    }
    const uint64_t bytes = h.total_bytes();
    return model::GuardTorch("allocating a received tensor",
                             [&]() -> absl::StatusOr<MutableBuffer> {
                               // The count drops when the tensor's memory is freed, wherever that
                               // is.
                               std::shared_ptr<std::atomic<uint64_t>> held = received_bytes_;
                               held->fetch_add(bytes);
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
  }

  void Deliver(const v1::FrameHeader& h, MutableBuffer buffer) {
    auto tensor = std::static_pointer_cast<at::Tensor>(buffer.keepalive);
    Enqueue(h, *tensor);
  }

 private:
  enum class Phase { kRunning, kReducing, kWaitingStep };

  struct Iteration {
    v1::IterationPlan plan;
    absl::Time received;
    std::unique_ptr<IterationTracker> tracker;
    std::vector<model::Microbatch> microbatches;  // data nodes
    v1::TimingReport timing;
    Phase phase = Phase::kRunning;
    // The stage's gradients hold the group's sum (TryReduce ran with
    // replicas) or were scaled by `scaled` (alone): a membership change must
    // put the local gradient back first.
    bool reduced = false;
    double scaled = 1.0;
    // Replicas preconditioning their own gradients: the raw local gradient
    // (the payload holds the preconditioned one) for putting back.
    at::Tensor raw_local;
    std::set<std::string> unreachable_reported;
    double max_delay_s = 0;  // pipeline work waiting for a bubble task
  };

  // --- executor ---------------------------------------------------------

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
        if (!stopping_ && !queue_.HasRunnable()) bubble = NextBubble();  // executor-only state
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
          RunBubble(bubble, /*at_step_end=*/false);
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
    if (job_id_.empty()) {
      LogError(status.message());
      return;
    }
    try {
      Fail(status);
    } catch (...) {
      LogError("job ", job_id_, ": failing after an exception threw again");
    }
  }

  // --- assignment ----------------------------------------------------------

  void OnAssignment(const v1::StageAssignment& a) {
    if (!job_id_.empty() && a.job_id() == job_id_ && a.epoch() == epoch_ &&
        static_cast<int>(a.stage()) == stage_index_ && a.restore_from().empty()) {
      // The coordinator repeats what it sent (a session reopened): answer
      // again, keep the stage.
      LogInfo("job ", job_id_, ": repeated assignment of stage ", stage_index_);
      for (const v1::WorkerMessage& m : replay_) Send(m, /*replay=*/false);
      return;
    }
    if (!job_id_.empty()) {
      if (a.job_id() == job_id_) {
        // The coordinator moves this worker to another stage of the job: it
        // drops its stage and builds the new one (with a replica's state).
        LogInfo("job ", job_id_, ": moving from stage ", stage_index_, " to stage ", a.stage());
      } else {
        LogWarning("assignment for job ", a.job_id(), " while holding job ", job_id_,
                   "; abandoning the old job");
      }
      Abandon();
    }
    absl::Status built = Build(a);
    if (!built.ok()) {
      LogError("cannot build stage ", a.stage(), " of job ", a.job_id(), ": ", built.message());
      ReportError(a.job_id(), a.start_iteration(), built);
      Abandon();
      return;
    }
    metrics_.Holding(job_id_, absl::StrCat(stage_index_));
    LogInfo("job ", job_id_, ": holding stage ", stage_index_, " (layers ", a.layer_begin(), "-",
            a.layer_end(), "), replica ", reducer_.rank() + 1, " of ", group_.size(),
            a.start_iteration() > 0 ? absl::StrCat(", from iteration ", a.start_iteration()) : "",
            a.restore_from().empty() ? "" : absl::StrCat(", restored from ", a.restore_from()),
            a.state_from().empty() ? "" : absl::StrCat(", state from ", a.state_from()));
    v1::WorkerMessage ready;
    ready.mutable_stage_ready()->set_job_id(job_id_);
    ready.mutable_stage_ready()->set_stage(stage_index_);
    uint64_t params = 0;
    for (const auto& [name, t] : stage_->Parameters()) params += t.numel();
    ready.mutable_stage_ready()->set_num_parameters(params);
    Send(std::move(ready));
  }

  absl::Status Build(const v1::StageAssignment& a) {
    ASSIGN_OR_RETURN(v1::JobSpec spec, NormalizeJobSpec(a.spec()));
    if (a.worker_id().empty()) return absl::InvalidArgumentError("assignment names no worker_id");
    me_ = a.worker_id();
    job_id_ = a.job_id();
    spec_ = spec;
    stage_index_ = static_cast<int>(a.stage());
    epoch_ = a.epoch();
    completed_ = a.start_iteration();
    group_.assign(a.replica_group().begin(), a.replica_group().end());
    std::string why;
    if (!reducer_.Restart(epoch_, group_, me_, &why)) return absl::InvalidArgumentError(why);
    const c10::Device device =
        options_.device == "cuda" ? c10::Device(c10::kCUDA) : c10::Device(c10::kCPU);
    device_ = device;
    // Non-data nodes take whatever the plan routes to them: the planner
    // bounds their activation memory; refusing work here could deadlock the
    // pipeline. Data nodes bound their own starts by memory_slots.
    v1::JobSpec stage_spec = spec;
    const uint32_t total =
        spec.pipeline().data_nodes() * spec.pipeline().microbatches_per_data_node();
    stage_spec.mutable_pipeline()->set_memory_slots(
        std::max(spec.pipeline().memory_slots(), total));
    ASSIGN_OR_RETURN(stage_, model::Stage::FromJobSpec(stage_spec, stage_index_, device));
    optimizer_ = std::make_unique<model::AdamW>(stage_->Parameters(), spec.optimizer().adamw());
    flat_numel_ = 0;
    for (const auto& [name, t] : stage_->Parameters()) flat_numel_ += t.numel();
    factor_numel_ = 0;
    const model::LayerRange layers = stage_->layers();
    if (spec.optimizer().kind() == v1::OPTIMIZER_KFAC) {
      ASSIGN_OR_RETURN(kfac_, model::Kfac::Create(stage_.get(), spec.optimizer()));
      optimizer_->set_precondition_hook(kfac_.get());
      for (int l = layers.begin; l < layers.end; ++l) {
        for (const at::Tensor& t : kfac_->PendingFactorTensors(l)) factor_numel_ += t.numel();
      }
    }
    bubbles_ = std::make_unique<BubbleSchedule>(kfac_ != nullptr, layers.begin, layers.end,
                                                model::KfacBlockShape(stage_->config()));
    if (!a.restore_from().empty()) {
      ASSIGN_OR_RETURN(model::CheckpointManifest manifest, model::ReadManifest(a.restore_from()));
      RETURN_IF_ERROR(model::LoadStage(a.restore_from(), manifest, stage_.get(), optimizer_.get(),
                                       kfac_.get()));
    } else if (a.state_from().empty() && !spec.checkpoint().init_from().empty()) {
      // A fresh start from imported weights; a restore or a live replica's
      // state (a joining worker) supersedes them.
      RETURN_IF_ERROR(model::InitStageFromHf(spec.checkpoint().init_from(), stage_.get()));
    }
    if (stage_index_ == 0) {
      ASSIGN_OR_RETURN(model::TextDataset data, model::LoadDataset(spec.data()));
      RETURN_IF_ERROR(model::CheckVocabulary(data, static_cast<int>(spec.model().vocab_size())));
      train_tokens_ = std::move(data.train);
    }
    wire_ = WireDType(spec.pipeline().wire_dtype());
    PeerTransportConfig config;
    config.region = options_.region;
    config.emulate_network = a.emulate_network();
    config.security = options_.security;
    transport_ =
        options_.transport ? options_.transport(config) : GrpcPeerTransport::Factory()(config);
    SetPeers(a.peers());
    state_from_ = a.state_from();
    FrameAdmission::Stage admitted;
    admitted.job_id = job_id_;
    admitted.iteration = completed_;
    admitted.epoch = epoch_;
    admitted.activation_shape = {spec.pipeline().samples_per_microbatch(),
                                 spec.model().context_length(), spec.model().d_model()};
    admitted.wire = wire_;
    admitted.flat_numel = flat_numel_;
    admitted.factor_numel = factor_numel_;
    admitted.state_from = state_from_;
    admitted.microbatches = total;
    admitted.replicas = a.replica_group_size();
    admission_.Open(admitted);
    if (set_job_) set_job_(job_id_);
    return absl::OkStatus();
  }

  void SetPeers(const google::protobuf::RepeatedPtrField<v1::Peer>& peers) {
    peers_.clear();
    for (const v1::Peer& p : peers) {
      if (p.worker_id() == me_) continue;
      peers_[p.worker_id()] =
          PeerEndpoint{p.worker_id(), p.address(), p.region(), p.data_address()};
    }
    PushPeers();
  }

  void PushPeers() {
    std::vector<PeerEndpoint> endpoints;
    std::set<std::string> members = {me_};
    for (const auto& [id, p] : peers_) {
      endpoints.push_back(p);
      members.insert(id);
    }
    admission_.SetMembers(std::move(members));
    transport_->SetPeers(endpoints);
  }

  // --- iteration flow ----------------------------------------------------

  void OnPlan(const v1::IterationPlan& plan) {
    if (plan.job_id() != job_id_ || stage_ == nullptr) {
      LogWarning("dropping plan for job ", plan.job_id(), " (holding ",
                 job_id_.empty() ? "none" : job_id_, ")");
      return;
    }
    if (it_ != nullptr || plan.iteration() < completed_) {
      if (it_ == nullptr || it_->plan.iteration() != plan.iteration()) {
        LogWarning("dropping plan for iteration ", plan.iteration(), " (",
                   it_ != nullptr ? absl::StrCat("iteration ", it_->plan.iteration(), " is running")
                                  : absl::StrCat(completed_, " iterations are done"),
                   ")");
      }
      return;
    }
    if (!state_from_.empty()) {
      return Fail(absl::FailedPreconditionError(
          absl::StrCat("a plan arrived before the stage state from ", state_from_)));
    }
    replay_.clear();
    std::vector<std::string> group = GroupOf(plan.replica_groups(), stage_index_);
    if (!group.empty()) group_ = std::move(group);
    if (plan.epoch() != epoch_) {
      // Workers were lost or joined since the last plan.
      epoch_ = plan.epoch();
      if (plan.peers_size() > 0) SetPeers(plan.peers());
    }
    std::string why;
    if (!reducer_.Restart(epoch_, group_, me_, &why)) {
      return Fail(absl::InvalidArgumentError(why));
    }
    it_ = std::make_unique<Iteration>();
    Iteration& it = *it_;
    it.plan = plan;
    it.received = absl::Now();
    it.timing.set_job_id(job_id_);
    it.timing.set_iteration(plan.iteration());
    it.timing.set_node(me_);
    it.tracker = std::make_unique<IterationTracker>(it.plan, me_);
    admission_.SetPosition(plan.iteration(), epoch_);
    const std::vector<uint32_t> own = it.tracker->Own();
    if (absl::Status s = LoadMicrobatches(own); !s.ok()) return Fail(s);
    // The coordinator's refresh numbering (it restarts after a resume or a
    // coordinator restart; a joining replica's state is relative to it).
    if (kfac_ != nullptr && plan.kfac_refresh_base() > 0) {
      kfac_->RebaseRefreshes(static_cast<int64_t>(plan.kfac_refresh_base()) - 2);
    }
    std::vector<uint32_t> capture;
    if (absl::Status s = bubbles_->Take(it.plan, me_, group_.size() > 1, &capture); !s.ok()) {
      return Fail(s);
    }
    for (uint32_t mb : capture) {
      if (!kfac_->captured(mb)) kfac_->Capture(mb);
    }
    // The data node's microbatches queue up as forwards that need a slot:
    // the queue starts each when the policy picks it and a slot is free.
    const int slots = options_.memory_slots > 0 ? options_.memory_slots
                                                : static_cast<int>(spec_.pipeline().memory_slots());
    {
      absl::MutexLock lock(&queue_mu_);
      queue_.BeginIteration(plan.iteration(), it.tracker->RouteStages(), slots,
                            spec_.pipeline().queue_policy() == v1::QUEUE_POLICY_BACKWARD_FIRST
                                ? sim::QueuePolicy::kBackwardFirst
                                : sim::QueuePolicy::kArrival);
    }
    QueueStarts(own);
    OfferEarly();
    MaybeFinishLocal();
  }

  // The iteration's data, once a data node first needs it.
  absl::Status LoadMicrobatches(const std::vector<uint32_t>& own) {
    Iteration& it = *it_;
    if (own.empty()) return absl::OkStatus();
    if (it.microbatches.empty()) {
      ASSIGN_OR_RETURN(it.microbatches, model::IterationMicrobatches(spec_, train_tokens_,
                                                                     it.plan.iteration(), device_));
    }
    for (uint32_t mb : own) {
      if (mb >= it.microbatches.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("plan names microbatch ", mb, " beyond the iteration's data"));
      }
    }
    return absl::OkStatus();
  }

  void QueueStarts(const std::vector<uint32_t>& own) {
    const uint64_t iteration = it_->plan.iteration();
    absl::MutexLock lock(&queue_mu_);
    for (uint32_t mb : own) {
      WorkQueue::Pipeline w;
      w.iteration = iteration;
      w.microbatch = mb;
      const v1::Route* r = it_->tracker->route(mb);
      w.epoch = r != nullptr ? r->epoch() : 0;
      queue_.PushPipeline(w, [this, iteration, mb] { StartMicrobatch(iteration, mb); });
    }
  }

  // Tensors kept for later (the next iteration's, a newer route's) queue up
  // again; those still not due are kept again.
  void OfferEarly() {
    std::vector<std::pair<v1::FrameHeader, at::Tensor>> early;
    early.swap(early_);
    for (auto& [h, t] : early) {
      if (it_ != nullptr && h.iteration() == it_->plan.iteration()) {
        Enqueue(h, t);
      } else if (it_ == nullptr || h.iteration() == it_->plan.iteration() + 1) {
        early_.emplace_back(h, t);
      }
    }
  }

  void StartMicrobatch(uint64_t iteration, uint32_t mb) {
    if (it_ == nullptr || it_->plan.iteration() != iteration) return;
    if (it_->tracker->route(mb) == nullptr) return;  // frozen meanwhile
    RunForward(mb, 0, it_->microbatches[mb].tokens);
  }

  // Forward of `mb` at position `pos` of its route (this node), then on.
  void RunForward(uint32_t mb, int pos, const at::Tensor& input) {
    Iteration& it = *it_;
    const v1::Route& r = *it.tracker->route(mb);
    const absl::Time start = absl::Now();
    auto out = stage_->Forward(mb, input);
    if (!out.ok()) return Fail(out.status());
    Record(v1::TaskTiming::KIND_FORWARD, mb, start);
    it.tracker->ForwardRan(mb);
    if (pos + 1 < r.nodes_size()) {
      SendTensor(r.nodes(pos + 1), v1::DIRECTION_FORWARD, mb, pos + 1, *out, r.epoch());
    } else if (r.nodes_size() == 1) {
      RunLoss(mb, *out);  // the route visits stage 0 only
    } else {
      SendTensor(r.data_node(), v1::DIRECTION_FORWARD, mb, r.nodes_size(), *out, r.epoch());
    }
  }

  void RunLoss(uint32_t mb, const at::Tensor& hidden) {
    Iteration& it = *it_;
    const v1::Route& r = *it.tracker->route(mb);
    const absl::Time start = absl::Now();
    auto loss = stage_->LossAndBackward(mb, hidden, it.microbatches[mb].targets);
    if (!loss.ok()) return Fail(loss.status());
    Record(v1::TaskTiming::KIND_LOSS, mb, start);
    it.tracker->LossRan(mb, loss->loss, static_cast<uint64_t>(loss->tokens));
    const int last = r.nodes_size() - 1;
    if (last == 0) {
      RunBackward(mb, 0, loss->grad_hidden);
    } else {
      SendTensor(r.nodes(last), v1::DIRECTION_BACKWARD, mb, last, loss->grad_hidden, r.epoch());
    }
  }

  void RunBackward(uint32_t mb, int pos, const at::Tensor& grad) {
    Iteration& it = *it_;
    const v1::Route& r = *it.tracker->route(mb);
    const absl::Time start = absl::Now();
    auto gin = stage_->Backward(mb, grad);
    if (!gin.ok()) return Fail(gin.status());
    Record(v1::TaskTiming::KIND_BACKWARD, mb, start);
    it.tracker->BackwardRan(mb, pos);
    {
      absl::MutexLock lock(&queue_mu_);
      queue_.Release(it.plan.iteration(), mb);
    }
    if (pos > 0) SendTensor(r.nodes(pos - 1), v1::DIRECTION_BACKWARD, mb, pos - 1, *gin, r.epoch());
  }

  void OnTensor(const v1::FrameHeader& h, at::Tensor t) {
    if (h.job_id() != job_id_) return;
    if (h.direction() == v1::DIRECTION_STATE) return OnState(h, t);
    if (it_ == nullptr || h.iteration() != it_->plan.iteration()) {
      if (it_ == nullptr || h.iteration() == it_->plan.iteration() + 1) {
        KeepEarly(h, t);
      } else {
        metrics_.LateFrame();
      }
      return;
    }
    Iteration& it = *it_;
    if (h.direction() == v1::DIRECTION_ALLREDUCE) {
      std::string why;
      if (!reducer_.Offer(h.sender(), h.epoch(), t, static_cast<int>(h.hop()), &why)) {
        metrics_.UnexpectedFrame();
        LogWarning("job ", job_id_, ": dropping ", why);
        return;
      }
      TryReduce();
      return;
    }
    const IterationTracker::Incoming in = it.tracker->Accept(h);
    switch (in.verdict) {
      case IterationTracker::Verdict::kRun: break;
      case IterationTracker::Verdict::kEarly: KeepEarly(h, t); return;
      case IterationTracker::Verdict::kStale: metrics_.LateFrame(); return;
      case IterationTracker::Verdict::kUnexpected:
        metrics_.UnexpectedFrame();
        LogWarning("dropping unexpected ", v1::Direction_Name(h.direction()), " tensor mb ",
                   h.microbatch(), " hop ", h.hop(), " epoch ", h.epoch(), " from ", h.sender());
        return;
    }
    at::Tensor x = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
    if (device_ != c10::Device(c10::kCPU)) x = x.to(device_);
    if (h.direction() == v1::DIRECTION_FORWARD) {
      if (in.loss) {
        RunLoss(h.microbatch(), x);
      } else {
        RunForward(h.microbatch(), in.hop, x);
      }
    } else {
      RunBackward(h.microbatch(), in.hop, x);
    }
    if (it_ != nullptr) MaybeFinishLocal();
  }

  // A tensor that belongs to work not known yet (the next iteration's plan
  // or a newer route is on the way). An honest iteration sends this node at
  // most a forward and a backward per microbatch plus the replicas'
  // all-reduce inputs (and the same again for re-runs); more is a flood and
  // is dropped.
  void KeepEarly(const v1::FrameHeader& h, const at::Tensor& t) {
    const size_t most = 4 * static_cast<size_t>(spec_.pipeline().data_nodes()) *
                            spec_.pipeline().microbatches_per_data_node() +
                        2 * group_.size() + 16;
    if (early_.size() >= most) {
      metrics_.UnexpectedFrame();
      return;
    }
    early_.emplace_back(h, t);
  }

  void MaybeFinishLocal() {
    Iteration& it = *it_;
    if (it.phase != Phase::kRunning || !it.tracker->LocalWorkDone()) return;
    it.phase = Phase::kReducing;
    const bool precondition = kfac_ != nullptr && kfac_->replicas_precondition();
    // Share this replica's summed gradient with the other replicas.
    if (group_.size() > 1 || precondition) {
      // Factors to sync need all of this iteration's curvature first.
      if (!bubbles_->sync_layers().empty() && !DrainBubbles(BubbleSchedule::IsCurvature, false)) {
        return;
      }
      auto flat = FlatGradients(it.tracker->visits() > 0, bubbles_->sync_layers());
      if (!flat.ok()) return Fail(flat.status());
      if (precondition) {
        // This replica's own factors precondition its own gradient; the
        // votes say which layers every replica could precondition.
        it.raw_local = *flat;
        auto payload = model::GuardTorch("preconditioning", [&]() -> absl::StatusOr<at::Tensor> {
          at::Tensor pre = flat->clone();
          RETURN_IF_ERROR(kfac_->PreconditionFlat(stage_->Parameters(), &pre));
          return at::cat({pre, kfac_->ReadyVotes()}).contiguous();
        });
        if (!payload.ok()) return Fail(payload.status());
        flat = *std::move(payload);
      }
      reducer_.SetLocal(*flat, it.tracker->visits());
      const int rank = reducer_.rank();
      for (const std::string& peer : reducer_.Others()) {
        SendTensor(peer, v1::DIRECTION_ALLREDUCE, static_cast<uint32_t>(rank),
                   static_cast<uint32_t>(it.tracker->visits()), *flat, epoch_);
        if (it_ == nullptr) return;
      }
    } else {
      reducer_.SetLocal(at::Tensor(), it.tracker->visits());
    }
    TryReduce();
  }

  // The stage's gradients, then the pending K-FAC factors of `sync_layers`,
  // as one flat fp32 tensor (the all-reduce payload).
  absl::StatusOr<at::Tensor> FlatGradients(bool visited, const std::vector<int>& sync_layers) {
    return model::GuardTorch("flattening gradients", [&]() -> absl::StatusOr<at::Tensor> {
      std::vector<at::Tensor> parts;
      for (const auto& [name, p] : stage_->Parameters()) {
        at::Tensor g = visited && p.grad().defined() ? p.grad() : at::zeros_like(p);
        parts.push_back(g.detach().to(at::kCPU).to(at::kFloat).reshape({-1}));
      }
      for (int layer : sync_layers) {
        for (const at::Tensor& f : kfac_->PendingFactorTensors(layer)) {
          parts.push_back(f.detach().to(at::kCPU).to(at::kFloat).reshape({-1}));
        }
      }
      return at::cat(parts).contiguous();
    });
  }

  // Writes a flat payload (FlatGradients' layout) back: the gradients (when
  // `grads`) and the pending factors of the synced layers.
  absl::Status Unflatten(const at::Tensor& flat, bool grads) {
    return model::GuardTorch("unflattening gradients", [&]() -> absl::Status {
      int64_t tail = flat_numel_;
      for (int layer : bubbles_->sync_layers()) {
        for (at::Tensor& f : kfac_->PendingFactorTensors(layer)) {
          f.copy_(flat.narrow(0, tail, f.numel()).view(f.sizes()).to(f.device()));
          tail += f.numel();
        }
      }
      if (!grads) return absl::OkStatus();
      int64_t offset = 0;
      for (const auto& [name, p] : stage_->Parameters()) {
        at::Tensor slice = flat.narrow(0, offset, p.numel()).view(p.sizes()).to(p.device());
        offset += p.numel();
        if (p.grad().defined()) {
          p.mutable_grad().copy_(slice);
        } else {
          p.mutable_grad() = slice.clone();
        }
      }
      return absl::OkStatus();
    });
  }

  void TryReduce() {
    Iteration& it = *it_;
    if (it.phase != Phase::kReducing || !reducer_.Ready()) return;
    const absl::Time start = absl::Now();
    const int total_visits = reducer_.TotalVisits();
    const bool precondition = kfac_ != nullptr && kfac_->replicas_precondition();
    if (group_.size() > 1 || precondition) {
      // Sum in rank order so every replica computes the identical result.
      const auto inputs = reducer_.InRankOrder();
      const int64_t numel = inputs.front()->payload.numel();
      at::Tensor sum;
      absl::Status s = model::GuardTorch("all-reduce", [&]() -> absl::Status {
        for (size_t r = 0; r < inputs.size(); ++r) {
          const at::Tensor& part = inputs[r]->payload;
          if (part.numel() != numel) {
            return absl::InvalidArgumentError(
                absl::StrCat("all-reduce from ", reducer_.members()[r], " has ", part.numel(),
                             " values, expected ", numel, " (gradients + K-FAC factors of layers ",
                             absl::StrJoin(bubbles_->sync_layers(), ","), ")"));
          }
          sum = sum.defined() ? sum + part : part.clone();
        }
        if (precondition) {
          const int64_t votes = sum.numel() - flat_numel_;
          RETURN_IF_ERROR(kfac_->AgreeReady(sum.narrow(0, flat_numel_, votes),
                                            static_cast<int>(inputs.size())));
        }
        return absl::OkStatus();
      });
      if (s.ok()) s = Unflatten(sum, total_visits > 0);
      if (!s.ok()) return Fail(s);
      it.reduced = true;
    }
    Record(v1::TaskTiming::KIND_ALLREDUCE, 0, start);
    const double scale = model::GradNormalizationScale(
        spec_.pipeline().grad_normalization(), total_visits, it.tracker->live_microbatches());
    if (scale != 1.0 && scale != 0.0) {
      absl::Status s = stage_->ScaleGradients(scale);
      if (!s.ok()) return Fail(s);
      it.scaled = scale;
    }
    // The clipping norm is over raw gradients: preconditioned ones are left
    // out (they get the same clip factor).
    std::set<std::string> preconditioned;
    if (precondition) preconditioned = kfac_->PreconditionedParameters();
    auto sq = stage_->SquaredGradNorm(preconditioned.empty() ? nullptr : &preconditioned);
    if (!sq.ok()) return Fail(sq.status());
    it.phase = Phase::kWaitingStep;
    v1::WorkerMessage m;
    v1::GradientNorm* n = m.mutable_grad_norm();
    n->set_job_id(job_id_);
    n->set_iteration(it.plan.iteration());
    n->set_stage(stage_index_);
    n->set_squared_norm(*sq);
    n->set_epoch(epoch_);
    Send(std::move(m));
  }

  // --- elastic training ----------------------------------------------------

  // Workers were lost mid-iteration: freeze what crossed them, reduce again
  // among the survivors, tell the coordinator what ran here.
  void OnMembership(const v1::MembershipChange& change) {
    if (change.job_id() != job_id_ || it_ == nullptr ||
        change.iteration() != it_->plan.iteration()) {
      LogWarning("dropping membership change for ", change.job_id(), " iteration ",
                 change.iteration());
      return;
    }
    Iteration& it = *it_;
    if (change.epoch() <= it.tracker->epoch()) {
      LogDebug("job ", job_id_, ": membership epoch ", change.epoch(), " again");
      return;
    }
    const std::set<std::string> lost(change.lost().begin(), change.lost().end());
    if (lost.count(me_)) {
      return Fail(absl::AbortedError("the coordinator counts this worker as lost"));
    }
    if (it.reduced) {
      // Put the local gradient (and factors) back: the sum included workers
      // that are gone, and re-runs may add to it.
      absl::Status s = Unflatten(it.raw_local.defined() ? it.raw_local : reducer_.local()->payload,
                                 it.tracker->visits() > 0);
      if (!s.ok()) return Fail(s);
      if (it.tracker->visits() == 0) stage_->ZeroGrad();
    } else if (it.scaled != 1.0) {
      absl::Status s = stage_->ScaleGradients(1.0 / it.scaled);
      if (!s.ok()) return Fail(s);
    }
    it.reduced = false;
    it.scaled = 1.0;
    const IterationTracker::Frozen frozen = it.tracker->Freeze(lost, change.epoch());
    for (uint32_t mb : frozen.microbatches) {
      {
        absl::MutexLock lock(&queue_mu_);
        queue_.DropMicrobatch(it.plan.iteration(), mb);
      }
      stage_->Drop(mb);
      if (kfac_ != nullptr) kfac_->DropCapture(mb);
      bubbles_->DropMicrobatch(mb);
    }
    metrics_.Frozen(static_cast<int>(frozen.microbatches.size()));
    epoch_ = change.epoch();
    std::vector<std::string> group = GroupOf(change.replica_groups(), stage_index_);
    if (!group.empty()) group_ = std::move(group);
    std::string why;
    if (!reducer_.Restart(epoch_, group_, me_, &why)) return Fail(absl::InvalidArgumentError(why));
    admission_.SetEpoch(epoch_);
    it.phase = Phase::kRunning;
    LogInfo("job ", job_id_, ": iteration ", it.plan.iteration(), " epoch ", epoch_, ": lost ",
            absl::StrJoin(lost, ", "), "; froze ", frozen.microbatches.size(), " microbatch(es)",
            frozen.backward_ran.empty()
                ? ""
                : absl::StrCat(" (backward ran here for ", absl::StrJoin(frozen.backward_ran, ","),
                               ")"));
    v1::WorkerMessage ack;
    v1::MembershipAck* a = ack.mutable_membership_ack();
    a->set_job_id(job_id_);
    a->set_iteration(it.plan.iteration());
    a->set_epoch(epoch_);
    for (uint32_t mb : frozen.backward_ran) a->add_backward_ran(mb);
    for (uint32_t mb : frozen.completed) a->add_completed(mb);
    Send(std::move(ack));
  }

  // New routes for frozen microbatches (possibly none).
  void OnReroute(const v1::RouteAmendment& amendment) {
    if (amendment.job_id() != job_id_ || it_ == nullptr ||
        amendment.iteration() != it_->plan.iteration()) {
      return;
    }
    Iteration& it = *it_;
    if (!it.tracker->awaiting_amendment() && amendment.epoch() == it.tracker->epoch()) return;
    std::vector<v1::Route> routes(amendment.routes().begin(), amendment.routes().end());
    if (absl::Status s = it.tracker->Amend(amendment.epoch(), routes); !s.ok()) return Fail(s);
    std::vector<uint32_t> own;
    {
      absl::MutexLock lock(&queue_mu_);
      for (const v1::Route& r : routes) {
        queue_.SetRoute(r.microbatch(), {r.stages().begin(), r.stages().end()}, r.epoch());
        if (r.data_node() == me_) own.push_back(r.microbatch());
      }
    }
    if (absl::Status s = LoadMicrobatches(own); !s.ok()) return Fail(s);
    QueueStarts(own);
    OfferEarly();
    MaybeFinishLocal();
  }

  // A live replica sends this stage's state to a joining one (between
  // iterations: the state is the one after the last step).
  void OnSendState(const v1::SendState& request) {
    if (request.job_id() != job_id_ || stage_ == nullptr) return;
    if (it_ != nullptr) {
      return Fail(absl::FailedPreconditionError(
          absl::StrCat("asked to send the stage state to ", request.to(), " mid-iteration")));
    }
    auto frame = PackStageState(*stage_, *optimizer_, kfac_.get(), job_id_, completed_, me_,
                                request.epoch());
    if (!frame.ok()) return Fail(frame.status());
    const uint64_t size = frame->bytes;
    metrics_.StateBytes(/*sent=*/true, size);
    if (!request.peer().worker_id().empty() && request.peer().worker_id() != me_) {
      const v1::Peer& p = request.peer();
      peers_[p.worker_id()] =
          PeerEndpoint{p.worker_id(), p.address(), p.region(), p.data_address()};
      PushPeers();
    }
    LogInfo("job ", job_id_, ": sending the stage state (", size, " bytes) to ", request.to());
    const std::string job = job_id_;
    const std::string to = request.to();
    transport_->Send(to, std::move(frame->header), std::move(frame->view),
                     [this, job, to](absl::Status s, double) {
                       if (s.ok()) return;
                       Post([this, job, to, s] {
                         if (job != job_id_) return;
                         LogWarning("job ", job_id_, ": the stage state did not reach ", to, ": ",
                                    s.message());
                         ReportUnreachable(completed_, to, s);
                       });
                     });
  }

  // The joining side: the state of the replica we join, checked and loaded.
  void OnState(const v1::FrameHeader& h, const at::Tensor& bytes) {
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

  // The coordinator runs the iteration again (it restarted): forget it.
  void OnAbort(const v1::AbortIteration& abort) {
    if (abort.job_id() != job_id_) return;
    if (it_ == nullptr || it_->plan.iteration() != abort.iteration()) return;
    LogInfo("job ", job_id_, ": iteration ", abort.iteration(), " aborted: ", abort.reason());
    DropIteration();
  }

  void DropIteration() {
    {
      absl::MutexLock lock(&queue_mu_);
      queue_.DropPipeline();
    }
    if (stage_ != nullptr) {
      stage_->DropAll();
      stage_->ZeroGrad();
    }
    if (kfac_ != nullptr) kfac_->DropAllCaptures();
    reducer_.Clear();
    it_.reset();
    early_.clear();
  }

  // --- step ----------------------------------------------------------------

  void OnStep(const v1::StepCommand& step) {
    if (it_ == nullptr || step.job_id() != job_id_ || step.iteration() != it_->plan.iteration() ||
        it_->phase != Phase::kWaitingStep || step.epoch() != epoch_) {
      LogWarning("dropping step command for ", step.job_id(), " iteration ", step.iteration(),
                 " epoch ", step.epoch());
      return;
    }
    Iteration& it = *it_;
    // K-FAC work of the iteration that found no idle time, and the serial
    // items, run now: the step may activate what they compute.
    if (!DrainBubbles([](const v1::BubbleTask&) { return true; }, true)) return;
    if (kfac_ != nullptr && it.plan.kfac_activate_refresh() > 0) {
      kfac_->Activate(static_cast<int64_t>(it.plan.kfac_activate_refresh() - 1));
      LogDebug("job ", job_id_, ": K-FAC refresh ", it.plan.kfac_activate_refresh() - 1,
               " active from iteration ", it.plan.iteration());
    }
    const absl::Time start = absl::Now();
    auto ready = StepStage(spec_, it.plan.iteration(), step.squared_norm(), stage_.get(),
                           optimizer_.get(), kfac_.get());
    if (!ready.ok()) return Fail(ready.status());
    const bool fault_now = options_.fault.kind != JobRuntimeOptions::FaultInjection::Kind::kNone &&
                           it.plan.iteration() == options_.fault.iteration;
    if (fault_now && options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kDiverge) {
      LogWarning("job ", job_id_,
                 ": --inject_fault: nudging a parameter after the step of "
                 "iteration ",
                 it.plan.iteration());
      torch::NoGradGuard no_grad;
      std::vector<model::NamedTensor> params = stage_->Parameters();
      if (!params.empty()) params.front().second.add_(1e-3);
    }
    if (!ready->empty()) {
      LogInfo("job ", job_id_, ": K-FAC: every replica of stage ", stage_index_,
              " preconditions layer(s) ", absl::StrJoin(*ready, ","),
              " with its own factors from iteration ", it.plan.iteration() + 1);
    }
    reducer_.Clear();
    Record(v1::TaskTiming::KIND_OPTIMIZER, 0, start);
    const double duration = absl::ToDoubleSeconds(absl::Now() - it.received);
    it.timing.set_iteration_time_s(duration);
    it.timing.set_bubble_delay_max_s(it.max_delay_s);
    PublishUtilization(it, duration);
    v1::WorkerMessage timing;
    *timing.mutable_timing() = it.timing;
    Send(std::move(timing));

    v1::WorkerMessage result;
    v1::IterationResult* r = result.mutable_result();
    r->set_job_id(job_id_);
    r->set_iteration(it.plan.iteration());
    r->set_loss_sum(it.tracker->completed_loss());
    r->set_tokens(it.tracker->completed_tokens());
    for (uint32_t mb : it.tracker->Completed()) r->add_microbatches(mb);
    if (fault_now && r->microbatches_size() > 0) {
      if (options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kDuplicateMicrobatch) {
        LogWarning("job ", job_id_, ": --inject_fault: reporting microbatch ", r->microbatches(0),
                   " twice");
        r->add_microbatches(r->microbatches(0));
      } else if (options_.fault.kind ==
                 JobRuntimeOptions::FaultInjection::Kind::kMissingMicrobatch) {
        LogWarning("job ", job_id_, ": --inject_fault: leaving microbatch ",
                   r->microbatches(r->microbatches_size() - 1), " out of the result");
        r->mutable_microbatches()->RemoveLast();
      }
    }
    r->set_parameter_checksum(ParameterChecksum(stage_->Parameters()));
    r->set_stage(stage_index_);
    r->set_duration_s(duration);
    r->set_epoch(epoch_);
    if (it.plan.checkpoint() && reducer_.rank() == 0) {
      // One replica per stage writes: replicas are identical.
      auto entry =
          model::WriteStageFile(it.plan.checkpoint_dir(), *stage_, *optimizer_, kfac_.get());
      if (!entry.ok()) return Fail(Annotate(entry.status(), "writing the checkpoint"));
      *r->mutable_checkpoint() = CheckpointFileOf(*entry);
    }
    completed_ = it.plan.iteration() + 1;
    it_.reset();
    admission_.SetIteration(completed_);
    metrics_.IterationDone();
    Send(std::move(result));
  }

  void OnCommit(const v1::CommitCheckpoint& commit) {
    if (commit.job_id() != job_id_ || stage_ == nullptr) return;
    const model::CheckpointManifest manifest = ManifestOf(commit, stage_->config(), spec_);
    absl::Status written = model::WriteManifest(commit.dir(), manifest);
    if (!written.ok()) return Fail(Annotate(written, "writing the checkpoint manifest"));
    v1::WorkerMessage m;
    m.mutable_checkpoint_committed()->set_job_id(job_id_);
    m.mutable_checkpoint_committed()->set_iteration(commit.iteration());
    m.mutable_checkpoint_committed()->set_dir(commit.dir());
    Send(std::move(m));
  }

  void OnCancel(const v1::CancelJob& cancel) {
    if (cancel.job_id() != job_id_) return;
    LogInfo("job ", job_id_, " released: ", cancel.reason());
    Abandon();
  }

  // --- K-FAC bubble work ---------------------------------------------------

  // The next bubble task to run while idle, or null. Serial ones only once
  // this node's pipeline work is done.
  const v1::BubbleTask* NextBubble() {
    if (it_ == nullptr || kfac_ == nullptr) return nullptr;
    return bubbles_->Next(*it_->tracker, it_->phase != Phase::kRunning, /*waiting_step=*/false);
  }

  // Runs one task (returned by the schedule) and removes it. False when the
  // job failed.
  bool RunBubble(const v1::BubbleTask* task, bool at_step_end) {
    Iteration& it = *it_;
    const v1::BubbleTask t = bubbles_->Remove(task);
    const absl::Time start = absl::Now();
    bubble_running_.store(true, std::memory_order_release);
    absl::Status s = model::GuardTorch("K-FAC", [&]() -> absl::Status {
      const int layer = static_cast<int>(t.layer());
      // num_parts 0: a plan from before parts (one whole item).
      const int parts = static_cast<int>(std::max<uint32_t>(1, t.num_parts()));
      const int part = static_cast<int>(t.part());
      switch (t.kind()) {
        case v1::BubbleTask::KIND_CURVATURE_A:
          return kfac_->CurvatureA(layer, t.microbatch(), part, parts);
        case v1::BubbleTask::KIND_CURVATURE_B:
          return kfac_->CurvatureB(layer, t.microbatch(), part, parts);
        case v1::BubbleTask::KIND_INVERT_A:
          return kfac_->InvertA(layer, t.module(), part, parts, static_cast<int64_t>(t.refresh()));
        case v1::BubbleTask::KIND_INVERT_B:
          return kfac_->InvertB(layer, t.module(), part, parts, static_cast<int64_t>(t.refresh()));
        default: return absl::OkStatus();
      }
    });
    bubble_running_.store(false, std::memory_order_release);
    const absl::Time end = absl::Now();
    if (BubbleSchedule::IsInversion(t)) {
      bubbles_->Inverted(t);
      // A layer no curvature microbatch ever reached (skip routes) has no
      // factor to invert yet: it stays with AdamW until one does.
      if (s.code() == absl::StatusCode::kFailedPrecondition &&
          !(t.kind() == v1::BubbleTask::KIND_INVERT_A
                ? kfac_->FactorA(static_cast<int>(t.layer()), t.module())
                : kfac_->FactorB(static_cast<int>(t.layer()), t.module()))
               .defined()) {
        LogWarning("job ", job_id_, ": ", BubbleSchedule::Name(t), " skipped: ", s.message());
        s = absl::OkStatus();
      }
    }
    const int64_t arrived = arrived_during_bubble_ns_.exchange(0);
    if (arrived != 0) {
      const double delay = std::max(0.0, (absl::ToUnixNanos(end) - arrived) * 1e-9);
      it.max_delay_s = std::max(it.max_delay_s, delay);
      metrics_.KfacDelay(delay);
    }
    if (!s.ok()) {
      Fail(Annotate(s, BubbleSchedule::Name(t)));
      return false;
    }
    Record(v1::TaskTiming::KIND_BUBBLE, t.microbatch(), start);
    metrics_.KfacTask(t,
                      t.serial()    ? "serial"
                      : at_step_end ? "overdue"
                                    : "bubble",
                      absl::ToDoubleSeconds(end - start));
    return true;
  }

  // Runs this iteration's bubble tasks now, until none that `wanted` selects
  // is left. `factors_final`: the step arrived, so synced factors are final
  // and their layers may be inverted (before it, a membership change could
  // still redo the all-reduce). False when the job failed.
  bool DrainBubbles(const std::function<bool(const v1::BubbleTask&)>& wanted, bool factors_final) {
    while (true) {
      const v1::BubbleTask* next = nullptr;
      switch (bubbles_->NextToDrain(*it_->tracker, factors_final, wanted, &next)) {
        case BubbleSchedule::Drain::kDone: return true;
        case BubbleSchedule::Drain::kStuck:
          Fail(absl::FailedPreconditionError(absl::StrCat(
              "K-FAC task ", BubbleSchedule::Name(*next),
              " cannot run: its input never came (the plan is inconsistent with the routes)")));
          return false;
        case BubbleSchedule::Drain::kTask:
          if (!RunBubble(next, /*at_step_end=*/true)) return false;
      }
    }
  }

  // Busy fraction of the iteration: pipeline work, and with K-FAC work.
  void PublishUtilization(const Iteration& it, double duration) {
    if (duration <= 0) return;
    const BusySeconds busy = SumBusy(it.timing);
    metrics_.Utilization(busy.pipeline / duration, (busy.pipeline + busy.kfac) / duration,
                         duration);
  }

  // --- helpers ----------------------------------------------------------

  void SendTensor(const std::string& to, v1::Direction direction, uint32_t mb, uint32_t hop,
                  const at::Tensor& tensor, uint64_t epoch) {
    at::Tensor wire = tensor.detach();
    v1::DType dtype = v1::DTYPE_FP32;
    if (direction != v1::DIRECTION_ALLREDUCE && wire_ != v1::DTYPE_FP32) {
      wire = wire.to(TorchType(wire_));
      dtype = wire_;
    } else if (wire.scalar_type() != at::kFloat) {
      wire = wire.to(at::kFloat);
    }
    wire = wire.to(at::kCPU).contiguous();
    v1::FrameHeader h;
    h.set_job_id(job_id_);
    h.set_iteration(it_->plan.iteration());
    h.set_microbatch(mb);
    h.set_direction(direction);
    h.set_sender(me_);
    h.set_hop(hop);
    h.set_epoch(epoch);
    for (int64_t d : wire.sizes()) h.add_shape(d);
    h.set_dtype(dtype);
    auto holder = std::make_shared<at::Tensor>(wire);
    TensorView view;
    view.data = holder->data_ptr();
    view.bytes = holder->nbytes();
    view.keepalive = holder;
    const uint64_t iteration = it_->plan.iteration();
    const uint64_t bytes = view.bytes;
    const std::string job = job_id_;
    transport_->Send(to, std::move(h), std::move(view),
                     [this, job, iteration, to, direction, bytes](absl::Status s, double t) {
                       Post([=] { OnTransferDone(job, iteration, to, direction, bytes, s, t); });
                     });
  }

  void OnTransferDone(const std::string& job, uint64_t iteration, const std::string& to,
                      v1::Direction direction, uint64_t bytes, const absl::Status& status,
                      double seconds) {
    if (job != job_id_) return;
    if (!status.ok()) {
      if (it_ == nullptr || it_->plan.iteration() != iteration) return;
      if (status.code() == absl::StatusCode::kCancelled && it_->tracker->lost().count(to)) {
        return;  // the sender to a lost worker was closed
      }
      if (spec_.elastic().disabled() || status.code() == absl::StatusCode::kNotFound ||
          status.code() == absl::StatusCode::kAlreadyExists) {
        return Fail(
            Annotate(status, absl::StrCat("sending ", v1::Direction_Name(direction), " to ", to)));
      }
      // The peer may be gone: the coordinator decides (and re-plans around
      // it); reported once per peer and iteration.
      if (!it_->unreachable_reported.insert(to).second) return;
      LogWarning("job ", job_id_, ": sending ", v1::Direction_Name(direction), " to ", to,
                 " failed: ", status.message(), "; reporting it");
      ReportUnreachable(iteration, to, status);
      return;
    }
    metrics_.Transfer(direction, seconds);
    metrics_.LinkTransfer(to, bytes, seconds);
    if (it_ != nullptr && it_->plan.iteration() == iteration) {
      v1::TransferTiming* t = it_->timing.add_transfers();
      t->set_peer(to);
      t->set_forward(direction == v1::DIRECTION_FORWARD);
      t->set_allreduce(direction == v1::DIRECTION_ALLREDUCE);
      t->set_bytes(bytes);
      t->set_duration_s(seconds);
    }
  }

  // A transfer to `peer` failed: the coordinator decides whether it is lost.
  void ReportUnreachable(uint64_t iteration, const std::string& peer, const absl::Status& why) {
    v1::WorkerMessage m;
    v1::PeerUnreachable* u = m.mutable_peer_unreachable();
    u->set_job_id(job_id_);
    u->set_iteration(iteration);
    u->set_peer(peer);
    u->set_message(std::string(why.message()));
    Send(std::move(m), /*replay=*/false);
  }

  // Times a task that started at `start` and just ended. With
  // --compute_slowdown F, a compute task first takes F times as long (the
  // executor sleeps the difference), as on a slower node.
  void Record(v1::TaskTiming::Kind kind, uint32_t mb, absl::Time start) {
    absl::Time end = absl::Now();
    if (options_.compute_slowdown > 1 && kind != v1::TaskTiming::KIND_ALLREDUCE) {
      absl::SleepFor((end - start) * (options_.compute_slowdown - 1));
      end = absl::Now();
    }
    const double seconds = absl::ToDoubleSeconds(end - start);
    if (it_ != nullptr) {
      v1::TaskTiming* t = it_->timing.add_tasks();
      t->set_kind(kind);
      t->set_microbatch(mb);
      t->set_start_s(absl::ToDoubleSeconds(start - it_->received));
      t->set_duration_s(seconds);
    }
    metrics_.Task(kind, seconds);
  }

  void Fail(const absl::Status& status) {
    LogError("job ", job_id_, ": ", status.message());
    ReportError(job_id_, it_ ? it_->plan.iteration() : completed_, status);
    Abandon();
  }

  void ReportError(const std::string& job, uint64_t iteration, const absl::Status& status) {
    v1::WorkerMessage m;
    v1::JobError* e = m.mutable_error();
    e->set_job_id(job);
    e->set_iteration(iteration);
    e->set_code(static_cast<int>(status.code()));
    e->set_message(absl::StrCat("worker ", me_, ": ", status.message()));
    Send(std::move(m), /*replay=*/false);
  }

  // Forgets the current job: stage, peers, iteration state.
  void Abandon() {
    admission_.Close();
    {
      // Queued pipeline work belongs to the abandoned job.
      absl::MutexLock lock(&queue_mu_);
      queue_.DropPipeline();
    }
    if (transport_ != nullptr) transport_->Close();
    transport_.reset();
    peers_.clear();
    it_.reset();
    early_.clear();
    replay_.clear();
    optimizer_.reset();
    kfac_.reset();
    bubbles_.reset();
    stage_.reset();
    train_tokens_ = model::TokenSequence();
    reducer_.Clear();
    state_from_.clear();
    if (!job_id_.empty()) metrics_.Utilization(0, 0);
    metrics_.Holding("", "");
    metrics_.ForgetLinks();
    if (!job_id_.empty() && set_job_) set_job_("");
    job_id_.clear();
  }

  // Sends to the coordinator; messages of the iteration in progress are kept
  // (`replay`) and repeated when the session reopens.
  void Send(v1::WorkerMessage message, bool replay = true) {
    if (replay && !job_id_.empty()) replay_.push_back(message);
    absl::Status s = send_(std::move(message));
    if (!s.ok()) LogWarning("cannot reach the coordinator: ", s.message());
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

  // What Allocate accepts (read on gRPC threads).
  FrameAdmission admission_;
  // Bytes of received tensors alive now (shared with their deleters).
  const std::shared_ptr<std::atomic<uint64_t>> received_bytes_ =
      std::make_shared<std::atomic<uint64_t>>(0);

  // Executor-only state.
  std::string me_;  // this worker's id, from the assignment
  std::string job_id_;
  v1::JobSpec spec_;
  int stage_index_ = 0;
  uint64_t epoch_ = 0;              // membership epoch known here
  uint64_t completed_ = 0;          // iterations whose step ran here
  std::vector<std::string> group_;  // this stage's replicas, rank order
  ReplicaReducer<at::Tensor> reducer_;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::unique_ptr<model::Stage> stage_;
  std::unique_ptr<model::AdamW> optimizer_;
  std::unique_ptr<model::Kfac> kfac_;  // K-FAC jobs only
  std::unique_ptr<BubbleSchedule> bubbles_;
  int64_t flat_numel_ = 0;
  int64_t factor_numel_ = 0;  // all held layers' factors (all-reduce bound)
  // Set while a bubble task runs; the first pipeline message arriving then
  // records its time (how long bubble work delays pipeline work).
  std::atomic<bool> bubble_running_{false};
  std::atomic<int64_t> arrived_during_bubble_ns_{0};
  model::TokenSequence train_tokens_;
  v1::DType wire_ = v1::DTYPE_FP32;
  std::unique_ptr<PeerTransport> transport_;
  std::map<std::string, PeerEndpoint> peers_;  // the transport's peers
  std::string state_from_;                     // joining: the replica whose state we wait for
  std::unique_ptr<Iteration> it_;
  std::vector<std::pair<v1::FrameHeader, at::Tensor>> early_;
  std::vector<v1::WorkerMessage> replay_;
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
}
void JobRuntime::Tick(absl::Time now) { impl_->metrics().IdleCheck(now); }

}  // namespace detour
