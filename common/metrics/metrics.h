// A small Prometheus client library in the spirit of prometheus-cpp:
// Registry -> Family -> cached labelled child. The registry renders every
// family in the Prometheus text exposition format 0.0.4 (see Serialize()).
//
//   metrics::Registry registry;
//   ASSIGN_OR_RETURN(metrics::CounterFamily* requests,
//                    registry.AddCounter("detour_requests", "Requests served.",
//                                        {"method", "code"}));
//   ASSIGN_OR_RETURN(metrics::Counter* ok, requests->WithLabels({"GET", "200"}));
//   ok->Increment();  // hot path: one atomic operation
//
// Families and children are owned by the registry and live exactly as long as
// it does; the pointers handed out stay valid (and stable) until then, unless
// their owner removes the child (Family::Remove).
#ifndef DETOUR_COMMON_METRICS_METRICS_H_
#define DETOUR_COMMON_METRICS_METRICS_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace detour::metrics {

template <typename T>
class Family;

// What a family is, as written on its `# TYPE` line.
enum class MetricType { kCounter, kGauge, kHistogram };

// "counter", "gauge" or "histogram".
absl::string_view MetricTypeName(MetricType type);

// A monotonically increasing value (requests served, bytes sent). Thread-safe
// and lock-free. Obtained from a CounterFamily, which owns it.
class Counter {
 public:
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  // Adds one.
  void Increment() { Add(1.0); }
  // Adds `delta`. A negative or NaN delta would break monotonicity: it is
  // refused with INVALID_ARGUMENT and the value is left unchanged.
  absl::Status IncrementBy(double delta);

  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  template <typename T>
  friend class Family;
  Counter() = default;
  void Add(double delta);

  std::atomic<double> value_{0.0};
};

// A value that goes up and down (queue depth, memory in use). Thread-safe and
// lock-free. Obtained from a GaugeFamily, which owns it.
class Gauge {
 public:
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double delta = 1.0);
  void Decrement(double delta = 1.0) { Increment(-delta); }
  // Sets the gauge to the current Unix time in seconds.
  void SetToCurrentTime();

  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  template <typename T>
  friend class Family;
  Gauge() = default;

  std::atomic<double> value_{0.0};
};

// Counts observations into buckets with fixed upper bounds (`le`), plus their
// sum. Thread-safe and lock-free: one atomic add per bucket count, one CAS
// loop for the sum. Obtained from a HistogramFamily, which owns it.
class Histogram {
 public:
  // Cumulative view of one histogram, as exposed.
  struct Snapshot {
    std::vector<double> upper_bounds;         // finite bounds, increasing
    std::vector<uint64_t> cumulative_counts;  // one per bound, then +Inf
    double sum = 0;
    uint64_t count = 0;  // always equals cumulative_counts.back()
  };

  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // Records `value` in the first bucket whose bound is >= value (or +Inf).
  // NaN is dropped: it would turn `_sum` into NaN for the rest of the
  // process's life.
  void Observe(double value);

  // Consistent enough for exposition: `count` is derived from the bucket
  // counts, so `_count` always equals the `+Inf` bucket. `sum` may lag the
  // counts by observations that are in flight.
  Snapshot GetSnapshot() const;

 private:
  template <typename T>
  friend class Family;
  explicit Histogram(const std::vector<double>& upper_bounds);

  const std::vector<double> upper_bounds_;
  // Non-cumulative; one per finite bound plus one for +Inf.
  std::unique_ptr<std::atomic<uint64_t>[]> bucket_counts_;
  std::atomic<double> sum_{0.0};
};

namespace internal {

// What the registry needs from every family. Not for use outside metrics.
class FamilyBase {
 public:
  FamilyBase(std::string name, std::string help, MetricType type,
             std::vector<std::string> label_names);
  virtual ~FamilyBase() = default;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricType type() const { return type_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // Appends `# HELP`, `# TYPE` and the samples, sorted by label values.
  // Appends nothing when the family has no child yet.
  virtual void AppendText(std::string* out) const = 0;

 private:
  const std::string name_;
  const std::string help_;
  const MetricType type_;
  const std::vector<std::string> label_names_;
};

}  // namespace internal

// All children of one metric that differ only in their label values. Owned by
// the Registry. Thread-safe: WithLabels may be called from any thread; keep
// the returned pointer to stay off its lock on hot paths.
template <typename T>
class Family final : public internal::FamilyBase {
 public:
  // Returns the child for `label_values` (in the order of label_names()),
  // creating it on first use. The same values always return the same child.
  // INVALID_ARGUMENT when the number of values differs from the number of
  // label names or a value is not valid UTF-8; RESOURCE_EXHAUSTED when the
  // family already holds max_series() children (a sign of unbounded labels).
  absl::StatusOr<T*> WithLabels(const std::vector<std::string>& label_values);

  // Deletes the child for `label_values`, so that the series disappears from
  // the exposition (a job that ended, a peer that left). Every pointer
  // WithLabels returned for it dangles afterwards: only the code that owns
  // the child's lifetime may remove it. A later WithLabels with the same
  // values starts a fresh child at 0. NOT_FOUND when there is no such child;
  // FAILED_PRECONDITION for a family without labels (always exposed).
  absl::Status Remove(const std::vector<std::string>& label_values);
  // Number of children (series, or histograms) the family holds.
  size_t size() const;

  // The histogram's finite bucket bounds; empty for counters and gauges.
  const std::vector<double>& bucket_bounds() const { return bucket_bounds_; }
  size_t max_series() const { return max_series_; }

  void AppendText(std::string* out) const override;

  // Use Registry::AddCounter/AddGauge/AddHistogram instead.
  Family(std::string name, std::string help, MetricType type, std::vector<std::string> label_names,
         std::vector<double> bucket_bounds, size_t max_series);

 private:
  const std::vector<double> bucket_bounds_;
  const size_t max_series_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::vector<std::string>, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

// Children per family before WithLabels refuses new label values.
inline constexpr size_t kDefaultMaxSeriesPerFamily = 10000;

// Owns metric families and renders them for scraping. Thread-safe: families
// may be added, updated and serialized concurrently from any thread.
//
// Names follow Prometheus rules: metric names match [a-zA-Z_:][a-zA-Z0-9_:]*,
// label names [a-zA-Z_][a-zA-Z0-9_]* and must not start with "__";
// histograms may not use the label "le". Adding a family whose name is taken
// returns the existing family when type, label names (and buckets) match,
// and ALREADY_EXISTS otherwise — so two modules can share one metric.
class Registry {
 public:
  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // A counter family. "_total" is appended to `name` unless it already ends
  // in "_total"; the family's name() is the exposed name. A family without
  // labels gets its single child at once, so it is exposed as 0 from the start.
  absl::StatusOr<CounterFamily*> AddCounter(absl::string_view name, absl::string_view help,
                                            std::vector<std::string> label_names = {},
                                            size_t max_series = kDefaultMaxSeriesPerFamily);

  absl::StatusOr<GaugeFamily*> AddGauge(absl::string_view name, absl::string_view help,
                                        std::vector<std::string> label_names = {},
                                        size_t max_series = kDefaultMaxSeriesPerFamily);

  // `bucket_bounds` are the finite upper bounds, strictly increasing; the
  // "+Inf" bucket is implicit. Empty bounds are allowed (only "+Inf").
  absl::StatusOr<HistogramFamily*> AddHistogram(absl::string_view name, absl::string_view help,
                                                std::vector<double> bucket_bounds,
                                                std::vector<std::string> label_names = {},
                                                size_t max_series = kDefaultMaxSeriesPerFamily);

  // Unlabelled metrics whose value `fn` computes at scrape time (process
  // statistics, sizes of containers owned elsewhere). `fn` runs on the
  // scraping thread while the registry is locked for reading: it must be
  // quick, must not call back into this registry, and must stay callable
  // until RemoveCallback(name) or the registry's destruction. A NaN result is
  // exposed as NaN. The counter's name gets "_total" as in AddCounter.
  absl::Status AddCallbackGauge(absl::string_view name, absl::string_view help,
                                std::function<double()> fn);
  absl::Status AddCallbackCounter(absl::string_view name, absl::string_view help,
                                  std::function<double()> fn);
  // Removes a callback metric by its exposed name, so its function may be
  // destroyed. NOT_FOUND if there is none; FAILED_PRECONDITION for a family
  // that is not a callback (those live as long as the registry).
  absl::Status RemoveCallback(absl::string_view name);

  // The whole registry in the text exposition format 0.0.4: families sorted
  // by name, children by label values, labels in declaration order.
  std::string Serialize() const;

 private:
  // Validates names and reserves every sample name the family exposes.
  absl::Status CheckNewFamily(const std::string& name, absl::string_view help, MetricType type,
                              const std::vector<std::string>& label_names) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void InsertFamily(std::unique_ptr<internal::FamilyBase> family)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  template <typename T>
  absl::StatusOr<Family<T>*> AddFamily(absl::string_view name, absl::string_view help,
                                       MetricType type, std::vector<std::string> label_names,
                                       std::vector<double> bucket_bounds, size_t max_series);
  absl::Status AddCallback(absl::string_view name, absl::string_view help, MetricType type,
                           std::function<double()> fn);

  mutable absl::Mutex mu_;
  // Keyed by exposed family name, which is also the serialization order.
  std::map<std::string, std::unique_ptr<internal::FamilyBase>> families_ ABSL_GUARDED_BY(mu_);
  // Every sample name in use (e.g. "x_bucket", "x_sum") -> its family's name,
  // so that a gauge "x_sum" cannot shadow histogram "x".
  absl::flat_hash_map<std::string, std::string> sample_names_ ABSL_GUARDED_BY(mu_);
};

// Validation used by the registry; exposed for callers that build names.
absl::Status ValidateMetricName(absl::string_view name);
absl::Status ValidateLabelName(absl::string_view name);
// Finite and strictly increasing.
absl::Status ValidateBucketBounds(const std::vector<double>& bounds);

// `count` bounds: start, start*factor, ... (start > 0, factor > 1).
absl::StatusOr<std::vector<double>> ExponentialBuckets(double start, double factor, int count);
// `count` bounds: start, start+width, ... (width > 0).
absl::StatusOr<std::vector<double>> LinearBuckets(double start, double width, int count);
// Bounds for request latencies in seconds, 0.5 ms to 60 s.
std::vector<double> DefaultLatencyBuckets();

// The one counter of an unlabelled counter family registered in `registry`,
// or null when `registry` is null or the family cannot be added (optional
// instrumentation: a component records nothing rather than failing).
Counter* OptionalCounter(Registry* registry, const std::string& name, const std::string& help);

}  // namespace detour::metrics

#endif  // DETOUR_COMMON_METRICS_METRICS_H_
