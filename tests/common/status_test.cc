#include "common/status.h"

#include <string>

#include "absl/strings/cord.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

absl::Status FailIfNegative(int v) {
  if (v < 0) return absl::InvalidArgumentError("negative");
  return absl::OkStatus();
}

absl::StatusOr<int> Half(int v) {
  if (v % 2 != 0) return absl::InvalidArgumentError("odd");
  return v / 2;
}

absl::StatusOr<int> Quarter(int v) {
  RETURN_IF_ERROR(FailIfNegative(v));
  ASSIGN_OR_RETURN(int h, Half(v));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusMacros, PropagateErrorsAndValues) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(-4).status().message(), "negative");
  EXPECT_EQ(Quarter(6).status().message(), "odd");
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Annotate, PrefixesContextAndKeepsCode) {
  absl::Status s = Annotate(absl::NotFoundError("no such file"), "job.json");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "job.json: no such file");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

TEST(Annotate, KeepsPayloads) {
  absl::Status inner = absl::UnavailableError("closed");
  inner.SetPayload("detour.test/mark", absl::Cord("yes"));
  const absl::Status s = Annotate(inner, "stripe 2");
  EXPECT_EQ(s.message(), "stripe 2: closed");
  ASSERT_TRUE(s.GetPayload("detour.test/mark").has_value());
  EXPECT_EQ(std::string(*s.GetPayload("detour.test/mark")), "yes");
}

}  // namespace
}  // namespace detour
