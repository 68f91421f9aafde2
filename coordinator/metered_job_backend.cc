#include "coordinator/metered_job_backend.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace detour {
namespace {

constexpr const char* kOpNames[] = {"load", "create", "write", "worker_records"};

}  // namespace

absl::Status MeteredJobBackend::AttachMetrics(metrics::Registry* registry) {
  // 1 ms .. 10 s: a local file write to an etcd quorum across regions.
  ASSIGN_OR_RETURN(
      metrics::HistogramFamily * latency,
      registry->AddHistogram(
          "detour_coordinator_store_request_seconds",
          "Time of each job-store request (files or etcd), by operation.",
          {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}, {"op"}));
  ASSIGN_OR_RETURN(metrics::CounterFamily * errors,
                   registry->AddCounter("detour_coordinator_store_errors",
                                        "Failed job-store requests, by operation and status code "
                                        "(aborted = a compare-and-swap conflict).",
                                        {"op", "code"}, /*max_series=*/kOps * 17));
  for (int op = kLoad; op < kOps; ++op) {
    ASSIGN_OR_RETURN(metrics::Histogram * h, latency->WithLabels({kOpNames[op]}));
    latency_[op].store(h, std::memory_order_release);
    // The codes a lost store gives start at 0, so DetourStoreErrors reads a
    // series before the first error (and its first error is a rise).
    for (const char* code : {"unavailable", "deadline_exceeded"}) {
      RETURN_IF_ERROR(errors->WithLabels({kOpNames[op], code}).status());
    }
  }
  errors_.store(errors, std::memory_order_release);
  return absl::OkStatus();
}

void MeteredJobBackend::Record(Op op, absl::Time started, const absl::Status& status) {
  if (metrics::Histogram* h = latency_[op].load(std::memory_order_acquire); h != nullptr) {
    h->Observe(absl::ToDoubleSeconds(absl::Now() - started));
  }
  if (status.ok()) return;
  if (metrics::CounterFamily* errors = errors_.load(std::memory_order_acquire); errors != nullptr) {
    const std::string code = absl::AsciiStrToLower(absl::StatusCodeToString(status.code()));
    if (auto c = errors->WithLabels({kOpNames[op], code}); c.ok()) (*c)->Increment();
  }
}

absl::StatusOr<std::vector<JobRecord>> MeteredJobBackend::LoadAll() {
  const absl::Time started = absl::Now();
  auto result = backend_->LoadAll();
  Record(kLoad, started, result.status());
  return result;
}

absl::StatusOr<JobRecord> MeteredJobBackend::Create(
    const std::function<v1::Job(uint64_t number)>& make) {
  const absl::Time started = absl::Now();
  auto result = backend_->Create(make);
  Record(kCreate, started, result.status());
  return result;
}

absl::StatusOr<int64_t> MeteredJobBackend::Write(const v1::Job& job, int64_t read_revision) {
  const absl::Time started = absl::Now();
  auto result = backend_->Write(job, read_revision);
  Record(kWrite, started, result.status());
  return result;
}

}  // namespace detour
