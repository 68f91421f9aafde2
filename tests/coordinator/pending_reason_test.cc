#include "coordinator/pending_reason.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

v1::JobSpec Spec(int stages, int data_nodes, int replicas) {
  v1::JobSpec spec;
  spec.mutable_pipeline()->set_num_stages(stages);
  spec.mutable_pipeline()->set_data_nodes(data_nodes);
  spec.mutable_pipeline()->set_replicas_per_stage(replicas);
  return spec;
}

std::vector<v1::WorkerInfo> Workers(std::vector<std::string> ids) {
  std::vector<v1::WorkerInfo> out;
  for (const std::string& id : ids) {
    out.emplace_back();
    out.back().set_worker_id(id);
    out.back().set_session_open(true);
  }
  return out;
}

TEST(PendingReason, CountsWhatTheJobNeeds) {
  EXPECT_EQ(WorkersNeeded(Spec(4, 2, 2)), 8u);
  EXPECT_EQ(WorkersNeeded(Spec(1, 3, 5)), 3u);
  EXPECT_EQ(WorkersNeeded(Spec(2, 1, 1)), 2u);
}

// The README's first run: two workers, a job that needs eight. The message
// says so instead of "pending" forever.
TEST(PendingReason, TooFewRegisteredIsFlagged) {
  const std::string why =
      PendingReason(Spec(4, 2, 2), Workers({"w1", "w2"}), Workers({"w1", "w2"}));
  EXPECT_EQ(why,
            "waiting for workers: needs 8 (2 data nodes + 3 stages × 2 replicas), 2 registered; "
            "it cannot start until 6 more register");
}

TEST(PendingReason, EnoughRegisteredButBusy) {
  const std::string why =
      PendingReason(Spec(2, 1, 1), Workers({"w1", "w2", "w3"}), Workers({"w3"}));
  EXPECT_EQ(why,
            "waiting for idle workers: needs 2, 3 registered, 1 idle (the others hold other jobs)");
  EXPECT_THAT(why, Not(HasSubstr("cannot start")));
}

TEST(PendingReason, PinnedWorkersMissingOrBusyAreNamed) {
  v1::JobSpec spec = Spec(2, 1, 1);
  spec.mutable_pipeline()->add_assignment()->add_nodes("w1");
  spec.mutable_pipeline()->add_assignment()->add_nodes("gpu9");
  EXPECT_EQ(PendingReason(spec, Workers({"w1", "w2"}), Workers({"w2"})),
            "waiting for the pinned workers (pipeline.assignment): gpu9 is not registered, so it "
            "cannot start until it registers; w1 is busy with another job");
  EXPECT_EQ(PendingReason(spec, Workers({"w1", "gpu9"}), Workers({})),
            "waiting for the pinned workers (pipeline.assignment): gpu9, w1 are busy with another "
            "job");
}

// A worker registers, then opens its session stream: in between it is not
// free, and the message says why rather than calling it busy.
TEST(PendingReason, APinnedWorkerWithoutASessionIsNamedAsSuch) {
  v1::JobSpec spec = Spec(2, 1, 1);
  spec.mutable_pipeline()->add_assignment()->add_nodes("d0");
  spec.mutable_pipeline()->add_assignment()->add_nodes("s1");
  std::vector<v1::WorkerInfo> registered = Workers({"d0", "s1"});
  registered[1].set_session_open(false);
  EXPECT_EQ(PendingReason(spec, registered, Workers({"d0"})),
            "waiting for the pinned workers (pipeline.assignment): s1 is registered without an "
            "open session (connecting, or reconnecting)");
  registered.push_back(Workers({"w9"})[0]);
  spec.mutable_pipeline()->mutable_assignment(0)->add_nodes("w9");
  spec.mutable_pipeline()->mutable_assignment(0)->add_nodes("gpu9");
  EXPECT_EQ(PendingReason(spec, registered, Workers({"d0"})),
            "waiting for the pinned workers (pipeline.assignment): gpu9 is not registered, so it "
            "cannot start until it registers; s1 is registered without an open session "
            "(connecting, or reconnecting); w9 is busy with another job");
}

}  // namespace
}  // namespace detour
