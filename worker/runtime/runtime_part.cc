#include "worker/runtime/runtime_part.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "worker/model/torch_status.h"

namespace detour {

absl::Status CheckFrameValues(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return absl::OkStatus();
  double lo = 0;
  double hi = 0;
  absl::Status s = model::GuardTorch("checking a received tensor", [&]() -> absl::Status {
    auto [min, max] = at::aminmax(t);
    lo = min.item<double>();
    hi = max.item<double>();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  if (std::isnan(lo) || std::isnan(hi)) return absl::InvalidArgumentError("it holds NaN");
  const double most = std::max(std::fabs(lo), std::fabs(hi));
  if (std::isinf(most)) return absl::InvalidArgumentError("it holds an infinity");
  if (most > kMaxFrameMagnitude) {
    return absl::InvalidArgumentError(
        absl::StrCat("it holds a value of magnitude ", most, ", beyond ", kMaxFrameMagnitude));
  }
  return absl::OkStatus();
}

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

RuntimePart::RuntimePart(RuntimeShared* shared, RuntimeCore* core)
    : core_(core),
      options_(shared->options),
      metrics_(shared->metrics),
      admission_(shared->admission),
      me_(shared->me),
      job_id_(shared->job_id),
      spec_(shared->spec),
      stage_index_(shared->stage_index),
      epoch_(shared->epoch),
      completed_(shared->completed),
      group_(shared->group),
      reducer_(shared->reducer),
      device_(shared->device),
      stage_(shared->stage),
      optimizer_(shared->optimizer),
      kfac_(shared->kfac),
      bubbles_(shared->bubbles),
      flat_numel_(shared->flat_numel),
      factor_numel_(shared->factor_numel),
      bubble_running_(shared->bubble_running),
      arrived_during_bubble_ns_(shared->arrived_during_bubble_ns),
      train_tokens_(shared->train_tokens),
      wire_(shared->wire),
      transport_(shared->transport),
      peers_(shared->peers),
      link_hint_(shared->link_hint),
      state_from_(shared->state_from),
      it_(shared->it),
      early_(shared->early),
      replay_(shared->replay),
      fault_done_(shared->fault_done) {}

PeerEndpoint RuntimePart::Endpoint(const v1::Peer& p) const {
  PeerEndpoint e{p.worker_id(), p.address(), p.region(), p.data_address(), LinkHint{}};
  if (link_hint_) e.link = link_hint_(p.worker_id());
  return e;
}

void RuntimePart::SetPeers(const google::protobuf::RepeatedPtrField<v1::Peer>& peers) {
  peers_.clear();
  for (const v1::Peer& p : peers) {
    if (p.worker_id() == me_) continue;
    peers_[p.worker_id()] = Endpoint(p);
  }
  PushPeers();
}

void RuntimePart::PushPeers() {
  std::vector<PeerEndpoint> endpoints;
  std::set<std::string> members = {me_};
  for (const auto& [id, p] : peers_) {
    endpoints.push_back(p);
    members.insert(id);
  }
  admission_.SetMembers(std::move(members));
  transport_->SetPeers(endpoints);
  if (options_.peers_changed) {
    std::vector<std::string> addresses;
    for (const PeerEndpoint& p : endpoints) {
      for (const std::string* a : {&p.address, &p.data_address}) {
        if (!a->empty()) addresses.push_back(*a);
      }
    }
    options_.peers_changed(addresses);
  }
}

void RuntimePart::SendTensor(const std::string& to, v1::Direction direction, uint32_t mb,
                             uint32_t hop, const at::Tensor& tensor, uint64_t epoch) {
  at::Tensor wire = tensor.detach();
  v1::DType dtype = v1::DTYPE_FP32;
  if (direction != v1::DIRECTION_ALLREDUCE && wire_ != v1::DTYPE_FP32) {
    wire = wire.to(TorchType(wire_));
    dtype = wire_;
  } else if (wire.scalar_type() != at::kFloat) {
    wire = wire.to(at::kFloat);
  }
  wire = wire.to(at::kCPU).contiguous();
  if (direction == v1::DIRECTION_FORWARD &&
      options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kNanActivations &&
      it_->plan.iteration() >= options_.fault.iteration && wire.numel() > 0) {
    LogWarning("job ", job_id_, ": --inject_fault: sending NaN activations to ", to,
               " (microbatch ", mb, " of iteration ", it_->plan.iteration(), ")");
    wire = wire.clone();
    wire.view({-1})[wire.numel() / 2] = std::numeric_limits<float>::quiet_NaN();
  }
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
  const bool flood = direction == v1::DIRECTION_FORWARD &&
                     options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kFrameFlood &&
                     iteration >= options_.fault.iteration;
  const v1::FrameHeader sent = flood ? h : v1::FrameHeader();
  const bool broken =
      direction == v1::DIRECTION_ALLREDUCE && !fault_done_ &&
      options_.fault.kind == JobRuntimeOptions::FaultInjection::Kind::kBrokenTransfer &&
      iteration == options_.fault.iteration;
  if (broken) {
    fault_done_ = true;
    LogWarning("job ", job_id_, ": --inject_fault: reporting the all-reduce tensor to ", to,
               " of iteration ", iteration, " failed, as a connection reset would");
  }
  transport_->Send(
      to, std::move(h), std::move(view),
      [this, job, iteration, to, direction, bytes](absl::Status s, double t) {
        core_->Post([=] { OnTransferDone(job, iteration, to, direction, bytes, s, t); });
      });
  if (broken) {  // now, while the iteration is this one: the real send's ack may come late
    OnTransferDone(
        job, iteration, to, direction, bytes,
        absl::UnavailableError(absl::StrCat("direct transport to ", to,
                                            ": connection reset (--inject_fault broken_transfer)")),
        0);
  }
  if (flood) SendFlood(to, sent, holder);
}

void RuntimePart::SendFlood(const std::string& to, const v1::FrameHeader& sent,
                            const std::shared_ptr<at::Tensor>& tensor) {
  // Plausible frames of the next iteration: every microbatch of the job, in
  // each of the next epochs the receiver takes (a re-run's), more than any
  // honest sender sends and more than the receiver's quota for this sender
  // takes. Each is a transfer of its own (the sender keys transfers by
  // iteration, epoch, microbatch and direction), none has the key of a real
  // one, and what comes back is ignored.
  constexpr uint64_t kEpochsAhead = 4;  // FrameAdmission::kMaxEpochsAhead
  const uint32_t microbatches = std::max<uint32_t>(
      1, spec_.pipeline().data_nodes() * spec_.pipeline().microbatches_per_data_node());
  LogWarning("job ", job_id_, ": --inject_fault: flooding ", to, " with ",
             kEpochsAhead * microbatches, " frames of iteration ", sent.iteration() + 1);
  for (uint64_t ahead = 1; ahead <= kEpochsAhead; ++ahead) {
    for (uint32_t mb = 0; mb < microbatches; ++mb) {
      v1::FrameHeader copy = sent;
      copy.set_iteration(sent.iteration() + 1);
      copy.set_epoch(sent.epoch() + ahead);
      copy.set_microbatch(mb);
      TensorView view;
      view.data = tensor->data_ptr();
      view.bytes = tensor->nbytes();
      view.keepalive = tensor;
      transport_->Send(to, std::move(copy), std::move(view), [](absl::Status, double) {});
    }
  }
}

void RuntimePart::OnTransferDone(const std::string& job, uint64_t iteration, const std::string& to,
                                 v1::Direction direction, uint64_t bytes,
                                 const absl::Status& status, double seconds) {
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

void RuntimePart::ReportUnreachable(uint64_t iteration, const std::string& peer,
                                    const absl::Status& why) {
  v1::WorkerMessage m;
  v1::PeerUnreachable* u = m.mutable_peer_unreachable();
  u->set_job_id(job_id_);
  u->set_iteration(iteration);
  u->set_peer(peer);
  u->set_message(std::string(why.message()));
  Send(std::move(m), /*replay=*/false);
}

void RuntimePart::ReportBadFrame(const std::string& sender, v1::Direction direction, uint32_t mb,
                                 uint64_t epoch, const absl::Status& why) {
  metrics_.UnexpectedFrame();
  if (it_ == nullptr || !it_->bad_frames_reported.insert(sender).second) return;
  LogWarning("job ", job_id_, ": dropped a ", v1::Direction_Name(direction), " tensor (microbatch ",
             mb, ") from ", sender, ": ", why.message(), "; reporting the sender");
  v1::WorkerMessage m;
  v1::BadFrame* b = m.mutable_bad_frame();
  b->set_job_id(job_id_);
  b->set_iteration(it_->plan.iteration());
  b->set_sender(sender);
  b->set_direction(static_cast<int32_t>(direction));
  b->set_microbatch(mb);
  b->set_epoch(epoch);
  b->set_message(std::string(why.message()));
  Send(std::move(m), /*replay=*/true);
}

void RuntimePart::Record(v1::TaskTiming::Kind kind, uint32_t mb, absl::Time start) {
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

}  // namespace detour
