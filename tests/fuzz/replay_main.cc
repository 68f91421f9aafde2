// Replays a fuzz target's corpus (seeds and every crash found so far) as a
// GoogleTest, so the normal suite (any compiler) keeps them fixed.
// DETOUR_FUZZ_CORPUS names the target's corpus directory.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/test_paths.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

TEST(FuzzCorpus, EveryInputRunsCleanly) {
  const std::filesystem::path dir =
      std::filesystem::path(detour::testing::SourceDir()) / DETOUR_FUZZ_CORPUS;
  ASSERT_TRUE(std::filesystem::is_directory(dir)) << dir;
  int inputs = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    const std::string data = bytes.str();
    SCOPED_TRACE(entry.path().string());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
    ++inputs;
  }
  EXPECT_GT(inputs, 0);
}

}  // namespace
