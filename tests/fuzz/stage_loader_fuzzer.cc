// Fuzzes the checkpoint stage-file loader end to end (worker/model/
// checkpoint.h, needs LibTorch): arbitrary bytes as stage-0.bin, with a
// manifest whose size and checksum match them (so the bytes reach the
// parser, as a file written truncated or corrupt would), loaded into a tiny
// stage 0 and its optimiser: container, tensor creation, shape checks and
// AdamW::LoadState. Every input must end in an error or a complete load,
// never a crash or an exception. (stage_file_fuzzer covers the container
// alone, without LibTorch, under the sanitizers.)

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/Parallel.h>

#include "tests/temp_dirs.h"
#include "worker/model/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using detour::model::ModelConfig;

// The fuzzer's model; its stage file (a few KiB) seeds the corpus.
ModelConfig TinyConfig() {
  ModelConfig c;
  c.num_layers = 1;
  c.d_model = 8;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.ffn_dim = 16;
  c.vocab_size = 16;
  c.context_length = 8;
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = [] {
    at::set_num_threads(1);
    const std::string d = detour::testing::ProcessTempDir() + "/stage";
    fs::create_directories(d);
    return d;
  }();
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  {
    std::ofstream out(dir + "/stage-0.bin", std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  auto stage = detour::model::Stage::Create(TinyConfig(), 0, 1,
                                            detour::model::StageOptions{1, c10::kCPU, 7});
  if (!stage.ok()) std::abort();
  detour::model::AdamW optimizer((*stage)->Parameters(), detour::v1::AdamWSpec());
  detour::model::CheckpointManifest manifest;
  manifest.model = TinyConfig();
  manifest.num_stages = 1;
  detour::model::StageFileEntry entry;
  entry.file = "stage-0.bin";
  entry.layers = {0, 1};
  entry.bytes = bytes.size();
  entry.checksum = detour::model::Checksum(bytes);
  manifest.stages.push_back(entry);
  // Write one seed when asked (DETOUR_FUZZ_WRITE_SEED=path): the stage file
  // of this tiny model, from which truncated and corrupted seeds are cut.
  if (const char* seed = std::getenv("DETOUR_FUZZ_WRITE_SEED")) {
    auto written = detour::model::WriteStageFile(dir + "/seed", **stage, optimizer);
    if (!written.ok()) std::abort();
    fs::copy_file(dir + "/seed/stage-0.bin", seed, fs::copy_options::overwrite_existing);
  }
  (void)detour::model::LoadStage(dir, manifest, stage->get(), &optimizer);
  return 0;
}
