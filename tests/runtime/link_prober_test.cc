// The link prober on a fake transport whose links have a known round trip
// and rate (and, for one, a window that opens as bytes flow, as TCP's does
// on a long fat link): what it reports, what it costs, and which probes it
// takes from peers.
#include "worker/runtime/link_prober.h"

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/transport/peer_sender.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

struct FakeLink {
  double rtt = 0.01;
  double rate = 200e6;  // bytes/s
  // The window opens as bytes flow: a transfer over 64 KiB gets rate ×
  // min(1, bytes sent so far, this one included / ramp_bytes). 0 = always
  // open.
  double ramp_bytes = 0;
  bool down = false;
  // The first this many tensors are refused, as by a peer that has not yet
  // been asked for the round.
  int refuse = 0;
  // The first two tensors over 4 MiB (the striped ones: the probe that opens
  // the windows and the stream's first) each take this much longer, as
  // connections whose windows open over a long round trip do.
  double opening_seconds = 0;
  // Each tensor of 4 MiB or less over 64 KiB (the single probes) takes this
  // much longer, as one connection's window opening again after it idled
  // over a long round trip.
  double single_seconds = 0;
};

// Completes each tensor after the time its link would take (a real sleep,
// so the prober's deadlines and its thread are exercised), reporting that
// time as the transfer's duration. Tensors in flight at once share their
// link: each waits for the ones queued before it.
class FakeTransport final : public PeerTransport {
 public:
  explicit FakeTransport(std::map<std::string, FakeLink> links) : links_(std::move(links)) {}
  ~FakeTransport() override { Close(); }

  void SetPeers(const std::vector<PeerEndpoint>& peers) override {
    absl::MutexLock lock(&mu_);
    for (const PeerEndpoint& p : peers) peers_.push_back(p.worker_id);
  }
  void Send(const std::string& to, v1::FrameHeader header, TensorView data, Done done) override {
    absl::MutexLock lock(&mu_);
    auto it = links_.find(to);
    if (it == links_.end() || closed_) {
      done(absl::NotFoundError(to), 0);
      return;
    }
    EXPECT_EQ(header.direction(), v1::DIRECTION_PROBE);
    EXPECT_EQ(header.shape(0), static_cast<int64_t>(data.bytes));
    FakeLink& l = it->second;
    sent_[to] += data.bytes;
    if (l.refuse > 0) {
      --l.refuse;
      done(
          absl::PermissionDeniedError("link probe from me for job j1: not a peer of a probe round"),
          0.001);
      return;
    }
    double seconds = l.rtt;
    double rate = l.rate;
    // Small tensors fit the initial window whatever the ramp.
    if (l.ramp_bytes > 0 && data.bytes > (64 << 10)) {
      rate *= std::min(1.0, static_cast<double>(sent_[to]) / l.ramp_bytes);
    }
    double opening = 0;
    if (data.bytes > (64 << 10) && data.bytes <= (4 << 20)) opening = l.single_seconds;
    if (data.bytes > (4 << 20) && opened_[to] < 2) {
      ++opened_[to];
      opening = l.opening_seconds;
    }
    const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
    double& free_at = free_at_[to];
    free_at = std::max(free_at, now) + opening + static_cast<double>(data.bytes) / rate;
    seconds += free_at - now;
    const bool down = l.down;
    threads_.emplace_back([seconds, down, done = std::move(done)] {
      absl::SleepFor(absl::Seconds(down ? 0.005 : seconds));
      if (down) {
        done(absl::UnavailableError("connect: connection refused"), 0.005);
      } else {
        done(absl::OkStatus(), seconds);
      }
    });
  }
  void Close() override {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      closed_ = true;
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }
  uint64_t sent(const std::string& to) {
    absl::MutexLock lock(&mu_);
    return sent_[to];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, FakeLink> links_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> sent_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, double> free_at_ ABSL_GUARDED_BY(mu_);  // seconds since the epoch
  std::map<std::string, int> opened_ ABSL_GUARDED_BY(mu_);      // tensors that met opening_seconds
  std::vector<std::string> peers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

class LinkProberTest : public ::testing::Test {
 protected:
  void Make(std::map<std::string, FakeLink> links) {
    links_ = std::move(links);
    prober_ = std::make_unique<LinkProber>(
        [this](const PeerTransportConfig& config) {
          auto t = std::make_unique<FakeTransport>(links_);
          last_ = t.get();
          last_config_ = config;
          return t;
        },
        PeerTransportConfig{},
        [this](v1::WorkerMessage m) {
          absl::MutexLock lock(&mu_);
          reports_.push_back(m.link_report());
          return absl::OkStatus();
        },
        nullptr);
    prober_->SetWorkerId("me");
  }

  v1::LinkProbe Probe(const std::vector<std::string>& peers, uint64_t bulk, uint32_t budget_ms) {
    v1::LinkProbe p;
    p.set_job_id("j1");
    p.set_round(7);
    p.set_pings(3);
    p.set_bulk_max_bytes(bulk);
    p.set_budget_ms(budget_ms);
    for (const std::string& id : peers) {
      v1::Peer* peer = p.add_peers();
      peer->set_worker_id(id);
      peer->set_address(id + ":1");
    }
    return p;
  }

  v1::LinkReport AwaitReport() {
    absl::MutexLock lock(&mu_);
    auto some = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !reports_.empty(); };
    EXPECT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&some), absl::Seconds(30)));
    if (reports_.empty()) return v1::LinkReport();
    v1::LinkReport r = reports_.front();
    reports_.erase(reports_.begin());
    return r;
  }

  // What a link's probes send before its stream: three pings, the single
  // probes (`single_mib` MiB in all), the one that opens the windows (32 MiB
  // unless the link is expected too slow for it).
  static uint64_t BeforeStream(uint64_t single_mib, uint64_t opening_mib = 32) {
    return 3 * LinkProber::kPingBytes + (single_mib << 20) + (opening_mib << 20);
  }

  static const v1::LinkMeasurement* Find(const v1::LinkReport& r, const std::string& peer) {
    for (const v1::LinkMeasurement& m : r.links()) {
      if (m.peer() == peer) return &m;
    }
    return nullptr;
  }

  std::map<std::string, FakeLink> links_;
  std::unique_ptr<LinkProber> prober_;
  FakeTransport* last_ = nullptr;
  PeerTransportConfig last_config_;  // of the newest round's transport
  absl::Mutex mu_;
  std::vector<v1::LinkReport> reports_ ABSL_GUARDED_BY(mu_);
};

// Latency is the smallest ping round trip; bandwidth the best bulk rate:
// single probes of 1, 2 and 4 MiB (over a long round trip the first only),
// then one of the largest size and a stream
// of more (two queued at a time), which reaches the rate of a link whose
// window opens slowly. A
// peer that cannot be reached is reported with the error; the worker itself
// is not probed. The measurements become the worker's link hints.
TEST_F(LinkProberTest, MeasuresLatencyAndTheRateAnOpeningWindowReaches) {
  Make({{"fast", {0.004, 400e6, 0, false}},
        {"long", {0.050, 100e6, 12e6, false}},
        {"down", {0.01, 1e6, 0, true}}});
  prober_->OnProbe(Probe({"me", "fast", "long", "down"}, 32 << 20, 20000));
  const v1::LinkReport r = AwaitReport();
  EXPECT_EQ(r.job_id(), "j1");
  EXPECT_EQ(r.round(), 7u);
  // A bulk round's transport stripes as each link needs.
  EXPECT_EQ(last_config_.direct_connections, 0);
  ASSERT_EQ(r.links_size(), 3) << r.ShortDebugString();
  const v1::LinkMeasurement* fast = Find(r, "fast");
  const v1::LinkMeasurement* slow = Find(r, "long");
  const v1::LinkMeasurement* down = Find(r, "down");
  ASSERT_TRUE(fast && slow && down) << r.ShortDebugString();
  EXPECT_NEAR(fast->rtt_seconds(), 0.004, 1e-6);
  // The rate less the ping's own transfer time in the round trip.
  EXPECT_NEAR(fast->bandwidth_bytes_per_s(), 400e6, 400e6 * 2e-2);
  EXPECT_TRUE(fast->error().empty()) << fast->error();
  EXPECT_NEAR(slow->rtt_seconds(), 0.05, 1e-6);
  // 1 MiB sees the window opening (1 MiB / 12 MB of the rate); 32 MiB and
  // the stream of 2 × 32 MiB after it get the full rate.
  EXPECT_NEAR(slow->bandwidth_bytes_per_s(), 100e6, 100e6 * 2e-2);
  // Pings, the single probes (1, 2 and 4 MiB; over a round trip of 50 ms
  // or more the first only), the 32 MiB one that opens the windows, then
  // the stream: at least three more, at most 256 MiB of them.
  for (const v1::LinkMeasurement* m : {slow, fast}) {
    const uint64_t before_stream = BeforeStream(m == slow ? 1 : 7);
    EXPECT_GE(m->probe_bytes(), before_stream + (uint64_t{96} << 20)) << m->peer();
    EXPECT_LE(m->probe_bytes(), before_stream + (uint64_t{256} << 20)) << m->peer();
  }
  EXPECT_THAT(down->error(), HasSubstr("connection refused"));
  EXPECT_EQ(down->rtt_seconds(), 0);
  EXPECT_EQ(down->bandwidth_bytes_per_s(), 0);
  // What the job's transport plans its connections from.
  const LinkHint hint = prober_->Hint("j1", "long");
  EXPECT_NEAR(absl::ToDoubleSeconds(hint.rtt), 0.05, 1e-6);
  EXPECT_NEAR(hint.rate_bytes_per_s, 100e6, 100e6 * 2e-2);
  EXPECT_EQ(prober_->Hint("j1", "down").rate_bytes_per_s, 0);
  EXPECT_EQ(prober_->Hint("j1", "down").rtt, absl::ZeroDuration());
  EXPECT_EQ(prober_->Hint("j2", "long").rate_bytes_per_s, 0);  // another job's
  // A latency round refreshes the round trip and keeps the rate.
  links_["long"].rtt = 0.08;
  prober_->OnProbe(Probe({"long"}, 0, 5000));
  AwaitReport();
  EXPECT_NEAR(absl::ToDoubleSeconds(prober_->Hint("j1", "long").rtt), 0.08, 1e-6);
  EXPECT_NEAR(prober_->Hint("j1", "long").rate_bytes_per_s, 100e6, 100e6 * 2e-2);
}

// On a long link whose connections take a while to open, the probe that
// opens them and the stream's first probe are slow: the stream's rate is
// taken between its acknowledgements, which leaves that out, where its bytes
// over its whole time (less a round trip) read about 0.7 of the link.
TEST_F(LinkProberTest, TheStreamsRateLeavesTheWindowsOpeningOut) {
  FakeLink long_link{0.3, 100e6, 0, false};
  long_link.opening_seconds = 1.0;
  Make({{"far", long_link}});
  prober_->OnProbe(Probe({"far"}, 32 << 20, 60000));
  const v1::LinkReport r = AwaitReport();
  const v1::LinkMeasurement* far = Find(r, "far");
  ASSERT_NE(far, nullptr) << r.ShortDebugString();
  EXPECT_TRUE(far->error().empty()) << far->error();
  EXPECT_NEAR(far->bandwidth_bytes_per_s(), 100e6, 100e6 * 5e-2);
  // At least five probes in the stream (four intervals to measure).
  const uint64_t before_stream = BeforeStream(1);
  EXPECT_GE(far->probe_bytes(), before_stream + (uint64_t{5 * 32} << 20));
}

// Over a long round trip every single probe meets a window opening again
// (on the test bed 1, 2 and 4 MiB took 7-11 round trips each of a 0.6 s
// link): only the first is sent, and the link's share goes to the striped
// probe and the stream, which read the link. Here all three would take 3.3 s
// of the 5.5 s, and the stream would have two acknowledgements (about 0.7 of
// the rate over its whole time) instead of five.
TEST_F(LinkProberTest, OverALongRoundTripOneSingleProbeLeadsToTheStream) {
  FakeLink long_link{0.1, 100e6, 0, false};
  long_link.single_seconds = 1.0;   // ten round trips more per single probe
  long_link.opening_seconds = 0.3;  // the striped probe's and the stream's first
  Make({{"far", long_link}, {"near", {0.002, 100e6, 0, false}}});
  prober_->OnProbe(Probe({"far"}, 32 << 20, 5500));
  const v1::LinkReport r = AwaitReport();
  const v1::LinkMeasurement* far = Find(r, "far");
  ASSERT_NE(far, nullptr) << r.ShortDebugString();
  EXPECT_TRUE(far->error().empty()) << far->error();
  EXPECT_NEAR(far->bandwidth_bytes_per_s(), 100e6, 100e6 * 5e-2);
  const uint64_t before_stream = BeforeStream(1);
  EXPECT_GE(far->probe_bytes(), before_stream + (uint64_t{5 * 32} << 20));
  EXPECT_EQ(far->probe_bytes() % (uint64_t{32} << 20), before_stream % (uint64_t{32} << 20))
      << "single probes other than the first 1 MiB";
  // A short link keeps the three.
  prober_->OnProbe(Probe({"near"}, 32 << 20, 10000));
  const v1::LinkReport near_report = AwaitReport();
  const v1::LinkMeasurement* near = Find(near_report, "near");
  ASSERT_NE(near, nullptr) << near_report.ShortDebugString();
  EXPECT_EQ(near->probe_bytes() % (uint64_t{32} << 20), BeforeStream(7) % (uint64_t{32} << 20));
}

// A slow link's stream of 32 MiB probes would end with its share before its
// acknowledgements tell the rate: here (20 MB/s, 4.5 s) the probe that opens
// the windows takes 2.3 s and the stream's first ends after the share, so
// the link would read the opening probe's 0.77 of its rate. Expected at
// 20 MB/s, it gets 8 MiB probes (four bandwidth-delay products of 2 MB),
// and the stream's acknowledgements measure it.
TEST_F(LinkProberTest, ASlowLinkExpectedSlowGetsProbesThatFitItsShare) {
  FakeLink slow_link{0.1, 20e6, 0, false};
  slow_link.single_seconds = 0.1;   // the 1 MiB probe reads a quarter of the link
  slow_link.opening_seconds = 0.5;  // the striped probe's and the stream's first
  Make({{"slow", slow_link}});
  v1::LinkProbe probe = Probe({"slow"}, 32 << 20, 4500);
  v1::LinkExpectation* e = probe.add_expected();
  e->set_peer("slow");
  e->set_rtt_s(0.1);
  e->set_bandwidth_bytes_per_s(20e6);
  prober_->OnProbe(probe);
  const v1::LinkReport r = AwaitReport();
  const v1::LinkMeasurement* slow = Find(r, "slow");
  ASSERT_NE(slow, nullptr) << r.ShortDebugString();
  EXPECT_TRUE(slow->error().empty()) << slow->error();
  EXPECT_NEAR(slow->bandwidth_bytes_per_s(), 20e6, 20e6 * 5e-2);
  // Pings, the 1 MiB probe, then 8 MiB probes only: the opening one and at
  // least five in the stream; less than a 32 MiB opening probe and one more.
  const uint64_t before_stream = BeforeStream(1, 8);
  EXPECT_EQ((slow->probe_bytes() - before_stream) % (uint64_t{8} << 20), 0u) << slow->probe_bytes();
  EXPECT_GE(slow->probe_bytes(), before_stream + (uint64_t{5 * 8} << 20));
  EXPECT_LT(slow->probe_bytes(), BeforeStream(1) + (uint64_t{32} << 20));
}

TEST_F(LinkProberTest, StreamProbesAreSizedToFitHalfTheShareAtTheExpectedRate) {
  const uint64_t mib = uint64_t{1} << 20;
  const uint64_t max = 32 * mib;
  // Unknown rate, or a fast link: the largest.
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 0, 0.1, absl::Seconds(6)), max);
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 100e6, 0.05, absl::Seconds(4.1)), max);
  // 20 MB/s in 6 s: six probes in 3 s are at most 10 MB each.
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 20e6, 0.1, absl::Seconds(6)), 8 * mib);
  // 20 MB/s in 12 s: 20 MB each.
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 20e6, 0.1, absl::Seconds(12)), 16 * mib);
  // 11 MB/s over 40 ms in 3.1 s: 2 MiB, under the stripe threshold (its
  // bandwidth-delay product, 0.44 MB, fits one connection's window).
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 11e6, 0.04, absl::Seconds(3.1)), 2 * mib);
  // Never below the smallest, however slow.
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 1e6, 0.1, absl::Seconds(2)), 2 * mib);
  // Nor below four expected bandwidth-delay products (two in flight then
  // carry a link four times faster than expected): 100 ms at 20 MB/s is
  // 2 MB, so 8 MiB however short the share; 300 ms is 6 MB, so 32 MiB
  // (16 MiB is 16.8 MB) where the share alone would take 16.
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 20e6, 0.1, absl::ZeroDuration()), 8 * mib);
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 20e6, 0.3, absl::Seconds(12)), max);
  EXPECT_EQ(LinkProber::StreamProbeBytes(max, 20e6, 0.2, absl::Seconds(6)), 16 * mib);
  // A largest size at or under the smallest stays as it is.
  EXPECT_EQ(LinkProber::StreamProbeBytes(3 * mib, 1e6, 0.1, absl::Seconds(2)), 3 * mib);
  // Under the stripe threshold a probe rides one connection.
  EXPECT_LT(LinkProber::kSmallestStreamProbeBytes, PeerSenderOptions{}.stripe_threshold_bytes);
}

// Under in-process emulation the delays are the sender's, not the network's:
// such rounds give no hints.
TEST_F(LinkProberTest, EmulatedRoundsLeaveNoHints) {
  Make({{"a", {0.004, 400e6, 0, false}}});
  v1::LinkProbe p = Probe({"a"}, 0, 5000);
  p.mutable_emulate_network()->set_name("emulated");
  prober_->OnProbe(p);
  const v1::LinkReport r = AwaitReport();
  ASSERT_EQ(r.links_size(), 1);
  EXPECT_GT(r.links(0).rtt_seconds(), 0);
  EXPECT_EQ(prober_->Hint("j1", "a").rtt, absl::ZeroDuration());
}

// A latency round (bulk 0) sends pings only, over one connection per peer;
// a budget too short for the links ends the round with an error for the
// links it did not finish.
TEST_F(LinkProberTest, ALatencyRoundSendsOnlyPingsAndABudgetBoundsTheRound) {
  Make({{"a", {0.002, 1e9, 0, false}}, {"slow", {0.5, 1e6, 0, false}}});
  const absl::Time start = absl::Now();
  prober_->OnProbe(Probe({"a", "slow"}, 0, 300));
  const v1::LinkReport r = AwaitReport();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_EQ(r.links_size(), 2);
  // Each link's pings go one after another, whatever the others do.
  EXPECT_NEAR(Find(r, "a")->rtt_seconds(), 0.002, 1e-6);
  EXPECT_TRUE(Find(r, "a")->error().empty()) << Find(r, "a")->error();
  EXPECT_EQ(Find(r, "a")->bandwidth_bytes_per_s(), 0);
  EXPECT_EQ(Find(r, "a")->probe_bytes(), 3 * LinkProber::kPingBytes);
  EXPECT_THAT(Find(r, "slow")->error(), HasSubstr("no answer to a ping"));
  EXPECT_EQ(last_config_.direct_connections, 1);
}

// Workers get the coordinator's request at slightly different times: a peer
// that refuses the first pings because its own request has not come yet is
// pinged again, and the link is measured.
TEST_F(LinkProberTest, APeerAskedLaterIsPingedAgain) {
  FakeLink late{0.003, 1e9, 0, false};
  late.refuse = 3;
  Make({{"late", late}, {"down", {0.01, 1e6, 0, true}}});
  prober_->OnProbe(Probe({"late", "down"}, 0, 4000));
  const v1::LinkReport r = AwaitReport();
  ASSERT_EQ(r.links_size(), 2);
  EXPECT_TRUE(Find(r, "late")->error().empty()) << Find(r, "late")->error();
  EXPECT_NEAR(Find(r, "late")->rtt_seconds(), 0.003, 1e-6);
  EXPECT_EQ(Find(r, "late")->probe_bytes(), (3 + 3) * LinkProber::kPingBytes);
  // A link that never answers is retried only within the round's first
  // quarter (here 1 s), then reported with its error.
  EXPECT_THAT(Find(r, "down")->error(), HasSubstr("connection refused"));
  EXPECT_LT(r.seconds(), 3.0);
}

TEST_F(LinkProberTest, RefusesRequestsOutOfBounds) {
  v1::LinkProbe p;
  p.set_job_id("j");
  p.set_pings(3);
  p.set_budget_ms(1000);
  EXPECT_TRUE(LinkProber::Validate(p).ok());
  v1::LinkProbe q = p;
  q.set_pings(0);
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("pings 0"));
  q = p;
  q.set_bulk_max_bytes(LinkProber::kMaxProbeBytes + 1);
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("bulk_max_bytes"));
  q = p;
  q.set_budget_ms(0);
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("budget_ms"));
  q = p;
  q.clear_job_id();
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("job_id"));
  q = p;
  q.add_peers()->set_worker_id("x");
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("without id or address"));
}

// A round's bulk budget is shared by need (1 s + 60 round trips a link), the
// measure the coordinator sized it by: a 300 ms link is not left the crumbs
// of an even split after the links before it took theirs.
TEST_F(LinkProberTest, BulkSharesFollowEachLinksNeed) {
  using Rtts = std::vector<std::optional<double>>;
  const absl::Duration left = absl::Milliseconds(39120);  // what the three need
  // 2 ms within a region (1.12 s), two 300 ms links (19 s each).
  EXPECT_NEAR(absl::ToDoubleSeconds(LinkProber::BulkShare(left, {0.002, 0.3, 0.3})), 1.12, 1e-9);
  EXPECT_NEAR(absl::ToDoubleSeconds(LinkProber::BulkShare(left, {0.3, 0.002, 0.3})), 19.0, 1e-9);
  // Unspent time goes to the links after: the last one gets all that is left.
  EXPECT_EQ(LinkProber::BulkShare(absl::Seconds(25), {0.3}), absl::Seconds(25));
  // Equal links split evenly; a link that did not answer needs the base.
  EXPECT_EQ(LinkProber::BulkShare(absl::Seconds(9), {0.1, 0.1, 0.1}), absl::Seconds(3));
  const Rtts unanswered_first = {std::nullopt, 0.05};  // needs 1 s of 1 + 4 s
  EXPECT_NEAR(absl::ToDoubleSeconds(LinkProber::BulkShare(absl::Seconds(8), unanswered_first)), 1.6,
              1e-9);
  EXPECT_EQ(LinkProber::BulkShare(absl::ZeroDuration(), {0.1}), absl::ZeroDuration());
  EXPECT_EQ(LinkProber::BulkShare(absl::Seconds(1), {}), absl::ZeroDuration());
}

// Probes are taken only from the peers of the newest round of the same job,
// within the size and memory bounds; their memory is given back when the
// buffer goes.
TEST_F(LinkProberTest, TakesProbesOnlyFromPeersOfItsRoundWithinBounds) {
  Make({});
  v1::FrameHeader h;
  h.set_job_id("j1");
  h.set_sender("p1");
  h.set_direction(v1::DIRECTION_PROBE);
  h.set_dtype(v1::DTYPE_BYTES);
  h.set_total_bytes(1 << 20);
  auto before = prober_->Allocate(h);
  EXPECT_EQ(before.status().code(), absl::StatusCode::kPermissionDenied);
  prober_->OnProbe(Probe({"p1"}, 0, 1000));
  auto ok = prober_->Allocate(h);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->bytes, uint64_t{1} << 20);
  v1::FrameHeader other = h;
  other.set_sender("p2");
  EXPECT_EQ(prober_->Allocate(other).status().code(), absl::StatusCode::kPermissionDenied);
  other = h;
  other.set_job_id("j2");
  EXPECT_EQ(prober_->Allocate(other).status().code(), absl::StatusCode::kPermissionDenied);
  v1::FrameHeader big = h;
  big.set_total_bytes(LinkProber::kMaxProbeBytes + 1);
  EXPECT_EQ(prober_->Allocate(big).status().code(), absl::StatusCode::kInvalidArgument);
  // kMaxHeldProbeBytes / kMaxProbeBytes buffers at most, held at once.
  v1::FrameHeader full = h;
  full.set_total_bytes(LinkProber::kMaxProbeBytes);
  std::vector<MutableBuffer> held;
  for (uint64_t i = 0; i < LinkProber::kMaxHeldProbeBytes / LinkProber::kMaxProbeBytes - 1; ++i) {
    auto b = prober_->Allocate(full);
    ASSERT_TRUE(b.ok()) << b.status();
    held.push_back(*std::move(b));
  }
  EXPECT_EQ(prober_->Allocate(full).status().code(), absl::StatusCode::kResourceExhausted);
  held.clear();
  *ok = MutableBuffer();
  EXPECT_TRUE(prober_->Allocate(full).ok());
  AwaitReport();  // the round with p1 (which the fake cannot reach)

  // A bulk round of the start: this worker probes p3 and takes p2's probes
  // (accept_from), no longer p1's.
  v1::LinkProbe slot = Probe({"p3"}, 0, 1000);
  slot.add_accept_from("p2");
  prober_->OnProbe(slot);
  other = h;
  other.set_sender("p2");
  EXPECT_TRUE(prober_->Allocate(other).ok());
  EXPECT_EQ(prober_->Allocate(h).status().code(), absl::StatusCode::kPermissionDenied);
  AwaitReport();
}

TEST_F(LinkProberTest, RefusesAcceptListsOutOfBounds) {
  v1::LinkProbe p;
  p.set_job_id("j");
  p.set_pings(3);
  p.set_budget_ms(1000);
  p.add_accept_from("w2");
  EXPECT_TRUE(LinkProber::Validate(p).ok());
  v1::LinkProbe q = p;
  q.add_accept_from("");
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("an id of 0 bytes"));
  q = p;
  q.add_accept_from(std::string(LinkProber::kMaxWorkerIdBytes + 1, 'w'));
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("a worker to accept"));
  q = p;
  for (int i = 0; i < LinkProber::kMaxPeers; ++i) q.add_accept_from("w");
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("workers to accept"));
}

// The links the coordinator expects of this worker are checked against the
// socket-buffer limits: one that no number of connections can carry at its
// expected rate is named with the setting to raise; one the connections
// carry, or an unknown one, is not. Expected figures are bounded.
TEST_F(LinkProberTest, ExpectedLinksTheSocketLimitsCapAreNamed) {
  v1::LinkProbe p;
  p.set_job_id("j");
  p.set_pings(3);
  p.set_budget_ms(1000);
  auto expect = [&p](const std::string& peer, double rtt_s, double rate) {
    v1::LinkExpectation* e = p.add_expected();
    e->set_peer(peer);
    e->set_rtt_s(rtt_s);
    e->set_bandwidth_bytes_per_s(rate);
  };
  expect("far", 0.3, 1.16e9);   // needs 16 x 44 MB of window: capped
  expect("near", 0.02, 100e6);  // 1.5 x 2 MB: one 4 MiB buffer carries it
  expect("unknown", 0, 0);
  ASSERT_TRUE(LinkProber::Validate(p).ok());
  TcpLimits debian;  // the kernel's defaults: wmem_max 208 KiB, tcp_wmem max 4 MiB
  const auto capped = LinkProber::CappedLinks(p, debian);
  ASSERT_FALSE(capped.empty());
  for (const auto& [peer, line] : capped) {
    EXPECT_EQ(peer, "far");
    EXPECT_THAT(line, HasSubstr("link to far: "));
    EXPECT_THAT(line, HasSubstr("caps one connection"));
    EXPECT_THAT(line, HasSubstr("even 16 connections carry only"));
  }
  // Limits raised far enough: nothing to say.
  TcpLimits raised;
  raised.wmem_max = raised.rmem_max = int64_t{1} << 30;
  raised.tcp_wmem[2] = raised.tcp_rmem[2] = int64_t{1} << 30;
  EXPECT_TRUE(LinkProber::CappedLinks(p, raised).empty());
  // Bounds.
  v1::LinkProbe q = p;
  q.mutable_expected(0)->set_rtt_s(61);
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("expected round trip 61"));
  q = p;
  q.mutable_expected(0)->set_bandwidth_bytes_per_s(std::nan(""));
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("expected bandwidth"));
  q = p;
  q.mutable_expected(0)->set_rtt_s(-1);
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("not in [0, 60]"));
  q = p;
  q.mutable_expected(0)->clear_peer();
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("peer id of 0 bytes"));
  q = p;
  for (int i = 0; i < LinkProber::kMaxPeers; ++i) q.add_expected()->set_peer("w");
  EXPECT_THAT(LinkProber::Validate(q).message(), HasSubstr("expected links"));
}

}  // namespace
}  // namespace detour
