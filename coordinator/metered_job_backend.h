// A JobBackend that times every call of the backend it wraps and counts its
// errors, by operation (load, create, write, and worker_records for the
// registry's records in the same store): the job store's latency and
// health as Prometheus sees them (detour_coordinator_store_*). The metrics
// are attached after construction (the coordinator registers them in Init);
// calls before that are not measured. Thread-safe.
#ifndef DETOUR_COORDINATOR_METERED_JOB_BACKEND_H_
#define DETOUR_COORDINATOR_METERED_JOB_BACKEND_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "coordinator/job_backend.h"

namespace detour {

class MeteredJobBackend final : public JobBackend {
 public:
  explicit MeteredJobBackend(std::unique_ptr<JobBackend> backend) : backend_(std::move(backend)) {}

  // Registers detour_coordinator_store_request_seconds{op} and
  // detour_coordinator_store_errors_total{op,code} in `registry`, which
  // must outlive this backend. Once.
  absl::Status AttachMetrics(metrics::Registry* registry);

  std::string Describe() const override { return backend_->Describe(); }
  absl::StatusOr<std::vector<JobRecord>> LoadAll() override;
  absl::StatusOr<JobRecord> Create(const std::function<v1::Job(uint64_t number)>& make) override;
  absl::StatusOr<int64_t> Write(const v1::Job& job, int64_t read_revision) override;
  void FenceWrites(int64_t term) override { backend_->FenceWrites(term); }
  bool Replicated() const override { return backend_->Replicated(); }

  // A request for the worker registry's records in the same store (op
  // "worker_records": its reads, writes and lease keep-alives), counted
  // with the jobs' so that the store's latency and error metrics and the
  // DetourStoreErrors alert cover both.
  void RecordWorkerRecords(absl::Time started, const absl::Status& status) {
    Record(kWorkerRecords, started, status);
  }

 private:
  enum Op { kLoad = 0, kCreate = 1, kWrite = 2, kWorkerRecords = 3 };
  static constexpr int kOps = 4;
  void Record(Op op, absl::Time started, const absl::Status& status);

  const std::unique_ptr<JobBackend> backend_;
  std::atomic<metrics::Histogram*> latency_[kOps] = {};
  std::atomic<metrics::CounterFamily*> errors_{nullptr};
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_METERED_JOB_BACKEND_H_
