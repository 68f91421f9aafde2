// The fixture and helpers of the elastic-training end-to-end tests
// (elastic_test.cc, elastic_resume_test.cc): real coordinator and worker
// processes on the test's ports, jobs followed by polling or by Watch.
#ifndef DETOUR_TESTS_E2E_ELASTIC_FIXTURE_H_
#define DETOUR_TESTS_E2E_ELASTIC_FIXTURE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/e2e/local_cluster.h"
#include "tests/e2e/micro_job.h"

namespace detour::testing {

class ElasticTest : public E2eTest {
 public:
  Daemon AddWorker(int port, const std::string& name,
                   std::vector<std::string> flags = WorkerFlags()) {
    return StartWorker(port, name, std::move(flags));
  }
  int RunCtl(const std::vector<std::string>& argv, std::string* out) { return Run(argv, out); }
  v1::Job SubmitJob(int port, const v1::JobSpec& spec) { return Submit(port, spec); }
  v1::Job Job(int port, const std::string& id) { return GetJob(port, id); }
  template <typename P>
  static bool Poll(P predicate, absl::Duration timeout) {
    return Eventually(predicate, timeout);
  }
  // EmptyStageIsSkippedThenRefilled with `spec` (4 stages of one worker
  // each, routes skipping one).
  void RunSkipThenRefill(const v1::JobSpec& spec);
};

// An elastic job that notices a closed session within half a second.
inline v1::JobSpec ElasticJob(int stages, int data_nodes, int replicas, double skip,
                              int iterations) {
  v1::JobSpec spec = MicroJob(stages, data_nodes, replicas, skip, iterations);
  spec.mutable_elastic()->set_reconnect_grace_ms(500);
  spec.mutable_elastic()->set_pause_timeout_s(120);
  return spec;
}

// The daemon whose worker id is `id`.
inline Daemon* ById(std::vector<Daemon>& workers, const std::string& id) {
  for (Daemon& d : workers) {
    if (d.id == id) return &d;
  }
  return nullptr;
}

// Node `index` of stage `stage` in `job`; "" and a test failure when the job
// has no such node (a failed Get returns an empty job, which must not be
// indexed: UBSan found that).
inline std::string NodeOf(const v1::Job& job, int stage, int index) {
  if (stage >= job.stages_size() || index >= job.stages(stage).nodes_size()) {
    ADD_FAILURE() << "the job has no node " << index << " in stage " << stage << ":\n"
                  << job.DebugString();
    return "";
  }
  return job.stages(stage).nodes(index);
}

inline int Count(const v1::Job& job, v1::JobHistoryEvent::Kind kind) {
  int n = 0;
  for (const auto& e : job.history()) n += e.kind() == kind;
  return n;
}

inline std::string History(const v1::Job& job) {
  std::string out;
  for (const auto& e : job.history()) {
    absl::StrAppend(&out, v1::JobHistoryEvent::Kind_Name(e.kind()), ": ", e.message(), "\n");
  }
  return out;
}

inline bool JobDone(const v1::Job& j) {
  return j.state() == v1::JOB_STATE_SUCCEEDED || j.state() == v1::JOB_STATE_FAILED ||
         j.state() == v1::JOB_STATE_CANCELLED;
}

// One job on the test's coordinator, followed by polling.
class ElasticRun {
 public:
  ElasticRun(ElasticTest* test, int port, const v1::JobSpec& spec) : test_(test), port_(port) {
    job_ = test_->SubmitJob(port, spec).id();
  }
  // A job submitted already.
  ElasticRun(ElasticTest* test, int port, std::string id)
      : test_(test), port_(port), job_(std::move(id)) {}
  const std::string& id() const { return job_; }
  v1::Job Get() const { return test_->Job(port_, job_); }
  // Waits until `iterations` are done; false on timeout or a final state.
  bool ReachIteration(uint64_t iterations, absl::Duration timeout) const {
    ElasticTest::Poll(
        [&] {
          const v1::Job j = Get();
          return j.progress().iteration() >= iterations || JobDone(j);
        },
        timeout);
    return Get().progress().iteration() >= iterations;
  }
  v1::Job AwaitEnd(absl::Duration timeout) const {
    v1::Job j;
    ElasticTest::Poll(
        [&] {
          j = Get();
          return JobDone(j);
        },
        timeout);
    return j;
  }

 private:
  ElasticTest* test_;
  int port_;
  std::string job_;
};

// Sleeps a pseudo-random fraction of an iteration, so the kill lands at a
// different point of it from run to run (the seed is printed on failure).
inline void SleepIntoIteration(const v1::Job& job, uint32_t seed) {
  std::mt19937 rng(seed);
  const double iteration_s = std::max(0.05, job.progress().iteration_time_s());
  absl::SleepFor(absl::Seconds(std::uniform_real_distribution<double>(0, iteration_s)(rng)));
}

inline void ExpectHealthyEnd(const v1::Job& job, const Daemon& c) {
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.message() << "\n"
                                                  << History(job) << c.process->Log();
  EXPECT_TRUE(std::isfinite(job.progress().loss()));
}

// A replica of a middle stage is killed at a random point of an iteration:

}  // namespace detour::testing

#endif  // DETOUR_TESTS_E2E_ELASTIC_FIXTURE_H_
