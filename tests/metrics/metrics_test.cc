#include "common/metrics/metrics.h"

#include <cstdlib>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Unwraps a StatusOr in a test, failing loudly.
template <typename T>
T Must(absl::StatusOr<T> value) {
  EXPECT_TRUE(value.ok()) << value.status();
  if (!value.ok()) std::abort();
  return *std::move(value);
}

TEST(MetricsRegistryTest, CounterTextIsExactAndSortedByLabelValues) {
  Registry registry;
  CounterFamily* requests =
      Must(registry.AddCounter("detour_requests", "Requests served.", {"method", "code"}));
  // Created out of order: the text is sorted by label values.
  ASSERT_TRUE(Must(requests->WithLabels({"POST", "500"}))->IncrementBy(2.5).ok());
  Counter* get_ok = Must(requests->WithLabels({"GET", "200"}));
  get_ok->Increment();
  get_ok->Increment();
  get_ok->Increment();
  Must(requests->WithLabels({"GET", "404"}));

  EXPECT_EQ(registry.Serialize(),
            "# HELP detour_requests_total Requests served.\n"
            "# TYPE detour_requests_total counter\n"
            "detour_requests_total{method=\"GET\",code=\"200\"} 3\n"
            "detour_requests_total{method=\"GET\",code=\"404\"} 0\n"
            "detour_requests_total{method=\"POST\",code=\"500\"} 2.5\n");
}

TEST(MetricsRegistryTest, CounterNameAlreadyEndingInTotalIsKept) {
  Registry registry;
  CounterFamily* family = Must(registry.AddCounter("detour_bytes_sent_total", "Bytes sent."));
  EXPECT_EQ(family->name(), "detour_bytes_sent_total");
  ASSERT_TRUE(Must(family->WithLabels({}))->IncrementBy(1024).ok());
  EXPECT_EQ(registry.Serialize(),
            "# HELP detour_bytes_sent_total Bytes sent.\n"
            "# TYPE detour_bytes_sent_total counter\n"
            "detour_bytes_sent_total 1024\n");
}

TEST(MetricsRegistryTest, GaugeTextIsExact) {
  Registry registry;
  Gauge* depth =
      Must(Must(registry.AddGauge("detour_queue_depth", "Frames waiting."))->WithLabels({}));
  depth->Set(10);
  depth->Increment();
  depth->Decrement(12.5);
  GaugeFamily* temps =
      Must(registry.AddGauge("detour_gpu_temperature_celsius", "GPU temperature.", {"gpu"}));
  Must(temps->WithLabels({"1"}))->Set(-std::numeric_limits<double>::infinity());
  Must(temps->WithLabels({"0"}))->Set(std::numeric_limits<double>::infinity());
  Must(temps->WithLabels({"2"}))->Set(std::numeric_limits<double>::quiet_NaN());

  EXPECT_EQ(registry.Serialize(),
            "# HELP detour_gpu_temperature_celsius GPU temperature.\n"
            "# TYPE detour_gpu_temperature_celsius gauge\n"
            "detour_gpu_temperature_celsius{gpu=\"0\"} +Inf\n"
            "detour_gpu_temperature_celsius{gpu=\"1\"} -Inf\n"
            "detour_gpu_temperature_celsius{gpu=\"2\"} NaN\n"
            "# HELP detour_queue_depth Frames waiting.\n"
            "# TYPE detour_queue_depth gauge\n"
            "detour_queue_depth -1.5\n");
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulativeWithInf) {
  Registry registry;
  HistogramFamily* family =
      Must(registry.AddHistogram("detour_step_seconds", "Step time.", {0.125, 1, 10}, {"stage"}));
  Histogram* stage0 = Must(family->WithLabels({"0"}));
  stage0->Observe(0.0625);
  stage0->Observe(0.125);  // on the bound: counts in le="0.125"
  stage0->Observe(0.5);
  stage0->Observe(100);
  stage0->Observe(std::numeric_limits<double>::quiet_NaN());  // dropped
  Must(family->WithLabels({"1"}));

  EXPECT_EQ(registry.Serialize(),
            "# HELP detour_step_seconds Step time.\n"
            "# TYPE detour_step_seconds histogram\n"
            "detour_step_seconds_bucket{stage=\"0\",le=\"0.125\"} 2\n"
            "detour_step_seconds_bucket{stage=\"0\",le=\"1\"} 3\n"
            "detour_step_seconds_bucket{stage=\"0\",le=\"10\"} 3\n"
            "detour_step_seconds_bucket{stage=\"0\",le=\"+Inf\"} 4\n"
            "detour_step_seconds_sum{stage=\"0\"} 100.6875\n"
            "detour_step_seconds_count{stage=\"0\"} 4\n"
            "detour_step_seconds_bucket{stage=\"1\",le=\"0.125\"} 0\n"
            "detour_step_seconds_bucket{stage=\"1\",le=\"1\"} 0\n"
            "detour_step_seconds_bucket{stage=\"1\",le=\"10\"} 0\n"
            "detour_step_seconds_bucket{stage=\"1\",le=\"+Inf\"} 0\n"
            "detour_step_seconds_sum{stage=\"1\"} 0\n"
            "detour_step_seconds_count{stage=\"1\"} 0\n");
}

TEST(MetricsRegistryTest, UnlabelledHistogramWithoutBoundsHasOnlyInf) {
  Registry registry;
  Histogram* h = Must(Must(registry.AddHistogram("x", "h", {}))->WithLabels({}));
  h->Observe(-3);
  EXPECT_EQ(registry.Serialize(),
            "# HELP x h\n# TYPE x histogram\n"
            "x_bucket{le=\"+Inf\"} 1\nx_sum -3\nx_count 1\n");
}

TEST(MetricsRegistryTest, FamiliesAreSortedByName) {
  Registry registry;
  Must(registry.AddGauge("b", "B"));
  Must(registry.AddGauge("a", "A"));
  Must(registry.AddCounter("c", "C"));
  EXPECT_EQ(registry.Serialize(),
            "# HELP a A\n# TYPE a gauge\na 0\n"
            "# HELP b B\n# TYPE b gauge\nb 0\n"
            "# HELP c_total C\n# TYPE c_total counter\nc_total 0\n");
}

TEST(MetricsRegistryTest, LabelledFamilyWithoutChildrenIsNotExposed) {
  Registry registry;
  Must(registry.AddCounter("detour_errors", "Errors.", {"kind"}));
  EXPECT_EQ(registry.Serialize(), "");
}

TEST(MetricsRegistryTest, EscapesLabelValues) {
  Registry registry;
  GaugeFamily* family = Must(registry.AddGauge("g", "G", {"path"}));
  Must(family->WithLabels({"C:\\dir \"quoted\"\nnext"}))->Set(1);
  EXPECT_EQ(registry.Serialize(),
            "# HELP g G\n# TYPE g gauge\n"
            "g{path=\"C:\\\\dir \\\"quoted\\\"\\nnext\"} 1\n");
}

TEST(MetricsRegistryTest, EscapesHelp) {
  Registry registry;
  Must(registry.AddGauge("g", "first line\nback\\slash \"kept\""));
  EXPECT_EQ(registry.Serialize(),
            "# HELP g first line\\nback\\\\slash \"kept\"\n"
            "# TYPE g gauge\ng 0\n");
}

TEST(MetricsRegistryTest, SameLabelsReturnTheSameChild) {
  Registry registry;
  CounterFamily* family = Must(registry.AddCounter("c", "C", {"a", "b"}));
  Counter* first = Must(family->WithLabels({"x", "y"}));
  Counter* again = Must(family->WithLabels({"x", "y"}));
  Counter* other = Must(family->WithLabels({"y", "x"}));
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
  first->Increment();
  EXPECT_EQ(again->Value(), 1);
  EXPECT_EQ(other->Value(), 0);
}

TEST(MetricsRegistryTest, SameFamilyTwiceReturnsTheSameFamily) {
  Registry registry;
  CounterFamily* first = Must(registry.AddCounter("c", "C", {"a"}));
  EXPECT_EQ(Must(registry.AddCounter("c", "C", {"a"})), first);
  EXPECT_EQ(Must(registry.AddCounter("c_total", "C", {"a"})), first);
  HistogramFamily* h = Must(registry.AddHistogram("h", "H", {1, 2}));
  EXPECT_EQ(Must(registry.AddHistogram("h", "H", {1, 2})), h);
}

TEST(MetricsRegistryTest, RejectsInvalidMetricNames) {
  Registry registry;
  for (const char* name : {"", "1abc", "a-b", "a b", "caf\xc3\xa9", "a.b"}) {
    absl::StatusOr<GaugeFamily*> family = registry.AddGauge(name, "help");
    ASSERT_FALSE(family.ok()) << name;
    EXPECT_EQ(family.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(family.status().message(), HasSubstr("metric name")) << name;
  }
  EXPECT_TRUE(registry.AddGauge("a:b_c9", "help").ok());
  EXPECT_TRUE(registry.AddGauge("_x", "help").ok());
  EXPECT_TRUE(registry.AddGauge(":x", "help").ok());
}

TEST(MetricsRegistryTest, RejectsInvalidLabelNames) {
  Registry registry;
  for (const char* label : {"", "__reserved", "1a", "a-b", "a:b"}) {
    absl::StatusOr<CounterFamily*> family = registry.AddCounter("c", "help", {label});
    ASSERT_FALSE(family.ok()) << label;
    EXPECT_EQ(family.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(family.status().message(), HasSubstr("label name")) << label;
  }
  absl::StatusOr<CounterFamily*> duplicate = registry.AddCounter("c", "help", {"a", "a"});
  ASSERT_FALSE(duplicate.ok());
  EXPECT_THAT(duplicate.status().message(), HasSubstr("appears twice"));

  absl::StatusOr<HistogramFamily*> le = registry.AddHistogram("h", "help", {1}, {"le"});
  ASSERT_FALSE(le.ok());
  EXPECT_EQ(le.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(le.status().message(), HasSubstr("\"le\" is reserved"));
  // Outside histograms "le" is an ordinary label.
  EXPECT_TRUE(registry.AddGauge("g", "help", {"le"}).ok());
  // Nothing half-registered by the failures above.
  EXPECT_TRUE(registry.AddCounter("c", "help", {"ok"}).ok());
}

TEST(MetricsRegistryTest, RejectsWrongLabelCount) {
  Registry registry;
  CounterFamily* family = Must(registry.AddCounter("c", "help", {"a", "b"}));
  absl::StatusOr<Counter*> child = family->WithLabels({"only one"});
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(child.status().message(),
            "metric c_total has 2 label(s) (a, b) but 1 value(s) were given");
  EXPECT_FALSE(family->WithLabels({"1", "2", "3"}).ok());
}

TEST(MetricsRegistryTest, RejectsInvalidUtf8LabelValue) {
  Registry registry;
  GaugeFamily* family = Must(registry.AddGauge("g", "help", {"a"}));
  absl::StatusOr<Gauge*> child = family->WithLabels({"bad \xff byte"});
  ASSERT_FALSE(child.ok());
  EXPECT_THAT(child.status().message(), HasSubstr("not valid UTF-8"));
  EXPECT_TRUE(family->WithLabels({"gr\xc3\xbc\xc3\x9f"}).ok());
}

TEST(MetricsRegistryTest, RejectsBadBuckets) {
  Registry registry;
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const std::vector<double>& bounds :
       std::vector<std::vector<double>>{{1, 1}, {2, 1}, {1, inf}, {nan}, {-inf, 0}}) {
    absl::StatusOr<HistogramFamily*> family = registry.AddHistogram("h", "help", bounds);
    ASSERT_FALSE(family.ok());
    EXPECT_EQ(family.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(family.status().message(), HasSubstr("histogram h"));
  }
  EXPECT_FALSE(ExponentialBuckets(0, 2, 3).ok());
  EXPECT_FALSE(ExponentialBuckets(1, 1, 3).ok());
  EXPECT_FALSE(LinearBuckets(0, 0, 3).ok());
  EXPECT_EQ(Must(ExponentialBuckets(1, 2, 4)), (std::vector<double>{1, 2, 4, 8}));
  EXPECT_EQ(Must(LinearBuckets(-1, 0.5, 3)), (std::vector<double>{-1, -0.5, 0}));
  EXPECT_TRUE(ValidateBucketBounds(DefaultLatencyBuckets()).ok());
}

TEST(MetricsRegistryTest, RejectsConflictingRegistrations) {
  Registry registry;
  Must(registry.AddCounter("x", "help", {"a"}));

  absl::StatusOr<GaugeFamily*> as_gauge = registry.AddGauge("x_total", "help");
  ASSERT_FALSE(as_gauge.ok());
  EXPECT_EQ(as_gauge.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(as_gauge.status().message(),
            "metric x_total is already registered as a counter; cannot "
            "register it as a gauge");

  absl::StatusOr<CounterFamily*> other_labels = registry.AddCounter("x", "help", {"b"});
  ASSERT_FALSE(other_labels.ok());
  EXPECT_EQ(other_labels.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(other_labels.status().message(), HasSubstr("labels (a)"));

  Must(registry.AddHistogram("h", "help", {1}));
  EXPECT_EQ(registry.AddHistogram("h", "help", {2}).status().code(),
            absl::StatusCode::kAlreadyExists);
  // A gauge may not take a name the histogram writes samples under.
  absl::StatusOr<GaugeFamily*> shadow = registry.AddGauge("h_sum", "help");
  ASSERT_FALSE(shadow.ok());
  EXPECT_EQ(shadow.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(shadow.status().message(), HasSubstr("used by metric h"));
  // ... nor the other way round.
  Must(registry.AddGauge("k_count", "help"));
  EXPECT_EQ(registry.AddHistogram("k", "help", {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(MetricsRegistryTest, CounterRejectsNegativeAndNaNIncrements) {
  Registry registry;
  Counter* counter = Must(Must(registry.AddCounter("c", "help"))->WithLabels({}));
  ASSERT_TRUE(counter->IncrementBy(2).ok());
  absl::Status negative = counter->IncrementBy(-1);
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.message(), HasSubstr("only go up"));
  EXPECT_FALSE(counter->IncrementBy(std::numeric_limits<double>::quiet_NaN()).ok());
  EXPECT_EQ(counter->Value(), 2);
}

TEST(MetricsRegistryTest, MaxSeriesBoundsLabelValues) {
  Registry registry;
  CounterFamily* family = Must(registry.AddCounter("c", "help", {"id"}, 2));
  Must(family->WithLabels({"1"}));
  Must(family->WithLabels({"2"}));
  absl::StatusOr<Counter*> third = family->WithLabels({"3"});
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(family->WithLabels({"1"}).ok());  // existing ones still work
}

TEST(MetricsRegistryTest, RemovedSeriesLeaveTheExpositionAndFreeTheirSlot) {
  Registry registry;
  GaugeFamily* family = Must(registry.AddGauge("g", "help", {"job_id"}, 2));
  Must(family->WithLabels({"a"}))->Set(1);
  Must(family->WithLabels({"b"}))->Set(2);
  EXPECT_EQ(family->size(), 2u);
  ASSERT_TRUE(family->Remove({"a"}).ok());
  EXPECT_EQ(family->size(), 1u);
  EXPECT_EQ(registry.Serialize(), "# HELP g help\n# TYPE g gauge\ng{job_id=\"b\"} 2\n");
  // The slot is free again for a new value, and "a" comes back at 0.
  EXPECT_TRUE(family->WithLabels({"c"}).ok());
  EXPECT_FALSE(family->WithLabels({"a"}).ok());  // limit 2: b and c
  ASSERT_TRUE(family->Remove({"c"}).ok());
  EXPECT_EQ(Must(family->WithLabels({"a"}))->Value(), 0);

  const absl::Status missing = family->Remove({"zzz"});
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("zzz"));
  CounterFamily* plain = Must(registry.AddCounter("plain", "help"));
  EXPECT_EQ(plain->Remove({}).code(), absl::StatusCode::kFailedPrecondition);
  // Removing every child hides the family, as before its first child.
  ASSERT_TRUE(family->Remove({"a"}).ok());
  ASSERT_TRUE(family->Remove({"b"}).ok());
  EXPECT_THAT(registry.Serialize(), Not(HasSubstr("# TYPE g ")));
}

TEST(MetricsRegistryTest, CallbackMetricsAreEvaluatedAtScrape) {
  Registry registry;
  double queued = 3;
  ASSERT_TRUE(
      registry
          .AddCallbackGauge("detour_outbox_frames", "Frames queued.", [&queued] { return queued; })
          .ok());
  ASSERT_TRUE(registry.AddCallbackCounter("detour_ticks", "Ticks.", [] { return 7.0; }).ok());
  EXPECT_EQ(registry.Serialize(),
            "# HELP detour_outbox_frames Frames queued.\n"
            "# TYPE detour_outbox_frames gauge\n"
            "detour_outbox_frames 3\n"
            "# HELP detour_ticks_total Ticks.\n"
            "# TYPE detour_ticks_total counter\n"
            "detour_ticks_total 7\n");
  queued = 5;
  EXPECT_THAT(registry.Serialize(), HasSubstr("detour_outbox_frames 5\n"));

  EXPECT_EQ(registry.AddCallbackGauge("detour_outbox_frames", "x", [] { return 1.0; }).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddGauge("detour_outbox_frames", "x").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddCallbackGauge("g", "x", nullptr).code(),
            absl::StatusCode::kInvalidArgument);

  ASSERT_TRUE(registry.RemoveCallback("detour_outbox_frames").ok());
  EXPECT_EQ(registry.RemoveCallback("detour_outbox_frames").code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(absl::StrContains(registry.Serialize(), "outbox"));
  Must(registry.AddGauge("plain", "x"));
  EXPECT_EQ(registry.RemoveCallback("plain").code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MetricsRegistryTest, ConcurrentUpdatesSumExactly) {
  Registry registry;
  CounterFamily* counters = Must(registry.AddCounter("c", "help", {"k"}));
  GaugeFamily* gauges = Must(registry.AddGauge("g", "help", {"k"}));
  HistogramFamily* histograms = Must(registry.AddHistogram("h", "help", {0.5, 1.5}, {"k"}));
  constexpr int kThreads = 8;
  constexpr int kIterations = 50000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Every thread resolves the children itself, racing on creation.
      Counter* counter = Must(counters->WithLabels({"shared"}));
      Gauge* gauge = Must(gauges->WithLabels({"shared"}));
      Histogram* histogram = Must(histograms->WithLabels({"shared"}));
      for (int i = 0; i < kIterations; ++i) {
        counter->Increment();
        gauge->Increment(2);
        gauge->Decrement();
        histogram->Observe(i % 2);  // 0 and 1 alternately
        if (i % 10000 == 0) {
          Must(counters->WithLabels({"thread" + std::to_string(t)}))->Increment();
          registry.Serialize();  // readers run alongside writers
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  constexpr double kTotal = static_cast<double>(kThreads) * kIterations;
  EXPECT_EQ(Must(counters->WithLabels({"shared"}))->Value(), kTotal);
  EXPECT_EQ(Must(gauges->WithLabels({"shared"}))->Value(), kTotal);
  Histogram::Snapshot snapshot = Must(histograms->WithLabels({"shared"}))->GetSnapshot();
  EXPECT_EQ(snapshot.count, kThreads * kIterations);
  EXPECT_EQ(snapshot.cumulative_counts,
            (std::vector<uint64_t>{kThreads * kIterations / 2, kThreads * kIterations,
                                   kThreads * kIterations}));
  EXPECT_EQ(snapshot.sum, kTotal / 2);
  EXPECT_EQ(Must(counters->WithLabels({"thread0"}))->Value(), kIterations / 10000);
}

}  // namespace
}  // namespace detour::metrics
