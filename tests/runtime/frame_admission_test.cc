// The worker's admission of incoming frames on its own
// (worker/runtime/frame_admission.h): every refusal, and the bounds.
#include "worker/runtime/frame_admission.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace detour {
namespace {

using ::testing::HasSubstr;

class FrameAdmissionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FrameAdmission::Stage s;
    s.job_id = "job-1";
    s.iteration = 5;
    s.epoch = 2;
    s.activation_shape = {2, 16, 32};
    s.wire = v1::DTYPE_FP32;
    s.flat_numel = 1000;
    s.factor_numel = 200;
    s.state_from = "donor";
    s.microbatches = 4;
    s.replicas = 2;
    a_.Open(s);
    a_.SetMembers({"me", "peer", "donor"});
  }
  static v1::FrameHeader Activation(const std::string& sender = "peer", uint64_t iteration = 5,
                                    uint64_t epoch = 2) {
    v1::FrameHeader h;
    h.set_job_id("job-1");
    h.set_sender(sender);
    h.set_iteration(iteration);
    h.set_epoch(epoch);
    h.set_direction(v1::DIRECTION_FORWARD);
    for (int64_t d : {2, 16, 32}) h.add_shape(d);
    h.set_dtype(v1::DTYPE_FP32);
    h.set_total_bytes(4 * 2 * 16 * 32);
    return h;
  }
  FrameAdmission a_;
};

TEST_F(FrameAdmissionTest, TakesTheJobsOwnFrames) {
  EXPECT_TRUE(a_.Admit(Activation()).ok());
  EXPECT_TRUE(a_.Admit(Activation("peer", 6)).ok()) << "the next iteration may start early";
  EXPECT_TRUE(a_.Admit(Activation("joiner", 5, 3)).ok())
      << "a worker of a newer epoch this worker does not know yet";
}

TEST_F(FrameAdmissionTest, RefusesOtherJobsStrangersAndStaleOrForgedFrames) {
  v1::FrameHeader other = Activation();
  other.set_job_id("job-2");
  EXPECT_EQ(a_.Admit(other).status.code(), absl::StatusCode::kFailedPrecondition);
  const auto stranger = a_.Admit(Activation("stranger"));
  EXPECT_EQ(stranger.status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(stranger.status.message()), HasSubstr("\"stranger\" is not a member"));
  const auto late = a_.Admit(Activation("peer", 4));
  EXPECT_EQ(late.refusal, FrameAdmission::Refusal::kLate);
  EXPECT_EQ(a_.Admit(Activation("peer", 7)).refusal, FrameAdmission::Refusal::kLate);
  EXPECT_THAT(std::string(a_.Admit(Activation("peer", 5, 2 + FrameAdmission::kMaxEpochsAhead + 1))
                              .status.message()),
              HasSubstr("too far ahead"));
  v1::FrameHeader shape = Activation();
  shape.set_shape(2, 64);
  EXPECT_EQ(a_.Admit(shape).status.code(), absl::StatusCode::kInvalidArgument);
  v1::FrameHeader dtype = Activation();
  dtype.set_dtype(v1::DTYPE_BF16);
  EXPECT_EQ(a_.Admit(dtype).status.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(FrameAdmissionTest, AllReducePayloadsAreTheGradientsPlusAtMostTheFactors) {
  v1::FrameHeader h = Activation();
  h.set_direction(v1::DIRECTION_ALLREDUCE);
  h.clear_shape();
  for (int64_t n : {int64_t{1000}, int64_t{1200}}) {
    h.clear_shape();
    h.add_shape(n);
    h.set_total_bytes(4 * n);
    EXPECT_TRUE(a_.Admit(h).ok()) << n;
  }
  for (int64_t n : {int64_t{999}, int64_t{1201}}) {
    h.clear_shape();
    h.add_shape(n);
    EXPECT_EQ(a_.Admit(h).status.code(), absl::StatusCode::kInvalidArgument) << n;
  }
}

TEST_F(FrameAdmissionTest, StageStateOnlyFromTheDonorOnceAndBounded) {
  v1::FrameHeader h = Activation("donor");
  h.set_direction(v1::DIRECTION_STATE);
  h.clear_shape();
  h.add_shape(1 << 20);
  h.set_dtype(v1::DTYPE_BYTES);
  h.set_total_bytes(1 << 20);
  EXPECT_TRUE(a_.Admit(h).ok());
  h.set_shape(0, static_cast<int64_t>(a_.state_bytes()) + 1);
  EXPECT_EQ(a_.Admit(h).status.code(), absl::StatusCode::kInvalidArgument);
  h.set_shape(0, 1 << 20);
  h.set_sender("peer");
  EXPECT_EQ(a_.Admit(h).status.code(), absl::StatusCode::kFailedPrecondition);
  h.set_sender("donor");
  a_.StateReceived();
  EXPECT_EQ(a_.Admit(h).status.code(), absl::StatusCode::kFailedPrecondition) << "one state only";
}

// A route data -> me -> last: me gets the data node's forward and the last
// node's backward of microbatch `mb`.
v1::Route RouteThrough(uint32_t mb, const std::string& data, const std::string& last) {
  v1::Route r;
  r.set_microbatch(mb);
  r.set_data_node(data);
  for (const std::string& n : {data, std::string("me"), last}) r.add_nodes(n);
  for (uint32_t stage : {0u, 1u, 2u}) r.add_stages(stage);
  return r;
}

TEST_F(FrameAdmissionTest, EachSendersQuotaIsWhatTheRoutesHaveItSendHere) {
  const uint64_t activation = 4 * 2 * 16 * 32;
  const uint64_t reduce = 4 * 1200;
  const uint64_t state = 4 * (6 * 1000 + 6 * 200) + (16u << 20);
  EXPECT_EQ(a_.state_bytes(), state);
  // Before any plan: one forward and one backward per microbatch (4), and
  // four all-reduce inputs.
  EXPECT_EQ(a_.SenderQuota("peer"), 8 * activation + 4 * reduce);
  EXPECT_EQ(a_.SenderQuota("donor"), 8 * activation + 4 * reduce + state);
  a_.SetRoutes("me", {RouteThrough(0, "peer", "donor"), RouteThrough(1, "peer", "donor"),
                      RouteThrough(2, "donor", "peer")});
  // peer: 2 forwards as data node, and mb 2's backward as the last node.
  EXPECT_EQ(a_.RoutedFrames("peer"), 3u);
  EXPECT_EQ(a_.RoutedFrames("donor"), 3u);
  EXPECT_EQ(a_.SenderQuota("peer"), 11 * activation + 4 * reduce);
  // A re-run's amended route adds to what the iteration's routes said.
  a_.AddRoutes("me", {RouteThrough(0, "peer", "donor")});
  EXPECT_EQ(a_.RoutedFrames("peer"), 4u);
  // The last node of a route gets the forward of the node before it and the
  // data node's backward.
  a_.SetRoutes("peer", {RouteThrough(0, "donor", "peer")});
  EXPECT_EQ(a_.RoutedFrames("me"), 1u) << "the forward from me";
  EXPECT_EQ(a_.RoutedFrames("donor"), 1u) << "the loss gradient from the data node";
}

TEST_F(FrameAdmissionTest, OneSendersFloodLeavesEveryOtherSendersQuota) {
  // "peer" floods frames of the next iteration until it is refused.
  int taken = 0;
  FrameAdmission::Verdict v;
  std::vector<std::shared_ptr<std::atomic<uint64_t>>> accounts;
  while ((v = a_.Admit(Activation("peer", 6))).ok()) {
    accounts.push_back(v.account);
    ASSERT_LT(++taken, 1000) << "no bound";
  }
  EXPECT_EQ(v.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(v.refusal, FrameAdmission::Refusal::kOverBudget);
  EXPECT_THAT(std::string(v.status.message()), HasSubstr("\"peer\" holds"));
  const uint64_t activation = 4 * 2 * 16 * 32;
  EXPECT_EQ(static_cast<uint64_t>(taken), a_.SenderQuota("peer") / activation);
  // Another member's real tensor is still taken.
  const FrameAdmission::Verdict donor = a_.Admit(Activation("donor"));
  ASSERT_TRUE(donor.ok()) << donor.status;
  EXPECT_EQ(donor.account->load(), activation);
  // Freed tensors give the flooder its quota back.
  accounts.front()->fetch_sub(activation);
  EXPECT_TRUE(a_.Admit(Activation("peer", 6)).ok());
}

TEST_F(FrameAdmissionTest, NewcomersAccountsAreBounded) {
  for (size_t i = 0; i < FrameAdmission::kMaxNewcomerAccounts; ++i) {
    EXPECT_TRUE(a_.Admit(Activation(absl::StrCat("joiner", i), 5, 3)).ok()) << i;
  }
  const auto more = a_.Admit(Activation("one-too-many", 5, 3));
  EXPECT_EQ(more.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a_.Admit(Activation("peer")).ok()) << "members are never newcomers";
}

TEST_F(FrameAdmissionTest, PositionMovesAndAClosedJobTakesNothing) {
  a_.SetPosition(6, 3);
  EXPECT_EQ(a_.Admit(Activation("peer", 5, 3)).refusal, FrameAdmission::Refusal::kLate);
  EXPECT_TRUE(a_.Admit(Activation("peer", 7, 3)).ok());
  EXPECT_EQ(a_.Admit(Activation("joiner", 6, 3)).status.code(), absl::StatusCode::kPermissionDenied)
      << "not a member of epoch 3";
  a_.Close();
  EXPECT_EQ(a_.Admit(Activation("peer", 6, 3)).status.code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace detour
