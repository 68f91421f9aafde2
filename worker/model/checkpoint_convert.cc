#include "worker/model/checkpoint_convert.h"

#include <unistd.h>

#include <filesystem>
#include <set>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/files.h"
#include "common/status.h"
#include "worker/model/stage_file.h"

namespace detour::model {
namespace {

namespace fs = std::filesystem;

constexpr char kFormatV2[] = "detour-checkpoint-v2";

// "stage-1.bin: 14 tensors, 0.2 MiB"
std::string Summary(const std::string& file, size_t tensors, uint64_t bytes) {
  return absl::StrFormat("%s: %d tensors, %.1f MiB", file, tensors,
                         static_cast<double>(bytes) / (1 << 20));
}

// Removes the directory being built unless Release() was called.
class ScratchDir {
 public:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}
  ~ScratchDir() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  void Release() { path_.clear(); }

 private:
  std::string path_;
};

// The v1 manifest's entries must name distinct stages and files (v1 writers
// wrote one file per stage); the v2 file of stage k is stage-<k>.bin.
absl::Status CheckDistinct(const CheckpointManifest& m, const std::string& dir) {
  std::set<int> stages;
  std::set<std::string> files;
  for (const StageFileEntry& e : m.stages) {
    if (!stages.insert(e.stage).second || !files.insert(e.file).second) {
      return absl::DataLossError(absl::StrCat((fs::path(dir) / "manifest.json").string(),
                                              ": two entries for stage ", e.stage, " or file ",
                                              e.file));
    }
  }
  if (m.stages.empty()) {
    return absl::DataLossError(
        absl::StrCat((fs::path(dir) / "manifest.json").string(), ": no stage files"));
  }
  return absl::OkStatus();
}

// Reads back a stage file the converter wrote: size bounded, container
// valid. Returns its manifest entry for `v1`'s stage and layers.
absl::StatusOr<StageFileEntry> CheckConverted(const std::string& dir, const StageFileEntry& v1,
                                              const std::string& file,
                                              const V1ConvertOptions& options) {
  const std::string path = (fs::path(dir) / file).string();
  auto bytes = ReadFileBounded(path, ManifestLimits::kMaxStageFileBytes);
  if (!bytes.ok()) {
    return absl::DataLossError(absl::StrCat("converting ", v1.file, ": the converted file ", path,
                                            " is unreadable: ", bytes.status().message()));
  }
  auto records = DecodeStageFile(*bytes, path);
  if (!records.ok()) {
    return absl::DataLossError(
        absl::StrCat("converting ", v1.file, ": ", records.status().message()));
  }
  if (records->empty()) {
    return absl::DataLossError(absl::StrCat(v1.file, " holds no tensors"));
  }
  StageFileEntry entry;
  entry.stage = v1.stage;
  entry.file = file;
  entry.layers = v1.layers;
  entry.bytes = bytes->size();
  entry.checksum = Checksum(*bytes);
  if (options.progress) {
    options.progress(absl::StrCat(v1.file, " → ", Summary(file, records->size(), entry.bytes)));
  }
  return entry;
}

}  // namespace

absl::StatusOr<CheckpointManifest> ConvertV1Checkpoint(const std::string& old_dir,
                                                       const std::string& new_dir,
                                                       const V1ConvertOptions& options) {
  if (!options.convert_stage) {
    return absl::InvalidArgumentError("ConvertV1Checkpoint: no convert_stage given");
  }
  std::string trimmed = new_dir;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const fs::path target = fs::path(trimmed).lexically_normal();
  std::error_code ec;
  if (target.empty() || !target.has_filename()) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", new_dir, "\" does not name a new directory"));
  }
  if (fs::exists(fs::symlink_status(target, ec))) {
    return absl::AlreadyExistsError(
        absl::StrCat(target.string(),
                     " exists; the converter writes a new checkpoint and "
                     "never replaces anything"));
  }
  ASSIGN_OR_RETURN(CheckpointManifest v1, ReadV1Manifest(old_dir));
  RETURN_IF_ERROR(CheckDistinct(v1, old_dir));
  // Every v1 file's size and checksum before LibTorch sees any of them: a
  // damaged file is named here, without running its reader.
  for (const StageFileEntry& e : v1.stages) {
    auto bytes = ReadStageFileBytes(old_dir, e);
    if (!bytes.ok()) return bytes.status();
  }

  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = absl::StrCat(target.string(), ".tmp.", ::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot create ", tmp, ": ", ec ? ec.message() : "it exists"));
  }
  ScratchDir scratch(tmp);

  CheckpointManifest v2 = v1;
  v2.format = kFormatV2;
  v2.stages.clear();
  for (const StageFileEntry& e : v1.stages) {
    const std::string file = absl::StrCat("stage-", e.stage, ".bin");
    const std::string v1_path = (fs::path(old_dir) / e.file).string();
    absl::Status s = options.convert_stage(v1_path, e, (fs::path(tmp) / file).string());
    if (!s.ok()) return Annotate(s, absl::StrCat("converting ", v1_path));
    ASSIGN_OR_RETURN(StageFileEntry entry, CheckConverted(tmp, e, file, options));
    v2.stages.push_back(std::move(entry));
  }
  RETURN_IF_ERROR(WriteManifest(tmp, v2));  // last: it marks a complete checkpoint
  RETURN_IF_ERROR(SyncDirectory(tmp));
  // Checked where it lies before it is renamed into place.
  RETURN_IF_ERROR(VerifyCheckpoint(tmp).status());
  fs::rename(tmp, target, ec);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot rename ", tmp, " to ", target.string(), ": ", ec.message()));
  }
  scratch.Release();
  RETURN_IF_ERROR(SyncDirectory(parent.string()));
  return v2;
}

absl::StatusOr<CheckpointManifest> VerifyCheckpoint(const std::string& dir) {
  ASSIGN_OR_RETURN(CheckpointManifest m, ReadManifest(dir));
  for (const StageFileEntry& e : m.stages) {
    ASSIGN_OR_RETURN(std::string bytes, ReadStageFileBytes(dir, e));
    RETURN_IF_ERROR(DecodeStageFile(bytes, (fs::path(dir) / e.file).string()).status());
  }
  return m;
}

}  // namespace detour::model
