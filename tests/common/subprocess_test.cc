// ChildProcess: the input pipe (fed, closed, refused by a child that is
// gone, without a SIGPIPE ending this process) and the working directory.
#include "common/subprocess.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace detour {
namespace {

namespace fs = std::filesystem;

class SubprocessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("detour_subprocess_", ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Log(const std::string& name) { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(SubprocessTest, InputPipeFeedsTheChild) {
  ChildProcess cat;
  ASSERT_TRUE(cat.StartWithInput({"/bin/cat"}, Log("cat.log")).ok());
  std::string big;
  for (int i = 0; i < 20000; ++i) big += absl::StrCat("line ", i, "\n");  // > a pipe's buffer
  ASSERT_TRUE(cat.WriteInput(big).ok());
  ASSERT_TRUE(cat.WriteInput("end\n").ok());
  cat.CloseInput();
  ASSERT_EQ(cat.Wait(absl::Seconds(30)), std::optional<int>(0));
  EXPECT_EQ(cat.Log(), big + "end\n");
}

TEST_F(SubprocessTest, WritingToAChildThatIsGoneIsAStatus) {
  ChildProcess gone;
  ASSERT_TRUE(gone.StartWithInput({"/bin/true"}, Log("true.log")).ok());
  ASSERT_EQ(gone.Wait(absl::Seconds(30)), std::optional<int>(0));
  // Still alive afterwards: no SIGPIPE ended this process.
  const absl::Status s = gone.WriteInput(std::string(1 << 20, 'x'));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  ChildProcess plain;
  ASSERT_TRUE(plain.Start({"/bin/true"}, Log("plain.log")).ok());
  EXPECT_EQ(plain.WriteInput("x").code(), absl::StatusCode::kFailedPrecondition);
  plain.Wait(absl::Seconds(30));
}

TEST_F(SubprocessTest, WorkingDirectory) {
  fs::create_directories(dir_ / "work");
  ChildProcess pwd;
  ASSERT_TRUE(pwd.StartWithInput({"/bin/pwd"}, Log("pwd.log"), (dir_ / "work").string()).ok());
  pwd.CloseInput();
  ASSERT_EQ(pwd.Wait(absl::Seconds(30)), std::optional<int>(0));
  EXPECT_EQ(fs::path(pwd.Log().substr(0, pwd.Log().size() - 1)), fs::canonical(dir_ / "work"));
  ChildProcess nowhere;
  ASSERT_TRUE(
      nowhere.StartWithInput({"/bin/pwd"}, Log("no.log"), (dir_ / "missing").string()).ok());
  EXPECT_EQ(nowhere.Wait(absl::Seconds(30)), std::optional<int>(127));
}

}  // namespace
}  // namespace detour
