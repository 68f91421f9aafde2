// Prepared datasets: what `detour-data prepare` writes, what workers map,
// determinism, the document split, and every way a dataset can be bad.
#include "worker/model/token_shards.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/files.h"
#include "detour/spm/model.pb.h"
#include "worker/model/corpus.h"
#include "worker/model/tokenizer.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

std::string Slurp(const fs::path& p) { return *ReadFileToString(p.string()); }

class ShardsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat("detour_shards_", ::getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "in" / "sub");
    // Paragraphs of generated text, a nested file and a JSONL file.
    ASSERT_TRUE(
        WriteFileAtomically((dir_ / "in" / "a.txt").string(), GenerateCorpus(1, 30000)).ok());
    ASSERT_TRUE(WriteFileAtomically((dir_ / "in" / "sub" / "b.txt").string(),
                                    "first paragraph\nstill first\n\n\nsecond ünï\n")
                    .ok());
    ASSERT_TRUE(WriteFileAtomically((dir_ / "in" / "c.jsonl").string(),
                                    "{\"text\": \"a json doc\\nwith two lines\", \"id\": 1}\n"
                                    "\n"
                                    "{\"text\": \"another\"}\n")
                    .ok());
  }
  void TearDown() override { fs::remove_all(dir_); }

  PrepareOptions Options(const std::string& out) {
    PrepareOptions o;
    o.inputs = {(dir_ / "in").string()};
    o.output = (dir_ / out).string();
    o.validation_fraction = 0.2;
    o.split_seed = 5;
    return o;
  }

  fs::path dir_;
};

TEST_F(ShardsTest, PreparedDocumentsReadBackExactlyAndDeterministically) {
  auto m = PrepareDataset(Options("ds"));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->format(), kDatasetFormat);
  EXPECT_EQ(m->token_bytes(), 2u);
  EXPECT_EQ(m->sources_size(), 3);
  EXPECT_GT(m->validation().documents(), 0u);
  EXPECT_GT(m->train().documents(), m->validation().documents());
  auto ds = OpenShardDataset((dir_ / "ds").string());
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->train.size() + ds->validation.size(),
            static_cast<int64_t>(m->train().tokens() + m->validation().tokens()));
  // Every document comes back as its text plus the separator; the set of
  // documents over both splits is exactly the inputs'.
  std::multiset<std::string> docs;
  for (auto [seq, starts] : {std::pair{&ds->train, &ds->train_documents},
                             std::pair{&ds->validation, &ds->validation_documents}}) {
    for (size_t d = 0; d + 1 < starts->size(); ++d) {
      auto ids = seq->Slice(static_cast<int64_t>((*starts)[d]),
                            static_cast<int64_t>((*starts)[d + 1] - (*starts)[d]));
      std::string text(ids.begin(), ids.end());
      ASSERT_EQ(text.back(), '\n');
      text.pop_back();
      docs.insert(text);
    }
  }
  EXPECT_EQ(docs.count("first paragraph\nstill first\n"), 1u);
  EXPECT_EQ(docs.count("second ünï\n"), 1u);
  EXPECT_EQ(docs.count("a json doc\nwith two lines"), 1u);
  EXPECT_EQ(docs.count("another"), 1u);
  // The same inputs give byte-identical files.
  ASSERT_TRUE(PrepareDataset(Options("again")).ok());
  for (const char* f :
       {"train.tokens", "train.index", "validation.tokens", "validation.index", "manifest.json"}) {
    std::string a = Slurp(dir_ / "ds" / f), b = Slurp(dir_ / "again" / f);
    if (std::string(f) == "manifest.json") {
      // Source paths differ only in the output name: not at all here.
      EXPECT_EQ(a, b);
    } else {
      EXPECT_EQ(a, b) << f;
    }
  }
  // Another split seed moves documents between the splits.
  PrepareOptions other = Options("other");
  other.split_seed = 6;
  auto m2 = PrepareDataset(other);
  ASSERT_TRUE(m2.ok());
  EXPECT_NE(m2->validation().tokens_checksum(), m->validation().tokens_checksum());
  EXPECT_FALSE(fs::exists(dir_ / "ds.partial"));
}

TEST_F(ShardsTest, SentencePieceDatasetsCarryTheirTokenizer) {
  if (::access("/usr/bin/spm_train", X_OK) != 0) GTEST_SKIP() << "no spm_train";
  const std::string input = (dir_ / "train.txt").string();
  ASSERT_TRUE(WriteFileAtomically(input, GenerateCorpus(3, 100000)).ok());
  SentencePieceTraining t;
  t.vocab_size = 400;
  auto model = TrainSentencePiece(t, input);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_TRUE(WriteFileAtomically((dir_ / "t.model").string(), *model).ok());
  PrepareOptions o = Options("ds");
  o.tokenizer_path = (dir_ / "t.model").string();
  auto m = PrepareDataset(o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->tokenizer_kind(), "sentencepiece");
  EXPECT_EQ(m->vocab_size(), 400u);
  EXPECT_EQ(m->eos_id(), 2);
  EXPECT_TRUE(fs::exists(dir_ / "ds" / "tokenizer.model"));
  v1::DataSpec spec;
  spec.set_source(v1::DATA_SOURCE_SHARDS);
  spec.set_path((dir_ / "ds").string());
  auto data = LoadShardDataset(spec);
  ASSERT_TRUE(data.ok()) << data.status();
  EXPECT_EQ(data->vocab_size, 400);
  EXPECT_EQ(CheckVocabulary(*data, 256).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckVocabulary(*data, 512).ok());
  // The same tokenizer named in the spec is fine; another one is refused.
  spec.set_tokenizer(o.tokenizer_path);
  EXPECT_TRUE(LoadShardDataset(spec).ok());
  t.vocab_size = 500;
  auto other = TrainSentencePiece(t, input);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(WriteFileAtomically((dir_ / "u.model").string(), *other).ok());
  spec.set_tokenizer((dir_ / "u.model").string());
  auto mismatch = LoadShardDataset(spec);
  EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(mismatch.status().message().find("u.model"), std::string::npos) << mismatch.status();
  spec.clear_tokenizer();
  spec.set_validation_fraction(0.1);
  EXPECT_EQ(LoadShardDataset(spec).status().code(), absl::StatusCode::kInvalidArgument);
  // Text sources tokenised with the model when the job starts.
  v1::DataSpec text;
  text.set_source(v1::DATA_SOURCE_TEXT);
  text.set_path(input);
  text.set_tokenizer(o.tokenizer_path);
  auto loaded = LoadDataset(text);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->vocab_size, 400);
  EXPECT_LT(loaded->train.size(), 100000 * 7 / 10);  // subwords, not bytes
}

// `detour-data tokenizer` before streaming: the inputs went through a
// scratch byte dataset (one document per line), were read back into a lines
// file without their line ends and empty lines, and spm_train read the file.
std::string TrainThroughAScratchFile(const SentencePieceTraining& t,
                                     const std::vector<std::string>& inputs, const fs::path& dir,
                                     int64_t* lines) {
  PrepareOptions scan;
  scan.inputs = inputs;
  scan.output = (dir / "scan").string();
  scan.text_documents = TextDocuments::kLines;
  scan.validation_fraction = 0;
  EXPECT_TRUE(PrepareDataset(scan).ok());
  auto opened = OpenShardDataset(scan.output, /*verify=*/false);
  EXPECT_TRUE(opened.ok()) << opened.status();
  std::string text;
  *lines = 0;
  const auto& starts = opened->train_documents;
  for (size_t doc = 0; doc + 1 < starts.size() && *lines < t.max_sentences; ++doc) {
    std::string line;
    for (uint64_t i = starts[doc]; i < starts[doc + 1]; ++i) {
      const int32_t c = opened->train[static_cast<int64_t>(i)];
      if (c != '\n') line.push_back(static_cast<char>(c));
    }
    if (line.empty()) continue;
    text += line + "\n";
    ++*lines;
  }
  const std::string file = (dir / "lines.txt").string();
  EXPECT_TRUE(WriteFileAtomically(file, text).ok());
  auto model = TrainSentencePiece(t, file);
  EXPECT_TRUE(model.ok()) << model.status();
  return model.ok() ? *model : "";
}

// A model with the two run-specific strings spm_train records (its input
// path and model prefix: fields 1 and 2 of the trainer spec) removed.
spm::ModelProto WithoutPaths(const std::string& bytes) {
  spm::ModelProto m;
  EXPECT_TRUE(m.ParseFromString(bytes));
  m.mutable_trainer_spec()->mutable_unknown_fields()->DeleteByNumber(1);
  m.mutable_trainer_spec()->mutable_unknown_fields()->DeleteByNumber(2);
  return m;
}

// Streaming the inputs' lines into spm_train trains the model the scratch
// route trained: the same pieces, scores, types, normaliser and training
// settings; only the recorded input path and prefix differ, and those are
// fixed now, so the same inputs give byte-identical models.
TEST_F(ShardsTest, StreamedTokenizerTrainingEqualsTheScratchFileRoute) {
  if (::access("/usr/bin/spm_train", X_OK) != 0) GTEST_SKIP() << "no spm_train";
  const fs::path in = dir_ / "tok";
  fs::create_directories(in);
  std::string text = GenerateCorpus(4, 150000);
  text +=
      "\n\nÜnïcödé wörds — “quotes”, 日本語, emoji 🙂,\ttabs and   runs   of "
      "spaces\r\n";
  ASSERT_TRUE(WriteFileAtomically((in / "a.txt").string(), text).ok());
  ASSERT_TRUE(WriteFileAtomically((in / "b.jsonl").string(),
                                  "{\"text\": \"a json line\"}\n\n{\"text\": \"x 12345\"}\n")
                  .ok());
  for (const char* type : {"bpe", "unigram"}) {
    SCOPED_TRACE(type);
    SentencePieceTraining t;
    t.model_type = type;
    t.vocab_size = 400;
    t.max_sentences = 1000;  // fewer than the inputs' ~1200 lines: the limit counts the same
    int64_t lines = 0;
    const fs::path old_dir = dir_ / absl::StrCat("old-", type);
    fs::create_directories(old_dir);
    const std::string before = TrainThroughAScratchFile(t, {in.string()}, old_dir, &lines);
    ASSERT_FALSE(before.empty());
    EXPECT_EQ(lines, 1000);
    TokenizerCorpus corpus;
    const std::string scratch = (dir_ / absl::StrCat("spm-", type)).string();
    auto now = TrainTokenizerOnInputs(t, {in.string()}, "text", scratch, &corpus);
    ASSERT_TRUE(now.ok()) << now.status();
    EXPECT_FALSE(fs::exists(scratch));
    EXPECT_EQ(corpus.lines, lines);
    const spm::ModelProto a = WithoutPaths(before);
    const spm::ModelProto b = WithoutPaths(*now);
    ASSERT_EQ(a.pieces_size(), b.pieces_size());
    for (int i = 0; i < a.pieces_size(); ++i) {
      ASSERT_EQ(a.pieces(i).piece(), b.pieces(i).piece()) << i;
      ASSERT_EQ(a.pieces(i).score(), b.pieces(i).score()) << i;
      ASSERT_EQ(a.pieces(i).type(), b.pieces(i).type()) << i;
    }
    EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
    EXPECT_NE(before, *now);  // the recorded paths did differ
    auto again = TrainTokenizerOnInputs(t, {in.string()}, "text", scratch);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(*again, *now);
  }
  // A JSONL text with line breaks trains on each of its lines; the inputs'
  // errors are named and leave nothing behind.
  SentencePieceTraining t;
  t.vocab_size = 400;
  TokenizerCorpus corpus;
  const std::string scratch = (dir_ / "spm-errors").string();
  auto split = TrainTokenizerOnInputs(t, {(dir_ / "in").string()}, "text", scratch, &corpus);
  ASSERT_TRUE(split.ok()) << split.status();
  // The non-empty lines of a.txt, b.txt's 3, and the JSONL texts' 2 + 1.
  int64_t expected = 6;
  for (absl::string_view l : absl::StrSplit(Slurp(dir_ / "in" / "a.txt"), '\n')) {
    expected += l.empty() ? 0 : 1;
  }
  EXPECT_EQ(corpus.lines, expected);
  ASSERT_TRUE(
      WriteFileAtomically((dir_ / "bad.jsonl").string(), "{\"text\": \"ok\"}\n{\"text\": 3}\n")
          .ok());
  auto bad = TrainTokenizerOnInputs(t, {(dir_ / "bad.jsonl").string()}, "text", scratch);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("bad.jsonl:2"), std::string::npos) << bad.status();
  EXPECT_FALSE(fs::exists(scratch));
  ASSERT_TRUE(WriteFileAtomically((dir_ / "empty.txt").string(), "\n\n").ok());
  auto empty = TrainTokenizerOnInputs(t, {(dir_ / "empty.txt").string()}, "text", scratch);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kFailedPrecondition) << empty.status();
  EXPECT_EQ(
      TrainTokenizerOnInputs(t, {(dir_ / "missing").string()}, "text", scratch).status().code(),
      absl::StatusCode::kNotFound);
}

TEST_F(ShardsTest, BadInputsAreNamed) {
  PrepareOptions o = Options("ds");
  o.inputs = {(dir_ / "missing.txt").string()};
  EXPECT_EQ(PrepareDataset(o).status().code(), absl::StatusCode::kNotFound);
  o.inputs = {"/dev/null"};
  EXPECT_EQ(PrepareDataset(o).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(
      WriteFileAtomically((dir_ / "bad.jsonl").string(), "{\"text\": \"ok\"}\n{\"text\": 3}\n")
          .ok());
  o.inputs = {(dir_ / "bad.jsonl").string()};
  auto bad = PrepareDataset(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("bad.jsonl:2"), std::string::npos) << bad.status();
  ASSERT_TRUE(
      WriteFileAtomically((dir_ / "bad2.jsonl").string(), "{\"text\": \"ok\"}\n[1,\n").ok());
  o.inputs = {(dir_ / "bad2.jsonl").string()};
  bad = PrepareDataset(o);
  EXPECT_NE(bad.status().message().find("bad2.jsonl:2"), std::string::npos) << bad.status();
  ASSERT_TRUE(WriteFileAtomically((dir_ / "latin1.txt").string(), "caf\xe9\n").ok());
  o.inputs = {(dir_ / "latin1.txt").string()};
  bad = PrepareDataset(o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("latin1.txt:1"), std::string::npos) << bad.status();
  o = Options("ds");
  ASSERT_TRUE(PrepareDataset(o).ok());
  EXPECT_EQ(PrepareDataset(o).status().code(), absl::StatusCode::kAlreadyExists);
  o.force = true;
  EXPECT_TRUE(PrepareDataset(o).ok());
  o.validation_fraction = 0.7;
  EXPECT_EQ(PrepareDataset(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ShardsTest, DamagedDatasetsAreRefused) {
  ASSERT_TRUE(PrepareDataset(Options("ds")).ok());
  const fs::path ds = dir_ / "ds";
  auto copy = [&](const std::string& name) {
    fs::remove_all(dir_ / name);
    fs::copy(ds, dir_ / name);
    return dir_ / name;
  };
  EXPECT_EQ(OpenShardDataset((dir_ / "nothing").string()).status().code(),
            absl::StatusCode::kNotFound);
  // Truncated token file.
  fs::path d = copy("trunc");
  fs::resize_file(d / "train.tokens", fs::file_size(d / "train.tokens") - 2);
  auto s = OpenShardDataset(d.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("train.tokens"), std::string::npos) << s.status();
  // One flipped byte: the checksum names the file.
  d = copy("flip");
  {
    std::fstream f(d / "validation.tokens", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1);
    f.put('\x7f');
  }
  s = OpenShardDataset(d.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("checksum"), std::string::npos) << s.status();
  EXPECT_TRUE(OpenShardDataset(d.string(), /*verify=*/false).ok());
  // A manifest with a field this build does not know, or a checksum that
  // does not fit its tokenizer kind.
  d = copy("vocab");
  std::string json = Slurp(d / "manifest.json");
  const std::string key = "\"vocab_size\": 256";
  ASSERT_NE(json.find(key), std::string::npos) << json;
  json.replace(json.find(key), key.size(), "\"vocab_size\": 256, \"eos_id\": -1, \"x\": 1");
  ASSERT_TRUE(WriteFileAtomically((d / "manifest.json").string(), json).ok());
  s = OpenShardDataset(d.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);  // unknown field "x"
  json = Slurp(ds / "manifest.json");
  json.replace(json.find("\"tokenizer_checksum\": \"byte\""), 28,
               "\"tokenizer_checksum\": \"fnv1a64:0\"");
  ASSERT_TRUE(WriteFileAtomically((d / "manifest.json").string(), json).ok());
  s = OpenShardDataset(d.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss) << s.status();
  // A file name that leaves the directory.
  d = copy("escape");
  json = Slurp(ds / "manifest.json");
  json.replace(json.find("\"train.tokens\""), 14, "\"../x.tokens\"");
  ASSERT_TRUE(WriteFileAtomically((d / "manifest.json").string(), json).ok());
  s = OpenShardDataset(d.string());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("plain names"), std::string::npos) << s.status();
  // Another format is named.
  d = copy("format");
  json = Slurp(ds / "manifest.json");
  json.replace(json.find(kDatasetFormat), std::string(kDatasetFormat).size(), "detour-dataset-v9");
  ASSERT_TRUE(WriteFileAtomically((d / "manifest.json").string(), json).ok());
  EXPECT_EQ(OpenShardDataset(d.string()).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ShardsTest, SamplesFromMappedTokensEqualThoseFromMemory) {
  ASSERT_TRUE(PrepareDataset(Options("ds")).ok());
  auto ds = OpenShardDataset((dir_ / "ds").string());
  ASSERT_TRUE(ds.ok());
  const std::vector<int32_t> copy = ds->train.Slice(0, ds->train.size());
  const TokenSequence memory(copy);
  const int ctx = 32;
  const int64_t n = NumSamples(ds->train.size(), ctx);
  ASSERT_GT(n, 10);
  SampleSharder sharder(n, 2, 7);
  std::vector<int64_t> a(ctx + 1), b(ctx + 1);
  for (uint64_t k = 0; k < 20; ++k) {
    const int64_t sample = sharder.SampleAt(static_cast<int>(k % 2), k);
    CopySample(ds->train, sample, ctx, a.data());
    CopySample(memory, sample, ctx, b.data());
    EXPECT_EQ(a, b);
    auto span = SampleTokens(copy, sample, ctx);
    EXPECT_TRUE(std::equal(span.begin(), span.end(), a.begin()));
  }
}

}  // namespace
}  // namespace detour::model
