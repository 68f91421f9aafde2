// The replica all-reduce's membership book-keeping (worker/runtime/
// replica_reducer.h) with plain payloads: who counts, in which order, what a
// membership change does to inputs in flight.
#include "worker/runtime/replica_reducer.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<int> Order(const ReplicaReducer<int>& r) {
  std::vector<int> out;
  for (const auto* in : r.InRankOrder()) out.push_back(in->payload);
  return out;
}

TEST(ReplicaReducer, SumsInRankOrderOnceEveryMemberSent) {
  ReplicaReducer<int> r;
  std::string why;
  ASSERT_TRUE(r.Restart(0, {"a", "b", "c"}, "b", &why)) << why;
  EXPECT_EQ(r.rank(), 1);
  EXPECT_THAT(r.Others(), ElementsAre("a", "c"));
  EXPECT_TRUE(r.Offer("c", 0, 30, 3, &why));
  r.SetLocal(20, 2);
  EXPECT_FALSE(r.Ready());
  EXPECT_THAT(r.Missing(), ElementsAre("a"));
  EXPECT_TRUE(r.Offer("a", 0, 10, 1, &why));
  ASSERT_TRUE(r.Ready());
  EXPECT_THAT(Order(r), ElementsAre(10, 20, 30));
  EXPECT_EQ(r.TotalVisits(), 6);
}

TEST(ReplicaReducer, RefusesStrangersDuplicatesAndOldEpochs) {
  ReplicaReducer<int> r;
  std::string why;
  ASSERT_TRUE(r.Restart(3, {"a", "b"}, "a", &why));
  EXPECT_FALSE(r.Offer("x", 3, 1, 1, &why));
  EXPECT_THAT(why, HasSubstr("not another member"));
  EXPECT_FALSE(r.Offer("a", 3, 1, 1, &why));  // itself
  EXPECT_FALSE(r.Offer("b", 2, 1, 1, &why));
  EXPECT_THAT(why, HasSubstr("epoch 2"));
  EXPECT_TRUE(r.Offer("b", 3, 1, 1, &why));
  EXPECT_FALSE(r.Offer("b", 3, 1, 1, &why));
  EXPECT_THAT(why, HasSubstr("second"));
  EXPECT_FALSE(r.Restart(4, {"b", "c"}, "a", &why));
  EXPECT_THAT(why, HasSubstr("not in its replica group"));
}

TEST(ReplicaReducer, AMembershipChangeDropsTheLostAndKeepsEarlyInputs) {
  ReplicaReducer<int> r;
  std::string why;
  ASSERT_TRUE(r.Restart(0, {"a", "b", "c"}, "a", &why));
  EXPECT_TRUE(r.Offer("b", 0, 2, 1, &why));
  EXPECT_TRUE(r.Offer("c", 0, 3, 1, &why));
  // b already knows c is lost and reduced again for epoch 1 before a did.
  EXPECT_TRUE(r.Offer("b", 1, 20, 1, &why));
  ASSERT_TRUE(r.Restart(1, {"a", "b"}, "a", &why));
  EXPECT_FALSE(r.Ready());  // the local input of epoch 1 is not set yet
  r.SetLocal(10, 1);
  ASSERT_TRUE(r.Ready());
  EXPECT_THAT(Order(r), ElementsAre(10, 20));  // c's epoch-0 input is gone
}

TEST(ReplicaReducer, FutureInputsAreBounded) {
  ReplicaReducer<int> r;
  std::string why;
  ASSERT_TRUE(r.Restart(0, {"a", "b"}, "a", &why));
  int accepted = 0;
  for (int e = 1; e < 100; ++e) accepted += r.Offer("b", e, e, 1, &why) ? 1 : 0;
  EXPECT_LT(accepted, 99);
  EXPECT_THAT(why, HasSubstr("too many"));
}

TEST(ReplicaReducer, AloneIsReadyWithItsOwnInput) {
  ReplicaReducer<int> r;
  std::string why;
  ASSERT_TRUE(r.Restart(5, {"solo"}, "solo", &why));
  EXPECT_FALSE(r.Ready());
  r.SetLocal(7, 4);
  EXPECT_TRUE(r.Ready());
  EXPECT_EQ(r.TotalVisits(), 4);
}

}  // namespace
}  // namespace detour
