#include "worker/runtime/job_runtime.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/spec.h"
#include "common/status.h"
#include "common/timing.h"
#include "worker/model/checkpoint.h"
#include "worker/model/engine.h"
#include "worker/model/kfac.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"
#include "worker/model/text_data.h"
#include "worker/model/torch_status.h"
#include "worker/transport/frame_codec.h"
#include "worker/transport/peer_sender.h"
#include "worker/runtime/work_queue.h"

namespace detour {
namespace {

at::ScalarType TorchType(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP16: return at::kHalf;
    case v1::DTYPE_BF16: return at::kBFloat16;
    case v1::DTYPE_INT64: return at::kLong;
    default: return at::kFloat;
  }
}

v1::DType WireDType(const std::string& name) {
  if (name == "fp16") return v1::DTYPE_FP16;
  if (name == "bf16") return v1::DTYPE_BF16;
  return v1::DTYPE_FP32;
}

// FNV-1a over the parameters' bytes: equal across replicas iff identical.
uint64_t Checksum(const std::vector<model::NamedTensor>& params) {
  uint64_t h = 1469598103934665603ull;
  for (const auto& [name, t] : params) {
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const auto* p = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0, n = c.nbytes(); i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  }
  return h;
}

LinkEmulation EmulationBetween(const v1::ClusterSpec& net, const std::string& from_region,
                               const std::string& to_region) {
  LinkEmulation e;
  if (net.nodes().empty() && net.links().empty()) return e;
  double latency_ms = net.intra_region_latency_ms() > 0 ? net.intra_region_latency_ms() : 1.0;
  double gbps = net.intra_region_bandwidth_gbytes_per_s() > 0
                    ? net.intra_region_bandwidth_gbytes_per_s()
                    : 5.0;
  if (from_region != to_region) {
    for (const v1::RegionLink& l : net.links()) {
      if ((l.region_a() == from_region && l.region_b() == to_region) ||
          (l.region_b() == from_region && l.region_a() == to_region)) {
        latency_ms = l.latency_ms();
        gbps = l.bandwidth_gbytes_per_s();
      }
    }
  }
  e.latency = absl::Milliseconds(latency_ms);
  e.bandwidth_bytes_per_s = gbps * 1e9;
  return e;
}

}  // namespace

class JobRuntime::Impl {
 public:
  Impl(JobRuntimeOptions options, SendFn send, JobFn set_job)
      : options_(std::move(options)), send_(std::move(send)), set_job_(std::move(set_job)) {
    InitMetrics();
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

  // Pipeline work goes through the queue's policy; all-reduce inputs are
  // control work (they wait for nothing).
  void Enqueue(const v1::FrameHeader& h, at::Tensor tensor) {
    NoteArrival();
    auto fn = [this, h, tensor] { OnTensor(h, tensor); };
    absl::MutexLock lock(&queue_mu_);
    if (stopping_) return;
    if (h.direction() == v1::DIRECTION_ALLREDUCE) {
      queue_.PushControl(std::move(fn));
      return;
    }
    WorkQueue::Pipeline w;
    w.iteration = h.iteration();
    w.microbatch = h.microbatch();
    w.hop = static_cast<int>(h.hop());
    w.backward = h.direction() == v1::DIRECTION_BACKWARD;
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
        default: LogWarning("ignoring an empty coordinator message");
      }
    });
  }

  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) {
    std::vector<int64_t> shape(h.shape().begin(), h.shape().end());
    {
      absl::MutexLock lock(&accept_mu_);
      if (accept_job_.empty() || h.job_id() != accept_job_) {
        return absl::FailedPreconditionError(
            absl::StrCat("this worker holds no stage of job ", h.job_id()));
      }
      if (h.iteration() < accept_iteration_ || h.iteration() > accept_iteration_ + 1) {
        Count(late_frames_);
        return absl::FailedPreconditionError(absl::StrCat(
            "iteration ", h.iteration(), " is not current (", accept_iteration_, ")"));
      }
      if (h.direction() == v1::DIRECTION_ALLREDUCE) {
        // Gradients, plus K-FAC factors in iterations that sync them (the
        // exact size is checked against the plan when the tensor is used).
        if (shape.size() != 1 || shape[0] < accept_flat_numel_ ||
            shape[0] > accept_flat_numel_ + accept_factor_numel_ || h.dtype() != v1::DTYPE_FP32) {
          return absl::InvalidArgumentError(absl::StrCat(
              "all-reduce tensor [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
              " does not match this stage's ", accept_flat_numel_, " fp32 gradients"));
        }
      } else if (shape != accept_activation_shape_ || h.dtype() != accept_wire_) {
        return absl::InvalidArgumentError(absl::StrCat(
            "activation [", absl::StrJoin(shape, ","), "] ", v1::DType_Name(h.dtype()),
            " does not match the job's [", absl::StrJoin(accept_activation_shape_, ","), "] ",
            v1::DType_Name(accept_wire_)));
      }
    }
    return model::GuardTorch("allocating a received tensor", [&]() -> absl::StatusOr<MutableBuffer> {
      auto tensor = std::make_shared<at::Tensor>(
          at::empty(shape, at::TensorOptions().dtype(TorchType(h.dtype()))));
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
  enum class Phase { kIdle, kRunning, kReducing, kWaitingStep };

  struct Iteration {
    v1::IterationPlan plan;
    absl::Time received;
    std::map<uint32_t, const v1::Route*> routes;  // by microbatch id
    int expected_tasks = 0;
    int done_tasks = 0;
    std::set<std::string> applied;  // (direction, mb, hop) already run
    std::vector<model::Microbatch> microbatches;  // data nodes
    double loss_sum = 0;
    uint64_t tokens = 0;
    std::vector<uint32_t> microbatches_done;
    int local_visits = 0;
    std::map<int, std::pair<at::Tensor, int>> reduce_inputs;  // rank -> (flat grad, visits)
    v1::TimingReport timing;
    Phase phase = Phase::kRunning;
    // K-FAC: microbatches whose forward / backward ran on this node; this
    // node's bubble tasks not yet run (plan order, serial ones last); the
    // layers whose factors ride on this iteration's all-reduce.
    std::set<uint32_t> forward_done;
    std::set<uint32_t> backward_done;
    std::list<v1::BubbleTask> bubbles;
    std::vector<int> sync_layers;
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

  void OnAssignment(const v1::StageAssignment& a) {
    if (!job_id_.empty()) {
      LogWarning("assignment for job ", a.job_id(), " while holding job ", job_id_,
                 "; abandoning the old job");
      Abandon();
    }
    absl::Status built = Build(a);
    if (!built.ok()) {
      LogError("cannot build stage ", a.stage(), " of job ", a.job_id(), ": ", built.message());
      ReportError(a.job_id(), 0, built);
      Abandon();
      return;
    }
    LogInfo("job ", job_id_, ": holding stage ", stage_index_, " (layers ", a.layer_begin(), "-",
            a.layer_end(), "), replica ", rank_ + 1, " of ", group_.size());
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
    group_.assign(a.replica_group().begin(), a.replica_group().end());
    rank_ = -1;
    for (size_t i = 0; i < group_.size(); ++i) {
      if (group_[i] == me_) rank_ = static_cast<int>(i);
    }
    if (rank_ < 0) {
      return absl::InvalidArgumentError(absl::StrCat("worker ", me_,
                                                     " is not in its own replica group"));
    }
    const c10::Device device = options_.device == "cuda" ? c10::Device(c10::kCUDA)
                                                         : c10::Device(c10::kCPU);
    device_ = device;
    // Non-data nodes take whatever the plan routes to them: the planner
    // bounds their activation memory; refusing work here could deadlock the
    // pipeline. Data nodes bound their own starts by memory_slots.
    v1::JobSpec stage_spec = spec;
    const uint32_t total = spec.pipeline().data_nodes() * spec.pipeline().microbatches_per_data_node();
    stage_spec.mutable_pipeline()->set_memory_slots(std::max(spec.pipeline().memory_slots(), total));
    ASSIGN_OR_RETURN(stage_, model::Stage::FromJobSpec(stage_spec, stage_index_, device));
    optimizer_ = std::make_unique<model::AdamW>(stage_->Parameters(), spec.optimizer().adamw());
    flat_numel_ = 0;
    for (const auto& [name, t] : stage_->Parameters()) flat_numel_ += t.numel();
    factor_numel_ = 0;
    if (spec.optimizer().kind() == v1::OPTIMIZER_KFAC) {
      ASSIGN_OR_RETURN(kfac_, model::Kfac::Create(stage_.get(), spec.optimizer()));
      optimizer_->set_precondition_hook(kfac_.get());
      const model::LayerRange layers = stage_->layers();
      for (int l = layers.begin; l < layers.end; ++l) {
        for (const at::Tensor& t : kfac_->PendingFactorTensors(l)) factor_numel_ += t.numel();
      }
    }
    if (stage_index_ == 0) {
      ASSIGN_OR_RETURN(model::TextDataset data, model::LoadDataset(spec.data()));
      train_tokens_ = std::move(data.train);
    }
    wire_ = WireDType(spec.pipeline().wire_dtype());
    for (const v1::Peer& p : a.peers()) {
      peers_[p.worker_id()] = p;
      if (p.worker_id() == me_) continue;
      PeerSenderOptions o;
      o.emulation = EmulationBetween(a.emulate_network(), options_.region, p.region());
      senders_[p.worker_id()] = std::make_unique<PeerSender>(p.address(), o);
    }
    {
      absl::MutexLock lock(&accept_mu_);
      accept_job_ = job_id_;
      accept_iteration_ = 0;
      accept_activation_shape_ = {spec.pipeline().samples_per_microbatch(),
                                  spec.model().context_length(), spec.model().d_model()};
      accept_wire_ = wire_;
      accept_flat_numel_ = flat_numel_;
      accept_factor_numel_ = factor_numel_;
    }
    if (set_job_) set_job_(job_id_);
    return absl::OkStatus();
  }

  void OnPlan(const v1::IterationPlan& plan) {
    if (plan.job_id() != job_id_ || stage_ == nullptr) {
      LogWarning("dropping plan for job ", plan.job_id(), " (holding ",
                 job_id_.empty() ? "none" : job_id_, ")");
      return;
    }
    if (it_ != nullptr) {
      LogWarning("dropping plan for iteration ", plan.iteration(), ": iteration ",
                 it_->plan.iteration(), " is still running");
      return;
    }
    it_ = std::make_unique<Iteration>();
    Iteration& it = *it_;
    it.plan = plan;
    it.received = absl::Now();
    it.timing.set_job_id(job_id_);
    it.timing.set_iteration(plan.iteration());
    it.timing.set_node(me_);
    {
      absl::MutexLock lock(&accept_mu_);
      accept_iteration_ = plan.iteration();
    }
    std::map<uint32_t, std::vector<int>> stages;
    std::vector<uint32_t> own;
    for (const v1::Route& r : it.plan.routes()) {
      it.routes[r.microbatch()] = &r;
      for (int p = 0; p < r.nodes_size(); ++p) {
        if (r.nodes(p) == me_) it.expected_tasks += 2;
      }
      stages[r.microbatch()].assign(r.stages().begin(), r.stages().end());
      if (r.data_node() == me_) own.push_back(r.microbatch());
    }
    if (!own.empty()) {
      auto mbs = model::IterationMicrobatches(spec_, train_tokens_, plan.iteration(), device_);
      if (!mbs.ok()) return Fail(mbs.status());
      it.microbatches = std::move(*mbs);
      for (uint32_t mb : own) {
        if (mb >= it.microbatches.size()) {
          return Fail(absl::InvalidArgumentError(absl::StrCat("plan names microbatch ", mb,
                                                              " beyond the iteration's data")));
        }
      }
    }
    if (absl::Status s = TakeBubbleTasks(); !s.ok()) return Fail(s);
    // The data node's microbatches queue up as forwards that need a slot:
    // the queue starts each when the policy picks it and a slot is free.
    const int slots = options_.memory_slots > 0
                          ? options_.memory_slots
                          : static_cast<int>(spec_.pipeline().memory_slots());
    const uint64_t iteration = plan.iteration();
    {
      absl::MutexLock lock(&queue_mu_);
      queue_.BeginIteration(iteration, std::move(stages), slots,
                            spec_.pipeline().queue_policy() == v1::QUEUE_POLICY_BACKWARD_FIRST
                                ? sim::QueuePolicy::kBackwardFirst
                                : sim::QueuePolicy::kArrival);
      for (uint32_t mb : own) {
        WorkQueue::Pipeline w;
        w.iteration = iteration;
        w.microbatch = mb;
        queue_.PushPipeline(w, [this, iteration, mb] { StartMicrobatch(iteration, mb); });
      }
    }
    // Tensors of this iteration that arrived before its plan queue up again.
    std::vector<std::pair<v1::FrameHeader, at::Tensor>> early;
    early.swap(early_);
    for (auto& [h, t] : early) {
      if (h.iteration() == iteration) Enqueue(h, t);
    }
    MaybeFinishLocal();
  }

  void StartMicrobatch(uint64_t iteration, uint32_t mb) {
    if (it_ == nullptr || it_->plan.iteration() != iteration) return;
    RunForward(mb, 0, it_->microbatches[mb].tokens);
  }

  // Forward of `mb` at position `pos` of its route (this node), then on.
  void RunForward(uint32_t mb, int pos, const at::Tensor& input) {
    Iteration& it = *it_;
    const v1::Route& r = *it.routes.at(mb);
    const absl::Time start = absl::Now();
    auto out = stage_->Forward(mb, input);
    if (!out.ok()) return Fail(out.status());
    Record(v1::TaskTiming::KIND_FORWARD, mb, start);
    ++it.done_tasks;
    it.forward_done.insert(mb);
    if (pos + 1 < r.nodes_size()) {
      SendTensor(r.nodes(pos + 1), v1::DIRECTION_FORWARD, mb, pos + 1, *out);
    } else if (r.nodes_size() == 1) {
      RunLoss(mb, *out);  // the route visits stage 0 only
    } else {
      SendTensor(r.data_node(), v1::DIRECTION_FORWARD, mb, r.nodes_size(), *out);
    }
  }

  void RunLoss(uint32_t mb, const at::Tensor& hidden) {
    Iteration& it = *it_;
    const v1::Route& r = *it.routes.at(mb);
    const absl::Time start = absl::Now();
    auto loss = stage_->LossAndBackward(mb, hidden, it.microbatches[mb].targets);
    if (!loss.ok()) return Fail(loss.status());
    Record(v1::TaskTiming::KIND_LOSS, mb, start);
    it.loss_sum += loss->loss;
    it.tokens += static_cast<uint64_t>(loss->tokens);
    const int last = r.nodes_size() - 1;
    if (last == 0) {
      RunBackward(mb, 0, loss->grad_hidden);
    } else {
      SendTensor(r.nodes(last), v1::DIRECTION_BACKWARD, mb, last, loss->grad_hidden);
    }
  }

  void RunBackward(uint32_t mb, int pos, const at::Tensor& grad) {
    Iteration& it = *it_;
    const v1::Route& r = *it.routes.at(mb);
    const absl::Time start = absl::Now();
    auto gin = stage_->Backward(mb, grad);
    if (!gin.ok()) return Fail(gin.status());
    Record(v1::TaskTiming::KIND_BACKWARD, mb, start);
    ++it.done_tasks;
    it.backward_done.insert(mb);
    ++it.local_visits;
    it.microbatches_done.push_back(mb);
    {
      absl::MutexLock lock(&queue_mu_);
      queue_.Release(it.plan.iteration(), mb);
    }
    if (pos > 0) SendTensor(r.nodes(pos - 1), v1::DIRECTION_BACKWARD, mb, pos - 1, *gin);
  }

  void OnTensor(const v1::FrameHeader& h, at::Tensor t) {
    if (h.job_id() != job_id_) return;
    if (it_ == nullptr || h.iteration() != it_->plan.iteration()) {
      if (it_ == nullptr || h.iteration() == it_->plan.iteration() + 1) {
        // Its plan is on the way. An honest iteration sends this node at most
        // a forward and a backward per microbatch plus the replicas'
        // all-reduce inputs; more is a flood and is dropped.
        const size_t most = 2 * static_cast<size_t>(spec_.pipeline().data_nodes()) *
                                spec_.pipeline().microbatches_per_data_node() +
                            2 * group_.size() + 16;
        if (early_.size() >= most) {
          Count(unexpected_frames_);
          return;
        }
        early_.emplace_back(h, t);
      } else {
        Count(late_frames_);
      }
      return;
    }
    Iteration& it = *it_;
    if (h.direction() == v1::DIRECTION_ALLREDUCE) {
      const int from = static_cast<int>(h.microbatch());
      if (from < 0 || from >= static_cast<int>(group_.size()) || from == rank_ ||
          it.reduce_inputs.count(from)) {
        Count(unexpected_frames_);
        return;
      }
      it.reduce_inputs[from] = {t, static_cast<int>(h.hop())};
      TryReduce();
      return;
    }
    const std::string key = absl::StrCat(h.direction(), "/", h.microbatch(), "/", h.hop());
    auto route = it.routes.find(h.microbatch());
    const int hop = static_cast<int>(h.hop());
    bool expected = route != it.routes.end() && !it.applied.count(key);
    if (expected) {
      const v1::Route& r = *route->second;
      if (h.direction() == v1::DIRECTION_FORWARD) {
        expected = (hop < r.nodes_size() && r.nodes(hop) == me_ && hop > 0) ||
                   (hop == r.nodes_size() && r.data_node() == me_);
      } else {
        expected = hop < r.nodes_size() && r.nodes(hop) == me_;
      }
    }
    if (!expected) {
      Count(unexpected_frames_);
      LogWarning("dropping unexpected ", v1::Direction_Name(h.direction()), " tensor mb ",
                 h.microbatch(), " hop ", h.hop(), " from ", h.sender());
      return;
    }
    it.applied.insert(key);
    at::Tensor x = t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
    if (device_ != c10::Device(c10::kCPU)) x = x.to(device_);
    const v1::Route& r = *route->second;
    if (h.direction() == v1::DIRECTION_FORWARD) {
      if (hop == r.nodes_size()) {
        RunLoss(h.microbatch(), x);
      } else {
        RunForward(h.microbatch(), hop, x);
      }
    } else {
      RunBackward(h.microbatch(), hop, x);
    }
    if (it_ != nullptr) MaybeFinishLocal();
  }

  void MaybeFinishLocal() {
    Iteration& it = *it_;
    if (it.phase != Phase::kRunning || it.done_tasks < it.expected_tasks) return;
    it.phase = Phase::kReducing;
    // Share this replica's summed gradient with the other replicas.
    if (group_.size() > 1) {
      // Factors to sync need all of this iteration's curvature first.
      if (!it.sync_layers.empty() && !DrainBubbles(IsCurvature)) return;
      auto flat = FlatGradients(it.local_visits > 0, it.sync_layers);
      if (!flat.ok()) return Fail(flat.status());
      local_flat_ = *flat;
      for (size_t i = 0; i < group_.size(); ++i) {
        if (static_cast<int>(i) == rank_) continue;
        SendTensor(group_[i], v1::DIRECTION_ALLREDUCE, static_cast<uint32_t>(rank_),
                   static_cast<uint32_t>(it.local_visits), local_flat_);
        if (it_ == nullptr) return;
      }
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

  void TryReduce() {
    Iteration& it = *it_;
    if (it.phase != Phase::kReducing) return;
    if (it.reduce_inputs.size() + 1 < group_.size()) return;
    const absl::Time start = absl::Now();
    int total_visits = it.local_visits;
    for (const auto& [rank, input] : it.reduce_inputs) total_visits += input.second;
    if (group_.size() > 1) {
      // Sum in rank order so every replica computes the identical result.
      absl::Status s = model::GuardTorch("all-reduce", [&]() -> absl::Status {
        at::Tensor sum;
        for (int r = 0; r < static_cast<int>(group_.size()); ++r) {
          const at::Tensor& part = r == rank_ ? local_flat_ : it.reduce_inputs.at(r).first;
          if (part.numel() != local_flat_.numel()) {
            return absl::InvalidArgumentError(absl::StrCat(
                "all-reduce from ", group_[r], " has ", part.numel(), " values, expected ",
                local_flat_.numel(), " (gradients + K-FAC factors of layers ",
                absl::StrJoin(it.sync_layers, ","), ")"));
          }
          sum = sum.defined() ? sum + part : part.clone();
        }
        // Synced factors: the tail of the payload, back into place.
        int64_t tail = flat_numel_;
        for (int layer : it.sync_layers) {
          for (at::Tensor& f : kfac_->PendingFactorTensors(layer)) {
            f.copy_(sum.narrow(0, tail, f.numel()).view(f.sizes()).to(f.device()));
            tail += f.numel();
          }
        }
        if (total_visits == 0) return absl::OkStatus();
        int64_t offset = 0;
        for (const auto& [name, p] : stage_->Parameters()) {
          at::Tensor slice = sum.narrow(0, offset, p.numel()).view(p.sizes()).to(p.device());
          offset += p.numel();
          if (p.grad().defined()) {
            p.mutable_grad().copy_(slice);
          } else {
            p.mutable_grad() = slice.clone();
          }
        }
        return absl::OkStatus();
      });
      if (!s.ok()) return Fail(s);
      local_flat_ = at::Tensor();
    }
    Record(v1::TaskTiming::KIND_ALLREDUCE, 0, start);
    const double scale = model::GradNormalizationScale(spec_.pipeline().grad_normalization(),
                                                       total_visits, it.plan.routes_size());
    if (scale != 1.0 && scale != 0.0) {
      absl::Status s = stage_->ScaleGradients(scale);
      if (!s.ok()) return Fail(s);
    }
    auto sq = stage_->SquaredGradNorm();
    if (!sq.ok()) return Fail(sq.status());
    it.phase = Phase::kWaitingStep;
    v1::WorkerMessage m;
    v1::GradientNorm* n = m.mutable_grad_norm();
    n->set_job_id(job_id_);
    n->set_iteration(it.plan.iteration());
    n->set_stage(stage_index_);
    n->set_squared_norm(*sq);
    Send(std::move(m));
  }

  void OnStep(const v1::StepCommand& step) {
    if (it_ == nullptr || step.job_id() != job_id_ || step.iteration() != it_->plan.iteration() ||
        it_->phase != Phase::kWaitingStep) {
      LogWarning("dropping step command for ", step.job_id(), " iteration ", step.iteration());
      return;
    }
    Iteration& it = *it_;
    // K-FAC work of the iteration that found no idle time, and the serial
    // items, run now: the step may activate what they compute.
    if (!DrainBubbles([](const v1::BubbleTask&) { return true; })) return;
    if (kfac_ != nullptr && it.plan.kfac_activate_refresh() > 0) {
      kfac_->Activate();
      LogDebug("job ", job_id_, ": K-FAC refresh ", it.plan.kfac_activate_refresh() - 1,
               " active from iteration ", it.plan.iteration());
    }
    const absl::Time start = absl::Now();
    const double lr = model::ScheduledLearningRate(spec_.optimizer(), it.plan.iteration(),
                                                   spec_.iterations());
    const double clip = model::GlobalClipScale(step.squared_norm(),
                                               spec_.optimizer().grad_clip_norm());
    absl::Status stepped = optimizer_->Step(lr, clip);
    if (!stepped.ok()) return Fail(stepped);
    stage_->ZeroGrad();
    if (kfac_ != nullptr) kfac_->DropAllCaptures();
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
    r->set_loss_sum(it.loss_sum);
    r->set_tokens(it.tokens);
    for (uint32_t mb : it.microbatches_done) r->add_microbatches(mb);
    r->set_parameter_checksum(Checksum(stage_->Parameters()));
    r->set_stage(stage_index_);
    r->set_duration_s(duration);
    if (it.plan.checkpoint() && rank_ == 0) {
      // One replica per stage writes: replicas are identical.
      auto entry = model::WriteStageFile(it.plan.checkpoint_dir(), *stage_, *optimizer_);
      if (!entry.ok()) return Fail(Annotate(entry.status(), "writing the checkpoint"));
      v1::CheckpointFile* f = r->mutable_checkpoint();
      f->set_stage(entry->stage);
      f->set_file(entry->file);
      f->set_layer_begin(entry->layers.begin);
      f->set_layer_end(entry->layers.end);
      f->set_bytes(entry->bytes);
      f->set_checksum(entry->checksum);
    }
    const uint64_t done_iteration = it.plan.iteration();
    it_.reset();
    {
      absl::MutexLock lock(&accept_mu_);
      accept_iteration_ = done_iteration + 1;
    }
    if (iterations_metric_ != nullptr) iterations_metric_->Increment();
    Send(std::move(result));
  }

  void OnCommit(const v1::CommitCheckpoint& commit) {
    if (commit.job_id() != job_id_ || stage_ == nullptr) return;
    model::CheckpointManifest manifest;
    manifest.iteration = commit.iteration();
    manifest.model = stage_->config();
    manifest.num_stages = static_cast<int>(spec_.pipeline().num_stages());
    manifest.replicas_per_stage = static_cast<int>(spec_.pipeline().replicas_per_stage());
    manifest.seed = spec_.seed();
    for (const v1::CheckpointFile& f : commit.files()) {
      model::StageFileEntry e;
      e.stage = static_cast<int>(f.stage());
      e.file = f.file();
      e.layers.begin = static_cast<int>(f.layer_begin());
      e.layers.end = static_cast<int>(f.layer_end());
      e.bytes = f.bytes();
      e.checksum = f.checksum();
      manifest.stages.push_back(e);
    }
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

  // This node's tasks from the plan: curvature microbatches are captured
  // (their block inputs and output gradients kept), sync layers noted, the
  // rest queued in plan order with the serial ones last.
  absl::Status TakeBubbleTasks() {
    Iteration& it = *it_;
    std::vector<v1::BubbleTask> in_gaps, serial;
    for (const v1::BubbleTask& t : it.plan.bubble_tasks()) {
      if (t.node() != me_) continue;
      if (kfac_ == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the plan gives K-FAC task ", BubbleTaskName(t), " to a job without K-FAC"));
      }
      const model::LayerRange layers = stage_->layers();
      if (static_cast<int>(t.layer()) < layers.begin || static_cast<int>(t.layer()) >= layers.end) {
        return absl::InvalidArgumentError(absl::StrCat("K-FAC task ", BubbleTaskName(t),
                                                       " names a layer this stage (",
                                                       layers.begin, "-", layers.end - 1,
                                                       ") does not hold"));
      }
      switch (t.kind()) {
        case v1::BubbleTask::KIND_CURVATURE_A:
        case v1::BubbleTask::KIND_CURVATURE_B:
          if (!it.routes.count(t.microbatch())) {
            return absl::InvalidArgumentError(absl::StrCat(
                "K-FAC task ", BubbleTaskName(t), " names a microbatch the plan has no route for"));
          }
          if (!kfac_->captured(t.microbatch())) kfac_->Capture(t.microbatch());
          break;
        case v1::BubbleTask::KIND_SYNC_FACTORS:
          if (group_.size() > 1) it.sync_layers.push_back(static_cast<int>(t.layer()));
          continue;
        case v1::BubbleTask::KIND_INVERT_A:
        case v1::BubbleTask::KIND_INVERT_B:
          break;
        case v1::BubbleTask::KIND_PRECONDITION:
          continue;  // part of every K-FAC step
        default:
          return absl::InvalidArgumentError(
              absl::StrCat("unknown K-FAC task kind ", static_cast<int>(t.kind())));
      }
      (t.serial() ? serial : in_gaps).push_back(t);
    }
    it.bubbles.assign(in_gaps.begin(), in_gaps.end());
    it.bubbles.insert(it.bubbles.end(), serial.begin(), serial.end());
    std::sort(it.sync_layers.begin(), it.sync_layers.end());
    it.sync_layers.erase(std::unique(it.sync_layers.begin(), it.sync_layers.end()),
                         it.sync_layers.end());
    return absl::OkStatus();
  }

  static std::string BubbleTaskName(const v1::BubbleTask& t) {
    std::string name = absl::AsciiStrToLower(v1::BubbleTask::Kind_Name(t.kind()).substr(5));
    absl::StrAppend(&name, "(layer ", t.layer());
    if (!t.module().empty()) absl::StrAppend(&name, " ", t.module());
    if (t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
        t.kind() == v1::BubbleTask::KIND_CURVATURE_B) {
      absl::StrAppend(&name, " mb ", t.microbatch());
    }
    absl::StrAppend(&name, ", refresh ", t.refresh(), ")");
    return name;
  }

  static bool IsCurvature(const v1::BubbleTask& t) {
    return t.kind() == v1::BubbleTask::KIND_CURVATURE_A ||
           t.kind() == v1::BubbleTask::KIND_CURVATURE_B;
  }
  static bool IsInversion(const v1::BubbleTask& t) {
    return t.kind() == v1::BubbleTask::KIND_INVERT_A || t.kind() == v1::BubbleTask::KIND_INVERT_B;
  }

  // Whether a task may run now. Curvature: the microbatch's forward (A) or
  // backward (B) ran here, and the layer's previous refresh is finalised
  // (its first inversion ran; Kfac then starts new pending sums). Inversion:
  // no curvature of the same or an earlier refresh of the layer is left in
  // this iteration, and its factors are not waiting for the all-reduce.
  bool BubbleReady(const v1::BubbleTask& t) const {
    const Iteration& it = *it_;
    if (IsCurvature(t)) {
      const bool input = t.kind() == v1::BubbleTask::KIND_CURVATURE_A
                             ? it.forward_done.count(t.microbatch()) > 0
                             : it.backward_done.count(t.microbatch()) > 0;
      if (!input) return false;
      if (t.refresh() == 0) return true;
      auto done = finalized_refresh_.find(static_cast<int>(t.layer()));
      if (done != finalized_refresh_.end() && done->second + 1 >= t.refresh()) return true;
      for (const v1::BubbleTask& o : it.bubbles) {
        if (IsInversion(o) && o.layer() == t.layer() && o.refresh() < t.refresh()) return false;
      }
      return true;
    }
    for (const v1::BubbleTask& o : it.bubbles) {
      if (IsCurvature(o) && o.layer() == t.layer() && o.refresh() <= t.refresh()) return false;
    }
    const bool syncing = std::binary_search(it.sync_layers.begin(), it.sync_layers.end(),
                                            static_cast<int>(t.layer()));
    return !syncing || it.phase == Phase::kWaitingStep;
  }

  // The next bubble task to run while idle, or null. Bubble tasks only while
  // pipeline work of the iteration remains or is over; serial ones only once
  // this node's pipeline work is done.
  const v1::BubbleTask* NextBubble() {
    if (it_ == nullptr || kfac_ == nullptr) return nullptr;
    for (const v1::BubbleTask& t : it_->bubbles) {
      if (t.serial() && it_->phase == Phase::kRunning) continue;
      if (BubbleReady(t)) return &t;
    }
    return nullptr;
  }

  // Runs one task (it must be in it_->bubbles) and removes it. False when the
  // job failed.
  bool RunBubble(const v1::BubbleTask* task, bool at_step_end) {
    Iteration& it = *it_;
    auto pos = std::find_if(it.bubbles.begin(), it.bubbles.end(),
                            [task](const v1::BubbleTask& t) { return &t == task; });
    const v1::BubbleTask t = *pos;
    it.bubbles.erase(pos);
    const absl::Time start = absl::Now();
    bubble_running_.store(true, std::memory_order_release);
    absl::Status s = model::GuardTorch("K-FAC", [&]() -> absl::Status {
      const int layer = static_cast<int>(t.layer());
      switch (t.kind()) {
        case v1::BubbleTask::KIND_CURVATURE_A: return kfac_->CurvatureA(layer, t.microbatch());
        case v1::BubbleTask::KIND_CURVATURE_B: return kfac_->CurvatureB(layer, t.microbatch());
        case v1::BubbleTask::KIND_INVERT_A: return kfac_->InvertA(layer, t.module());
        case v1::BubbleTask::KIND_INVERT_B: return kfac_->InvertB(layer, t.module());
        default: return absl::OkStatus();
      }
    });
    bubble_running_.store(false, std::memory_order_release);
    const absl::Time end = absl::Now();
    if (IsInversion(t)) {
      uint64_t& done = finalized_refresh_[static_cast<int>(t.layer())];
      done = std::max(done, t.refresh());
      // A layer no curvature microbatch ever reached (skip routes) has no
      // factor to invert yet: it stays with AdamW until one does.
      if (s.code() == absl::StatusCode::kFailedPrecondition &&
          !(t.kind() == v1::BubbleTask::KIND_INVERT_A
                ? kfac_->FactorA(static_cast<int>(t.layer()), t.module())
                : kfac_->FactorB(static_cast<int>(t.layer()), t.module()))
               .defined()) {
        LogWarning("job ", job_id_, ": ", BubbleTaskName(t), " skipped: ", s.message());
        s = absl::OkStatus();
      }
    }
    const int64_t arrived = arrived_during_bubble_ns_.exchange(0);
    if (arrived != 0) {
      const double delay = std::max(0.0, (absl::ToUnixNanos(end) - arrived) * 1e-9);
      it.max_delay_s = std::max(it.max_delay_s, delay);
      if (kfac_delay_metric_ != nullptr) kfac_delay_metric_->Observe(delay);
    }
    if (!s.ok()) {
      Fail(Annotate(s, BubbleTaskName(t)));
      return false;
    }
    Record(v1::TaskTiming::KIND_BUBBLE, t.microbatch(), start);
    const double seconds = absl::ToDoubleSeconds(end - start);
    const std::string placement = t.serial() ? "serial" : at_step_end ? "overdue" : "bubble";
    if (kfac_tasks_metric_ != nullptr) {
      auto c = kfac_tasks_metric_->WithLabels(
          {absl::AsciiStrToLower(v1::BubbleTask::Kind_Name(t.kind()).substr(5)), placement});
      if (c.ok()) (*c)->Increment();
    }
    if (kfac_seconds_metric_ != nullptr) {
      auto c = kfac_seconds_metric_->WithLabels({placement});
      if (c.ok()) (void)(*c)->IncrementBy(seconds);
    }
    return true;
  }

  // Runs this iteration's bubble tasks now, at step end, until none that
  // `wanted` selects is left: the first ready wanted task, else the first
  // ready inversion (it may be what unblocks the next refresh's curvature).
  // Every task is ready once the node's pipeline work is done, unless the plan
  // disagrees with the routes. False when the job failed.
  bool DrainBubbles(const std::function<bool(const v1::BubbleTask&)>& wanted) {
    Iteration& it = *it_;
    while (true) {
      const v1::BubbleTask* left = nullptr;
      const v1::BubbleTask* next = nullptr;
      const v1::BubbleTask* inversion = nullptr;
      for (const v1::BubbleTask& t : it.bubbles) {
        const bool want = wanted(t);
        if (want && left == nullptr) left = &t;
        if (!BubbleReady(t)) continue;
        if (want && next == nullptr) next = &t;
        if (IsInversion(t) && inversion == nullptr) inversion = &t;
      }
      if (left == nullptr) return true;
      if (next == nullptr) next = inversion;
      if (next == nullptr) {
        Fail(absl::FailedPreconditionError(absl::StrCat(
            "K-FAC task ", BubbleTaskName(*left),
            " cannot run: its input never came (the plan is inconsistent with the routes)")));
        return false;
      }
      if (!RunBubble(next, /*at_step_end=*/true)) return false;
    }
  }

  // Busy fraction of the iteration: pipeline work, and with K-FAC work.
  void PublishUtilization(const Iteration& it, double duration) {
    if (utilization_metric_ == nullptr || duration <= 0) return;
    const BusySeconds busy = SumBusy(it.timing);
    if (auto g = utilization_metric_->WithLabels({"pipeline"}); g.ok()) {
      (*g)->Set(busy.pipeline / duration);
    }
    if (auto g = utilization_metric_->WithLabels({"pipeline_and_kfac"}); g.ok()) {
      (*g)->Set((busy.pipeline + busy.kfac) / duration);
    }
  }

  // --- helpers ----------------------------------------------------------

  void SendTensor(const std::string& to, v1::Direction direction, uint32_t mb, uint32_t hop,
                  const at::Tensor& tensor) {
    auto sender = senders_.find(to);
    if (sender == senders_.end()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat("no peer ", to, " in the assignment")));
    }
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
    sender->second->Send(std::move(h), std::move(view),
                         [this, job, iteration, to, direction, bytes](absl::Status s, double t) {
                           Post([=] { OnTransferDone(job, iteration, to, direction, bytes, s, t); });
                         });
  }

  void OnTransferDone(const std::string& job, uint64_t iteration, const std::string& to,
                      v1::Direction direction, uint64_t bytes, const absl::Status& status,
                      double seconds) {
    if (job != job_id_) return;
    if (!status.ok()) {
      if (it_ != nullptr && it_->plan.iteration() == iteration) {
        Fail(Annotate(status, absl::StrCat("sending ", v1::Direction_Name(direction), " to ", to)));
      }
      return;
    }
    if (transfer_metric_ != nullptr) {
      auto h = transfer_metric_->WithLabels(
          {direction == v1::DIRECTION_FORWARD    ? "forward"
           : direction == v1::DIRECTION_BACKWARD ? "backward"
                                                 : "allreduce"});
      if (h.ok()) (*h)->Observe(seconds);
    }
    if (it_ != nullptr && it_->plan.iteration() == iteration) {
      v1::TransferTiming* t = it_->timing.add_transfers();
      t->set_peer(to);
      t->set_forward(direction == v1::DIRECTION_FORWARD);
      t->set_bytes(bytes);
      t->set_duration_s(seconds);
    }
  }

  void Record(v1::TaskTiming::Kind kind, uint32_t mb, absl::Time start) {
    const absl::Time end = absl::Now();
    const double seconds = absl::ToDoubleSeconds(end - start);
    if (it_ != nullptr) {
      v1::TaskTiming* t = it_->timing.add_tasks();
      t->set_kind(kind);
      t->set_microbatch(mb);
      t->set_start_s(absl::ToDoubleSeconds(start - it_->received));
      t->set_duration_s(seconds);
    }
    if (busy_metric_ != nullptr) (void)busy_metric_->IncrementBy(seconds);
    if (task_metric_ != nullptr) {
      auto h = task_metric_->WithLabels(
          {absl::AsciiStrToLower(v1::TaskTiming::Kind_Name(kind).substr(5))});
      if (h.ok()) (*h)->Observe(seconds);
    }
  }

  void Fail(const absl::Status& status) {
    LogError("job ", job_id_, ": ", status.message());
    ReportError(job_id_, it_ ? it_->plan.iteration() : 0, status);
    Abandon();
  }

  void ReportError(const std::string& job, uint64_t iteration, const absl::Status& status) {
    v1::WorkerMessage m;
    v1::JobError* e = m.mutable_error();
    e->set_job_id(job);
    e->set_iteration(iteration);
    e->set_code(static_cast<int>(status.code()));
    e->set_message(absl::StrCat("worker ", me_, ": ", status.message()));
    Send(std::move(m));
  }

  // Forgets the current job: stage, peers, iteration state.
  void Abandon() {
    {
      absl::MutexLock lock(&accept_mu_);
      accept_job_.clear();
    }
    {
      // Queued pipeline work belongs to the abandoned job.
      absl::MutexLock lock(&queue_mu_);
      queue_.DropPipeline();
    }
    for (auto& [id, sender] : senders_) sender->Close();
    senders_.clear();
    peers_.clear();
    it_.reset();
    early_.clear();
    optimizer_.reset();
    kfac_.reset();
    finalized_refresh_.clear();
    stage_.reset();
    train_tokens_.clear();
    local_flat_ = at::Tensor();
    if (!job_id_.empty() && set_job_) set_job_("");
    job_id_.clear();
  }

  void Send(v1::WorkerMessage message) {
    absl::Status s = send_(std::move(message));
    if (!s.ok()) LogWarning("cannot reach the coordinator: ", s.message());
  }

  void InitMetrics() {
    metrics::Registry* m = options_.metrics;
    if (m == nullptr) return;
    if (auto f = m->AddHistogram("detour_worker_task_seconds",
                                 "Compute time of pipeline tasks on this worker.",
                                 metrics::DefaultLatencyBuckets(), {"kind"});
        f.ok()) {
      task_metric_ = *f;
    }
    if (auto f = m->AddHistogram("detour_worker_transfer_seconds",
                                 "Time from handing a tensor to gRPC to the peer's "
                                 "acknowledgement.",
                                 metrics::DefaultLatencyBuckets(), {"direction"});
        f.ok()) {
      transfer_metric_ = *f;
    }
    auto counter = [&](const char* name, const char* help) -> metrics::Counter* {
      auto f = m->AddCounter(name, help);
      if (!f.ok()) return nullptr;
      auto c = (*f)->WithLabels({});
      return c.ok() ? *c : nullptr;
    };
    busy_metric_ = counter("detour_worker_busy_seconds",
                           "Seconds spent computing pipeline and optimiser tasks.");
    iterations_metric_ = counter("detour_worker_iterations", "Iterations completed.");
    late_frames_ = counter("detour_worker_frames_late",
                           "Tensors for an old or unknown iteration, dropped.");
    unexpected_frames_ = counter("detour_worker_frames_unexpected",
                                 "Tensors not matching the plan (hop, duplicate), dropped.");
    if (auto f = m->AddGauge("detour_worker_busy_fraction",
                             "Busy fraction of the last iteration's wall time: work=\"pipeline\" "
                             "counts forward, backward and loss; work=\"pipeline_and_kfac\" "
                             "adds K-FAC curvature and inversion work.",
                             {"work"});
        f.ok()) {
      utilization_metric_ = *f;
    }
    if (auto f = m->AddCounter("detour_worker_kfac_tasks",
                               "K-FAC tasks run, by kind and placement: bubble (while idle), "
                               "serial (planned at step end), overdue (planned in a bubble, "
                               "run at step end because no idle time came).",
                               {"kind", "placement"});
        f.ok()) {
      kfac_tasks_metric_ = *f;
    }
    if (auto f = m->AddCounter("detour_worker_kfac_seconds",
                               "Seconds of K-FAC work, by placement.", {"placement"});
        f.ok()) {
      kfac_seconds_metric_ = *f;
    }
    if (auto f = m->AddHistogram("detour_worker_kfac_delay_seconds",
                                 "How long pipeline work that arrived during a K-FAC bubble "
                                 "task waited for it to finish.",
                                 metrics::DefaultLatencyBuckets());
        f.ok()) {
      if (auto h = (*f)->WithLabels({}); h.ok()) kfac_delay_metric_ = *h;
    }
  }

  static void Count(metrics::Counter* c) {
    if (c != nullptr) c->Increment();
  }

  const JobRuntimeOptions options_;
  const SendFn send_;
  const JobFn set_job_;

  // Executor queue.
  absl::Mutex queue_mu_;
  WorkQueue queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::thread executor_;

  // What Allocate accepts (read on gRPC threads).
  absl::Mutex accept_mu_;
  std::string accept_job_ ABSL_GUARDED_BY(accept_mu_);
  uint64_t accept_iteration_ ABSL_GUARDED_BY(accept_mu_) = 0;
  std::vector<int64_t> accept_activation_shape_ ABSL_GUARDED_BY(accept_mu_);
  v1::DType accept_wire_ ABSL_GUARDED_BY(accept_mu_) = v1::DTYPE_FP32;
  int64_t accept_flat_numel_ ABSL_GUARDED_BY(accept_mu_) = 0;
  int64_t accept_factor_numel_ ABSL_GUARDED_BY(accept_mu_) = 0;

  // Executor-only state.
  std::string me_;  // this worker's id, from the assignment
  std::string job_id_;
  v1::JobSpec spec_;
  int stage_index_ = 0;
  std::vector<std::string> group_;
  int rank_ = 0;
  c10::Device device_ = c10::Device(c10::kCPU);
  std::unique_ptr<model::Stage> stage_;
  std::unique_ptr<model::AdamW> optimizer_;
  std::unique_ptr<model::Kfac> kfac_;  // K-FAC jobs only
  std::map<int, uint64_t> finalized_refresh_;  // layer -> newest refresh inverted
  int64_t flat_numel_ = 0;
  int64_t factor_numel_ = 0;  // all held layers' factors (all-reduce bound)
  // Set while a bubble task runs; the first pipeline message arriving then
  // records its time (how long bubble work delays pipeline work).
  std::atomic<bool> bubble_running_{false};
  std::atomic<int64_t> arrived_during_bubble_ns_{0};
  std::vector<int32_t> train_tokens_;
  v1::DType wire_ = v1::DTYPE_FP32;
  std::map<std::string, v1::Peer> peers_;
  std::map<std::string, std::unique_ptr<PeerSender>> senders_;
  std::unique_ptr<Iteration> it_;
  std::vector<std::pair<v1::FrameHeader, at::Tensor>> early_;
  at::Tensor local_flat_;

  metrics::HistogramFamily* task_metric_ = nullptr;
  metrics::HistogramFamily* transfer_metric_ = nullptr;
  metrics::Counter* busy_metric_ = nullptr;
  metrics::Counter* iterations_metric_ = nullptr;
  metrics::Counter* late_frames_ = nullptr;
  metrics::Counter* unexpected_frames_ = nullptr;
  metrics::GaugeFamily* utilization_metric_ = nullptr;
  metrics::CounterFamily* kfac_tasks_metric_ = nullptr;
  metrics::CounterFamily* kfac_seconds_metric_ = nullptr;
  metrics::Histogram* kfac_delay_metric_ = nullptr;
};

JobRuntime::JobRuntime(JobRuntimeOptions options, SendFn send, JobFn set_job)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(send), std::move(set_job))) {}

JobRuntime::~JobRuntime() { Stop(); }

void JobRuntime::OnCoordinatorMessage(const v1::CoordinatorMessage& message) {
  impl_->OnCoordinatorMessage(message);
}

absl::StatusOr<MutableBuffer> JobRuntime::Allocate(const v1::FrameHeader& header) {
  return impl_->Allocate(header);
}

void JobRuntime::Deliver(const v1::FrameHeader& header, MutableBuffer buffer) {
  impl_->Deliver(header, std::move(buffer));
}

void JobRuntime::Stop() { impl_->Stop(); }

}  // namespace detour
