#include "worker/transport/activation_server.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "common/net/grpc_status.h"
#include "common/net/identity.h"
#include "common/net/reactor_support.h"
#include "common/net/tls.h"
#include "common/tsan.h"
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

TensorAssembler::TensorAssembler(ActivationServer* server, std::optional<std::string> peer_name)
    : server_(server), peer_name_(std::move(peer_name)) {}

TensorAssembler::~TensorAssembler() {
  // A stream that ends with tensors half received gives their memory back.
  for (auto& [key, a] : assemblies_) Forget(a);
}

void TensorAssembler::Forget(const Assembly& a) {
  server_->Release(a.reserved);
  server_->AddBookkeeping(-a.bookkeeping);
}

void TensorAssembler::Erase(Assemblies::iterator it) {
  Forget(it->second);
  assemblies_.erase(it);
}

void TensorAssembler::Malformed(absl::string_view why, std::vector<v1::FrameAck>* acks) {
  ActivationServer& s = *server_;
  s.Count(&s.frames_, s.frames_metric_);
  s.Count(&s.malformed_, s.malformed_metric_);
  LogWarning("activation stream: dropped malformed frame: ", why);
  acks->push_back(AckFor(v1::FrameHeader(), false, std::string(why)));
}

TensorAssembler::Verdict TensorAssembler::Begin(const v1::FrameHeader& h, size_t data_bytes,
                                                Claim* claim, std::vector<v1::FrameAck>* acks,
                                                absl::Status* end) {
  ActivationServer& s = *server_;
  s.Count(&s.frames_, s.frames_metric_);
  absl::Status valid = ValidateFrameHeader(h, data_bytes, s.options_.max_tensor_bytes);
  if (!valid.ok()) {
    s.Count(&s.malformed_, s.malformed_metric_);
    LogWarning("activation stream: dropped frame from ", absl::CHexEscape(h.sender()), ": ",
               valid.message());
    acks->push_back(AckFor(h, false, std::string(valid.message())));
    return Verdict::kDrop;
  }
  if (s.options_.require_peer_certificates &&
      (!peer_name_.has_value() || h.sender() != *peer_name_)) {
    s.Count(&s.unauthorized_, s.unauthorized_metric_);
    const std::string who = peer_name_.value_or("(none)");
    LogWarning("activation stream: certificate ", who, " sent a frame as \"",
               absl::CHexEscape(h.sender()), "\"; ending its stream");
    *end = absl::PermissionDeniedError(
        absl::StrCat("frames from certificate ", who, " must name it as sender"));
    return Verdict::kEndStream;
  }
  const std::string key = TensorKey(h);
  auto it = assemblies_.find(key);
  if (it == assemblies_.end()) {
    // A stream holds a bounded number of half-received tensors; a peer
    // that opens more is refused (it cannot make us book-keep without end).
    if (assemblies_.size() >= kMaxPartialTensors) {
      s.Count(&s.rejected_, s.rejected_metric_);
      acks->push_back(AckFor(
          h, false,
          absl::StrCat("more than ", kMaxPartialTensors, " tensors half-received on this stream")));
      return Verdict::kDrop;
    }
    // Within the server's limits (all streams together) before the sink
    // is asked for memory.
    std::string why;
    if (!s.Reserve(h.total_bytes(), &why)) {
      s.Count(&s.rejected_, s.rejected_metric_);
      acks->push_back(AckFor(h, false, why));
      return Verdict::kDrop;
    }
    Assembly a;
    a.first = h;
    a.reserved = h.total_bytes();
    auto buffer = s.sink_->Allocate(h);
    if (!buffer.ok()) {
      a.rejected = true;
      if (buffer.status().code() == absl::StatusCode::kPermissionDenied) {
        s.Count(&s.unauthorized_, s.unauthorized_metric_);
      } else {
        s.Count(&s.rejected_, s.rejected_metric_);
      }
      LogWarning("activation stream: rejected tensor ", key, " from ", h.sender(), ": ",
                 buffer.status().message());
      acks->push_back(AckFor(h, false, std::string(buffer.status().message())));
    } else if (buffer->bytes < h.total_bytes()) {
      a.rejected = true;
      s.Count(&s.rejected_, s.rejected_metric_);
      acks->push_back(AckFor(h, false, "receiver buffer smaller than the tensor"));
    } else {
      a.buffer = *std::move(buffer);
      // Only an accepted tensor gets its chunk book-keeping (bounded by
      // ValidateFrameHeader through total_bytes).
      a.seen.assign(h.num_chunks(), false);
    }
    if (a.rejected) {  // no sink memory held: give the bytes back now
      s.ReleaseBytes(a.reserved);
      a.reserved = 0;
    }
    a.bookkeeping = static_cast<int64_t>(sizeof(Assembly) + 2 * key.size() +
                                         a.first.SpaceUsedLong() + a.seen.capacity() / 8);
    s.AddBookkeeping(a.bookkeeping);
    it = assemblies_.emplace(key, std::move(a)).first;
  }
  Assembly& a = it->second;
  if (h.num_chunks() != a.first.num_chunks() || h.total_bytes() != a.first.total_bytes() ||
      h.dtype() != a.first.dtype()) {
    s.Count(&s.malformed_, s.malformed_metric_);
    acks->push_back(AckFor(h, false, "chunk disagrees with the first chunk of its tensor"));
    return Verdict::kDrop;
  }
  if (a.rejected) {
    s.Count(&s.dropped_, s.dropped_metric_);
    if (++a.received == a.first.num_chunks()) Erase(it);
    return Verdict::kDrop;
  }
  if (a.seen[h.chunk_index()]) {
    s.Count(&s.duplicates_, s.duplicates_metric_);
    return Verdict::kDrop;
  }
  if (!FitsGeometry(&a, h, data_bytes)) {
    s.Count(&s.malformed_, s.malformed_metric_);
    acks->push_back(AckFor(h, false,
                           absl::StrCat("chunk ", h.chunk_index(), " of ", h.num_chunks(), " (",
                                        data_bytes, " bytes at offset ", h.offset(),
                                        ") does not tile its tensor with the others")));
    return Verdict::kDrop;
  }
  // Claimed now, not when its data is in: with a striped session another
  // connection may bring the same chunk while this one is still reading.
  a.seen[h.chunk_index()] = true;
  claim->key = key;
  claim->chunk = h.chunk_index();
  claim->bytes = data_bytes;
  claim->dest = static_cast<char*>(a.buffer.data) + h.offset();
  return Verdict::kAccept;
}

bool TensorAssembler::FitsGeometry(Assembly* a, const v1::FrameHeader& h, uint64_t bytes) {
  // Every chunk but the last is chunk_bytes long at index × chunk_bytes; the
  // last one ends the tensor. With num_chunks distinct indices that covers
  // every byte exactly once, whatever the order the chunks arrive in.
  // (ValidateFrameHeader already holds offset + bytes <= total_bytes.)
  const uint64_t n = h.num_chunks(), i = h.chunk_index(), off = h.offset();
  const uint64_t total = a->first.total_bytes();
  if (i + 1 == n) {
    if (off + bytes != total) return false;
    if (n == 1) return off == 0;
    if (bytes == 0) return false;
    if (a->chunk_bytes != 0) return off == (n - 1) * a->chunk_bytes;
    a->last_offset = off;
    return true;
  }
  if (bytes == 0) return false;
  if (a->chunk_bytes != 0) return bytes == a->chunk_bytes && off == i * a->chunk_bytes;
  if (off % bytes != 0 || off / bytes != i || (n - 1) > (total - 1) / bytes) return false;
  if (a->last_offset != kNoOffset &&
      (a->last_offset % bytes != 0 || a->last_offset / bytes != n - 1)) {
    return false;
  }
  a->chunk_bytes = bytes;
  return true;
}

TensorAssembler::Verdict TensorAssembler::Begin(const v1::FrameHeader& header, size_t data_bytes,
                                                void** dest, std::vector<v1::FrameAck>* acks,
                                                absl::Status* end) {
  have_current_ = false;
  const Verdict verdict = Begin(header, data_bytes, &current_, acks, end);
  if (verdict == Verdict::kAccept) {
    *dest = current_.dest;
    have_current_ = true;
  }
  return verdict;
}

void TensorAssembler::Finish(std::vector<v1::FrameAck>* acks) {
  if (!have_current_) return;
  have_current_ = false;
  Finish(current_, acks);
}

void TensorAssembler::Finish(const Claim& claim, std::vector<v1::FrameAck>* acks) {
  ActivationServer& s = *server_;
  auto it = assemblies_.find(claim.key);
  if (it == assemblies_.end()) return;
  Assembly& a = it->second;
  s.Count(&s.bytes_, s.bytes_metric_, claim.bytes);
  if (++a.received == a.first.num_chunks()) {
    v1::FrameHeader done = a.first;
    MutableBuffer buffer = std::move(a.buffer);
    Erase(it);
    s.Count(&s.tensors_, s.tensors_metric_);
    s.sink_->Deliver(done, std::move(buffer));
    acks->push_back(AckFor(done, true, ""));
  }
}

// One sender's stream. Chunks of one tensor always travel on one stream, so
// reassembly state lives here and needs no lock (reads are serial).
class ActivationStreamReactor : public grpc::ServerGenericBidiReactor {
 public:
  // `peer_name`: the verified certificate name of the sender, if any.
  // `refusal`: why the stream is refused for who opened it (no worker
  // certificate), already counted and logged; OK to read it.
  ActivationStreamReactor(ActivationServer* server, bool right_method,
                          std::optional<std::string> peer_name, const absl::Status& refusal)
      : assembler_(server, peer_name) {
    if (!right_method) {
      Apply(outbox_.RequestFinish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "unknown method")));
      return;
    }
    if (!refusal.ok()) {
      Apply(outbox_.RequestFinish(ToGrpcStatus(refusal)));
      return;
    }
    NextRead();
  }

  ~ActivationStreamReactor() override {
    DETOUR_HAPPENS_AFTER(this);  // after the last reaction (OnDone comes last)
  }

  void OnReadDone(bool ok) override {
    // Reads are serial, each on whichever gRPC thread: this reaction follows
    // the one that started the read (gRPC orders them; TSan cannot see it).
    DETOUR_HAPPENS_AFTER(this);
    if (!ok) {  // the sender closed its side: answer what it sent, then end
      Apply(outbox_.FinishAfterQueued(grpc::Status::OK));
      return;
    }
    if (!Handle()) return;  // the stream is being ended
    incoming_.Clear();
    {
      // A sender that does not read its acks is not read either (HTTP/2 flow
      // control then holds its writes): acks cannot pile up without bound.
      absl::MutexLock lock(&read_mu_);
      if (outbox_.queued() >= kMaxQueuedAcks) {
        read_paused_ = true;
        DETOUR_HAPPENS_BEFORE(this);  // OnWriteDone resumes the reads
        return;
      }
    }
    NextRead();
  }

  void OnWriteDone(bool ok) override {
    ServerOutbox<grpc::ByteBuffer>::Action action;
    bool resume = false;
    {
      absl::MutexLock lock(&read_mu_);
      action = outbox_.WriteDone(ok);
      if (read_paused_ && outbox_.queued() <= kMaxQueuedAcks / 2) {
        read_paused_ = false;
        resume = true;
      }
    }
    Apply(action);
    if (resume) {
      DETOUR_HAPPENS_AFTER(this);
      NextRead();
    }
  }
  void OnDone() override { delete this; }

 private:
  void NextRead() {
    DETOUR_HAPPENS_BEFORE(this);
    StartRead(&incoming_);
  }

  // False when the stream is ending (a sender its certificate does not name).
  bool Handle() {
    acks_.clear();
    auto frame = DecodeFrame(incoming_);
    if (!frame.ok()) {
      assembler_.Malformed(frame.status().message(), &acks_);
      SendAcks();
      return true;
    }
    void* dest = nullptr;
    absl::Status end;
    switch (assembler_.Begin(frame->header, frame->data_bytes, &dest, &acks_, &end)) {
      case TensorAssembler::Verdict::kAccept:
        frame->CopyTo(dest);
        assembler_.Finish(&acks_);
        break;
      case TensorAssembler::Verdict::kDrop: break;
      case TensorAssembler::Verdict::kEndStream:
        Apply(outbox_.RequestFinish(ToGrpcStatus(end)));
        return false;
    }
    SendAcks();
    return true;
  }

  void SendAcks() {
    for (const v1::FrameAck& ack : acks_) Apply(outbox_.Enqueue(Serialize(ack)));
  }

  void Apply(const ServerOutbox<grpc::ByteBuffer>::Action& action) {
    if (action.write != nullptr) StartWrite(action.write);
    if (action.finish) Finish(action.status);
  }

  // Acks queued for a sender before its stream stops being read.
  static constexpr size_t kMaxQueuedAcks = 64;

  TensorAssembler assembler_;
  grpc::ByteBuffer incoming_;
  std::vector<v1::FrameAck> acks_;
  ServerOutbox<grpc::ByteBuffer> outbox_;
  absl::Mutex read_mu_;  // orders the pause check with the outbox draining
  bool read_paused_ ABSL_GUARDED_BY(read_mu_) = false;
};

ActivationServer::ActivationServer(TensorSink* sink, ActivationServerOptions options)
    : sink_(sink), options_(options) {
  if (options_.metrics == nullptr) return;
  auto counter = [&](const char* name, const char* help) {
    return metrics::OptionalCounter(options_.metrics, name, help);
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
  unauthorized_metric_ =
      counter("detour_activation_frames_unauthorized",
              "Streams and frames refused for their sender: no worker certificate, a sender name "
              "the certificate does not carry, or not a member of the job (PERMISSION_DENIED).");
}

grpc::ServerGenericBidiReactor* ActivationServer::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  std::optional<std::string> peer_name = VerifiedPeerName(ctx->auth_context().get());
  absl::Status refusal;
  if (options_.require_peer_certificates && ctx->method() == kMethod) {
    if (!peer_name.has_value()) {
      refusal = absl::UnauthenticatedError(
          "activation streams need a worker certificate from the cluster CA");
    } else {
      refusal = CheckWorkerPeer(ctx->auth_context().get(), options_.allow_unmarked_worker_certs);
    }
    if (!refusal.ok()) {
      // Anyone who completes a TLS handshake (clients with tokens need no
      // certificate) can open streams: counted, and logged in summaries.
      CountUnauthorizedStream();
      std::optional<std::string> line;
      {
        absl::MutexLock lock(&refusal_mu_);
        line = refusal_log_.Note(refusal.code() == absl::StatusCode::kUnauthenticated
                                     ? RefusalReason::kHandshake
                                     : RefusalReason::kIdentity,
                                 ctx->peer(), refusal.message(), absl::Now());
      }
      if (line.has_value()) LogWarning(*line);
    }
  }
  return new ActivationStreamReactor(this, ctx->method() == kMethod, std::move(peer_name), refusal);
}

void ActivationServer::CountUnauthorizedStream() { Count(&unauthorized_, unauthorized_metric_); }

void ActivationServer::Count(std::atomic<uint64_t>* counter, metrics::Counter* metric, uint64_t n) {
  counter->fetch_add(n, std::memory_order_relaxed);
  if (metric != nullptr) (void)metric->IncrementBy(static_cast<double>(n));
}

namespace {

template <typename T>
void RaisePeak(std::atomic<T>* peak, T value) {
  T seen = peak->load(std::memory_order_relaxed);
  while (value > seen && !peak->compare_exchange_weak(seen, value, std::memory_order_relaxed)) {}
}

}  // namespace

bool ActivationServer::Reserve(uint64_t bytes, std::string* why) {
  uint64_t tensors = partial_tensors_.load();
  do {
    if (tensors >= options_.max_partial_tensors) {
      *why = absl::StrCat("receiver holds ", tensors, " half-received tensors (limit ",
                          options_.max_partial_tensors, ")");
      return false;
    }
  } while (!partial_tensors_.compare_exchange_weak(tensors, tensors + 1));
  uint64_t held = partial_bytes_.load();
  do {
    if (bytes > options_.max_partial_bytes || held > options_.max_partial_bytes - bytes) {
      partial_tensors_.fetch_sub(1);
      *why = absl::StrCat("receiver holds ", held, " bytes of half-received tensors; ", bytes,
                          " more exceed the limit of ", options_.max_partial_bytes);
      return false;
    }
  } while (!partial_bytes_.compare_exchange_weak(held, held + bytes));
  RaisePeak(&peak_partial_tensors_, tensors + 1);
  RaisePeak(&peak_partial_bytes_, held + bytes);
  return true;
}

void ActivationServer::Release(uint64_t bytes) {
  partial_tensors_.fetch_sub(1);
  ReleaseBytes(bytes);
}

void ActivationServer::ReleaseBytes(uint64_t bytes) { partial_bytes_.fetch_sub(bytes); }

void ActivationServer::AddBookkeeping(int64_t bytes) {
  RaisePeak(&peak_bookkeeping_bytes_, bookkeeping_bytes_.fetch_add(bytes) + bytes);
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
  s.unauthorized = unauthorized_.load();
  s.partial_tensors = partial_tensors_.load();
  s.peak_partial_tensors = peak_partial_tensors_.load();
  s.partial_bytes = partial_bytes_.load();
  s.peak_partial_bytes = peak_partial_bytes_.load();
  s.bookkeeping_bytes = static_cast<uint64_t>(std::max<int64_t>(0, bookkeeping_bytes_.load()));
  s.peak_bookkeeping_bytes = static_cast<uint64_t>(peak_bookkeeping_bytes_.load());
  return s;
}

}  // namespace detour
