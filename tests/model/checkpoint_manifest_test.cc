// The checkpoint manifest: round trip, and every malformed or out-of-range
// field refused by name (DATA_LOSS) instead of being cast into the model.
#include "common/checkpoint_manifest.h"

#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_replace.h"

namespace detour::model {
namespace {

CheckpointManifest Example() {
  CheckpointManifest m;
  m.iteration = 12;
  m.model.num_layers = 4;
  m.model.d_model = 64;
  m.model.num_heads = 4;
  m.model.num_kv_heads = 2;
  m.model.ffn_dim = 192;
  m.model.vocab_size = 256;
  m.model.context_length = 32;
  m.num_stages = 2;
  m.replicas_per_stage = 3;
  m.seed = 18446744073709551615ull;
  m.rng_state = "state \"quoted\"\n";
  m.stages.push_back({0, "stage-0.pt", {0, 2}, 123456, Checksum("a")});
  m.stages.push_back({1, "stage-1.pt", {2, 4}, 120000, Checksum("b")});
  m.data.source = "shards";
  m.data.path = "/srv/data/corpus.ds";
  m.data.tokenizer_checksum = Checksum("t");
  m.data.validation_fraction = 0.05;
  return m;
}

TEST(CheckpointManifestTest, RoundTrips) {
  const CheckpointManifest m = Example();
  auto back = ParseManifest(ManifestJson(m), "m.json");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->iteration, 12u);
  EXPECT_EQ(back->seed, m.seed);
  EXPECT_EQ(back->rng_state, m.rng_state);
  EXPECT_EQ(back->replicas_per_stage, 3);
  EXPECT_EQ(back->model.DebugString(), m.model.DebugString());
  ASSERT_EQ(back->stages.size(), 2u);
  EXPECT_EQ(back->stages[1].file, "stage-1.pt");
  EXPECT_TRUE(back->stages[1].layers == (LayerRange{2, 4}));
  EXPECT_EQ(back->stages[1].checksum, Checksum("b"));
  EXPECT_EQ(Checksum(""), "fnv1a64:cbf29ce484222325");
  EXPECT_EQ(back->data.source, "shards");
  EXPECT_EQ(back->data.path, "/srv/data/corpus.ds");
  EXPECT_EQ(back->data.tokenizer, "");
  EXPECT_EQ(back->data.tokenizer_checksum, Checksum("t"));
  EXPECT_EQ(back->data.validation_fraction, 0.05);
  // Manifests written before data provenance existed still load.
  CheckpointManifest old = m;
  old.data = {};
  auto back_old = ParseManifest(ManifestJson(old), "m.json");
  ASSERT_TRUE(back_old.ok()) << back_old.status();
  EXPECT_FALSE(back_old->data.known());
}

// Regression: numbers were cast from JSON doubles unchecked
// (1e300 stages, 2^31 layers: undefined behaviour, then allocations sized
// by them), and stage entries were not checked against the model.
TEST(CheckpointManifestTest, RefusesOutOfRangeFieldsByName) {
  const std::string good = ManifestJson(Example());
  struct Case {
    std::string from, to, field;
  };
  const Case cases[] = {
      {"\"num_stages\": 2", "\"num_stages\": 1e300", "num_stages"},
      {"\"num_stages\": 2", "\"num_stages\": 5", "num_stages"},  // > num_layers
      {"\"iteration\": 12", "\"iteration\": -1", "iteration"},
      {"\"d_model\": 64", "\"d_model\": 64.5", "model.d_model"},
      {"\"num_layers\": 4", "\"num_layers\": 2147483648", "model.num_layers"},
      {"\"num_heads\": 4", "\"num_heads\": 3", "model"},  // does not divide d_model
      {"\"layer_end\": 4", "\"layer_end\": 5", "stages[1].layer_end"},
      {"\"layer_begin\": 2, \"layer_end\": 4", "\"layer_begin\": 3, \"layer_end\": 2",
       "stages[1].layer_end"},
      {"\"stage\": 1,", "\"stage\": 2,", "stages[1].stage"},
      {"\"stage-1.pt\"", "\"../stage-1.pt\"", "stages[1].file"},
      {"\"stage-1.pt\"", "\"\"", "stages[1].file"},
      {Checksum("b"), "md5:00", "stages[1].checksum"},
      {"\"bytes\": 120000", "\"bytes\": 1e30", "stages[1].bytes"},
      {"\"seed\": \"18446744073709551615\"", "\"seed\": \"18446744073709551616\"", "seed"},
      {"\"source\": \"shards\"", "\"source\": \"ftp\"", "data.source"},
      {"\"validation_fraction\": 0.05", "\"validation_fraction\": 0.9", "data.validation_fraction"},
      {"\"path\": \"/srv/data/corpus.ds\"", "\"path\": 7", "data.path"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.to);
    const std::string bad = absl::StrReplaceAll(good, {{c.from, c.to}});
    ASSERT_NE(bad, good);
    auto m = ParseManifest(bad, "dir/manifest.json");
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
    EXPECT_NE(m.status().message().find("dir/manifest.json: "), std::string::npos) << m.status();
    EXPECT_NE(m.status().message().find(c.field), std::string::npos) << m.status();
  }
  // More stage entries than stages.
  CheckpointManifest three = Example();
  three.stages.push_back(three.stages[1]);
  EXPECT_EQ(ParseManifest(ManifestJson(three), "m").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseManifest(std::string(2 << 20, ' '), "m").status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(ParseManifest(absl::StrReplaceAll(good, {{"detour-checkpoint-v2", "v9"}}), "m")
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace detour::model
