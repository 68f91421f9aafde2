#include "tools/detour_wanem/link.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace detour::wanem {
namespace {

constexpr int64_t kMs = 1000000;
constexpr int64_t kFloor = 64 * 1024;

Link MakeLink(const LinkParams& p, uint64_t seed = 7) {
  Link link(seed, kFloor);
  link.SetParams(p);
  return link;
}

TEST(WanLinkTest, UnlimitedRateAddsOnlyTheDelay) {
  LinkParams p;
  p.delay_ms = 20;
  Link link = MakeLink(p);
  for (int i = 0; i < 5; ++i) {
    const Link::Verdict v = link.Admit(i * kMs, 1500);
    ASSERT_EQ(v.outcome, Link::Outcome::kForward);
    EXPECT_EQ(v.release_ns, i * kMs + 20 * kMs);
  }
  EXPECT_EQ(link.stats().admitted_packets, 5u);
  EXPECT_EQ(link.stats().admitted_bytes, 5u * 1500);
}

TEST(WanLinkTest, RateSerializesPacketsBackToBack) {
  LinkParams p;
  p.rate_bytes_per_s = 1e6;  // 1000 bytes take 1 ms
  p.delay_ms = 5;
  Link link = MakeLink(p);
  // Four packets at once leave one serialization time apart.
  for (int i = 0; i < 4; ++i) {
    const Link::Verdict v = link.Admit(0, 1000);
    ASSERT_EQ(v.outcome, Link::Outcome::kForward);
    EXPECT_EQ(v.release_ns, (i + 1) * kMs + 5 * kMs) << "packet " << i;
  }
  EXPECT_EQ(link.BacklogBytes(0), 4000);
  EXPECT_EQ(link.BacklogBytes(3 * kMs), 1000);
  // An idle link starts at the arrival, not where it last stopped.
  const Link::Verdict late = link.Admit(100 * kMs, 500);
  EXPECT_EQ(late.release_ns, 100 * kMs + kMs / 2 + 5 * kMs);
}

TEST(WanLinkTest, QueueDropsTailBeyondItsLimit) {
  LinkParams p;
  p.rate_bytes_per_s = 1e6;
  p.queue_bytes = 5000;
  Link link = MakeLink(p);
  int forwarded = 0;
  for (int i = 0; i < 10; ++i) {
    if (link.Admit(0, 1000).outcome == Link::Outcome::kForward) ++forwarded;
  }
  EXPECT_EQ(forwarded, 5);
  EXPECT_EQ(link.stats().dropped_queue, 5u);
  // Two milliseconds drain two packets' worth: two more fit, the third not.
  EXPECT_EQ(link.Admit(2 * kMs, 1000).outcome, Link::Outcome::kForward);
  EXPECT_EQ(link.Admit(2 * kMs, 1000).outcome, Link::Outcome::kForward);
  EXPECT_EQ(link.Admit(2 * kMs, 1000).outcome, Link::Outcome::kDropQueue);
}

TEST(WanLinkTest, AutomaticQueueIsTheRoundTripBdpWithAFloor) {
  LinkParams p;
  p.rate_bytes_per_s = 1e6;
  p.delay_ms = 50;  // BDP over the 100 ms round trip: 100000 bytes
  EXPECT_EQ(MakeLink(p).QueueLimitBytes(), 100000);
  p.delay_ms = 1;  // 2000 bytes: the floor wins
  EXPECT_EQ(MakeLink(p).QueueLimitBytes(), kFloor);
  p.queue_bytes = 3000;  // explicit wins
  EXPECT_EQ(MakeLink(p).QueueLimitBytes(), 3000);
}

TEST(WanLinkTest, JitterStaysWithinItsBoundsAndKeepsOrder) {
  LinkParams p;
  p.delay_ms = 10;
  p.jitter_ms = 5;
  Link link = MakeLink(p);
  int64_t previous = 0;
  for (int i = 0; i < 2000; ++i) {
    const int64_t now = i * kMs / 10;
    const int64_t release = link.Admit(now, 100).release_ns;
    ASSERT_GE(release, now + 10 * kMs);
    ASSERT_LE(release, now + 15 * kMs);
    ASSERT_GE(release, previous) << "packet " << i << " overtook its predecessor";
    previous = release;
  }
  // Packets further apart than the jitter are not held back by the order
  // rule, so their delays show the draws: spread over the whole interval.
  int64_t lowest = INT64_MAX, highest = 0;
  for (int i = 0; i < 200; ++i) {
    const int64_t now = 1000 * kMs + i * 20 * kMs;
    const int64_t delay = link.Admit(now, 100).release_ns - now;
    lowest = std::min(lowest, delay);
    highest = std::max(highest, delay);
  }
  EXPECT_GE(lowest, 10 * kMs);
  EXPECT_LT(lowest, 10 * kMs + kMs / 2);
  EXPECT_GT(highest, 15 * kMs - kMs / 2);
  EXPECT_LE(highest, 15 * kMs);
}

TEST(WanLinkTest, JitterReordersOnlyWhenAllowed) {
  LinkParams p;
  p.delay_ms = 10;
  p.jitter_ms = 5;
  p.reorder = true;
  Link link = MakeLink(p);
  int overtaken = 0;
  int64_t previous = 0;
  for (int i = 0; i < 1000; ++i) {
    const int64_t release = link.Admit(i * kMs / 10, 100).release_ns;
    if (release < previous) ++overtaken;
    previous = release;
  }
  EXPECT_GT(overtaken, 100);
}

TEST(WanLinkTest, LossRateMatchesWithinToleranceAndIsDeterministic) {
  LinkParams p;
  p.loss = 0.1;
  Link a = MakeLink(p, 42), b = MakeLink(p, 42), c = MakeLink(p, 43);
  std::vector<bool> fate_a, fate_c;
  int lost = 0;
  for (int i = 0; i < 100000; ++i) {
    const bool la = a.Admit(i, 100).outcome == Link::Outcome::kDropLoss;
    const bool lb = b.Admit(i, 100).outcome == Link::Outcome::kDropLoss;
    ASSERT_EQ(la, lb) << "same seed, packet " << i;
    fate_a.push_back(la);
    fate_c.push_back(c.Admit(i, 100).outcome == Link::Outcome::kDropLoss);
    lost += la;
  }
  // Binomial(100000, 0.1): sd 95 packets; 5 sd either side.
  EXPECT_NEAR(lost, 10000, 500);
  EXPECT_EQ(a.stats().dropped_loss, static_cast<uint64_t>(lost));
  EXPECT_NE(fate_a, fate_c) << "another seed gave the same losses";
}

TEST(WanLinkTest, LostPacketStillOccupiesTheLink) {
  LinkParams p;
  p.rate_bytes_per_s = 1e6;
  p.loss = 1;
  Link link = MakeLink(p);
  EXPECT_EQ(link.Admit(0, 1000).outcome, Link::Outcome::kDropLoss);
  p.loss = 0;
  link.SetParams(p);
  EXPECT_EQ(link.Admit(0, 1000).release_ns, 2 * kMs);
}

TEST(WanLinkTest, CutDropsEverythingUntilRestored) {
  LinkParams p;
  p.delay_ms = 1;
  Link link = MakeLink(p);
  p.cut = true;
  link.SetParams(p);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(link.Admit(i, 100).outcome, Link::Outcome::kDropCut);
  EXPECT_EQ(link.stats().dropped_cut, 3u);
  EXPECT_EQ(link.stats().admitted_packets, 0u);
  p.cut = false;
  link.SetParams(p);
  EXPECT_EQ(link.Admit(10, 100).outcome, Link::Outcome::kForward);
}

TEST(WanLinkTest, LoweringTheDelayKeepsPacketsInOrder) {
  LinkParams p;
  p.delay_ms = 100;
  Link link = MakeLink(p);
  const int64_t first = link.Admit(0, 100).release_ns;
  p.delay_ms = 1;
  link.SetParams(p);
  EXPECT_EQ(link.Admit(kMs, 100).release_ns, first);
}

}  // namespace
}  // namespace detour::wanem
