#include "worker/transport/activation_server.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/net/reactor_support.h"
#include "worker/transport/frame_codec.h"

namespace detour {
namespace {

std::string TensorKey(const v1::FrameHeader& h) {
  return absl::StrCat(h.job_id(), "/", h.iteration(), "/", h.epoch(), "/", h.microbatch(), "/",
                      h.direction(), "/", h.hop());
}

grpc::ByteBuffer Serialize(const v1::FrameAck& ack) {
  const std::string bytes = ack.SerializeAsString();
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

v1::FrameAck AckFor(const v1::FrameHeader& h, bool ok, std::string error) {
  v1::FrameAck ack;
  ack.set_job_id(h.job_id());
  ack.set_iteration(h.iteration());
  ack.set_microbatch(h.microbatch());
  ack.set_direction(h.direction());
  ack.set_epoch(h.epoch());
  ack.set_ok(ok);
  ack.set_error(std::move(error));
  return ack;
}

}  // namespace

// One sender's stream. Chunks of one tensor always travel on one stream, so
// reassembly state lives here and needs no lock (reads are serial).
class ActivationStreamReactor : public grpc::ServerGenericBidiReactor {
 public:
  ActivationStreamReactor(ActivationServer* server, bool right_method) : server_(server) {
    if (!right_method) {
      Apply(outbox_.RequestFinish(
          grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "unknown method")));
      return;
    }
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the sender closed its side: answer what it sent, then end
      Apply(outbox_.FinishAfterQueued(grpc::Status::OK));
      return;
    }
    Handle();
    incoming_.Clear();
    StartRead(&incoming_);
  }

  void OnWriteDone(bool ok) override { Apply(outbox_.WriteDone(ok)); }
  void OnDone() override { delete this; }

 private:
  struct Assembly {
    v1::FrameHeader first;
    MutableBuffer buffer;
    std::vector<bool> seen;
    uint32_t received = 0;
    bool rejected = false;
  };

  void Handle() {
    ActivationServer& s = *server_;
    s.Count(&s.frames_, s.frames_metric_);
    auto frame = DecodeFrame(incoming_);
    if (!frame.ok()) {
      s.Count(&s.malformed_, s.malformed_metric_);
      LogWarning("activation stream: dropped malformed frame: ", frame.status().message());
      Ack(AckFor(v1::FrameHeader(), false, std::string(frame.status().message())));
      return;
    }
    const v1::FrameHeader& h = frame->header;
    absl::Status valid = ValidateFrameHeader(h, frame->data_bytes, s.options_.max_tensor_bytes);
    if (!valid.ok()) {
      s.Count(&s.malformed_, s.malformed_metric_);
      LogWarning("activation stream: dropped frame from ", h.sender(), ": ", valid.message());
      Ack(AckFor(h, false, std::string(valid.message())));
      return;
    }
    const std::string key = TensorKey(h);
    auto it = assemblies_.find(key);
    if (it == assemblies_.end()) {
      // A stream holds a bounded number of half-received tensors; a peer
      // that opens more is refused (it cannot make us book-keep without end).
      if (assemblies_.size() >= kMaxPartialTensors) {
        s.Count(&s.rejected_, s.rejected_metric_);
        Ack(AckFor(h, false, absl::StrCat("more than ", kMaxPartialTensors,
                                          " tensors half-received on this stream")));
        return;
      }
      Assembly a;
      a.first = h;
      auto buffer = s.sink_->Allocate(h);
      if (!buffer.ok()) {
        a.rejected = true;
        s.Count(&s.rejected_, s.rejected_metric_);
        LogWarning("activation stream: rejected tensor ", key, " from ", h.sender(), ": ",
                   buffer.status().message());
        Ack(AckFor(h, false, std::string(buffer.status().message())));
      } else if (buffer->bytes < h.total_bytes()) {
        a.rejected = true;
        s.Count(&s.rejected_, s.rejected_metric_);
        Ack(AckFor(h, false, "receiver buffer smaller than the tensor"));
      } else {
        a.buffer = *std::move(buffer);
        // Only an accepted tensor gets its chunk book-keeping (bounded by
        // ValidateFrameHeader through total_bytes).
        a.seen.assign(h.num_chunks(), false);
      }
      it = assemblies_.emplace(key, std::move(a)).first;
    }
    Assembly& a = it->second;
    if (h.num_chunks() != a.first.num_chunks() || h.total_bytes() != a.first.total_bytes() ||
        h.dtype() != a.first.dtype()) {
      s.Count(&s.malformed_, s.malformed_metric_);
      Ack(AckFor(h, false, "chunk disagrees with the first chunk of its tensor"));
      return;
    }
    if (a.rejected) {
      s.Count(&s.dropped_, s.dropped_metric_);
      if (++a.received == a.first.num_chunks()) assemblies_.erase(it);
      return;
    }
    if (a.seen[h.chunk_index()]) {
      s.Count(&s.duplicates_, s.duplicates_metric_);
      return;
    }
    a.seen[h.chunk_index()] = true;
    frame->CopyTo(static_cast<char*>(a.buffer.data) + h.offset());
    s.Count(&s.bytes_, s.bytes_metric_, frame->data_bytes);
    if (++a.received == a.first.num_chunks()) {
      v1::FrameHeader done = a.first;
      MutableBuffer buffer = std::move(a.buffer);
      assemblies_.erase(it);
      s.Count(&s.tensors_, s.tensors_metric_);
      s.sink_->Deliver(done, std::move(buffer));
      Ack(AckFor(done, true, ""));
    }
  }

  void Ack(const v1::FrameAck& ack) { Apply(outbox_.Enqueue(Serialize(ack))); }

  void Apply(const ServerOutbox<grpc::ByteBuffer>::Action& action) {
    if (action.write != nullptr) StartWrite(action.write);
    if (action.finish) Finish(action.status);
  }

  // Half-received tensors one stream may hold (a sender has a few in flight).
  static constexpr size_t kMaxPartialTensors = 256;

  ActivationServer* const server_;
  grpc::ByteBuffer incoming_;
  std::map<std::string, Assembly> assemblies_;
  ServerOutbox<grpc::ByteBuffer> outbox_;
};

ActivationServer::ActivationServer(TensorSink* sink, ActivationServerOptions options)
    : sink_(sink), options_(options) {
  if (options_.metrics == nullptr) return;
  auto counter = [&](const char* name, const char* help) -> metrics::Counter* {
    auto family = options_.metrics->AddCounter(name, help);
    if (!family.ok()) return nullptr;
    auto child = (*family)->WithLabels({});
    return child.ok() ? *child : nullptr;
  };
  frames_metric_ = counter("detour_activation_frames_received", "Tensor frames read.");
  tensors_metric_ = counter("detour_activation_tensors_received", "Whole tensors delivered.");
  bytes_metric_ = counter("detour_activation_received_bytes", "Tensor bytes accepted.");
  malformed_metric_ =
      counter("detour_activation_frames_malformed", "Frames dropped as undecodable or invalid.");
  rejected_metric_ = counter("detour_activation_tensors_rejected",
                             "Tensors refused by the receiver (wrong job, shape, iteration...).");
  duplicates_metric_ =
      counter("detour_activation_chunks_duplicate", "Chunks received twice and dropped.");
  dropped_metric_ =
      counter("detour_activation_chunks_dropped", "Chunks of rejected tensors, dropped.");
}

grpc::ServerGenericBidiReactor* ActivationServer::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  return new ActivationStreamReactor(this, ctx->method() == kMethod);
}

void ActivationServer::Count(std::atomic<uint64_t>* counter, metrics::Counter* metric,
                             uint64_t n) {
  counter->fetch_add(n, std::memory_order_relaxed);
  if (metric != nullptr) (void)metric->IncrementBy(static_cast<double>(n));
}

ActivationServer::Stats ActivationServer::stats() const {
  Stats s;
  s.frames = frames_.load();
  s.tensors = tensors_.load();
  s.bytes = bytes_.load();
  s.malformed = malformed_.load();
  s.rejected = rejected_.load();
  s.duplicates = duplicates_.load();
  s.dropped = dropped_.load();
  return s;
}

}  // namespace detour
