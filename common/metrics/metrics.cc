#include "common/metrics/metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <type_traits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/metrics/exposition.h"

namespace detour::metrics {
namespace {

// std::atomic<double>::fetch_add is C++20; this is the C++17 equivalent.
void AtomicAdd(std::atomic<double>& target, double delta) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {}
}

bool IsNameStart(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Prometheus requires label values and help text to be valid UTF-8.
bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t extra;
    uint32_t code_point;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1;
      code_point = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2;
      code_point = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3;
      code_point = c & 0x07;
    } else {
      return false;
    }
    if (i + extra >= s.size()) return false;  // truncated sequence
    for (size_t k = 1; k <= extra; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      code_point = (code_point << 6) | (cc & 0x3F);
    }
    static constexpr uint32_t kMinForLength[] = {0, 0x80, 0x800, 0x10000};
    if (code_point < kMinForLength[extra]) return false;  // overlong
    if (code_point > 0x10FFFF) return false;
    if (code_point >= 0xD800 && code_point <= 0xDFFF) return false;
    i += extra + 1;
  }
  return true;
}

std::string DescribeLabels(const std::vector<std::string>& label_names) {
  return absl::StrCat("(", absl::StrJoin(label_names, ", "), ")");
}

std::string CounterName(absl::string_view name) {
  if (absl::EndsWith(name, "_total")) return std::string(name);
  return absl::StrCat(name, "_total");
}

// The names of the sample lines a family writes, plus its own name.
std::vector<std::string> SampleNames(const std::string& name, MetricType type) {
  if (type == MetricType::kHistogram) {
    return {name, name + "_bucket", name + "_sum", name + "_count"};
  }
  return {name};
}

void AppendHeader(std::string* out, const internal::FamilyBase& family) {
  absl::StrAppend(out, "# HELP ", family.name(), " ", EscapeHelp(family.help()), "\n# TYPE ",
                  family.name(), " ", MetricTypeName(family.type()), "\n");
}

// A metric whose only sample is computed by a function at scrape time.
class CallbackFamily final : public internal::FamilyBase {
 public:
  CallbackFamily(std::string name, std::string help, MetricType type, std::function<double()> fn)
      : FamilyBase(std::move(name), std::move(help), type, {}), fn_(std::move(fn)) {}

  void AppendText(std::string* out) const override {
    AppendHeader(out, *this);
    AppendSample(out, name(), {}, {}, "", "", fn_());
  }

 private:
  const std::function<double()> fn_;
};

}  // namespace

absl::string_view MetricTypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
  }
  return "untyped";
}

// ---------------------------------------------------------------------------
// Counter, Gauge, Histogram

void Counter::Add(double delta) { AtomicAdd(value_, delta); }

absl::Status Counter::IncrementBy(double delta) {
  if (!(delta >= 0)) {  // also refuses NaN
    return absl::InvalidArgumentError(
        absl::StrCat("a counter can only go up: increment must be >= 0, got ", FormatValue(delta)));
  }
  Add(delta);
  return absl::OkStatus();
}

void Gauge::Increment(double delta) { AtomicAdd(value_, delta); }

void Gauge::SetToCurrentTime() {
  const auto since_epoch = std::chrono::system_clock::now().time_since_epoch();
  Set(std::chrono::duration<double>(since_epoch).count());
}

Histogram::Histogram(const std::vector<double>& upper_bounds)
    : upper_bounds_(upper_bounds),
      bucket_counts_(std::make_unique<std::atomic<uint64_t>[]>(upper_bounds.size() + 1)) {
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    bucket_counts_[i].store(0, std::memory_order_relaxed);
  }
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // Buckets are "less than or equal": the first bound >= value.
  const size_t index =
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin();
  bucket_counts_[index].fetch_add(1, std::memory_order_relaxed);
  AtomicAdd(sum_, value);
}

Histogram::Snapshot Histogram::GetSnapshot() const {
  Snapshot snapshot;
  snapshot.upper_bounds = upper_bounds_;
  snapshot.cumulative_counts.reserve(upper_bounds_.size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= upper_bounds_.size(); ++i) {
    running += bucket_counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts.push_back(running);
  }
  snapshot.count = running;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

// ---------------------------------------------------------------------------
// Families

namespace internal {

FamilyBase::FamilyBase(std::string name, std::string help, MetricType type,
                       std::vector<std::string> label_names)
    : name_(std::move(name)),
      help_(std::move(help)),
      type_(type),
      label_names_(std::move(label_names)) {}

}  // namespace internal

template <typename T>
Family<T>::Family(std::string name, std::string help, MetricType type,
                  std::vector<std::string> label_names, std::vector<double> bucket_bounds,
                  size_t max_series)
    : FamilyBase(std::move(name), std::move(help), type, std::move(label_names)),
      bucket_bounds_(std::move(bucket_bounds)),
      max_series_(max_series) {}

template <typename T>
absl::StatusOr<T*> Family<T>::WithLabels(const std::vector<std::string>& label_values) {
  if (label_values.size() != label_names().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metric ", name(), " has ", label_names().size(), " label(s) ",
        DescribeLabels(label_names()), " but ", label_values.size(), " value(s) were given"));
  }
  {
    absl::ReaderMutexLock lock(&mu_);
    auto it = children_.find(label_values);
    if (it != children_.end()) return it->second.get();
  }
  for (size_t i = 0; i < label_values.size(); ++i) {
    if (!IsValidUtf8(label_values[i])) {
      return absl::InvalidArgumentError(absl::StrCat("metric ", name(), ": value of label ",
                                                     label_names()[i], " is not valid UTF-8"));
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = children_.find(label_values);
  if (it != children_.end()) return it->second.get();
  if (children_.size() >= max_series_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("metric ", name(), " already has ", children_.size(),
                     " series, its limit; are label values unbounded?"));
  }
  std::unique_ptr<T> child;
  if constexpr (std::is_same_v<T, Histogram>) {
    child.reset(new Histogram(bucket_bounds_));
  } else {
    child.reset(new T());
  }
  T* raw = child.get();
  children_.emplace(label_values, std::move(child));
  return raw;
}

template <typename T>
absl::Status Family<T>::Remove(const std::vector<std::string>& label_values) {
  if (label_names().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("metric ", name(), " has no labels; its one series cannot be removed"));
  }
  absl::MutexLock lock(&mu_);
  if (children_.erase(label_values) == 0) {
    return absl::NotFoundError(absl::StrCat("metric ", name(), " has no series with labels ",
                                            DescribeLabels(label_values)));
  }
  return absl::OkStatus();
}

template <typename T>
size_t Family<T>::size() const {
  absl::ReaderMutexLock lock(&mu_);
  return children_.size();
}

template <typename T>
void Family<T>::AppendText(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (children_.empty()) return;
  std::vector<std::pair<const std::vector<std::string>*, const T*>> sorted;
  sorted.reserve(children_.size());
  for (const auto& [labels, child] : children_) {
    sorted.emplace_back(&labels, child.get());
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return *a.first < *b.first; });

  AppendHeader(out, *this);
  for (const auto& [labels, child] : sorted) {
    if constexpr (std::is_same_v<T, Histogram>) {
      const Histogram::Snapshot snapshot = child->GetSnapshot();
      const std::string bucket_name = name() + "_bucket";
      for (size_t i = 0; i < snapshot.upper_bounds.size(); ++i) {
        AppendSample(out, bucket_name, label_names(), *labels, "le",
                     FormatValue(snapshot.upper_bounds[i]),
                     static_cast<double>(snapshot.cumulative_counts[i]));
      }
      AppendSample(out, bucket_name, label_names(), *labels, "le", "+Inf",
                   static_cast<double>(snapshot.count));
      AppendSample(out, name() + "_sum", label_names(), *labels, "", "", snapshot.sum);
      AppendSample(out, name() + "_count", label_names(), *labels, "", "",
                   static_cast<double>(snapshot.count));
    } else {
      AppendSample(out, name(), label_names(), *labels, "", "", child->Value());
    }
  }
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

// ---------------------------------------------------------------------------
// Validation and bucket helpers

absl::Status ValidateMetricName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("metric name is empty");
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsNameStart(c) || c == ':' || (i > 0 && IsDigit(c));
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid metric name \"", name, "\": must match [a-zA-Z_:][a-zA-Z0-9_:]*"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError("label name is empty");
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    if (!(IsNameStart(c) || (i > 0 && IsDigit(c)))) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid label name \"", name, "\": must match [a-zA-Z_][a-zA-Z0-9_]*"));
    }
  }
  if (absl::StartsWith(name, "__")) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid label name \"", name, "\": names starting with __ are reserved for Prometheus"));
  }
  return absl::OkStatus();
}

absl::Status ValidateBucketBounds(const std::vector<double>& bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram bucket bound ", i, " is ", FormatValue(bounds[i]),
                       "; bounds must be finite (the +Inf bucket is implicit)"));
    }
    if (i > 0 && !(bounds[i] > bounds[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram bucket bounds must be strictly increasing, but bound ", i, " (",
                       FormatValue(bounds[i]), ") follows ", FormatValue(bounds[i - 1])));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> ExponentialBuckets(double start, double factor, int count) {
  if (!(start > 0) || !(factor > 1) || count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("exponential buckets need start > 0, factor > 1, count >= 0; got ",
                     FormatValue(start), ", ", FormatValue(factor), ", ", count));
  }
  std::vector<double> bounds;
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  if (absl::Status status = ValidateBucketBounds(bounds); !status.ok()) {
    return status;
  }
  return bounds;
}

absl::StatusOr<std::vector<double>> LinearBuckets(double start, double width, int count) {
  if (!std::isfinite(start) || !(width > 0) || count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear buckets need a finite start, width > 0, count >= 0; got ",
                     FormatValue(start), ", ", FormatValue(width), ", ", count));
  }
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  if (absl::Status status = ValidateBucketBounds(bounds); !status.ok()) {
    return status;
  }
  return bounds;
}

std::vector<double> DefaultLatencyBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

// ---------------------------------------------------------------------------
// Registry

Registry::Registry() = default;
Registry::~Registry() = default;

absl::Status Registry::CheckNewFamily(const std::string& name, absl::string_view help,
                                      MetricType type,
                                      const std::vector<std::string>& label_names) const {
  if (absl::Status status = ValidateMetricName(name); !status.ok()) {
    return status;
  }
  if (!IsValidUtf8(help)) {
    return absl::InvalidArgumentError(
        absl::StrCat("help text of metric ", name, " is not valid UTF-8"));
  }
  for (size_t i = 0; i < label_names.size(); ++i) {
    if (absl::Status status = ValidateLabelName(label_names[i]); !status.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": ", status.message()));
    }
    if (type == MetricType::kHistogram && label_names[i] == "le") {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", name, ": label name \"le\" is reserved for the bucket bound"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (label_names[j] == label_names[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat("metric ", name, ": label name \"", label_names[i], "\" appears twice"));
      }
    }
  }
  for (const std::string& sample_name : SampleNames(name, type)) {
    auto it = sample_names_.find(sample_name);
    if (it != sample_names_.end()) {
      return absl::AlreadyExistsError(absl::StrCat("cannot register ", MetricTypeName(type), " ",
                                                   name, ": the name ", sample_name,
                                                   " is already used by metric ", it->second));
    }
  }
  return absl::OkStatus();
}

void Registry::InsertFamily(std::unique_ptr<internal::FamilyBase> family) {
  for (std::string& sample_name : SampleNames(family->name(), family->type())) {
    sample_names_.emplace(std::move(sample_name), family->name());
  }
  std::string key = family->name();
  families_.emplace(std::move(key), std::move(family));
}

template <typename T>
absl::StatusOr<Family<T>*> Registry::AddFamily(absl::string_view name, absl::string_view help,
                                               MetricType type,
                                               std::vector<std::string> label_names,
                                               std::vector<double> bucket_bounds,
                                               size_t max_series) {
  const std::string full_name =
      type == MetricType::kCounter ? CounterName(name) : std::string(name);
  if (type == MetricType::kHistogram) {
    if (absl::Status status = ValidateBucketBounds(bucket_bounds); !status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram ", full_name, ": ", status.message()));
    }
  }
  if (max_series == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", full_name, ": max_series must be positive"));
  }
  Family<T>* family = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = families_.find(full_name);
    if (it != families_.end()) {
      auto* existing = dynamic_cast<Family<T>*>(it->second.get());
      if (existing == nullptr || existing->type() != type) {
        return absl::AlreadyExistsError(absl::StrCat(
            "metric ", full_name, " is already registered as a ",
            dynamic_cast<CallbackFamily*>(it->second.get()) != nullptr ? "callback " : "",
            MetricTypeName(it->second->type()), "; cannot register it as a ",
            MetricTypeName(type)));
      }
      if (existing->label_names() != label_names) {
        return absl::AlreadyExistsError(
            absl::StrCat("metric ", full_name, " is already registered with labels ",
                         DescribeLabels(existing->label_names()),
                         "; cannot register it with labels ", DescribeLabels(label_names)));
      }
      if (existing->bucket_bounds() != bucket_bounds) {
        return absl::AlreadyExistsError(absl::StrCat(
            "histogram ", full_name, " is already registered with different bucket bounds"));
      }
      return existing;
    }
    if (absl::Status status = CheckNewFamily(full_name, help, type, label_names); !status.ok()) {
      return status;
    }
    auto owned =
        std::make_unique<Family<T>>(full_name, std::string(help), type, std::move(label_names),
                                    std::move(bucket_bounds), max_series);
    family = owned.get();
    InsertFamily(std::move(owned));
  }
  if (family->label_names().empty()) {
    // Expose unlabelled metrics as zero from the start; cannot fail.
    family->WithLabels({}).IgnoreError();
  }
  return family;
}

absl::StatusOr<CounterFamily*> Registry::AddCounter(absl::string_view name, absl::string_view help,
                                                    std::vector<std::string> label_names,
                                                    size_t max_series) {
  return AddFamily<Counter>(name, help, MetricType::kCounter, std::move(label_names), {},
                            max_series);
}

absl::StatusOr<GaugeFamily*> Registry::AddGauge(absl::string_view name, absl::string_view help,
                                                std::vector<std::string> label_names,
                                                size_t max_series) {
  return AddFamily<Gauge>(name, help, MetricType::kGauge, std::move(label_names), {}, max_series);
}

absl::StatusOr<HistogramFamily*> Registry::AddHistogram(absl::string_view name,
                                                        absl::string_view help,
                                                        std::vector<double> bucket_bounds,
                                                        std::vector<std::string> label_names,
                                                        size_t max_series) {
  return AddFamily<Histogram>(name, help, MetricType::kHistogram, std::move(label_names),
                              std::move(bucket_bounds), max_series);
}

absl::Status Registry::AddCallback(absl::string_view name, absl::string_view help, MetricType type,
                                   std::function<double()> fn) {
  const std::string full_name =
      type == MetricType::kCounter ? CounterName(name) : std::string(name);
  if (!fn) {
    return absl::InvalidArgumentError(
        absl::StrCat("callback metric ", full_name, " has no function"));
  }
  absl::MutexLock lock(&mu_);
  if (families_.count(full_name) > 0) {
    return absl::AlreadyExistsError(absl::StrCat("metric ", full_name, " is already registered"));
  }
  if (absl::Status status = CheckNewFamily(full_name, help, type, {}); !status.ok()) {
    return status;
  }
  InsertFamily(std::make_unique<CallbackFamily>(full_name, std::string(help), type, std::move(fn)));
  return absl::OkStatus();
}

absl::Status Registry::AddCallbackGauge(absl::string_view name, absl::string_view help,
                                        std::function<double()> fn) {
  return AddCallback(name, help, MetricType::kGauge, std::move(fn));
}

absl::Status Registry::AddCallbackCounter(absl::string_view name, absl::string_view help,
                                          std::function<double()> fn) {
  return AddCallback(name, help, MetricType::kCounter, std::move(fn));
}

absl::Status Registry::RemoveCallback(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  auto it = families_.find(std::string(name));
  if (it == families_.end()) {
    return absl::NotFoundError(absl::StrCat("no metric named ", name, " is registered"));
  }
  if (dynamic_cast<CallbackFamily*>(it->second.get()) == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "metric ", name, " is not a callback metric; only callback metrics can be removed"));
  }
  for (const std::string& sample_name : SampleNames(it->second->name(), it->second->type())) {
    sample_names_.erase(sample_name);
  }
  families_.erase(it);
  return absl::OkStatus();
}

std::string Registry::Serialize() const {
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->AppendText(&out);
  return out;
}

Counter* OptionalCounter(Registry* registry, const std::string& name, const std::string& help) {
  if (registry == nullptr) return nullptr;
  auto family = registry->AddCounter(name, help);
  if (!family.ok()) return nullptr;
  auto counter = (*family)->WithLabels({});
  return counter.ok() ? *counter : nullptr;
}

}  // namespace detour::metrics
