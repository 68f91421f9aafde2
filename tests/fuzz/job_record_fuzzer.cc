// Fuzzes the coordinator's recovery: a job record file with arbitrary
// content in the data dir, loaded by the job store and recovered (a pending
// job's stored spec is validated again). Nothing may crash; an unreadable
// file is kept aside.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/spec.h"
#include "coordinator/job_store.h"
#include "tests/temp_dirs.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = detour::testing::ProcessTempDir() + "/jobs";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  std::filesystem::create_directories(dir + "/jobs", ec);
  {
    std::ofstream out(dir + "/jobs/job-000001.json", std::ios::binary);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  detour::JobStore store(dir);
  if (!store.Load().ok()) return 0;
  for (const auto& job : store.List(detour::v1::JOB_STATE_UNSPECIFIED)) {
    (void)detour::NormalizeJobSpec(job.spec());
  }
  return 0;
}
