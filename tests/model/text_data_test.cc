// Tokenizer, text reading, split, sharding and the embedded corpus.
#include "worker/model/text_data.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include <gtest/gtest.h>

#include "worker/model/byte_tokenizer.h"
#include "worker/model/corpus.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

TEST(ByteTokenizerTest, RoundTripsArbitraryBytes) {
  uint64_t state = 42;
  for (int len : {0, 1, 7, 1000}) {
    std::string bytes(len, '\0');
    for (auto& c : bytes) c = static_cast<char>(SplitMix64(&state) & 0xff);
    auto tokens = ByteTokenizer::Encode(bytes);
    ASSERT_EQ(tokens.size(), bytes.size());
    for (int32_t t : tokens) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, 256);
    }
    auto back = ByteTokenizer::Decode(tokens);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, bytes);
  }
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(*ByteTokenizer::Decode(ByteTokenizer::Encode(all)), all);
  auto bad = ByteTokenizer::Decode(std::vector<int32_t>{65, 300});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("position 1"), std::string::npos);
}

TEST(Utf8Test, AcceptsValidRejectsInvalid) {
  EXPECT_TRUE(CheckUtf8("plain ascii").ok());
  EXPECT_TRUE(CheckUtf8("\xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80").ok());
  EXPECT_FALSE(CheckUtf8("ab\xff").ok());
  EXPECT_FALSE(CheckUtf8("\xc3").ok());          // truncated
  EXPECT_FALSE(CheckUtf8("\xc0\xaf").ok());      // overlong
  EXPECT_FALSE(CheckUtf8("\xed\xa0\x80").ok());  // surrogate
  EXPECT_NE(CheckUtf8("abc\xff").message().find("offset 3"), std::string::npos);
}

TEST(ReadTextSourceTest, FileAndDirectory) {
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("detour_text_source." + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "sub");
  std::ofstream(dir / "b.txt") << "second";
  std::ofstream(dir / "a.txt") << "first";
  std::ofstream(dir / "sub" / "c.txt") << "third";
  auto text = ReadTextSource(dir.string());
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, "first\nsecond\nthird");
  auto one = ReadTextSource((dir / "b.txt").string());
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, "second");
  EXPECT_EQ(ReadTextSource((dir / "none").string()).status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir / "sub" / "bad.txt") << "x\xff";
  auto bad = ReadTextSource(dir.string());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("bad.txt"), std::string::npos);
  fs::remove_all(dir);
}

// Regression: data.path=/dev/zero drove a data worker past 3 GB.
// Non-regular files are refused by name and sizes are checked before
// anything is read: a sparse file just over the cap is refused without
// allocating it (it would need 256 MiB, twice over, to be read).
TEST(ReadTextSourceTest, RefusesDevicesAndOversizedSourcesWithoutReadingThem) {
  auto zero = ReadTextSource("/dev/zero");
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("/dev/zero"), std::string::npos) << zero.status();
  EXPECT_NE(zero.status().message().find("neither a regular file nor a directory"),
            std::string::npos);

  const fs::path dir =
      fs::path(::testing::TempDir()) / ("detour_text_cap." + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "many");
  const fs::path big = dir / "big.txt";
  std::ofstream(big).put('x');
  fs::resize_file(big, kMaxTextSourceBytes + 1);  // sparse: no disk, no memory
  auto huge = ReadTextSource(big.string());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(huge.status().message().find(big.string()), std::string::npos) << huge.status();
  EXPECT_NE(huge.status().message().find("limit of 268435456 bytes (256 MiB)"), std::string::npos)
      << huge.status();

  // A directory counts all its files together (two halves of the cap plus
  // the separating newline are one byte too many).
  for (const char* name : {"a.txt", "b.txt"}) {
    std::ofstream(dir / "many" / name).put('x');
    fs::resize_file(dir / "many" / name, kMaxTextSourceBytes / 2);
  }
  auto both = ReadTextSource((dir / "many").string());
  EXPECT_EQ(both.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(both.status().message().find((dir / "many").string()), std::string::npos)
      << both.status();

  // At the cap exactly a file is fine (a small cap keeps the test small).
  std::ofstream(dir / "small.txt") << "0123456789";
  auto fits = ReadTextSource((dir / "small.txt").string(), 10);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(*fits, "0123456789");
  EXPECT_EQ(ReadTextSource((dir / "small.txt").string(), 9).status().code(),
            absl::StatusCode::kResourceExhausted);
  fs::remove_all(dir);
}

// A file whose size stat does not tell (procfs reports 0) is read with the
// bound too: reading stops one byte past the cap.
TEST(ReadTextSourceTest, BoundsReadingWhenTheSizeIsUnknown) {
  auto proc = ReadTextSource("/proc/self/status", 16);
  EXPECT_EQ(proc.status().code(), absl::StatusCode::kResourceExhausted) << proc.status();
  EXPECT_NE(proc.status().message().find("/proc/self/status"), std::string::npos);
  auto whole = ReadTextSource("/proc/self/status");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_NE(whole->find("VmRSS"), std::string::npos);
}

TEST(SplitTextTest, HoldsOutTheTailAtALineBoundary) {
  std::string text;
  for (int i = 0; i < 100; ++i) text += "line " + std::to_string(i) + "\n";
  auto ds = SplitText(text, 0.1);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(ds->train.size() + ds->validation.size(), text.size());
  EXPECT_NEAR(static_cast<double>(ds->validation.size()) / text.size(), 0.1, 0.02);
  EXPECT_EQ(ds->train[ds->train.size() - 1], '\n');
  EXPECT_FALSE(SplitText(text, 0.7).ok());
  EXPECT_FALSE(SplitText(text, -0.1).ok());
}

TEST(SamplesTest, CountsAndViews) {
  EXPECT_EQ(NumSamples(10, 4), 2);  // tokens 0..4, 4..8
  EXPECT_EQ(NumSamples(9, 4), 2);
  EXPECT_EQ(NumSamples(8, 4), 1);
  EXPECT_EQ(NumSamples(4, 4), 0);
  std::vector<int32_t> t = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto s = SampleTokens(t, 1, 4);
  ASSERT_EQ(s.size(), 5u);
  EXPECT_EQ(s[0], 4);
  EXPECT_EQ(s[4], 8);
}

// Every data node, over one epoch's worth of iterations, reads each sample
// exactly once between them all.
TEST(SampleSharderTest, CoversTheCorpusWithoutOverlap) {
  for (int64_t samples : {1, 7, 64, 1000, 4099}) {
    for (int nodes : {1, 2, 3, 5}) {
      SampleSharder sharder(samples, nodes, 11);
      std::vector<int> hits(samples, 0);
      // One epoch = global positions [0, samples): position g is node g % D,
      // shard offset g / D.
      for (int64_t g = 0; g < samples; ++g) {
        const int64_t s =
            sharder.SampleAt(static_cast<int>(g % nodes), static_cast<uint64_t>(g / nodes));
        ASSERT_GE(s, 0);
        ASSERT_LT(s, samples);
        ++hits[s];
      }
      for (int64_t s = 0; s < samples; ++s) EXPECT_EQ(hits[s], 1) << s;
    }
  }
}

TEST(SampleSharderTest, IterationsOfNodesAreDisjointAndDeterministic) {
  const int64_t samples = 1000;
  const int nodes = 3, per_iteration = 8;
  SampleSharder a(samples, nodes, 5), b(samples, nodes, 5), c(samples, nodes, 6);
  std::set<int64_t> seen;
  int differs = 0;
  // 41 iterations × 3 nodes × 8 = 984 reads < one epoch: all distinct.
  for (uint64_t it = 0; it < 41; ++it) {
    for (int node = 0; node < nodes; ++node) {
      for (int j = 0; j < per_iteration; ++j) {
        const uint64_t off = SampleSharder::IterationOffset(it, per_iteration) + j;
        const int64_t s = a.SampleAt(node, off);
        EXPECT_EQ(s, b.SampleAt(node, off));
        differs += s != c.SampleAt(node, off);
        EXPECT_TRUE(seen.insert(s).second) << "sample " << s << " read twice";
      }
    }
  }
  EXPECT_GT(differs, 900);  // another seed gives another order
  // Not the identity order.
  int in_place = 0;
  for (int64_t g = 0; g < 100; ++g) in_place += a.SampleAt(0, g) == g * nodes;
  EXPECT_LT(in_place, 10);
  // Epoch 2 is another permutation of all samples.
  std::set<int64_t> epoch2;
  for (int64_t g = samples; g < 2 * samples; ++g) {
    epoch2.insert(a.SampleAt(static_cast<int>(g % nodes), g / nodes));
  }
  EXPECT_EQ(epoch2.size(), static_cast<size_t>(samples));
}

TEST(CorpusTest, DeterministicStructuredAndLarge) {
  const std::string& corpus = EmbeddedCorpus();
  EXPECT_GE(corpus.size(), 3u << 20);
  EXPECT_EQ(&corpus, &EmbeddedCorpus());
  EXPECT_EQ(GenerateCorpus(2026, 10000), corpus.substr(0, GenerateCorpus(2026, 10000).size()));
  EXPECT_NE(GenerateCorpus(1, 5000), GenerateCorpus(2, 5000));
  EXPECT_TRUE(CheckUtf8(corpus).ok());
  EXPECT_NE(corpus.find(" plus "), std::string::npos);
  EXPECT_NE(corpus.find("Count from "), std::string::npos);
  EXPECT_NE(corpus.find(" gives "), std::string::npos);
  // Arithmetic facts are true.
  const std::string sample = GenerateCorpus(3, 200000);
  size_t pos = 0;
  int checked = 0;
  while ((pos = sample.find(" plus ", pos)) != std::string::npos && checked < 200) {
    size_t a_start = sample.rfind(' ', pos - 1);
    a_start = a_start == std::string::npos ? 0 : a_start + 1;
    int a = 0, b = 0, c = 0;
    if (std::sscanf(sample.c_str() + a_start, "%d plus %d is %d.", &a, &b, &c) == 3) {
      EXPECT_EQ(a + b, c);
      ++checked;
    }
    pos += 6;
  }
  EXPECT_GT(checked, 50);
  auto ds = SplitText(corpus, 0.05);
  ASSERT_TRUE(ds.ok());
  EXPECT_GT(NumSamples(ds->validation.size(), 128), 1000);
}

}  // namespace
}  // namespace detour::model
