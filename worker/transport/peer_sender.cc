#include "worker/transport/peer_sender.h"

#include <fcntl.h>
#include <openssl/rand.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/net/identity.h"
#include "common/net/server.h"
#include "common/net/shutdown_signal.h"
#include "common/status.h"
#include "common/tsan.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/proto_buffer_reader.h"
#include "common/net/connection_admission.h"
#include "worker/transport/direct_link.h"

namespace detour {
namespace {

constexpr char kMethod[] = "/detour.v1.ActivationService/Stream";

// A tensor in flight: one per (job, iteration, epoch, microbatch,
// direction) and peer — a microbatch re-run on a new route (newer epoch) may
// go to the same peer while the old route's tensor is still pending.
std::string AckKey(const std::string& job, uint64_t iteration, uint64_t epoch, uint32_t microbatch,
                   int direction) {
  return absl::StrCat(job, "/", iteration, "/", epoch, "/", microbatch, "/", direction);
}

}  // namespace

// How chunks reach the peer. The writer thread starts every operation on it,
// without the sender's lock held.
class PeerSender::Stream {
 public:
  virtual ~Stream() = default;
  // Writes one chunk. OnWriteDone follows (inline or from another thread).
  virtual void Write(Chunk* chunk) = 0;
  // Ends the stream (`closing`: politely, the peer may finish reading) and
  // gives it up; OnStreamDone follows once nothing of it is left running.
  virtual void End(bool closing) = 0;
};

// One bidirectional ActivationService stream. A hold keeps it alive while
// the writer thread may still start operations; it deletes itself in OnDone,
// and only then tells the sender: its ClientContext holds the call and a
// reference to the channel, so until the delete is over the sender must not
// count it gone (Close() could return, and the sender, its channel, even gRPC
// itself at process exit be torn down, while a gRPC thread is still releasing
// this call).
class PeerSender::GrpcStream : public Stream,
                               public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  GrpcStream(PeerSender* owner, grpc::GenericStub* stub) : owner_(owner) {
    stub->PrepareBidiStreamingCall(&context_, kMethod, grpc::StubOptions(), this);
    AddHold();
    NextRead();
    StartCall();
  }

  void Write(Chunk* chunk) override {
    outgoing_ = EncodeFrame(chunk->header, chunk->data, chunk->offset, chunk->bytes);
    StartWrite(&outgoing_);
  }

  void End(bool closing) override {
    bool ended = false;
    if (closing) {
      StartWritesDone();
      absl::MutexLock lock(&owner_->mu_);
      ended = owner_->mu_.AwaitWithTimeout(absl::Condition(
                                               +[](bool* e) { return *e; }, &owner_->read_ended_),
                                           absl::Seconds(2));
    }
    // A broken stream, or one whose peer did not end it: cancelled, so its
    // OnDone is certain to come (Close() waits for it).
    if (!ended) context_.TryCancel();
    RemoveHold();
  }

  void OnWriteDone(bool ok) override {
    outgoing_.Clear();
    owner_->OnWriteDone(ok);
  }

  void OnReadDone(bool ok) override {
    // Serial reads on any gRPC thread, ordered by gRPC (invisible to TSan).
    DETOUR_HAPPENS_AFTER(this);
    if (!ok) {
      owner_->OnReadEnded();
      DETOUR_HAPPENS_BEFORE(this);  // OnDone follows
      return;
    }
    v1::FrameAck ack;
    grpc::ProtoBufferReader reader(&incoming_);
    if (ack.ParseFromZeroCopyStream(&reader)) owner_->OnAck(ack);
    NextRead();
  }

  void OnDone(const grpc::Status&) override {
    DETOUR_HAPPENS_AFTER(this);
    PeerSender* const owner = owner_;
    delete this;
    owner->OnStreamDone();
  }

 private:
  void NextRead() {
    DETOUR_HAPPENS_BEFORE(this);
    StartRead(&incoming_);
  }

  PeerSender* const owner_;
  grpc::ClientContext context_;
  grpc::ByteBuffer incoming_;
  grpc::ByteBuffer outgoing_;
};

// Direct connections to the peer (the stripes of one session). The writer
// thread hands each chunk to one connection's queue and goes on; each
// connection has a thread that writes its queue (blocking, from the tensor's
// memory) and one that reads acks. A large tensor's chunks are cut into one
// contiguous range per connection; a small tensor's all go to the connection
// with the least queued. Any connection that fails gives the whole stream up
// (the receiver ends the session too, freeing what it held half-received).
class PeerSender::DirectStream : public Stream {
 public:
  DirectStream(PeerSender* owner, std::vector<std::unique_ptr<DirectLink>> links)
      : owner_(owner), links_(std::move(links)) {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < links_.size(); ++i) {
      links_[i]->SetIoTimeout(owner_->options_.ack_timeout);
      if (links_.size() > 1) links_[i]->SetNotsentLowat(kStripeNotsentLowat);
      writers_.emplace_back([this, i] { WriteLoop(i); });
      readers_.emplace_back([this, i] { ReadAcks(i); });
    }
  }

  void Write(Chunk* chunk) override {
    {
      absl::MutexLock lock(&mu_);
      chunks_.push_back(std::move(*chunk));
    }
    owner_->OnWriteDone(true);
  }

  void End(bool closing) override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      polite_ = closing;
      if (closing) {
        // Let a frame being written finish, so the peer sees a clean end.
        mu_.AwaitWithTimeout(absl::Condition(
                                 +[](int* n) { return *n == 0; }, &busy_),
                             absl::Seconds(2));
      }
    }
    if (closing) {
      for (auto& link : links_) link->CloseWrite();
      absl::MutexLock lock(&owner_->mu_);
      owner_->mu_.AwaitWithTimeout(absl::Condition(
                                       +[](bool* e) { return *e; }, &owner_->read_ended_),
                                   absl::Seconds(2));
    }
    for (auto& link : links_) link->Shutdown();
    for (auto& t : writers_) t.join();
    for (auto& t : readers_) t.join();
    PeerSender* const owner = owner_;
    delete this;
    owner->OnStreamDone();
  }

 private:
  void WriteLoop(size_t lane) {
    DirectLink* link = links_[lane].get();
    std::string header;
    while (true) {
      Chunk chunk;
      {
        absl::MutexLock lock(&mu_);
        // Whichever connection is free takes the next chunk: one that a loss
        // holds up (its socket takes no more, TCP_NOTSENT_LOWAT) takes fewer.
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !chunks_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (stopping_) return;
        chunk = std::move(chunks_.front());
        chunks_.pop_front();
        ++busy_;
      }
      header.clear();
      header.resize(kDirectFramePrefixBytes);
      chunk.header.AppendToString(&header);
      EncodeDirectFramePrefix(static_cast<uint32_t>(header.size() - kDirectFramePrefixBytes),
                              chunk.bytes, header.data());
      const char* data = static_cast<const char*>(chunk.data.data) + chunk.offset;
      absl::Status written = link->Write(header.data(), header.size(), data, chunk.bytes);
      bool report;
      {
        absl::MutexLock lock(&mu_);
        --busy_;
        report = !stopping_;
      }
      if (written.ok()) owner_->CountWritten(lane, chunk.bytes);
      if (!written.ok()) {
        if (report) {
          owner_->OnStreamError(absl::UnavailableError(
              absl::StrCat("direct transport to ", owner_->peer_, " (connection ", lane + 1, " of ",
                           links_.size(), "): ", written.message())));
          owner_->OnStreamBroken();
        }
        return;
      }
    }
  }

  void ReadAcks(size_t lane) {
    DirectLink* link = links_[lane].get();
    std::string bytes;
    while (true) {
      char prefix[kDirectAckPrefixBytes];
      absl::Status read = link->Read(prefix, sizeof(prefix), /*idle_ok=*/true);
      if (read.code() == absl::StatusCode::kDeadlineExceeded) continue;  // idle
      uint32_t size = 0;
      if (read.ok()) read = DecodeDirectAckPrefix(prefix, &size);
      if (read.ok()) {
        bytes.resize(size);
        read = link->Read(bytes.data(), size);
      }
      v1::FrameAck ack;
      if (read.ok() && !ack.ParseFromString(bytes)) {
        read = absl::InvalidArgumentError("unparseable acknowledgement");
      }
      if (!read.ok()) {
        bool stopping, polite;
        {
          absl::MutexLock lock(&mu_);
          stopping = stopping_;
          polite = polite_;
        }
        // Once End began, what the shutdown does to the reads is no news;
        // only a polite end waits to hear that the peer closed.
        if (!stopping && read.code() != absl::StatusCode::kCancelled) {
          owner_->OnStreamError(absl::UnavailableError(
              absl::StrCat("direct transport to ", owner_->peer_, " (connection ", lane + 1, " of ",
                           links_.size(), "): ", read.message())));
        }
        if (!stopping || polite) owner_->OnReadEnded();
        return;
      }
      owner_->OnAck(ack);
    }
  }

  PeerSender* const owner_;
  const std::vector<std::unique_ptr<DirectLink>> links_;
  absl::Mutex mu_;
  std::deque<Chunk> chunks_ ABSL_GUARDED_BY(mu_);  // chunks no connection has taken yet
  int busy_ ABSL_GUARDED_BY(mu_) = 0;              // frames being written
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool polite_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> writers_;
  std::vector<std::thread> readers_;
};

PeerSender::PeerSender(std::string peer_address, PeerSenderOptions options)
    : PeerSender(peer_address,
                 options.direct_address.empty()
                     ? MakeChannel(peer_address, options.security, options.peer_name)
                     : nullptr,
                 options) {}

PeerSender::PeerSender(std::string peer_address, std::shared_ptr<grpc::Channel> channel,
                       PeerSenderOptions options)
    : peer_(std::move(peer_address)), options_(options), channel_(std::move(channel)) {
  if (direct()) {
    IgnoreSigpipe();
    if (options_.security.tls()) {
      auto ctx = options_.security.NewSslContext(/*server=*/false);
      if (ctx.ok()) {
        ssl_ctx_ = *std::move(ctx);
      } else {
        ssl_ctx_status_ = ctx.status();
      }
    }
    if (::pipe2(wake_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) wake_pipe_[0] = wake_pipe_[1] = -1;
    tcp_limits_ = ReadTcpLimits();
  } else if (channel_ == nullptr) {
    channel_ = MakeChannel(peer_, options_.security, options_.peer_name);
  }
  writer_ = std::thread([this] { WriterLoop(); });
}

PeerSender::~PeerSender() {
  Close();
  if (wake_pipe_[0] >= 0) ::close(wake_pipe_[0]);
  if (wake_pipe_[1] >= 0) ::close(wake_pipe_[1]);
}

void PeerSender::Connect() {
  if (!direct()) {
    if (channel_ != nullptr) channel_->GetState(/*try_to_connect=*/true);
    return;
  }
  absl::MutexLock lock(&mu_);
  if (stream_ == nullptr && !closing_) connect_wanted_ = true;
}

void PeerSender::Send(v1::FrameHeader header, TensorView data, Done done) {
  const std::string key = AckKey(header.job_id(), header.iteration(), header.epoch(),
                                 header.microbatch(), header.direction());
  absl::MutexLock lock(&mu_);
  // Striped over the session's connections when they are open (Connect
  // opened them ahead, or an earlier tensor did); else cut as for one.
  const size_t chunk = StripeChunkBytes(data.bytes, direct_info_.connections,
                                        std::max<size_t>(kMinChunkBytes, options_.chunk_bytes),
                                        options_.stripe_threshold_bytes);
  const uint32_t chunks =
      data.bytes == 0 ? 1 : static_cast<uint32_t>((data.bytes + chunk - 1) / chunk);
  header.set_total_bytes(data.bytes);
  header.set_num_chunks(chunks);
  if (closing_) {
    done(absl::CancelledError("sender closed"), 0);
    return;
  }
  if (pending_.count(key)) {
    done(
        absl::AlreadyExistsError(absl::StrCat("tensor ", key, " is already being sent to ", peer_)),
        0);
    return;
  }
  const absl::Time now = absl::Now();
  for (uint32_t i = 0; i < chunks; ++i) {
    const size_t offset = static_cast<size_t>(i) * chunk;
    const size_t bytes = std::min(chunk, data.bytes - std::min(data.bytes, offset));
    header.set_chunk_index(i);
    header.set_offset(offset);
    Chunk c;
    c.header = header;
    c.data = data;
    c.offset = offset;
    c.key = key;
    c.bytes = bytes;
    c.release = now;
    if (options_.emulation.enabled()) {
      // The link carries one chunk at a time; each arrives `latency` after it
      // finished transmitting. Release times are fixed here so that latency
      // overlaps across chunks as on a real link.
      const double bw = options_.emulation.bandwidth_bytes_per_s;
      const absl::Duration transmit =
          bw > 0 ? absl::Seconds(static_cast<double>(bytes) / bw) : absl::ZeroDuration();
      link_free_at_ = std::max(link_free_at_, now) + transmit;
      c.release = link_free_at_ + options_.emulation.latency;
    }
    queue_.push_back(std::move(c));
  }
  Pending p;
  p.header = header;
  p.data = std::move(data);
  p.done = std::move(done);
  p.first_write = absl::InfiniteFuture();
  p.deadline = now + options_.ack_timeout;
  pending_.emplace(key, std::move(p));
}

void PeerSender::FailAll(const absl::Status& status) {
  std::map<std::string, Pending> failed;
  failed.swap(pending_);
  queue_.clear();
  // Completion callbacks must not block and must not call back into this
  // sender's Send under our lock; they only record results.
  for (auto& [key, p] : failed) p.done(status, 0);
}

void PeerSender::WriterLoop() {
  std::unique_ptr<grpc::GenericStub> stub;
  if (!direct()) stub = std::make_unique<grpc::GenericStub>(channel_);
  while (true) {
    mu_.Lock();
    // Wake for work, for a broken stream, for closing, or to expire overdue
    // transfers.
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      if (write_in_flight_) return false;
      return closing_ || stream_broken_ || !queue_.empty() ||
             (connect_wanted_ && stream_ == nullptr);
    };
    absl::Duration wait = absl::Milliseconds(500);
    if (!queue_.empty() && !write_in_flight_) {
      wait = std::max(absl::ZeroDuration(), queue_.front().release - absl::Now());
    }
    mu_.AwaitWithTimeout(absl::Condition(&ready), wait);

    const absl::Time now = absl::Now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (now > it->second.deadline) {
        it->second.done(
            absl::DeadlineExceededError(absl::StrCat("no acknowledgement from ", peer_, " within ",
                                                     absl::FormatDuration(options_.ack_timeout))),
            0);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    if (write_in_flight_) {
      mu_.Unlock();
      continue;
    }
    if (stream_broken_ || closing_) {
      Stream* old = stream_;
      stream_ = nullptr;
      const bool closing = closing_;
      if (stream_broken_) {
        stream_broken_ = false;
        FailAll(absl::UnavailableError(
            broken_reason_.empty() ? absl::StrCat("stream to ", peer_, " broke") : broken_reason_));
        broken_reason_.clear();
      }
      if (old != nullptr) {
        mu_.Unlock();
        old->End(closing);
        mu_.Lock();
      }
      if (closing) {
        mu_.Unlock();
        return;
      }
      mu_.Unlock();
      continue;
    }
    const bool chunk_ready = !queue_.empty() && queue_.front().release <= absl::Now();
    if (!chunk_ready && !(connect_wanted_ && stream_ == nullptr && direct())) {
      connect_wanted_ = false;  // connected already, or over gRPC (Connect did it)
      mu_.Unlock();
      continue;
    }
    connect_wanted_ = false;
    if (stream_ == nullptr && direct()) {
      // Connecting blocks (up to connect_timeout, or until Close wakes it):
      // without the lock, before the chunk leaves the queue.
      mu_.Unlock();
      absl::StatusOr<std::vector<std::unique_ptr<DirectLink>>> links = ConnectDirect();
      mu_.Lock();
      if (!links.ok()) {
        stream_broken_ = true;
        broken_reason_ = absl::StrCat("cannot reach ", peer_, " (direct transport at ",
                                      options_.direct_address, "): ", links.status().message());
        mu_.Unlock();
        continue;
      }
      if (closing_) {
        mu_.Unlock();
        continue;  // the links close here; the loop ends on closing_
      }
      read_ended_ = false;
      ++live_streams_;
      stream_ = new DirectStream(this, *std::move(links));
    }
    if (queue_.empty() || queue_.front().release > absl::Now()) {  // connected ahead
      mu_.Unlock();
      continue;
    }
    Chunk chunk = std::move(queue_.front());
    queue_.pop_front();
    auto p = pending_.find(chunk.key);
    if (p == pending_.end()) {  // its transfer already failed
      mu_.Unlock();
      continue;
    }
    if (p->second.first_write == absl::InfiniteFuture()) p->second.first_write = absl::Now();
    if (stream_ == nullptr) {
      read_ended_ = false;
      ++live_streams_;
      stream_ = new GrpcStream(this, stub.get());
    }
    Stream* stream = stream_;
    current_ = std::move(chunk);
    write_in_flight_ = true;
    mu_.Unlock();
    stream->Write(&current_);
  }
}

absl::Status PeerSender::ReceiverIsWorker(const DirectLink& link) const {
  if (link.ssl() == nullptr) return absl::OkStatus();  // plaintext: nothing to check
  absl::Status kind = CheckWorkerPeer(link.ssl(), options_.security.allow_unmarked_worker_certs());
  if (kind.ok()) return kind;
  return absl::Status(
      kind.code(), absl::StrCat("direct transport: ", options_.direct_address,
                                " (expecting worker ", options_.peer_name, "): ", kind.message()));
}

absl::StatusOr<std::vector<std::unique_ptr<DirectLink>>> PeerSender::ConnectDirect() {
  if (!ssl_ctx_status_.ok()) return ssl_ctx_status_;
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + options_.connect_timeout;
  absl::Duration pause = absl::Milliseconds(50);
  for (int attempt = 1;; ++attempt) {
    absl::StatusOr<std::vector<std::unique_ptr<DirectLink>>> links = ConnectDirectOnce(deadline);
    if (links.ok()) {
      absl::MutexLock lock(&mu_);
      direct_info_.connect_attempts = attempt;
      return links;
    }
    // A receiver under a connection flood closes handshaking connections
    // to make room (connection_admission.h): each try has a fair chance,
    // and the session is new every time (the server ends a session when
    // any of its stripes closes).
    if (!ClosedByReceiver(links.status())) return links.status();
    // Up to half as much again, so that senders refused together do not
    // come back together.
    uint16_t jitter = 0;
    (void)RAND_bytes(reinterpret_cast<unsigned char*>(&jitter), sizeof(jitter));
    const absl::Duration wait = pause + pause * (jitter / 131072.0);
    if (absl::Now() + wait >= deadline) {
      return Annotate(links.status(),
                      absl::StrCat("closed by the receiver at each of ", attempt,
                                   attempt == 1 ? " try" : " tries", " in ",
                                   absl::FormatDuration(
                                       absl::Trunc(absl::Now() - start, absl::Milliseconds(1)))));
    }
    if (!PauseUnlessClosed(wait)) return absl::CancelledError("sender closed");
    pause = std::min(pause * 2, absl::Seconds(1));
  }
}

bool PeerSender::PauseUnlessClosed(absl::Duration pause) {
  pollfd wake{wake_pipe_[0], POLLIN, 0};
  const int ms = static_cast<int>(absl::ToInt64Milliseconds(pause));
  while (true) {
    const int n = ::poll(&wake, 1, ms);
    if (n < 0 && errno == EINTR) continue;
    return n == 0;
  }
}

absl::StatusOr<std::vector<std::unique_ptr<DirectLink>>> PeerSender::ConnectDirectOnce(
    absl::Time deadline) {
  DirectHello hello;
  if (RAND_bytes(reinterpret_cast<unsigned char*>(&hello.session), sizeof(hello.session)) != 1) {
    return absl::InternalError("direct transport: no random session id (RAND_bytes failed)");
  }
  DirectSocketOptions socket;
  socket.bbr = options_.bbr && BbrUsable();
  // One connection, its receiver checked: the receiver's certificate names
  // the peer (checked in the handshake) and must be a worker's: a
  // coordinator's or a user's certificate with the same name is not one to
  // hand activations to, nor to greet.
  auto open_checked = [&]() -> absl::StatusOr<std::unique_ptr<DirectLink>> {
    auto link = DirectLink::Open(options_.direct_address, ssl_ctx_, options_.peer_name,
                                 std::max(absl::Milliseconds(1), deadline - absl::Now()),
                                 wake_pipe_[0], socket);
    if (!link.ok()) return link.status();
    if (absl::Status kind = ReceiverIsWorker(**link); !kind.ok()) return kind;
    return link;
  };
  // One stripe: opened, checked, greeted.
  auto open_stripe = [&](int stripe) -> absl::StatusOr<std::unique_ptr<DirectLink>> {
    auto link = open_checked();
    if (!link.ok()) return link.status();
    DirectHello mine = hello;
    mine.stripe = static_cast<uint32_t>(stripe);
    if (absl::Status s = (*link)->Greet(mine, deadline - absl::Now()); !s.ok()) {
      return Annotate(s, absl::StrCat("direct transport: ", options_.direct_address));
    }
    return link;
  };
  // The number of stripes: asked for, or what the link's bandwidth-delay
  // product needs under this machine's socket-buffer limits. The round trip,
  // when the hint lacks it, is the kernel's estimate from the first
  // connection's handshake.
  LinkHint hint = options_.link;
  if (!(hint.rate_bytes_per_s > 0)) hint.rate_bytes_per_s = kDefaultLinkRateBytesPerS;
  std::vector<std::unique_ptr<DirectLink>> links;
  std::unique_ptr<DirectLink> first;
  if (hint.rtt <= absl::ZeroDuration()) {
    auto opened = open_checked();
    if (!opened.ok()) return opened.status();
    first = *std::move(opened);
    hint.rtt = first->Rtt();
  }
  const StripePlan plan = PlanStripes(hint, tcp_limits_);
  const int count = options_.direct_connections > 0
                        ? std::min(options_.direct_connections, kMaxDirectStripes)
                        : plan.connections;
  socket.sndbuf = plan.sndbuf_request;
  hello.stripes = static_cast<uint32_t>(count);
  if (first != nullptr) {
    if (socket.sndbuf > 0) first->SetSendBuffer(socket.sndbuf);
    if (absl::Status s = first->Greet(hello, deadline - absl::Now()); !s.ok()) return s;
    links.push_back(std::move(first));
  }
  // The stripes not open yet connect in parallel, each in a few round trips.
  // With the round trip known (the link probes measured it) and few enough
  // stripes, all of them at once: a new pair then pays its handshakes' round
  // trips once instead of twice, seconds over a long link. A receiver that
  // does not know this sender yet (its peer list has not named it) lets a
  // source hold only so many handshakes (connection_admission.h), half of
  // which this sender takes, the host's other senders and the link prober
  // the rest; more stripes than that wait until a first greeting has made
  // this source trusted.
  constexpr int kStripesAtOnce = AdmissionLimits{}.max_unauthenticated_per_source / 2;
  auto open_stripes = [&](int begin, int end) -> absl::Status {
    std::vector<absl::StatusOr<std::unique_ptr<DirectLink>>> more(end - begin);
    std::vector<std::thread> connecting;
    for (int i = begin; i < end; ++i) {
      connecting.emplace_back(
          [&open_stripe, &more, i, begin] { more[i - begin] = open_stripe(i); });
    }
    for (auto& t : connecting) t.join();
    for (auto& link : more) {
      if (!link.ok()) {
        return begin == 0 ? link.status() : Annotate(link.status(), "stripe connection");
      }
      links.push_back(*std::move(link));
    }
    return absl::OkStatus();
  };
  if (links.empty() && count > kStripesAtOnce) {
    RETURN_IF_ERROR(open_stripes(0, kStripesAtOnce));
  }
  RETURN_IF_ERROR(open_stripes(static_cast<int>(links.size()), count));
  absl::MutexLock lock(&mu_);
  direct_info_.connections = count;
  direct_info_.written.assign(static_cast<size_t>(count), 0);
  direct_info_.congestion_control = links.front()->congestion_control();
  direct_info_.rtt = hint.rtt;
  direct_info_.sndbuf_request = socket.sndbuf;
  return links;
}

DirectConnectionInfo PeerSender::direct_info() const {
  absl::MutexLock lock(&mu_);
  return direct_info_;
}

void PeerSender::CountWritten(size_t connection, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  if (connection < direct_info_.written.size()) direct_info_.written[connection] += bytes;
}

void PeerSender::OnStreamBroken() {
  absl::MutexLock lock(&mu_);
  if (!closing_) stream_broken_ = true;
}

void PeerSender::OnWriteDone(bool ok) {
  absl::MutexLock lock(&mu_);
  write_in_flight_ = false;
  current_ = Chunk();
  if (!ok) stream_broken_ = true;
}

void PeerSender::OnStreamError(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (broken_reason_.empty() && !closing_) broken_reason_ = std::string(status.message());
}

void PeerSender::OnReadEnded() {
  absl::MutexLock lock(&mu_);
  read_ended_ = true;
  if (!closing_) stream_broken_ = true;
}

void PeerSender::OnAck(const v1::FrameAck& ack) {
  const std::string key =
      AckKey(ack.job_id(), ack.iteration(), ack.epoch(), ack.microbatch(), ack.direction());
  Pending p;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(key);
    if (it == pending_.end()) return;  // late ack for a failed transfer
    p = std::move(it->second);
    pending_.erase(it);
  }
  const double seconds = p.first_write == absl::InfiniteFuture()
                             ? 0
                             : absl::ToDoubleSeconds(absl::Now() - p.first_write);
  if (ack.ok()) {
    p.done(absl::OkStatus(), seconds);
  } else {
    p.done(absl::FailedPreconditionError(
               absl::StrCat("peer ", peer_, " rejected the tensor: ", ack.error())),
           seconds);
  }
}

void PeerSender::OnStreamDone() {
  // The writer cleared stream_ before it ended the stream, so this stream is
  // no longer current; only the count remains.
  absl::MutexLock lock(&mu_);
  --live_streams_;
}

void PeerSender::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closing_ && !writer_.joinable()) return;
    closing_ = true;
    FailAll(absl::CancelledError("sender closed"));
  }
  if (wake_pipe_[1] >= 0) {  // a direct connect in progress gives up
    const char byte = 1;
    (void)!::write(wake_pipe_[1], &byte, 1);
  }
  if (writer_.joinable()) writer_.join();
  // Every stream was cancelled or ended and has no hold left, so gRPC calls
  // OnDone for each; returning earlier would leave them pointing at a
  // destroyed sender.
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &live_streams_));
}

}  // namespace detour
