// Where a leading coordinator keeps a copy of its worker registry for the
// coordinator that leads after it: with the etcd store, records in etcd
// (EtcdWorkerDirectory); with the file store (one coordinator), nowhere
// (NoWorkerDirectory). The registry is the truth; the directory mirrors what
// it is given and hands the last leader's records to the next one, which
// keeps those workers' ids for them until they register again.
// Implementations are thread-safe and never block Changed() on storage.
#ifndef DETOUR_COORDINATOR_WORKER_DIRECTORY_H_
#define DETOUR_COORDINATOR_WORKER_DIRECTORY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "detour/v1/control_service.pb.h"

namespace detour {

class WorkerDirectory {
 public:
  virtual ~WorkerDirectory() = default;

  virtual std::string Describe() const = 0;
  // The records a previous leader left, each checked for size and shape
  // (the ones that are not fit are logged and skipped). Errors only when
  // the storage cannot be read.
  virtual absl::StatusOr<std::vector<v1::WorkerInfo>> Load() = 0;
  // Mirrors from now on, as the leader of `term` (the store's fence).
  virtual void Lead(int64_t term) = 0;
  // What the registry mirrors changed; the directory reads it again soon,
  // on a thread of its own. Returns at once.
  virtual void Changed() = 0;
  // Stops mirroring (leadership lost, or stopping). The records stay for
  // the next leader until the storage lets them expire.
  virtual void StopLeading() = 0;
};

// The file store's directory: one coordinator, nothing to hand over.
class NoWorkerDirectory : public WorkerDirectory {
 public:
  std::string Describe() const override { return "no worker directory"; }
  absl::StatusOr<std::vector<v1::WorkerInfo>> Load() override {
    return std::vector<v1::WorkerInfo>();
  }
  void Lead(int64_t) override {}
  void Changed() override {}
  void StopLeading() override {}
};

}  // namespace detour

#endif  // DETOUR_COORDINATOR_WORKER_DIRECTORY_H_
