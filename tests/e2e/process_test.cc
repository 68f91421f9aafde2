// The test harness's own directories (tests/e2e/process.h): a test's
// directory goes with it unless asked to stay, and one that cannot be made
// fails the test instead of handing back a shared directory.
#include "tests/e2e/process.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace detour::testing {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

// Sets an environment variable for one scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name); old != nullptr) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_.has_value()) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(TempDirTest, IsRemovedWithWhatIsInItWhenItGoes) {
  std::string path;
  {
    const TempDir dir("process_test");
    path = dir.path();
    ASSERT_TRUE(fs::is_directory(path));
    EXPECT_THAT(fs::path(path).filename().string(), HasSubstr("process_test-"));
    fs::create_directories(path + "/a/b");
    std::ofstream(path + "/a/b/file") << "data";
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST(TempDirTest, StaysWhenAskedTo) {
  std::string path;
  {
    const ScopedEnv keep("DETOUR_E2E_KEEP_DIRS", "1");
    const TempDir dir("process_test_kept");
    path = dir.path();
  }
  EXPECT_TRUE(fs::is_directory(path));
  fs::remove_all(path);
}

TEST(TempDirTest, IsMadeUnderTmpdir) {
  const TempDir parent("process_test_parent");
  const ScopedEnv tmpdir("TMPDIR", parent.path().c_str());
  const TempDir dir("child");
  EXPECT_EQ(fs::path(dir.path()).parent_path().string(), parent.path());
}

TEST(TempDirTest, OneThatCannotBeMadeFailsNamingWhere) {
  const ScopedEnv tmpdir("TMPDIR", "/nonexistent-detour-test-dir");
  try {
    const TempDir dir("never");
    ADD_FAILURE() << "made " << dir.path();
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent-detour-test-dir/never-"));
    EXPECT_THAT(e.what(), HasSubstr("No such file or directory"));
  }
}

}  // namespace
}  // namespace detour::testing
