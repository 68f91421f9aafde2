// Export → import in process: a trained model exported to the HF layout and
// imported into stages built from another seed gives identical logits; BF16,
// tied embeddings and foreign checkpoints import; mismatches are refused
// naming the tensor or field; and an independent numpy LLaMA forward over
// the exported files (hf_numpy_reference.py) matches our logits.
#include "worker/model/hf_import.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "model_test_util.h"
#include "tests/test_paths.h"
#include "worker/model/checkpoint.h"
#include "worker/model/corpus.h"
#include "worker/model/engine.h"
#include "worker/model/hf_export.h"
#include "worker/model/hf_llama.h"
#include "worker/model/routes.h"
#include "worker/model/safetensors.h"
#include "worker/model/transformer.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;
using testing::MaxAbsDiff;
using testing::SmallSpec;

// Logits [B, T, vocab] of the full pipeline 0 → 1 → ... → S-1 (in eval).
at::Tensor Logits(PipelineEngine& engine, const at::Tensor& tokens) {
  auto x = engine.stage(0).Infer(tokens);
  EXPECT_TRUE(x.ok()) << x.status();
  at::Tensor h = *x;
  for (int s = 1; s < engine.num_stages(); ++s) {
    auto y = engine.stage(s).Infer(h);
    EXPECT_TRUE(y.ok()) << y.status();
    h = *y;
  }
  std::map<std::string, at::Tensor> p = testing::ToMap(engine.stage(0).Parameters());
  c10::NoGradGuard no_grad;
  return at::linear(RmsNorm(h, p.at("norm.weight"), engine.stage(0).config().norm_eps),
                    p.at("head.weight"));
}

class HfImportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    at::set_num_threads(1);
    root_ = fs::path(::testing::TempDir()) / ("hf_import_test." + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    spec_ = SmallSpec(7);
    spec_.mutable_optimizer()->mutable_adamw()->set_lr(1e-2);
    auto engine = PipelineEngine::Create(spec_, c10::Device(c10::kCPU));
    ASSERT_TRUE(engine.ok()) << engine.status();
    trained_ = std::move(*engine);
    // Two steps, so the norms are no longer all ones and every tensor matters.
    const TokenSequence text = SplitText(GenerateCorpus(3, 20000), 0.0)->train;
    for (uint64_t it = 0; it < 2; ++it) {
      auto routes = GenerateRoutes(spec_.pipeline(), 4, 1, it);
      auto mbs = IterationMicrobatches(spec_, text, it, at::Device(at::kCPU));
      ASSERT_TRUE(routes.ok() && mbs.ok());
      ASSERT_TRUE(trained_->RunIteration(it, *routes, *mbs).ok());
    }
    ASSERT_TRUE(SaveCheckpoint((root_ / "ckpt").string(), *trained_, 2, "").ok());
    tokens_ = at::remainder(at::arange(0, 2 * 16, at::kLong) * 37 + 5, 256).reshape({2, 16});
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string Export(SafetensorsDType dtype, const std::string& name) {
    HfExportOptions o;
    o.dtype = dtype;
    const std::string out = (root_ / name).string();
    absl::Status s = ExportHfCheckpoint((root_ / "ckpt").string(), out, o);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  // A fresh engine of another seed with every stage imported from `dir`.
  std::unique_ptr<PipelineEngine> Imported(const std::string& dir, absl::Status* status) {
    v1::JobSpec other = spec_;
    other.set_seed(99);
    auto engine = PipelineEngine::Create(other, c10::Device(c10::kCPU));
    EXPECT_TRUE(engine.ok());
    *status = absl::OkStatus();
    for (int s = 0; s < (*engine)->num_stages() && status->ok(); ++s) {
      *status = InitStageFromHf(dir, &(*engine)->stage(s));
    }
    return std::move(*engine);
  }

  fs::path root_;
  v1::JobSpec spec_;
  std::unique_ptr<PipelineEngine> trained_;
  at::Tensor tokens_;
};

TEST_F(HfImportTest, ExportThenImportGivesIdenticalLogits) {
  const std::string dir = Export(SafetensorsDType::kF32, "hf");
  absl::Status s;
  auto imported = Imported(dir, &s);
  ASSERT_TRUE(s.ok()) << s;
  const at::Tensor expected = Logits(*trained_, tokens_);
  EXPECT_EQ(MaxAbsDiff(expected, Logits(*imported, tokens_)), 0.0);
  // Not by accident: the seed-99 model before the import differs.
  v1::JobSpec other = spec_;
  other.set_seed(99);
  auto fresh = PipelineEngine::Create(other, c10::Device(c10::kCPU));
  EXPECT_GT(MaxAbsDiff(expected, Logits(**fresh, tokens_)), 1e-3);
}

TEST_F(HfImportTest, Bf16ImportsCloseToF32) {
  const std::string dir = Export(SafetensorsDType::kBF16, "hf16");
  absl::Status s;
  auto imported = Imported(dir, &s);
  ASSERT_TRUE(s.ok()) << s;
  const at::Tensor expected = Logits(*trained_, tokens_);
  const double diff = MaxAbsDiff(expected, Logits(*imported, tokens_));
  EXPECT_GT(diff, 0.0);   // rounded ...
  EXPECT_LT(diff, 2e-2);  // ... to bf16's 8 bits of mantissa
}

// Rewrites dir/model.safetensors with `edit` applied to its tensor list.
void Rewrite(const std::string& dir,
             const std::function<void(std::vector<SafetensorsTensor>*)>& edit) {
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsTensor> tensors = (*f)->contents().tensors;
  std::vector<std::string> keep;  // owned copies: the file is replaced
  keep.reserve(tensors.size() + 1);
  for (auto& t : tensors) t.data = keep.emplace_back(t.data);
  edit(&tensors);
  std::map<std::string, std::string> meta = (*f)->contents().metadata;
  f->reset();
  ASSERT_TRUE(WriteSafetensorsFile(dir + "/model.safetensors", tensors, meta).ok());
}

void ReplaceInFile(const std::string& path, const std::string& from, const std::string& to) {
  auto text = ReadFileToString(path);
  ASSERT_TRUE(text.ok());
  const size_t at = text->find(from);
  ASSERT_NE(at, std::string::npos) << from;
  text->replace(at, from.size(), to);
  ASSERT_TRUE(WriteFileAtomically(path, *text).ok());
}

TEST_F(HfImportTest, TiedCheckpointsInitialiseTheHeadFromTheEmbedding) {
  const std::string dir = Export(SafetensorsDType::kF32, "tied");
  Rewrite(dir, [](std::vector<SafetensorsTensor>* t) {
    t->erase(std::remove_if(t->begin(), t->end(),
                            [](const SafetensorsTensor& x) { return x.name == "lm_head.weight"; }),
             t->end());
  });
  absl::Status s;
  Imported(dir, &s);
  EXPECT_NE(s.message().find("no tensor lm_head.weight"), std::string::npos) << s;
  ReplaceInFile(dir + "/config.json", "\"tie_word_embeddings\": false",
                "\"tie_word_embeddings\": true");
  auto imported = Imported(dir, &s);
  ASSERT_TRUE(s.ok()) << s;
  auto p = testing::ToMap(imported->stage(0).Parameters());
  EXPECT_EQ(MaxAbsDiff(p.at("head.weight"), p.at("embed.weight")), 0.0);
}

TEST_F(HfImportTest, RefusesMismatchesNamingTheTensorOrField) {
  const std::string dir = Export(SafetensorsDType::kF32, "bad");
  absl::Status s;
  // A job of another shape.
  v1::JobSpec wide = spec_;
  wide.mutable_model()->set_ffn_dim(96);
  auto engine = PipelineEngine::Create(wide, c10::Device(c10::kCPU));
  ASSERT_TRUE(engine.ok());
  s = InitStageFromHf(dir, &(*engine)->stage(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("intermediate_size 64 vs the job's model.ffn_dim 96"),
            std::string::npos)
      << s;

  // A tensor of the wrong shape (config.json still says the right one).
  Rewrite(dir, [](std::vector<SafetensorsTensor>* t) {
    for (auto& x : *t) {
      if (x.name == "model.layers.3.mlp.down_proj.weight") {
        x.shape = {64, 32};
      }
    }
  });
  auto imported = Imported(dir, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("model.layers.3.mlp.down_proj.weight is [64, 32] but the job's model "
                             "needs [32, 64]"),
            std::string::npos)
      << s;
  // Nothing changed on a refused import.
  auto before = testing::ToMap(imported->stage(3).Parameters());
  v1::JobSpec other = spec_;
  other.set_seed(99);
  auto fresh = PipelineEngine::Create(other, c10::Device(c10::kCPU));
  EXPECT_EQ(MaxAbsDiff(before.at("layers.3.wq"),
                       testing::ToMap((*fresh)->stage(3).Parameters()).at("layers.3.wq")),
            0.0);

  // A bias our model does not have.
  const std::string dir2 = Export(SafetensorsDType::kF32, "bias");
  const std::string bias(32 * 4, '\0');
  Rewrite(dir2, [&](std::vector<SafetensorsTensor>* t) {
    t->push_back({"model.layers.0.self_attn.q_proj.bias", SafetensorsDType::kF32, {32}, bias});
  });
  Imported(dir2, &s);
  EXPECT_NE(s.message().find("model.layers.0.self_attn.q_proj.bias is not a parameter"),
            std::string::npos)
      << s;

  // No weights at all; a missing directory.
  fs::remove(dir2 + "/model.safetensors");
  Imported(dir2, &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  Imported((root_ / "nowhere").string(), &s);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
}

TEST_F(HfImportTest, ReadsShardedCheckpointsAndF16) {
  const std::string dir = Export(SafetensorsDType::kF32, "sharded");
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  // Two shards: the embedding (as F16) alone, everything else.
  std::vector<SafetensorsTensor> a, b;
  std::vector<std::string> keep;
  keep.reserve(2);
  std::vector<std::string> map;
  for (const SafetensorsTensor& t : (*f)->contents().tensors) {
    if (t.name == "model.embed_tokens.weight") {
      at::Tensor x = at::empty(t.shape, at::kFloat);
      std::memcpy(x.data_ptr(), t.data.data(), t.data.size());
      at::Tensor h = x.to(at::kHalf).contiguous();
      SafetensorsTensor half = t;
      half.dtype = SafetensorsDType::kF16;
      half.data = keep.emplace_back(static_cast<const char*>(h.data_ptr()), h.nbytes());
      a.push_back(half);
      map.push_back("\"" + t.name + "\": \"model-00001-of-00002.safetensors\"");
    } else {
      b.push_back(t);
      map.push_back("\"" + t.name + "\": \"model-00002-of-00002.safetensors\"");
    }
  }
  ASSERT_TRUE(WriteSafetensorsFile(dir + "/model-00001-of-00002.safetensors", a, {}).ok());
  ASSERT_TRUE(WriteSafetensorsFile(dir + "/model-00002-of-00002.safetensors", b, {}).ok());
  f->reset();
  fs::remove(dir + "/model.safetensors");
  ASSERT_TRUE(
      WriteFileAtomically(dir + "/model.safetensors.index.json",
                          "{\"metadata\": {}, \"weight_map\": {" + absl::StrJoin(map, ", ") + "}}")
          .ok());
  absl::Status s;
  auto imported = Imported(dir, &s);
  ASSERT_TRUE(s.ok()) << s;
  const double diff = MaxAbsDiff(Logits(*trained_, tokens_), Logits(*imported, tokens_));
  EXPECT_GT(diff, 0.0);
  EXPECT_LT(diff, 1e-2);
  // A weight map pointing outside the directory.
  ASSERT_TRUE(WriteFileAtomically(dir + "/model.safetensors.index.json",
                                  "{\"weight_map\": {\"x\": \"../evil.safetensors\"}}")
                  .ok());
  Imported(dir, &s);
  EXPECT_NE(s.message().find("does not name a file in the directory"), std::string::npos) << s;
}

// Our logits against an independent numpy LLaMA forward over the exported
// files (no LibTorch, no transformers: its own safetensors and config.json
// reading). Skipped where python3 or numpy is missing.
TEST_F(HfImportTest, NumpyReferenceForwardMatchesOurLogits) {
  // Debian's python3-numpy belongs to /usr/bin/python3, which a python3
  // earlier on PATH (pyenv, a venv) may hide.
  std::string python;
  for (const char* candidate : {"/usr/bin/python3", "python3"}) {
    const std::string probe = absl::StrCat(candidate, " -c 'import numpy' >/dev/null 2>&1");
    if (std::system(probe.c_str()) == 0) {
      python = candidate;
      break;
    }
  }
  if (python.empty()) GTEST_SKIP() << "no python3 with numpy (Debian: python3-numpy)";
  const std::string dir = Export(SafetensorsDType::kF32, "numpy");
  const at::Tensor logits = Logits(*trained_, tokens_).contiguous();
  std::string tokens_text;
  for (int64_t i = 0; i < tokens_.numel(); ++i) {
    absl::StrAppend(&tokens_text, i ? " " : "", tokens_.view({-1})[i].item<int64_t>());
  }
  ASSERT_TRUE(WriteFileAtomically(dir + "/test_tokens.txt", tokens_text).ok());
  ASSERT_TRUE(
      WriteFileAtomically(dir + "/test_logits.f32",
                          std::string(static_cast<const char*>(logits.data_ptr()), logits.nbytes()))
          .ok());
  const std::string script = detour::testing::SourceDir() + "/tests/model/hf_numpy_reference.py";
  const std::string cmd = absl::StrCat(python, " ", script, " ", dir, " 2 16 2>&1");
  FILE* pipe = ::popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) out += buf;
  const int rc = ::pclose(pipe);
  ASSERT_EQ(WEXITSTATUS(rc), 0) << out;
  EXPECT_NE(out.find("max abs diff"), std::string::npos) << out;
  std::cout << out;
}

}  // namespace
}  // namespace detour::model
