#include "common/hash.h"

#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace detour {
namespace {

TEST(Fnv1a64Test, KnownValuesAndPieces) {
  // FNV-1a 64's published values: the offset basis, "a" and "foobar".
  EXPECT_EQ(Fnv1a64Of(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64Of("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fnv1a64Of("foobar"), 0x85944171f73967e8ULL);
  Fnv1a64 f;
  f.Add("foo");
  f.Add("bar");
  EXPECT_EQ(f.value(), Fnv1a64Of("foobar"));
  EXPECT_EQ(f.Hex(), "fnv1a64:85944171f73967e8");
}

uint64_t Fast(const std::vector<uint64_t>& words, size_t bytes) {
  FastHash64 h;
  h.Add(words.data(), bytes);
  return h.value();
}

TEST(FastHash64Test, EveryOneWordChangeChangesTheHash) {
  // Stage-sized buffers differ from a copy in one word at every position
  // class (each lane, the single-word loop, the tail): always detected.
  std::mt19937_64 rng(7);
  for (size_t bytes : {size_t{8}, size_t{31}, size_t{32}, size_t{100}, size_t{4099}}) {
    std::vector<uint64_t> words((bytes + 7) / 8);
    for (uint64_t& w : words) w = rng();
    if (bytes % 8) words.back() &= (uint64_t{1} << (8 * (bytes % 8))) - 1;
    const uint64_t base = Fast(words, bytes);
    EXPECT_EQ(base, Fast(words, bytes)) << "deterministic";
    for (size_t i = 0; i < words.size(); ++i) {
      for (int bit : {0, 13, 31, 63}) {
        if (i == words.size() - 1 && bytes % 8 && bit >= 8 * static_cast<int>(bytes % 8)) continue;
        std::vector<uint64_t> changed = words;
        changed[i] ^= uint64_t{1} << bit;
        EXPECT_NE(Fast(changed, bytes), base) << bytes << " bytes, word " << i << " bit " << bit;
      }
    }
  }
}

TEST(FastHash64Test, LengthAndPiecesCount) {
  const std::string zeros(64, '\0');
  std::set<uint64_t> seen;
  // All-zero buffers of every length hash differently.
  for (size_t n = 0; n <= zeros.size(); ++n) {
    FastHash64 h;
    h.Add(zeros.data(), n);
    EXPECT_TRUE(seen.insert(h.value()).second) << n;
  }
  // ("ab", "c") is not ("a", "bc"): tensors are separate pieces.
  FastHash64 x, y;
  x.Add("ab", 2);
  x.Add("c", 1);
  y.Add("a", 1);
  y.Add("bc", 2);
  EXPECT_NE(x.value(), y.value());
  // A seed gives another hash of the same bytes.
  FastHash64 s1(1), s2(2);
  s1.Add("abc", 3);
  s2.Add("abc", 3);
  EXPECT_NE(s1.value(), s2.value());
}

}  // namespace
}  // namespace detour
