// A TensorSink for transport tests: accepts tensors of job "job-1" into
// fresh vectors and keeps them; refuses any other job. Thread-safe.
#ifndef DETOUR_TESTS_TRANSPORT_RECORDING_SINK_H_
#define DETOUR_TESTS_TRANSPORT_RECORDING_SINK_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/transport/activation_server.h"

namespace detour {

class RecordingSink : public TensorSink {
 public:
  absl::StatusOr<MutableBuffer> Allocate(const v1::FrameHeader& h) override {
    if (h.job_id() != "job-1") {
      return absl::FailedPreconditionError(absl::StrCat("unknown job ", h.job_id()));
    }
    auto storage = std::make_shared<std::vector<char>>(h.total_bytes());
    MutableBuffer b;
    b.data = storage->data();
    b.bytes = storage->size();
    b.keepalive = storage;
    return b;
  }
  void Deliver(const v1::FrameHeader& h, MutableBuffer buffer) override {
    absl::MutexLock lock(&mu_);
    auto storage = std::static_pointer_cast<std::vector<char>>(buffer.keepalive);
    received_.push_back({h, *storage});
  }
  std::vector<std::pair<v1::FrameHeader, std::vector<char>>> received() {
    absl::MutexLock lock(&mu_);
    return received_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<v1::FrameHeader, std::vector<char>>> received_ ABSL_GUARDED_BY(mu_);
};

}  // namespace detour

#endif  // DETOUR_TESTS_TRANSPORT_RECORDING_SINK_H_
