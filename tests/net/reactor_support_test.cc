#include "common/net/reactor_support.h"

#include <string>

#include "gtest/gtest.h"

namespace detour {
namespace {

TEST(ServerOutbox, OneWriteInFlightInOrder) {
  ServerOutbox<std::string> box;
  auto a = box.Enqueue("a");
  ASSERT_NE(a.write, nullptr);
  EXPECT_EQ(*a.write, "a");
  EXPECT_EQ(box.Enqueue("b").write, nullptr);  // queued behind "a"
  EXPECT_EQ(box.Enqueue("c").write, nullptr);
  auto next = box.WriteDone(true);
  ASSERT_NE(next.write, nullptr);
  EXPECT_EQ(*next.write, "b");
  next = box.WriteDone(true);
  EXPECT_EQ(*next.write, "c");
  next = box.WriteDone(true);
  EXPECT_EQ(next.write, nullptr);
  EXPECT_FALSE(next.finish);
}

TEST(ServerOutbox, FinishWaitsForWriteInFlight) {
  ServerOutbox<std::string> box;
  ASSERT_NE(box.Enqueue("a").write, nullptr);
  box.Enqueue("dropped");
  auto f = box.RequestFinish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "bye"));
  EXPECT_FALSE(f.finish);  // "a" still in flight
  EXPECT_EQ(box.Enqueue("late").write, nullptr);
  auto done = box.WriteDone(true);
  EXPECT_EQ(done.write, nullptr);  // queued message dropped
  EXPECT_TRUE(done.finish);
  EXPECT_EQ(done.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  // Only once.
  EXPECT_FALSE(box.RequestFinish(grpc::Status::OK).finish);
}

TEST(ServerOutbox, FinishAtOnceWhenIdle) {
  ServerOutbox<std::string> box;
  auto f = box.RequestFinish(grpc::Status::OK);
  EXPECT_TRUE(f.finish);
  EXPECT_FALSE(box.RequestFinish(grpc::Status::OK).finish);
}

TEST(ServerOutbox, LastMessageThenFinish) {
  ServerOutbox<std::string> box;
  auto a = box.EnqueueLast("final", grpc::Status::OK);
  ASSERT_NE(a.write, nullptr);
  EXPECT_FALSE(a.finish);
  auto done = box.WriteDone(true);
  EXPECT_TRUE(done.finish);
  EXPECT_TRUE(done.status.ok());
}

TEST(ServerOutbox, FinishAfterQueuedDrainsTheQueueFirst) {
  ServerOutbox<std::string> box;
  ASSERT_NE(box.Enqueue("a").write, nullptr);
  box.Enqueue("b");
  auto f = box.FinishAfterQueued(grpc::Status::OK);
  EXPECT_FALSE(f.finish);
  EXPECT_EQ(box.Enqueue("late").write, nullptr);  // refused once finishing
  auto next = box.WriteDone(true);
  ASSERT_NE(next.write, nullptr);
  EXPECT_EQ(*next.write, "b");  // still delivered
  EXPECT_FALSE(next.finish);
  auto done = box.WriteDone(true);
  EXPECT_EQ(done.write, nullptr);
  EXPECT_TRUE(done.finish);
  EXPECT_TRUE(done.status.ok());
  // Idle: finishes at once.
  ServerOutbox<std::string> idle;
  EXPECT_TRUE(idle.FinishAfterQueued(grpc::Status::OK).finish);
}

TEST(ServerOutbox, FailedWriteFinishesWithUnavailable) {
  ServerOutbox<std::string> box;
  box.Enqueue("a");
  box.Enqueue("b");
  auto done = box.WriteDone(false);
  EXPECT_EQ(done.write, nullptr);
  EXPECT_TRUE(done.finish);
  EXPECT_EQ(done.status.error_code(), grpc::StatusCode::UNAVAILABLE);
}

}  // namespace
}  // namespace detour
