// Export of a checkpoint to the HF layout, config.json parsing and checks,
// without LibTorch: the checkpoint is written with our own container.
#include "worker/model/hf_export.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/files.h"
#include "common/checkpoint_manifest.h"
#include "worker/model/hf_llama.h"
#include "worker/model/safetensors.h"
#include "worker/model/stage_file.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

ModelConfig SmallConfig() {
  ModelConfig c;
  c.num_layers = 3;
  c.d_model = 16;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.ffn_dim = 32;
  c.vocab_size = 40;
  c.context_length = 8;
  c.rope_theta = 500000.0;
  c.norm_eps = 1e-6;
  return c;
}

// Value of element i of parameter p: distinct everywhere.
float Value(size_t p, size_t i) { return static_cast<float>(p) + 0.001f * static_cast<float>(i); }

class HfExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("hf_export_test." + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_ / "ckpt");
  }
  void TearDown() override { fs::remove_all(root_); }

  // A 2-stage checkpoint of SmallConfig(), with an optimiser entry too.
  void WriteCheckpoint(const std::string& skip = "") {
    const ModelConfig c = SmallConfig();
    params_ = HfLlamaParameters(c);
    data_.assign(params_.size(), {});
    CheckpointManifest m;
    m.iteration = 7;
    m.model = c;
    m.num_stages = 2;
    std::vector<std::vector<StageTensorRecord>> stages(2);
    for (size_t p = 0; p < params_.size(); ++p) {
      size_t n = 1;
      for (int64_t d : params_[p].shape) n *= d;
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = Value(p, i);
      data_[p].assign(reinterpret_cast<const char*>(v.data()), n * sizeof(float));
      if (params_[p].ours == skip) continue;
      const bool stage1 = params_[p].ours.rfind("layers.2.", 0) == 0;
      stages[stage1].push_back({params_[p].ours, StageDType::kFloat32, params_[p].shape, data_[p]});
      if (p == 1) {
        stages[0].push_back(
            {params_[p].ours + ".adam_m", StageDType::kFloat32, params_[p].shape, data_[p]});
      }
    }
    for (int s = 0; s < 2; ++s) {
      const std::string bytes = EncodeStageFile(stages[s]);
      StageFileEntry e;
      e.stage = s;
      e.file = "stage-" + std::to_string(s) + ".bin";
      e.layers = s == 0 ? LayerRange{0, 2} : LayerRange{2, 3};
      e.bytes = bytes.size();
      e.checksum = Checksum(bytes);
      ASSERT_TRUE(WriteFileAtomically((root_ / "ckpt" / e.file).string(), bytes).ok());
      m.stages.push_back(e);
    }
    ASSERT_TRUE(WriteManifest((root_ / "ckpt").string(), m).ok());
  }

  fs::path root_;
  std::vector<HfParameter> params_;
  std::vector<std::string> data_;
};

TEST_F(HfExportTest, ExportsEveryParameterUnderItsHfName) {
  WriteCheckpoint();
  std::vector<std::string> lines;
  HfExportOptions o;
  o.progress = [&](absl::string_view l) { lines.emplace_back(l); };
  const std::string out = (root_ / "hf").string();
  ASSERT_TRUE(ExportHfCheckpoint((root_ / "ckpt").string(), out, o).ok());
  EXPECT_FALSE(lines.empty());
  auto f = SafetensorsFile::Open(out + "/model.safetensors");
  ASSERT_TRUE(f.ok()) << f.status();
  const SafetensorsContents& st = (*f)->contents();
  EXPECT_EQ(st.tensors.size(), params_.size());  // no optimiser state
  EXPECT_EQ(st.metadata.at("format"), "pt");
  for (size_t p = 0; p < params_.size(); ++p) {
    const SafetensorsTensor* t = st.Find(params_[p].hf);
    ASSERT_NE(t, nullptr) << params_[p].hf;
    EXPECT_EQ(t->dtype, SafetensorsDType::kF32);
    EXPECT_EQ(t->shape, params_[p].shape);
    EXPECT_EQ(t->data, data_[p]) << params_[p].hf;
  }
  EXPECT_NE(st.Find("model.layers.2.self_attn.k_proj.weight"), nullptr);
  EXPECT_EQ(st.Find("model.layers.1.self_attn.k_proj.weight")->shape,
            (std::vector<int64_t>{8, 16}));  // GQA: 2 KV heads of 4 dims

  auto text = ReadFileToString(out + "/config.json");
  ASSERT_TRUE(text.ok());
  auto hf = ParseHfLlamaConfig(*text, "config.json");
  ASSERT_TRUE(hf.ok()) << hf.status() << "\n" << *text;
  EXPECT_TRUE(CheckHfConfigMatches(*hf, SmallConfig(), "config.json").ok());
  EXPECT_FALSE(hf->tie_word_embeddings);
  EXPECT_NE(text->find("\"LlamaForCausalLM\""), std::string::npos);
  EXPECT_NE(text->find("\"tokenizer\": \"byte\""), std::string::npos);
  EXPECT_NE(text->find("\"torch_dtype\": \"float32\""), std::string::npos);

  // A second export into the same directory is refused unless asked for.
  auto again = ExportHfCheckpoint((root_ / "ckpt").string(), out, HfExportOptions());
  EXPECT_EQ(again.code(), absl::StatusCode::kAlreadyExists) << again;
  o.overwrite = true;
  EXPECT_TRUE(ExportHfCheckpoint((root_ / "ckpt").string(), out, o).ok());
}

TEST_F(HfExportTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Float32ToBFloat16(1.0f), 0x3F80);
  EXPECT_EQ(Float32ToBFloat16(-2.0f), 0xC000);
  float f = 0;
  uint32_t bits = 0x3F808000;  // exactly half way: rounds to even (down)
  std::memcpy(&f, &bits, 4);
  EXPECT_EQ(Float32ToBFloat16(f), 0x3F80);
  bits = 0x3F818000;  // half way above an odd mantissa: up
  std::memcpy(&f, &bits, 4);
  EXPECT_EQ(Float32ToBFloat16(f), 0x3F82);
  bits = 0x7FC00001;
  std::memcpy(&f, &bits, 4);
  EXPECT_EQ(Float32ToBFloat16(f) & 0x7FC0, 0x7FC0);  // NaN stays NaN

  WriteCheckpoint();
  HfExportOptions o;
  o.dtype = SafetensorsDType::kBF16;
  const std::string out = (root_ / "hf16").string();
  ASSERT_TRUE(ExportHfCheckpoint((root_ / "ckpt").string(), out, o).ok());
  auto file = SafetensorsFile::Open(out + "/model.safetensors");
  ASSERT_TRUE(file.ok());
  const SafetensorsTensor* t = (*file)->contents().Find("model.embed_tokens.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, SafetensorsDType::kBF16);
  EXPECT_EQ(t->data.size(), data_[0].size() / 2);
  auto text = ReadFileToString(out + "/config.json");
  EXPECT_NE(text->find("\"torch_dtype\": \"bfloat16\""), std::string::npos);
}

TEST_F(HfExportTest, NamesWhatIsWrongWithTheCheckpoint) {
  WriteCheckpoint("layers.1.w_up");
  auto s = ExportHfCheckpoint((root_ / "ckpt").string(), (root_ / "hf").string(), {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("lacks parameter layers.1.w_up (model.layers.1.mlp.up_proj.weight)"),
            std::string::npos)
      << s;
  EXPECT_FALSE(fs::exists(root_ / "hf" / "model.safetensors"));

  EXPECT_EQ(ExportHfCheckpoint((root_ / "nothing").string(), (root_ / "hf").string(), {}).code(),
            absl::StatusCode::kNotFound);

  WriteCheckpoint();
  // A flipped byte in a stage file: its checksum no longer matches.
  auto bytes = ReadFileToString((root_ / "ckpt" / "stage-1.bin").string());
  (*bytes)[bytes->size() - 1] ^= 1;
  ASSERT_TRUE(WriteFileAtomically((root_ / "ckpt" / "stage-1.bin").string(), *bytes).ok());
  s = ExportHfCheckpoint((root_ / "ckpt").string(), (root_ / "hf").string(), {});
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
}

// A SentencePiece ModelProto: `pieces` field-1 entries and a trainer_spec
// (field 2) with bos_id 41 and eos_id 42.
std::string SentencePieceBytes(int pieces, int bos, int eos) {
  std::string s;
  for (int i = 0; i < pieces; ++i) s += std::string("\x0a\x03\x0a\x01", 4) + "a";
  std::string trainer;
  trainer += std::string("\xc8\x02", 2) + static_cast<char>(bos);  // 41 << 3 | 0 = 328
  trainer += std::string("\xd0\x02", 2) + static_cast<char>(eos);  // 42 << 3 | 0 = 336
  s += std::string("\x12", 1) + static_cast<char>(trainer.size()) + trainer;
  return s;
}

TEST_F(HfExportTest, ShipsASentencePieceTokenizer) {
  auto info = InspectSentencePieceModel(SentencePieceBytes(5, 3, 4), "sp");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->pieces, 5);
  EXPECT_EQ(info->bos_id, 3);
  EXPECT_EQ(info->eos_id, 4);
  EXPECT_FALSE(InspectSentencePieceModel("\x0a\xff", "sp").ok());
  EXPECT_FALSE(InspectSentencePieceModel("hello world", "sp").ok());

  WriteCheckpoint();
  const std::string sp = (root_ / "sp.model").string();
  ASSERT_TRUE(WriteFileAtomically(sp, SentencePieceBytes(30, 1, 2)).ok());
  HfExportOptions o;
  o.tokenizer_model = sp;
  const std::string out = (root_ / "hf").string();
  ASSERT_TRUE(ExportHfCheckpoint((root_ / "ckpt").string(), out, o).ok());
  EXPECT_EQ(*ReadFileToString(out + "/tokenizer.model"), SentencePieceBytes(30, 1, 2));
  EXPECT_TRUE(fs::exists(out + "/tokenizer_config.json"));
  auto text = ReadFileToString(out + "/config.json");
  EXPECT_NE(text->find("\"bos_token_id\": 1"), std::string::npos) << *text;
  EXPECT_NE(text->find("\"eos_token_id\": 2"), std::string::npos);
  EXPECT_NE(text->find("\"tokenizer\": \"sentencepiece\""), std::string::npos);

  // More pieces than the model's vocabulary.
  ASSERT_TRUE(WriteFileAtomically(sp, SentencePieceBytes(41, 1, 2)).ok());
  o.overwrite = true;
  auto s = ExportHfCheckpoint((root_ / "ckpt").string(), out, o);
  EXPECT_NE(s.message().find("41 pieces, more than the model's vocab_size 40"), std::string::npos)
      << s;
}

// Without --tokenizer the export ships the tokenizer the checkpoint records;
// a recorded tokenizer that is gone, or a --tokenizer the checkpoint was not
// trained with, is refused rather than exported under the wrong ids.
TEST_F(HfExportTest, UsesTheRecordedTokenizerAndRefusesAnother) {
  const std::string sp = (root_ / "sp.model").string();
  ASSERT_TRUE(WriteFileAtomically(sp, SentencePieceBytes(30, 1, 2)).ok());
  const std::string ckpt = (root_ / "ckpt").string();
  auto record = [&](const std::string& tokenizer, const std::string& checksum) {
    WriteCheckpoint();
    auto m = ReadManifest(ckpt);
    ASSERT_TRUE(m.ok()) << m.status();
    m->data.source = "text";
    m->data.path = "/corpus";
    m->data.tokenizer = tokenizer;
    m->data.tokenizer_checksum = checksum;
    ASSERT_TRUE(WriteManifest(ckpt, *m).ok());
  };
  HfExportOptions o;
  o.overwrite = true;
  const std::string out = (root_ / "hf").string();

  record(sp, Checksum(SentencePieceBytes(30, 1, 2)));
  ASSERT_TRUE(ExportHfCheckpoint(ckpt, out, o).ok());
  EXPECT_EQ(*ReadFileToString(out + "/tokenizer.model"), SentencePieceBytes(30, 1, 2));

  // The recorded model changed since training.
  ASSERT_TRUE(WriteFileAtomically(sp, SentencePieceBytes(31, 1, 2)).ok());
  auto s = ExportHfCheckpoint(ckpt, out, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("is not the one the checkpoint was trained with"), std::string::npos)
      << s;
  // ... or is gone.
  fs::remove(sp);
  s = ExportHfCheckpoint(ckpt, out, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find(sp + " ("), std::string::npos) << s;
  EXPECT_NE(s.message().find("pass --tokenizer"), std::string::npos) << s;
  // An explicit --tokenizer equal to the recorded one still exports.
  const std::string copy = (root_ / "copy.model").string();
  ASSERT_TRUE(WriteFileAtomically(copy, SentencePieceBytes(30, 1, 2)).ok());
  o.tokenizer_model = copy;
  EXPECT_TRUE(ExportHfCheckpoint(ckpt, out, o).ok());

  // Trained with bytes: a SentencePiece --tokenizer is refused, none is fine.
  record("", "byte");
  s = ExportHfCheckpoint(ckpt, out, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("trained with the byte tokenizer"), std::string::npos) << s;
  o.tokenizer_model.clear();
  const std::string bytes_out = (root_ / "hf-bytes").string();
  ASSERT_TRUE(ExportHfCheckpoint(ckpt, bytes_out, o).ok());
  EXPECT_FALSE(fs::exists(bytes_out + "/tokenizer.model"));
  EXPECT_NE(ReadFileToString(bytes_out + "/config.json")->find("\"tokenizer\": \"byte\""),
            std::string::npos);
}

TEST(HfLlamaConfigTest, ReadsAForeignConfigWithDefaults) {
  // The shape of a released LLaMA config (abridged), without the fields
  // transformers defaults.
  const std::string json = R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 16, "initializer_range": 0.02,
    "intermediate_size": 32, "max_position_embeddings": 4096, "num_attention_heads": 4,
    "num_hidden_layers": 3, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 500000.0,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.40.0",
    "use_cache": true, "vocab_size": 40})";
  auto hf = ParseHfLlamaConfig(json, "c.json");
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_TRUE(hf->tie_word_embeddings);
  EXPECT_TRUE(CheckHfConfigMatches(*hf, SmallConfig(), "c.json").ok());
  ModelConfig other = SmallConfig();
  other.ffn_dim = 64;
  auto s = CheckHfConfigMatches(*hf, other, "c.json");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("intermediate_size 32 vs the job's model.ffn_dim 64"),
            std::string::npos)
      << s;
  other = SmallConfig();
  other.norm_eps = 1e-5;
  EXPECT_NE(CheckHfConfigMatches(*hf, other, "c.json").message().find("rms_norm_eps"),
            std::string::npos);
  other = SmallConfig();
  other.context_length = 8192;
  EXPECT_NE(CheckHfConfigMatches(*hf, other, "c.json").message().find("max_position_embeddings"),
            std::string::npos);
}

TEST(HfLlamaConfigTest, RefusesModelsWeWouldComputeDifferently) {
  const std::string base =
      R"("hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
         "num_hidden_layers": 3, "vocab_size": 40)";
  struct Case {
    std::string extra;
    const char* expect;
  };
  const Case cases[] = {
      {R"("model_type": "mistral")", "model_type is \"mistral\""},
      {R"("model_type": "llama", "hidden_act": "gelu")", "hidden_act"},
      {R"("model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0})",
       "rope_scaling"},
      {R"("model_type": "llama", "attention_bias": true)", "attention_bias"},
      {R"("model_type": "llama", "head_dim": 8)", "head_dim"},
      {R"("model_type": "llama", "num_key_value_heads": 3)", "num_kv_heads"},
      {R"("model_type": "llama", "rms_norm_eps": -1)", "rms_norm_eps"},
      {R"("model_type": "llama", "tie_word_embeddings": "yes")", "tie_word_embeddings"},
  };
  for (const Case& c : cases) {
    auto hf = ParseHfLlamaConfig("{" + c.extra + ", " + base + "}", "c.json");
    ASSERT_FALSE(hf.ok()) << c.extra;
    EXPECT_NE(hf.status().message().find(c.expect), std::string::npos) << hf.status();
  }
  EXPECT_NE(ParseHfLlamaConfig("{" + base + "}", "c.json").status().message().find("model_type"),
            std::string::npos);
  EXPECT_NE(ParseHfLlamaConfig(R"({"model_type": "llama", "hidden_size": 16})", "c.json")
                .status()
                .message()
                .find("num_hidden_layers is missing"),
            std::string::npos);
  EXPECT_FALSE(ParseHfLlamaConfig("{\"model_type\": \"llama\",", "c.json").ok());
}

TEST(HfLlamaConfigTest, NamesMapBothWays) {
  for (const HfParameter& p : HfLlamaParameters(SmallConfig())) EXPECT_EQ(HfNameOf(p.ours), p.hf);
  EXPECT_EQ(HfNameOf("layers.0.wq.adam_m"), "");
  EXPECT_EQ(HfNameOf("kfac.layers.0.a"), "");
  EXPECT_TRUE(IsIgnoredHfTensor("model.layers.0.self_attn.rotary_emb.inv_freq"));
}

}  // namespace
}  // namespace detour::model
