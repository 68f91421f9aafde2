// A stage's state as it moves and is checked outside the iteration: packed
// into one frame for a joining replica (parameters, AdamW's moments, K-FAC's
// state: model::SerializeStageState) and loaded from one on the joining
// side; the parameter checksum replicas compare after every step; one
// optimiser step at the coordinator's StepCommand; and the checkpoint
// records of a written stage file and of a commit. The job runtime calls
// these on its executor thread; they keep no state. Thread-compatible.
#ifndef DETOUR_WORKER_RUNTIME_STAGE_STATE_H_
#define DETOUR_WORKER_RUNTIME_STAGE_STATE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/checkpoint_manifest.h"
#include "detour/v1/activation_service.pb.h"
#include "detour/v1/control_service.pb.h"
#include "detour/v1/spec.pb.h"
#include "worker/model/kfac.h"
#include "worker/model/optimizer.h"
#include "worker/model/stage.h"
#include "worker/transport/frame_codec.h"

namespace detour {

// The parameters' bytes, hashed where they lie (a copy only for a tensor off
// the CPU or not contiguous): equal across replicas iff identical, up to
// FastHash64's collisions. Runs after every step, so it stays a small
// fraction of one (docs/BENCHMARKS.md §"Parameter checksum").
uint64_t ParameterChecksum(const std::vector<model::NamedTensor>& params);

// The stage's state after the last step, as one DIRECTION_STATE frame of
// job `job_id` from `sender` in `epoch` (`iteration`: the iterations the
// state has seen). The view keeps the bytes alive.
struct StateFrame {
  v1::FrameHeader header;
  TensorView view;
  uint64_t bytes = 0;
};
absl::StatusOr<StateFrame> PackStageState(const model::Stage& stage, const model::AdamW& optimizer,
                                          const model::Kfac* kfac, const std::string& job_id,
                                          uint64_t iteration, const std::string& sender,
                                          uint64_t epoch);

// Loads a state frame's bytes (from `sender`, named in errors) into the
// stage, its optimiser and K-FAC. DATA_LOSS or INVALID_ARGUMENT naming the
// entry when the bytes are not a state of this stage.
absl::Status UnpackStageState(const std::string& sender, const void* data, size_t size,
                              model::Stage* stage, model::AdamW* optimizer, model::Kfac* kfac);

// One optimiser step of iteration `iteration` at the coordinator's word:
// the scheduled learning rate, the global clip from the job's `squared_norm`,
// then K-FAC's agreement among replicas and clean gradients and captures.
// Returns the layers every replica now preconditions with its own factors
// (K-FAC with per-replica preconditioning; empty otherwise).
absl::StatusOr<std::vector<int>> StepStage(const v1::JobSpec& spec, uint64_t iteration,
                                           double squared_norm, model::Stage* stage,
                                           model::AdamW* optimizer, model::Kfac* kfac);

// What an IterationResult reports of a stage file just written.
v1::CheckpointFile CheckpointFileOf(const model::StageFileEntry& entry);

// The manifest a commit asks the first data node to write.
model::CheckpointManifest ManifestOf(const v1::CommitCheckpoint& commit,
                                     const model::ModelConfig& config, const v1::JobSpec& spec);

}  // namespace detour

#endif  // DETOUR_WORKER_RUNTIME_STAGE_STATE_H_
