#include "worker/runtime/link_prober.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace detour {
namespace {

// Peers with probe series of their own (the rest are not exported).
constexpr size_t kMaxExportedPeers = 64;
// A bulk probe's rate counts only when its transfer (its time less one round
// trip) took at least this share of the round trip, or kMinWire: shorter
// ones are mostly noise.
constexpr double kMinWireShareOfRtt = 0.25;
constexpr double kMinWireSeconds = 0.0005;
// The rate has stopped growing when a larger probe gains less than this.
constexpr double kGrowth = 1.10;

// Transfers in flight, one per key, and their outcomes as they come. A
// callback that comes after the round gave up writes into state nobody reads
// any more.
class Inflight {
 public:
  struct Outcome {
    absl::Status status;
    double seconds = 0;
  };

  explicit Inflight(PeerTransport* transport) : transport_(transport) {}

  void Send(const std::string& key, const std::string& to, v1::FrameHeader header,
            TensorView view) {
    std::shared_ptr<State> state = state_;
    {
      absl::MutexLock lock(&state->mu);
      state->pending.insert(key);
    }
    transport_->Send(to, std::move(header), std::move(view),
                     [state, key](absl::Status status, double seconds) {
                       absl::MutexLock lock(&state->mu);
                       if (!state->pending.erase(key)) return;
                       state->done[key] = Outcome{std::move(status), seconds};
                     });
  }

  bool empty() {
    absl::MutexLock lock(&state_->mu);
    return state_->pending.empty() && state_->done.empty();
  }

  // The transfers done since the last call; waits for at least one until
  // `deadline` or `stop`.
  std::map<std::string, Outcome> Next(absl::Time deadline, const std::function<bool()>& stop) {
    absl::MutexLock lock(&state_->mu);
    auto some = [this]() ABSL_SHARED_LOCKS_REQUIRED(state_->mu) {
      return !state_->done.empty() || state_->pending.empty();
    };
    while (!some() && absl::Now() < deadline && !stop()) {
      state_->mu.AwaitWithDeadline(absl::Condition(&some),
                                   std::min(deadline, absl::Now() + absl::Milliseconds(200)));
    }
    std::map<std::string, Outcome> out;
    out.swap(state_->done);
    return out;
  }

  // Gives up on what is still in flight (its callbacks are ignored); returns
  // the keys.
  std::set<std::string> Abandon() {
    absl::MutexLock lock(&state_->mu);
    std::set<std::string> out;
    out.swap(state_->pending);
    return out;
  }

 private:
  struct State {
    absl::Mutex mu;
    std::set<std::string> pending ABSL_GUARDED_BY(mu);
    std::map<std::string, Outcome> done ABSL_GUARDED_BY(mu);
  };
  PeerTransport* const transport_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

}  // namespace

LinkProber::LinkProber(PeerTransportFactory factory, PeerTransportConfig base, SendFn send,
                       metrics::Registry* metrics)
    : factory_(std::move(factory)), base_(std::move(base)), send_(std::move(send)) {
  if (metrics != nullptr) {
    if (auto f =
            metrics->AddGauge("detour_worker_link_probe_rtt_seconds",
                              "Smallest round trip of the last link probe to the peer.", {"peer"});
        f.ok()) {
      rtt_ = *f;
    }
    if (auto f = metrics->AddGauge("detour_worker_link_probe_bandwidth_bytes_per_second",
                                   "Best rate of the last bulk link probe to the peer.", {"peer"});
        f.ok()) {
      bandwidth_ = *f;
    }
    rounds_ = metrics::OptionalCounter(metrics, "detour_worker_link_probe_rounds",
                                       "Link probe rounds this worker ran for the coordinator.");
    probe_bytes_ = metrics::OptionalCounter(metrics, "detour_worker_link_probe_sent_bytes",
                                            "Bytes of link probes this worker sent.");
  }
  thread_ = std::thread([this] { Loop(); });
}

LinkProber::~LinkProber() { Stop(); }

void LinkProber::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void LinkProber::SetWorkerId(const std::string& id) {
  absl::MutexLock lock(&mu_);
  me_ = id;
}

absl::Status LinkProber::Validate(const v1::LinkProbe& p) {
  if (p.job_id().empty()) return absl::InvalidArgumentError("link probe: job_id is empty");
  if (p.peers_size() > kMaxPeers) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: ", p.peers_size(), " peers (at most ", kMaxPeers, ")"));
  }
  if (p.pings() < 1 || p.pings() > static_cast<uint32_t>(kMaxPings)) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: pings ", p.pings(), " not in [1, ", kMaxPings, "]"));
  }
  if (p.bulk_max_bytes() > kMaxProbeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: bulk_max_bytes ", p.bulk_max_bytes(), " over ", kMaxProbeBytes));
  }
  if (p.budget_ms() < 1 || p.budget_ms() > kMaxBudgetMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe: budget_ms ", p.budget_ms(), " not in [1, ", kMaxBudgetMs, "]"));
  }
  for (const v1::Peer& peer : p.peers()) {
    if (peer.worker_id().empty() || (peer.address().empty() && peer.data_address().empty())) {
      return absl::InvalidArgumentError("link probe: a peer without id or address");
    }
  }
  return absl::OkStatus();
}

void LinkProber::OnProbe(const v1::LinkProbe& probe) {
  if (absl::Status s = Validate(probe); !s.ok()) {
    LogWarning("ignoring a link probe request: ", s.message());
    return;
  }
  absl::MutexLock lock(&mu_);
  allowed_job_ = probe.job_id();
  allowed_peers_.clear();
  for (const v1::Peer& peer : probe.peers()) allowed_peers_.insert(peer.worker_id());
  next_ = probe;
}

absl::StatusOr<MutableBuffer> LinkProber::Allocate(const v1::FrameHeader& h) {
  {
    absl::MutexLock lock(&mu_);
    if (h.job_id() != allowed_job_ || !allowed_peers_.count(h.sender())) {
      return absl::PermissionDeniedError(absl::StrCat("link probe from ", h.sender(), " for job ",
                                                      h.job_id(), ": not a peer of a probe round"));
    }
  }
  const uint64_t bytes = h.total_bytes();
  if (bytes > kMaxProbeBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("link probe of ", bytes, " bytes (at most ", kMaxProbeBytes, ")"));
  }
  std::shared_ptr<std::atomic<uint64_t>> held = held_;
  if (held->fetch_add(bytes) + bytes > kMaxHeldProbeBytes) {
    held->fetch_sub(bytes);
    return absl::ResourceExhaustedError("link probes: too many probe bytes held at once");
  }
  auto* memory = new uint8_t[std::max<uint64_t>(1, bytes)];
  MutableBuffer b;
  b.data = memory;
  b.bytes = bytes;
  b.keepalive = std::shared_ptr<void>(memory, [held, bytes](void* p) {
    delete[] static_cast<uint8_t*>(p);
    held->fetch_sub(bytes);
  });
  return b;
}

void LinkProber::Loop() {
  while (true) {
    std::optional<v1::LinkProbe> probe;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]()
                       ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_ || next_.has_value(); };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      probe = std::move(next_);
      next_.reset();
    }
    v1::LinkReport report = Round(*probe);
    if (rounds_ != nullptr) rounds_->Increment();
    int failed = 0;
    for (const v1::LinkMeasurement& m : report.links()) {
      failed += m.error().empty() ? 0 : 1;
      // Rounds with bulk probes (a job's start) are logged link by link.
      if (probe->bulk_max_bytes() == 0) continue;
      LogInfo("job ", report.job_id(), ": link to ", m.peer(), ": ",
              m.error().empty()
                  ? absl::StrFormat("round trip %.2f ms, %.1f MB/s (%.1f MiB of probes)",
                                    m.rtt_seconds() * 1e3, m.bandwidth_bytes_per_s() / 1e6,
                                    m.probe_bytes() / 1048576.0)
                  : absl::StrCat("not measured: ", m.error()));
    }
    LogInfo("job ", report.job_id(), ": link probe round ", report.round(), ": ",
            report.links_size(), " peer(s) in ", absl::StrFormat("%.2f", report.seconds()), " s",
            failed > 0 ? absl::StrCat(", ", failed, " failed") : "");
    for (const v1::LinkMeasurement& m : report.links()) Export(m);
    v1::WorkerMessage message;
    *message.mutable_link_report() = std::move(report);
    if (absl::Status s = send_(std::move(message)); !s.ok()) {
      LogWarning("cannot send a link report to the coordinator: ", s.message());
    }
  }
}

void LinkProber::Export(const v1::LinkMeasurement& m) {
  if (rtt_ == nullptr || bandwidth_ == nullptr) return;
  if (!exported_.count(m.peer()) && exported_.size() >= kMaxExportedPeers) return;
  exported_.insert(m.peer());
  if (m.rtt_seconds() > 0) {
    if (auto g = rtt_->WithLabels({m.peer()}); g.ok()) (*g)->Set(m.rtt_seconds());
  }
  if (m.bandwidth_bytes_per_s() > 0) {
    if (auto g = bandwidth_->WithLabels({m.peer()}); g.ok()) (*g)->Set(m.bandwidth_bytes_per_s());
  }
}

v1::LinkReport LinkProber::Round(const v1::LinkProbe& p) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::Milliseconds(p.budget_ms());
  auto stop = [this] {
    absl::MutexLock lock(&mu_);
    return stopping_;
  };
  std::string me;
  {
    absl::MutexLock lock(&mu_);
    me = me_;
  }
  v1::LinkReport report;
  report.set_job_id(p.job_id());
  report.set_round(p.round());

  PeerTransportConfig config = base_;
  config.emulate_network = p.emulate_network();
  std::unique_ptr<PeerTransport> transport = factory_(config);
  std::vector<PeerEndpoint> endpoints;
  std::map<std::string, v1::LinkMeasurement*> links;
  for (const v1::Peer& peer : p.peers()) {
    if (peer.worker_id() == me || links.count(peer.worker_id())) continue;
    endpoints.push_back({peer.worker_id(), peer.address(), peer.region(), peer.data_address()});
    v1::LinkMeasurement* m = report.add_links();
    m->set_peer(peer.worker_id());
    links[peer.worker_id()] = m;
  }
  transport->SetPeers(endpoints);

  const uint64_t largest = std::max<uint64_t>(kPingBytes, p.bulk_max_bytes());
  auto zeros = std::make_shared<std::vector<uint8_t>>(largest, 0);
  uint32_t sequence = 0;
  auto probe = [&](uint64_t bytes) {
    v1::FrameHeader h;
    h.set_job_id(p.job_id());
    h.set_sender(me);
    h.set_direction(v1::DIRECTION_PROBE);
    h.set_dtype(v1::DTYPE_BYTES);
    h.add_shape(static_cast<int64_t>(bytes));
    h.set_microbatch(sequence++);
    TensorView view;
    view.data = zeros->data();
    view.bytes = bytes;
    view.keepalive = zeros;
    return std::make_pair(h, view);
  };
  auto count_sent = [&](v1::LinkMeasurement* m, uint64_t bytes) {
    m->set_probe_bytes(m->probe_bytes() + bytes);
    if (probe_bytes_ != nullptr) (void)probe_bytes_->IncrementBy(static_cast<double>(bytes));
  };

  // Latency: every peer at once, each link's pings one after another.
  std::map<std::string, double> rtt;
  std::map<std::string, uint32_t> pings_sent;
  {
    Inflight pings(transport.get());
    auto send_ping = [&](const std::string& peer) {
      auto [h, view] = probe(kPingBytes);
      pings.Send(peer, peer, std::move(h), std::move(view));
      count_sent(links[peer], kPingBytes);
      ++pings_sent[peer];
    };
    for (auto& [peer, m] : links) send_ping(peer);
    while (!pings.empty() && !stop()) {
      if (absl::Now() >= deadline) break;
      for (const auto& [peer, o] : pings.Next(deadline, stop)) {
        v1::LinkMeasurement* m = links[peer];
        if (!o.status.ok()) {
          m->set_error(absl::StrCat("ping: ", o.status.message()));
          continue;
        }
        if (!rtt.count(peer) || o.seconds < rtt[peer]) rtt[peer] = o.seconds;
        if (pings_sent[peer] < p.pings() && absl::Now() < deadline) send_ping(peer);
      }
    }
    // A link that never answered within the budget; one that did keeps
    // what its answered pings showed.
    for (const std::string& peer : pings.Abandon()) {
      if (!rtt.count(peer)) links[peer]->set_error("no answer to a ping within the round's budget");
    }
  }
  // The in-process emulation (--emulate_network) delays frames once, on the
  // way out, and acknowledgements not at all: a ping's round trip is then
  // the emulated one-way latency, and a real link's round trip is twice it.
  const double rtt_factor = p.has_emulate_network() ? 2.0 : 1.0;
  for (auto& [peer, m] : links) {
    if (m->error().empty() && rtt.count(peer)) m->set_rtt_seconds(rtt[peer] * rtt_factor);
  }

  // Bandwidth: one link at a time, growing probes.
  size_t left = links.size();
  for (auto& [peer, m] : links) {
    const size_t share = left--;
    if (p.bulk_max_bytes() < kFirstBulkBytes || !m->error().empty() || stop()) continue;
    const absl::Time peer_deadline = absl::Now() + (deadline - absl::Now()) / share;
    const double r = m->rtt_seconds() / rtt_factor;  // what a transfer's ack adds
    double best = 0;
    int samples = 0, flat = 0;
    for (uint64_t size = kFirstBulkBytes; size <= p.bulk_max_bytes() && !stop(); size *= 2) {
      Inflight bulk(transport.get());
      auto [h, view] = probe(size);
      bulk.Send(peer, peer, std::move(h), std::move(view));
      count_sent(m, size);
      std::map<std::string, Inflight::Outcome> done = bulk.Next(peer_deadline, stop);
      if (done.empty()) {
        bulk.Abandon();
        if (best == 0) m->set_error("no bulk probe finished within the link's share of the budget");
        break;
      }
      const Inflight::Outcome& o = done.begin()->second;
      if (!o.status.ok()) {
        m->set_error(absl::StrCat("bulk probe: ", o.status.message()));
        break;
      }
      const double wire = o.seconds - r;
      LogDebug("job ", p.job_id(), ": bulk probe to ", peer, ": ", size >> 20, " MiB in ",
               absl::StrFormat("%.1f", o.seconds * 1e3), " ms");
      if (wire < std::max(kMinWireSeconds, kMinWireShareOfRtt * r)) continue;
      const double rate = static_cast<double>(size) / wire;
      ++samples;
      const bool growing = rate > kGrowth * best;
      best = std::max(best, rate);
      // Two sizes in a row without growth: the link carries what it can. (One
      // is not enough: a tensor large enough to be striped opens the other
      // connections cold, and is slower than the smaller one before it.)
      flat = growing ? 0 : flat + 1;
      if (samples >= 3 && flat >= 2) break;
    }
    if (best > 0) m->set_bandwidth_bytes_per_s(best);
  }
  transport->Close();
  report.set_seconds(absl::ToDoubleSeconds(absl::Now() - start));
  return report;
}

}  // namespace detour
