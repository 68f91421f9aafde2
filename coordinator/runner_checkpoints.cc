#include "coordinator/runner_checkpoints.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_manifest.h"

namespace detour {

RunnerCheckpoints::RunnerCheckpoints(std::string root, std::string job_id)
    : root_(std::move(root)), job_id_(std::move(job_id)) {}

void RunnerCheckpoints::Load(const std::string& last) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path root = fs::path(root_) / job_id_;
  std::vector<std::string> dirs;
  for (auto it = fs::directory_iterator(root, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("iter-", 0) == 0 && fs::exists(it->path() / "manifest.json", ec)) {
      dirs.push_back(it->path().string());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  dirs_.assign(dirs.begin(), dirs.end());
  last_ = last;
}

absl::StatusOr<uint64_t> RunnerCheckpoints::IterationOf(const std::string& dir) {
  auto manifest = model::ReadManifest(dir);
  if (!manifest.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", dir, " is not complete (", manifest.status().message(), ")"));
  }
  return manifest->iteration;
}

bool RunnerCheckpoints::Due(const v1::CheckpointPolicy& policy, uint64_t iteration,
                            uint64_t iterations, bool stage_empty) {
  return !stage_empty && !policy.disabled() &&
         ((policy.every_iterations() > 0 && (iteration + 1) % policy.every_iterations() == 0) ||
          iteration + 1 == iterations);
}

std::string RunnerCheckpoints::Dir(uint64_t iterations_done) const {
  return absl::StrFormat("%s/%s/iter-%06d", root_, job_id_, iterations_done);
}

v1::CommitCheckpoint RunnerCheckpoints::Commit(
    uint64_t iterations_done, const std::string& dir,
    const std::map<std::string, v1::IterationResult>& results, int* stages) const {
  v1::CommitCheckpoint c;
  c.set_job_id(job_id_);
  c.set_iteration(iterations_done);
  c.set_dir(dir);
  std::set<uint32_t> seen;
  for (const auto& [id, r] : results) {
    if (r.has_checkpoint() && seen.insert(r.checkpoint().stage()).second) {
      *c.add_files() = r.checkpoint();
    }
  }
  *stages = static_cast<int>(seen.size());
  return c;
}

void RunnerCheckpoints::Committed(const std::string& dir, uint32_t keep_last) {
  if (dirs_.empty() || dirs_.back() != dir) dirs_.push_back(dir);
  last_ = dir;
  const uint32_t keep = std::max<uint32_t>(1, keep_last);
  while (dirs_.size() > keep) {
    std::error_code ec;
    std::filesystem::remove_all(dirs_.front(), ec);
    dirs_.pop_front();
  }
}

}  // namespace detour
