// SentencePiece tokenizers: detour's own encoder against Debian's reference
// implementation (spm_encode) on models trained by spm_train, round trips,
// and bad model files.
#include "worker/model/tokenizer.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "worker/model/corpus.h"
#include "worker/model/text_data.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

bool HaveSpm() {
  return ::access("/usr/bin/spm_train", X_OK) == 0 && ::access("/usr/bin/spm_encode", X_OK) == 0;
}

class TokenizerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("detour_tok_", ::getpid(), "_", GetParam());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Trains a small model of the parameter's type on generated text.
  std::string Train(int vocab) {
    const std::string input = (dir_ / "train.txt").string();
    std::string text = GenerateCorpus(7, 200000);
    text +=
        "Ünïcödé wörds — “quotes”, 日本語のテキスト, emoji 🙂 and "
        "tabs\tinside.\n";
    EXPECT_TRUE(WriteFileAtomically(input, text).ok());
    SentencePieceTraining t;
    t.model_type = GetParam();
    t.vocab_size = vocab;
    auto model = TrainSentencePiece(t, input);
    EXPECT_TRUE(model.ok()) << model.status();
    return model.ok() ? *model : "";
  }

  // spm_encode's ids for each line of `lines`.
  std::vector<std::vector<int32_t>> Reference(const std::string& model,
                                              const std::vector<std::string>& lines) {
    const std::string m = (dir_ / "m.model").string();
    const std::string in = (dir_ / "in.txt").string();
    const std::string out = (dir_ / "out.txt").string();
    EXPECT_TRUE(WriteFileAtomically(m, model).ok());
    std::string text;
    for (const auto& l : lines) text += l + "\n";
    EXPECT_TRUE(WriteFileAtomically(in, text).ok());
    const std::string cmd = absl::StrCat("/usr/bin/spm_encode --model=", m,
                                         " --output_format=id < ", in, " > ", out, " 2>/dev/null");
    EXPECT_EQ(std::system(cmd.c_str()), 0);
    std::ifstream f(out);
    std::vector<std::vector<int32_t>> ids;
    std::string line;
    while (std::getline(f, line)) {
      std::vector<int32_t> v;
      for (absl::string_view s : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
        int32_t x;
        EXPECT_TRUE(absl::SimpleAtoi(s, &x));
        v.push_back(x);
      }
      ids.push_back(v);
    }
    return ids;
  }

  fs::path dir_;
};

TEST_P(TokenizerTest, EncodesLikeTheReferenceImplementationAndRoundTrips) {
  if (!HaveSpm()) GTEST_SKIP() << "Debian's sentencepiece tools are not installed";
  const std::string model = Train(600);
  auto tok = Tokenizer::FromSentencePiece(model, "test model");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->kind(), "sentencepiece");
  EXPECT_LE((*tok)->vocab_size(), 600);  // hard_vocab_limit=false may give fewer
  EXPECT_GT((*tok)->vocab_size(), 400);
  EXPECT_EQ((*tok)->eos_id(), 2);
  // Text the model has not seen, with characters it never saw (byte fallback).
  std::vector<std::string> lines;
  std::istringstream corpus(GenerateCorpus(99, 20000));
  for (std::string l; std::getline(corpus, l);) {
    if (!l.empty()) lines.push_back(l);
  }
  lines.push_back("  two  leading spaces, trailing  ");
  lines.push_back(
      "Ünïcödé wörds — “quotes”, 日本語, Ωμέγα, ☃ and 🙂🙂 with 12345 "
      "digits");
  lines.push_back("x");
  const auto want = Reference(model, lines);
  ASSERT_EQ(want.size(), lines.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    auto ids = (*tok)->Encode(lines[i]);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(*ids, want[i]) << "line " << i << ": " << lines[i];
    auto back = (*tok)->Decode(*ids);
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, lines[i]);
  }
  // Long multi-line text is encoded in pieces with the same result as the
  // lines one by one joined by the newline's byte piece.
  std::string all;
  std::vector<int32_t> joined;
  for (size_t i = 0; i < lines.size(); ++i) {
    all += lines[i] + "\n";
    joined.insert(joined.end(), want[i].begin(), want[i].end());
    joined.push_back(3 + '\n');  // <0x0A>: byte pieces follow <unk> <s> </s>
  }
  while (all.size() < 200000) all += all;
  auto ids = (*tok)->Encode(all);
  ASSERT_TRUE(ids.ok());
  auto back = (*tok)->Decode(*ids);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, all);
  auto first = (*tok)->Encode(all.substr(0, all.find('\n', 1000) + 1));
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(std::equal(first->begin(), first->end(), joined.begin()));
  // Ids outside the vocabulary are refused by name.
  auto bad = (*tok)->Decode(std::vector<int32_t>{5, 600});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("token 1"), std::string::npos) << bad.status();
}

INSTANTIATE_TEST_SUITE_P(Models, TokenizerTest, ::testing::Values("bpe", "unigram"));

TEST(TokenizerLoadTest, ByteTokenizerIsTheDefault) {
  auto t = Tokenizer::Load("");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ((*t)->kind(), "byte");
  EXPECT_EQ((*t)->vocab_size(), 256);
  EXPECT_EQ((*t)->checksum(), "byte");
  EXPECT_EQ(*(*t)->Decode(*(*t)->Encode("héllo\n")), "héllo\n");
}

TEST(TokenizerLoadTest, BadFilesAreRefusedByName) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("detour_tokbad_", ::getpid());
  fs::create_directories(dir);
  auto missing = Tokenizer::Load((dir / "nope.model").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.model"), std::string::npos);
  ASSERT_TRUE(WriteFileAtomically((dir / "junk.model").string(), "\xff\xff\xff not a proto").ok());
  auto junk = Tokenizer::Load((dir / "junk.model").string());
  EXPECT_EQ(junk.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(junk.status().message().find("junk.model"), std::string::npos) << junk.status();
  // An empty file parses as a model without pieces.
  ASSERT_TRUE(WriteFileAtomically((dir / "empty.model").string(), "").ok());
  EXPECT_EQ(Tokenizer::Load((dir / "empty.model").string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto device = Tokenizer::Load("/dev/zero");
  EXPECT_EQ(device.status().code(), absl::StatusCode::kInvalidArgument) << device.status();
  SentencePieceTraining t;
  t.vocab_size = 10;
  EXPECT_EQ(TrainSentencePiece(t, (dir / "x").string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  t.vocab_size = 1000;
  t.model_type = "word";
  EXPECT_EQ(TrainSentencePiece(t, (dir / "x").string()).status().code(),
            absl::StatusCode::kInvalidArgument);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace detour::model
