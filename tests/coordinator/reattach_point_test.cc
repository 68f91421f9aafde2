#include "coordinator/reattach_point.h"

#include <cmath>
#include <limits>
#include <map>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

v1::JobStatus Status(uint64_t completed, bool in_iteration = false, uint64_t epoch = 4) {
  v1::JobStatus s;
  s.set_completed_iterations(completed);
  s.set_in_iteration(in_iteration);
  s.set_epoch(epoch);
  return s;
}

v1::PendingStep Step(uint64_t iteration, double squared_norm = 2.5, uint64_t epoch = 4) {
  v1::PendingStep p;
  p.set_iteration(iteration);
  p.set_squared_norm(squared_norm);
  p.set_epoch(epoch);
  p.set_completed_microbatches(6);
  return p;
}

TEST(ReattachPointTest, WorkersAtOneIterationGoOnFromIt) {
  const v1::PendingStep stale = Step(2);
  for (const v1::PendingStep* pending : {static_cast<const v1::PendingStep*>(nullptr), &stale}) {
    auto point = FindReattachPoint({{"a", Status(3, true)}, {"b", Status(3)}}, pending);
    ASSERT_TRUE(point.ok()) << point.status();
    EXPECT_EQ(point->next_iteration, 3u);
    EXPECT_THAT(point->laggards, IsEmpty());
  }
}

TEST(ReattachPointTest, WorkersOneStepBehindGetTheStoredStep) {
  const v1::PendingStep pending = Step(3);
  auto point = FindReattachPoint(
      {{"c", Status(3, true)}, {"a", Status(4)}, {"b", Status(3, true)}, {"d", Status(4, true)}},
      &pending);
  ASSERT_TRUE(point.ok()) << point.status();
  EXPECT_EQ(point->next_iteration, 4u);
  EXPECT_THAT(point->laggards, ElementsAre("b", "c"));
}

TEST(ReattachPointTest, WorkersThatCannotBeJoinedSayWhy) {
  const v1::PendingStep pending = Step(3);
  struct Case {
    std::map<std::string, v1::JobStatus> status;
    v1::PendingStep pending;
    bool has_pending;
    std::string error;
  } cases[] = {
      {{}, pending, true, "no worker of the job came back"},
      {{{"a", Status(5)}, {"b", Status(3, true)}}, Step(3), true, "(3 and 5) and no step joins"},
      {{{"a", Status(4)}, {"b", Status(3, true)}},
       pending,
       false,
       "the record holds no step of iteration 3"},
      {{{"a", Status(4)}, {"b", Status(3, true)}},
       Step(2),
       true,
       "the record holds no step of iteration 3"},
      {{{"a", Status(4)}, {"b", Status(3, false)}},
       pending,
       true,
       "worker b is not waiting for a step"},
      {{{"a", Status(4)}, {"b", Status(3, true, 5)}},
       pending,
       true,
       "worker b is at epoch 5, the step's is 4"},
      {{{"a", Status(4)}, {"b", Status(3, true)}},
       Step(3, std::nan("")),
       true,
       "holds a squared norm of nan"},
      {{{"a", Status(4)}, {"b", Status(3, true)}}, Step(3, -1), true, "holds a squared norm of -1"},
      {{{"a", Status(4)}, {"b", Status(3, true)}},
       Step(3, std::numeric_limits<double>::infinity()),
       true,
       "holds a squared norm of inf"},
  };
  for (const Case& c : cases) {
    auto point = FindReattachPoint(c.status, c.has_pending ? &c.pending : nullptr);
    ASSERT_FALSE(point.ok()) << c.error;
    EXPECT_EQ(point.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(point.status().message(), HasSubstr(c.error));
  }
}

TEST(ReattachPointTest, TheStepMessageCarriesTheStoredFields) {
  const v1::CoordinatorMessage m = StepMessage("job-7", Step(3, 2.5, 9));
  ASSERT_TRUE(m.has_step());
  EXPECT_EQ(m.step().job_id(), "job-7");
  EXPECT_EQ(m.step().iteration(), 3u);
  EXPECT_EQ(m.step().squared_norm(), 2.5);
  EXPECT_EQ(m.step().epoch(), 9u);
  EXPECT_EQ(m.step().completed_microbatches(), 6u);
}

TEST(ReattachPointTest, ReplicasOfAStageMustHoldTheSameParameters) {
  const std::map<std::string, int> stages{{"a1", 1}, {"a2", 1}, {"b", 2}, {"d0", 0}};
  EXPECT_TRUE(CheckReplicasAgree({{"a1", 5}, {"a2", 5}, {"b", 6}, {"d0", 7}}, stages,
                                 "differ after iteration 4")
                  .ok());
  // A worker that is no longer a member is not compared.
  EXPECT_TRUE(
      CheckReplicasAgree({{"a1", 5}, {"a2", 5}, {"gone", 9}}, stages, "differ after iteration 4")
          .ok());
  absl::Status s =
      CheckReplicasAgree({{"a1", 5}, {"a2", 6}, {"b", 6}}, stages, "differ after iteration 4");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(
      s.message(),
      HasSubstr("replicas of stage 1 differ after iteration 4 (worker a2 differs from a1)"));
}

}  // namespace
}  // namespace detour
