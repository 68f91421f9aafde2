// The worker's admission of incoming frames on its own
// (worker/runtime/frame_admission.h): every refusal, and the bounds.
#include "worker/runtime/frame_admission.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
  EXPECT_TRUE(a_.Admit(Activation(), 0).ok());
  EXPECT_TRUE(a_.Admit(Activation("peer", 6), 0).ok()) << "the next iteration may start early";
  EXPECT_TRUE(a_.Admit(Activation("joiner", 5, 3), 0).ok())
      << "a worker of a newer epoch this worker does not know yet";
}

TEST_F(FrameAdmissionTest, RefusesOtherJobsStrangersAndStaleOrForgedFrames) {
  v1::FrameHeader other = Activation();
  other.set_job_id("job-2");
  EXPECT_EQ(a_.Admit(other, 0).status.code(), absl::StatusCode::kFailedPrecondition);
  const auto stranger = a_.Admit(Activation("stranger"), 0);
  EXPECT_EQ(stranger.status.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(stranger.status.message()), HasSubstr("\"stranger\" is not a member"));
  const auto late = a_.Admit(Activation("peer", 4), 0);
  EXPECT_EQ(late.refusal, FrameAdmission::Refusal::kLate);
  EXPECT_EQ(a_.Admit(Activation("peer", 7), 0).refusal, FrameAdmission::Refusal::kLate);
  EXPECT_THAT(
      std::string(a_.Admit(Activation("peer", 5, 2 + FrameAdmission::kMaxEpochsAhead + 1), 0)
                      .status.message()),
      HasSubstr("too far ahead"));
  v1::FrameHeader shape = Activation();
  shape.set_shape(2, 64);
  EXPECT_EQ(a_.Admit(shape, 0).status.code(), absl::StatusCode::kInvalidArgument);
  v1::FrameHeader dtype = Activation();
  dtype.set_dtype(v1::DTYPE_BF16);
  EXPECT_EQ(a_.Admit(dtype, 0).status.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(FrameAdmissionTest, AllReducePayloadsAreTheGradientsPlusAtMostTheFactors) {
  v1::FrameHeader h = Activation();
  h.set_direction(v1::DIRECTION_ALLREDUCE);
  h.clear_shape();
  for (int64_t n : {int64_t{1000}, int64_t{1200}}) {
    h.clear_shape();
    h.add_shape(n);
    h.set_total_bytes(4 * n);
    EXPECT_TRUE(a_.Admit(h, 0).ok()) << n;
  }
  for (int64_t n : {int64_t{999}, int64_t{1201}}) {
    h.clear_shape();
    h.add_shape(n);
    EXPECT_EQ(a_.Admit(h, 0).status.code(), absl::StatusCode::kInvalidArgument) << n;
  }
}

TEST_F(FrameAdmissionTest, StageStateOnlyFromTheDonorOnceAndBounded) {
  v1::FrameHeader h = Activation("donor");
  h.set_direction(v1::DIRECTION_STATE);
  h.clear_shape();
  h.add_shape(1 << 20);
  h.set_dtype(v1::DTYPE_BYTES);
  h.set_total_bytes(1 << 20);
  EXPECT_TRUE(a_.Admit(h, 0).ok());
  h.set_shape(0, static_cast<int64_t>(a_.state_bytes()) + 1);
  EXPECT_EQ(a_.Admit(h, 0).status.code(), absl::StatusCode::kInvalidArgument);
  h.set_shape(0, 1 << 20);
  h.set_sender("peer");
  EXPECT_EQ(a_.Admit(h, 0).status.code(), absl::StatusCode::kFailedPrecondition);
  h.set_sender("donor");
  a_.StateReceived();
  EXPECT_EQ(a_.Admit(h, 0).status.code(), absl::StatusCode::kFailedPrecondition)
      << "one state only";
}

TEST_F(FrameAdmissionTest, HeldBytesAreBoundedByWhatAnHonestIterationHolds) {
  // 4 × 4 microbatches × an activation, (2·2+2) all-reduce payloads, a state.
  const uint64_t activation = 4 * 2 * 16 * 32;
  const uint64_t reduce = 4 * 1200;
  const uint64_t state = 4 * (6 * 1000 + 6 * 200) + (16u << 20);
  EXPECT_EQ(a_.state_bytes(), state);
  EXPECT_EQ(a_.held_bytes(), 16 * activation + 6 * reduce + state);
  const auto over = a_.Admit(Activation(), a_.held_bytes() - activation + 1);
  EXPECT_EQ(over.status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(over.refusal, FrameAdmission::Refusal::kOverBudget);
  EXPECT_TRUE(a_.Admit(Activation(), a_.held_bytes() - activation).ok());
}

TEST_F(FrameAdmissionTest, PositionMovesAndAClosedJobTakesNothing) {
  a_.SetPosition(6, 3);
  EXPECT_EQ(a_.Admit(Activation("peer", 5, 3), 0).refusal, FrameAdmission::Refusal::kLate);
  EXPECT_TRUE(a_.Admit(Activation("peer", 7, 3), 0).ok());
  EXPECT_EQ(a_.Admit(Activation("joiner", 6, 3), 0).status.code(),
            absl::StatusCode::kPermissionDenied)
      << "not a member of epoch 3";
  a_.Close();
  EXPECT_EQ(a_.Admit(Activation("peer", 6, 3), 0).status.code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace detour
