#include "worker/runtime/link_prober.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/link_probe_need.h"
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
// Single bulk probes go up to this size; larger ones are striped over
// several connections (peer_sender.h) and are measured as a stream.
constexpr uint64_t kLastSingleBytes = uint64_t{4} << 20;
// On a link whose round trip is at least this, a stream follows (the
// largest probe is striped) and only the first single probe is sent: each
// of 1, 2 and 4 MiB takes 7-11 round trips of a window opening again (4.4,
// 6.7 and 5.6 s over a 0.6 s round trip on the test bed), reads a fraction of
// the link, and the three took most of the link's share before its stream.
// The first stays: a floor for a link too slow for the striped probe to
// finish within its share.
constexpr double kOneSingleFromRttSeconds = 0.05;
// The stream measurement (after one probe of its size alone, which opens the
// connections' windows): kStreamDepth probes of that size queued
// at all times, one more sent as each is acknowledged, until it has run
// kStreamTime and kStreamRtts round trips, kMaxStreamBytes were sent (but
// never fewer than kStreamMinProbes), or the link's share of the
// budget is spent.
constexpr uint64_t kStreamDepth = 2;
// The fewest probes a stream sends (the link's share of the budget may still
// end it earlier): four intervals between acknowledgements to measure.
constexpr uint64_t kStreamMinProbes = 5;
constexpr absl::Duration kStreamTime = absl::Milliseconds(250);
constexpr int kStreamRtts = 10;
constexpr uint64_t kMaxStreamBytes = uint64_t{256} << 20;
// A failed ping is retried within this part of the round (the smaller of the
// two), waiting kFirstPingRetry, then twice as long each time up to
// kLastPingRetry.
constexpr absl::Duration kPingRetryWindow = absl::Seconds(2);
constexpr double kPingRetryShareOfBudget = 0.25;
constexpr absl::Duration kFirstPingRetry = absl::Milliseconds(20);
constexpr absl::Duration kLastPingRetry = absl::Milliseconds(400);

// Whether a round measures bandwidth too (else it only pings): its bulk
// probes start at kFirstBulkBytes.
bool MeasuresBandwidth(const v1::LinkProbe& p) {
  return p.bulk_max_bytes() >= LinkProber::kFirstBulkBytes;
}

// Transfers in flight, one per key, and their outcomes as they come. A
// callback that comes after the round gave up writes into state nobody reads
// any more.
class Inflight {
 public:
  struct Outcome {
    absl::Status status;
    double seconds = 0;
    absl::Time at;  // when the outcome came
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
                       state->done[key] = Outcome{std::move(status), seconds, absl::Now()};
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

// One round's sending side: the request, the transport its probes go over
// (its own, closed by Finish) and the report it fills in.
class ProbeRound {
 public:
  ProbeRound(const v1::LinkProbe& p, std::string me, std::unique_ptr<PeerTransport> transport,
             metrics::Counter* probe_bytes, std::function<bool()> stop)
      : p_(p),
        me_(std::move(me)),
        transport_(std::move(transport)),
        probe_bytes_(probe_bytes),
        stop_(std::move(stop)),
        start_(absl::Now()),
        deadline_(start_ + absl::Milliseconds(p.budget_ms())),
        // The in-process emulation (--emulate_network) delays frames once,
        // on the way out, and acknowledgements not at all: a ping's round
        // trip is then the emulated one-way latency, and a real link's
        // round trip is twice it.
        rtt_factor_(p.has_emulate_network() ? 2.0 : 1.0),
        zeros_(std::make_shared<std::vector<uint8_t>>(
            std::max<uint64_t>(LinkProber::kPingBytes, p.bulk_max_bytes()), 0)) {
    report_.set_job_id(p.job_id());
    report_.set_round(p.round());
    std::vector<PeerEndpoint> endpoints;
    for (const v1::Peer& peer : p.peers()) {
      if (peer.worker_id() == me_ || links_.count(peer.worker_id())) continue;
      endpoints.push_back(
          {peer.worker_id(), peer.address(), peer.region(), peer.data_address(), LinkHint{}});
      v1::LinkMeasurement* m = report_.add_links();
      m->set_peer(peer.worker_id());
      links_[peer.worker_id()] = m;
    }
    for (const v1::LinkExpectation& e : p.expected()) {
      expected_rate_[e.peer()] = e.bandwidth_bytes_per_s();
    }
    transport_->SetPeers(endpoints);
  }

  // Latency: every peer at once, each link's pings one after another.
  void MeasureLatency();
  // Bandwidth: one link at a time, each in its share of what is left of the
  // budget.
  void MeasureBandwidth();
  // Closes the transport; the report.
  v1::LinkReport Finish();

 private:
  // First single probes of growing size up to kLastSingleBytes (tensors that
  // small travel whole on one connection), then one of bulk_max_bytes (less
  // on a link expected too slow for it: LinkProber::StreamProbeBytes) and
  // right after it a stream of more of that size (kStreamDepth queued at
  // once), which finds every striped connection's window open.
  void MeasureLink(const std::string& peer, v1::LinkMeasurement* m, absl::Time peer_deadline);
  // Sends `count` probes of `size` to `peer` at once and waits for all: the
  // rate of the whole (0 when too short to tell); nothing when one failed or
  // the link's share of the budget ran out (an error is set unless `best`
  // says an earlier size measured the link).
  std::optional<double> Measure(const std::string& peer, v1::LinkMeasurement* m, uint64_t size,
                                int count, absl::Time peer_deadline, double best);
  // The stream of probes of `size` (kStreamDepth, kStreamTime): the
  // rate between its first acknowledgement and its last (or, with too few,
  // of what was acknowledged over its time less one round trip);
  // nothing when a probe failed (the error is set) or none was acknowledged
  // within the link's share of the budget (an error unless `best` > 0).
  std::optional<double> Stream(const std::string& peer, v1::LinkMeasurement* m, uint64_t size,
                               absl::Time peer_deadline, double best);
  std::pair<v1::FrameHeader, TensorView> Probe(uint64_t bytes);
  void CountSent(v1::LinkMeasurement* m, uint64_t bytes);

  const v1::LinkProbe& p_;
  const std::string me_;
  const std::unique_ptr<PeerTransport> transport_;
  metrics::Counter* const probe_bytes_;
  const std::function<bool()> stop_;
  const absl::Time start_;
  const absl::Time deadline_;
  const double rtt_factor_;
  const std::shared_ptr<std::vector<uint8_t>> zeros_;
  uint32_t sequence_ = 0;
  v1::LinkReport report_;
  std::map<std::string, v1::LinkMeasurement*> links_;  // into report_
  std::map<std::string, double> expected_rate_;        // bytes/s, per peer (p.expected)
};

std::pair<v1::FrameHeader, TensorView> ProbeRound::Probe(uint64_t bytes) {
  v1::FrameHeader h;
  h.set_job_id(p_.job_id());
  h.set_sender(me_);
  h.set_direction(v1::DIRECTION_PROBE);
  h.set_dtype(v1::DTYPE_BYTES);
  h.add_shape(static_cast<int64_t>(bytes));
  h.set_microbatch(sequence_++);
  TensorView view;
  view.data = zeros_->data();
  view.bytes = bytes;
  view.keepalive = zeros_;
  return std::make_pair(h, view);
}

void ProbeRound::CountSent(v1::LinkMeasurement* m, uint64_t bytes) {
  m->set_probe_bytes(m->probe_bytes() + bytes);
  if (probe_bytes_ != nullptr) (void)probe_bytes_->IncrementBy(static_cast<double>(bytes));
}

void ProbeRound::MeasureLatency() {
  // The coordinator asks every worker of a round at about the same time, so
  // a peer may refuse the first pings ("not a peer of a probe round") until
  // its own request arrives: a failed ping is sent again, backing off, while
  // the link has answered none and the round is young.
  const absl::Time retry_until =
      start_ + std::min(kPingRetryWindow, (deadline_ - start_) * kPingRetryShareOfBudget);
  std::map<std::string, double> rtt;
  std::map<std::string, uint32_t> pings_sent;
  std::map<std::string, absl::Time> retry_at;  // links waiting to ping again
  std::map<std::string, absl::Duration> backoff;
  std::map<std::string, std::string> failure;  // the newest failed ping's
  Inflight pings(transport_.get());
  auto send_ping = [&](const std::string& peer) {
    auto [h, view] = Probe(LinkProber::kPingBytes);
    pings.Send(peer, peer, std::move(h), std::move(view));
    CountSent(links_[peer], LinkProber::kPingBytes);
    ++pings_sent[peer];
  };
  for (auto& [peer, m] : links_) send_ping(peer);
  while ((!pings.empty() || !retry_at.empty()) && !stop_() && absl::Now() < deadline_) {
    absl::Time wake = deadline_;
    for (auto it = retry_at.begin(); it != retry_at.end();) {
      if (it->second <= absl::Now()) {
        send_ping(it->first);
        it = retry_at.erase(it);
      } else {
        wake = std::min(wake, it->second);
        ++it;
      }
    }
    if (pings.empty()) {  // only retries to wait for
      absl::SleepFor(std::min(wake - absl::Now(), absl::Milliseconds(100)));
      continue;
    }
    for (const auto& [peer, o] : pings.Next(wake, stop_)) {
      v1::LinkMeasurement* m = links_[peer];
      if (!o.status.ok()) {
        failure[peer] = absl::StrCat("ping: ", o.status.message());
        absl::Duration& wait = backoff[peer];
        wait = wait == absl::ZeroDuration() ? kFirstPingRetry : std::min(2 * wait, kLastPingRetry);
        if (!rtt.count(peer) && absl::Now() + wait < retry_until) {
          --pings_sent[peer];  // a refused ping is not one of the link's pings
          retry_at[peer] = absl::Now() + wait;
        } else {
          m->set_error(failure[peer]);
        }
        continue;
      }
      if (!rtt.count(peer) || o.seconds < rtt[peer]) rtt[peer] = o.seconds;
      if (pings_sent[peer] < p_.pings() && absl::Now() < deadline_) send_ping(peer);
    }
  }
  // A link that never answered within the budget; one that did keeps what
  // its answered pings showed.
  for (const std::string& peer : pings.Abandon()) {
    if (!rtt.count(peer)) links_[peer]->set_error("no answer to a ping within the round's budget");
  }
  for (const auto& [peer, at] : retry_at) {
    if (!rtt.count(peer)) links_[peer]->set_error(failure[peer]);
  }
  for (auto& [peer, m] : links_) {
    if (m->error().empty() && rtt.count(peer)) m->set_rtt_seconds(rtt[peer] * rtt_factor_);
  }
}

void ProbeRound::MeasureBandwidth() {
  if (!MeasuresBandwidth(p_)) return;
  std::vector<std::pair<std::string, v1::LinkMeasurement*>> todo;
  for (auto& [peer, m] : links_) {
    if (m->error().empty()) todo.emplace_back(peer, m);
  }
  for (size_t i = 0; i < todo.size() && !stop_(); ++i) {
    std::vector<std::optional<double>> rtts;
    for (size_t j = i; j < todo.size(); ++j) {
      const double rtt = todo[j].second->rtt_seconds();
      rtts.push_back(rtt > 0 ? std::optional<double>(rtt) : std::nullopt);
    }
    const absl::Time now = absl::Now();
    MeasureLink(todo[i].first, todo[i].second, now + LinkProber::BulkShare(deadline_ - now, rtts));
  }
}

void ProbeRound::MeasureLink(const std::string& peer, v1::LinkMeasurement* m,
                             absl::Time peer_deadline) {
  double best = 0;
  const bool streams = p_.bulk_max_bytes() > kLastSingleBytes;
  const uint64_t last_single = streams && m->rtt_seconds() >= kOneSingleFromRttSeconds
                                   ? LinkProber::kFirstBulkBytes
                                   : std::min(kLastSingleBytes, p_.bulk_max_bytes());
  for (uint64_t size = LinkProber::kFirstBulkBytes; size <= last_single && !stop_(); size *= 2) {
    const std::optional<double> rate = Measure(peer, m, size, 1, peer_deadline, best);
    if (!rate.has_value()) {
      if (best > 0) m->set_bandwidth_bytes_per_s(best);
      return;
    }
    best = std::max(best, *rate);
  }
  if (streams && !stop_()) {
    // The first probe of the stream's size (striped from 8 MiB) opens the
    // connections' windows (and counts too); the stream follows at once,
    // before they close again.
    auto expected = expected_rate_.find(peer);
    const uint64_t size = LinkProber::StreamProbeBytes(
        p_.bulk_max_bytes(), expected == expected_rate_.end() ? 0.0 : expected->second,
        m->rtt_seconds(), peer_deadline - absl::Now());
    if (const std::optional<double> warm = Measure(peer, m, size, 1, peer_deadline, best)) {
      best = std::max(best, *warm);
      if (const std::optional<double> rate = Stream(peer, m, size, peer_deadline, best)) {
        best = std::max(best, *rate);
      }
    }
  }
  if (best > 0) m->set_bandwidth_bytes_per_s(best);
}

std::optional<double> ProbeRound::Measure(const std::string& peer, v1::LinkMeasurement* m,
                                          uint64_t size, int count, absl::Time peer_deadline,
                                          double best) {
  const double ack = m->rtt_seconds() / rtt_factor_;  // what a transfer's ack adds
  const absl::Time sent = absl::Now();
  Inflight bulk(transport_.get());
  for (int i = 0; i < count; ++i) {
    auto [h, view] = Probe(size);
    bulk.Send(absl::StrCat(i), peer, std::move(h), std::move(view));
    CountSent(m, size);
  }
  absl::Time last = absl::InfinitePast();
  for (int done = 0; done < count;) {
    std::map<std::string, Inflight::Outcome> outcomes = bulk.Next(peer_deadline, stop_);
    if (outcomes.empty()) {
      bulk.Abandon();
      if (best == 0) m->set_error("no bulk probe finished within the link's share of the budget");
      return std::nullopt;
    }
    for (const auto& [key, o] : outcomes) {
      if (!o.status.ok()) {
        bulk.Abandon();
        m->set_error(absl::StrCat("bulk probe: ", o.status.message()));
        return std::nullopt;
      }
      last = std::max(last, o.at);
      ++done;
    }
  }
  const double seconds = absl::ToDoubleSeconds(last - sent);
  LogDebug("job ", p_.job_id(), ": bulk probe to ", peer, ": ", count, " x ", size >> 20,
           " MiB in ", absl::StrFormat("%.1f", seconds * 1e3), " ms");
  const double wire = seconds - ack;
  if (wire < std::max(kMinWireSeconds, kMinWireShareOfRtt * ack)) return 0.0;
  return static_cast<double>(size) * count / wire;
}

std::optional<double> ProbeRound::Stream(const std::string& peer, v1::LinkMeasurement* m,
                                         uint64_t size, absl::Time peer_deadline, double best) {
  const uint64_t most = std::max<uint64_t>(kStreamMinProbes, kMaxStreamBytes / size);
  const double ack = m->rtt_seconds() / rtt_factor_;  // what a transfer's ack adds
  const absl::Time start = absl::Now();
  const absl::Time stop_sending =
      std::min(peer_deadline, start + std::max(kStreamTime, kStreamRtts * absl::Seconds(ack)));
  Inflight stream(transport_.get());
  uint64_t sent = 0;
  uint64_t acked = 0;
  auto send = [&] {
    auto [h, view] = Probe(size);
    stream.Send(absl::StrCat(sent), peer, std::move(h), std::move(view));
    CountSent(m, size);
    ++sent;
  };
  while (sent < kStreamDepth) send();
  absl::Time last = absl::InfinitePast();
  std::vector<absl::Time> acks;  // when each acknowledgement came
  while (acked < sent) {
    std::map<std::string, Inflight::Outcome> outcomes = stream.Next(peer_deadline, stop_);
    if (outcomes.empty()) {  // the link's share is spent (or the round stops)
      stream.Abandon();
      break;
    }
    for (const auto& [key, o] : outcomes) {
      if (!o.status.ok()) {
        stream.Abandon();
        m->set_error(absl::StrCat("bulk probe: ", o.status.message()));
        return std::nullopt;
      }
      last = std::max(last, o.at);
      acks.push_back(o.at);
      ++acked;
    }
    while (sent < most && sent - acked < kStreamDepth &&
           (sent < kStreamMinProbes || absl::Now() < stop_sending)) {
      send();
    }
  }
  if (acked == 0) {
    if (best == 0) m->set_error("no bulk probe finished within the link's share of the budget");
    return std::nullopt;
  }
  const double seconds = absl::ToDoubleSeconds(last - start);
  const double min_wire = std::max(kMinWireSeconds, kMinWireShareOfRtt * ack);
  // The whole stream's rate: what was acknowledged over its time less one
  // round trip. On a long link that time counts the first probe's ramp,
  // most of a short stream.
  const double wire = seconds - ack;
  const double whole =
      wire < min_wire ? 0.0 : static_cast<double>(size) * static_cast<double>(acked) / wire;
  // Once the stream runs, one probe is delivered between one acknowledgement
  // and the next: the rate between the first and the last leaves the round
  // trip and the ramp out. kStreamMinProbes gives it four intervals (over
  // two, acknowledgements that came close together read up to 1.46× the
  // link on the test bed).
  std::sort(acks.begin(), acks.end());
  double between = 0;
  if (acks.size() >= kStreamDepth + 1) {
    const double span = absl::ToDoubleSeconds(acks.back() - acks.front());
    if (span >= min_wire) {
      between = static_cast<double>(size) * static_cast<double>(acks.size() - 1) / span;
    }
  }
  std::string ack_ms;
  for (absl::Time t : acks) {
    absl::StrAppend(&ack_ms, ack_ms.empty() ? "" : " ",
                    absl::StrFormat("%.1f", absl::ToDoubleMilliseconds(t - start)));
  }
  LogInfo("job ", p_.job_id(), ": probe stream to ", peer, ": acks at ", ack_ms, " ms");
  LogInfo("job ", p_.job_id(), ": probe stream to ", peer, ": ", acked, " x ", size >> 20,
          " MiB in ", absl::StrFormat("%.1f", seconds * 1e3), " ms; ",
          absl::StrFormat("%.1f", between / 1e6), " MB/s between its first and last ack, ",
          absl::StrFormat("%.1f", whole / 1e6), " MB/s over the whole stream; ",
          absl::StrFormat("%.1f", best / 1e6), " MB/s before it");
  return between > 0 ? between : whole;
}

v1::LinkReport ProbeRound::Finish() {
  transport_->Close();
  report_.set_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
  return std::move(report_);
}

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

absl::Duration LinkProber::BulkShare(absl::Duration left,
                                     const std::vector<std::optional<double>>& rtts) {
  if (rtts.empty() || left <= absl::ZeroDuration()) return absl::ZeroDuration();
  absl::Duration total = absl::ZeroDuration();
  for (const std::optional<double>& rtt : rtts) total += LinkProbeNeed(rtt);
  return left * absl::FDivDuration(LinkProbeNeed(rtts[0]), total);
}

uint64_t LinkProber::StreamProbeBytes(uint64_t bulk_max, double expected_rate, double rtt_s,
                                      absl::Duration left) {
  if (!(expected_rate > 0) || !(rtt_s >= 0)) return bulk_max;
  // The striped probe and the stream's fewest.
  const double probes = static_cast<double>(1 + kStreamMinProbes);
  const double room = absl::ToDoubleSeconds(left) / 2;
  const double floor = 4 * expected_rate * rtt_s;
  uint64_t size = bulk_max;
  while (size / 2 >= kSmallestStreamProbeBytes && static_cast<double>(size / 2) >= floor &&
         probes * static_cast<double>(size) / expected_rate > room) {
    size /= 2;
  }
  return size;
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
  if (p.accept_from_size() > kMaxPeers) {
    return absl::InvalidArgumentError(absl::StrCat("link probe: ", p.accept_from_size(),
                                                   " workers to accept (at most ", kMaxPeers, ")"));
  }
  for (const std::string& id : p.accept_from()) {
    if (id.empty() || id.size() > kMaxWorkerIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("link probe: a worker to accept with an id of ", id.size(), " bytes"));
    }
  }
  if (p.expected_size() > kMaxPeers) {
    return absl::InvalidArgumentError(absl::StrCat("link probe: ", p.expected_size(),
                                                   " expected links (at most ", kMaxPeers, ")"));
  }
  for (const v1::LinkExpectation& e : p.expected()) {
    if (e.peer().empty() || e.peer().size() > kMaxWorkerIdBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("link probe: an expected link to a peer id of ", e.peer().size(), " bytes"));
    }
    if (!(e.rtt_s() >= 0 && e.rtt_s() <= kMaxExpectedRttS)) {
      return absl::InvalidArgumentError(absl::StrCat("link probe: expected round trip ", e.rtt_s(),
                                                     " s to ", e.peer(), " not in [0, ",
                                                     kMaxExpectedRttS, "]"));
    }
    if (!(e.bandwidth_bytes_per_s() >= 0 && e.bandwidth_bytes_per_s() <= kMaxExpectedRate)) {
      return absl::InvalidArgumentError(
          absl::StrCat("link probe: expected bandwidth ", e.bandwidth_bytes_per_s(), " B/s to ",
                       e.peer(), " not in [0, ", kMaxExpectedRate, "]"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::string>> LinkProber::CappedLinks(const v1::LinkProbe& probe,
                                                                         const TcpLimits& limits) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const v1::LinkExpectation& e : probe.expected()) {
    const LinkHint hint{e.bandwidth_bytes_per_s(), absl::Seconds(e.rtt_s())};
    if (!(hint.rate_bytes_per_s > 0) || hint.rtt <= absl::ZeroDuration()) continue;
    const StripePlan plan = PlanStripes(hint, limits);
    if (plan.total_rate >= hint.rate_bytes_per_s) continue;  // the connections carry it
    for (std::string& line : TcpLimitWarnings(hint, limits, plan)) {
      out.emplace_back(e.peer(), absl::StrCat("link to ", e.peer(), ": ", line));
    }
  }
  return out;
}

void LinkProber::WarnCappedLinks(const v1::LinkProbe& probe) {
  if (probe.expected().empty()) return;
  const auto capped = CappedLinks(probe, ReadTcpLimits());
  absl::MutexLock lock(&mu_);
  if (warned_job_ != probe.job_id()) {
    warned_job_ = probe.job_id();
    warned_.clear();
  }
  std::set<std::string> now;
  for (const auto& [peer, line] : capped) {
    if (warned_.count(peer)) continue;  // once per job and peer
    LogWarning("job ", probe.job_id(), ": ", line);
    now.insert(peer);
  }
  warned_.insert(now.begin(), now.end());  // peers are bounded by kMaxPeers
}

void LinkProber::OnProbe(const v1::LinkProbe& probe) {
  if (absl::Status s = Validate(probe); !s.ok()) {
    LogWarning("ignoring a link probe request: ", s.message());
    return;
  }
  WarnCappedLinks(probe);
  absl::MutexLock lock(&mu_);
  allowed_job_ = probe.job_id();
  allowed_peers_.clear();
  for (const v1::Peer& peer : probe.peers()) allowed_peers_.insert(peer.worker_id());
  allowed_peers_.insert(probe.accept_from().begin(), probe.accept_from().end());
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
      // Rounds with bulk probes (a job's start, the slots while it runs) are
      // logged link by link.
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
    if (!probe->has_emulate_network()) RememberHints(report);
    v1::WorkerMessage message;
    *message.mutable_link_report() = std::move(report);
    if (absl::Status s = send_(std::move(message)); !s.ok()) {
      LogWarning("cannot send a link report to the coordinator: ", s.message());
    }
  }
}

void LinkProber::RememberHints(const v1::LinkReport& report) {
  absl::MutexLock lock(&mu_);
  if (hints_job_ != report.job_id()) {
    hints_.clear();
    hints_job_ = report.job_id();
  }
  for (const v1::LinkMeasurement& m : report.links()) {
    LinkHint& hint = hints_[m.peer()];  // peers are bounded by kMaxPeers
    if (m.rtt_seconds() > 0) hint.rtt = absl::Seconds(m.rtt_seconds());
    // Latency rounds keep the rate the start round measured.
    if (m.bandwidth_bytes_per_s() > 0) hint.rate_bytes_per_s = m.bandwidth_bytes_per_s();
  }
}

LinkHint LinkProber::Hint(const std::string& job_id, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  if (job_id != hints_job_) return LinkHint{};
  auto it = hints_.find(peer);
  return it == hints_.end() ? LinkHint{} : it->second;
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
  std::string me;
  {
    absl::MutexLock lock(&mu_);
    me = me_;
  }
  PeerTransportConfig config = base_;
  config.emulate_network = p.emulate_network();
  // A latency round sends pings only, every peer at once: one connection
  // each. Striped, every worker of a round would open up to 16 TLS
  // connections to each peer at the same moment, and the peers' admission
  // would shed some of them and fail their pings.
  if (!MeasuresBandwidth(p)) config.direct_connections = 1;
  ProbeRound round(p, me, factory_(config), probe_bytes_, [this] {
    absl::MutexLock lock(&mu_);
    return stopping_;
  });
  round.MeasureLatency();
  round.MeasureBandwidth();
  return round.Finish();
}

}  // namespace detour
