// Checkpoints: a trainer's state on disk, independent of the plan that wrote it.
//
//   <dir>/step_00000100/manifest.json   the model (ModelSpec::config, else its name and layer
//                                       groups), step, the batch sampler's state, the plan
//                                       that wrote it, and for every piece of every group: its
//                                       layer, kind, rank, element range, file, size, checksum
//   <dir>/step_00000100/rank<r>/<layer>.<kind>.bin   one piece, raw little-endian fp32
//   <dir>/latest                        the name of the newest complete checkpoint
//
// Pieces are saved as the plan holds them (a ZeRO-3 run saves N shards of every group; replicated
// state is saved by every rank, and loading reads rank 0's copy), each by the worker that holds it
// (Trainer::WriteState: a graph of write_file tasks pinned to the pieces' workers, so no state
// travels to the driver; workers on other machines need the checkpoint directory at the same
// absolute path, a shared filesystem). The driver checks every worker's receipt (size, checksum)
// and writes the manifest. Loading assembles each group from whatever pieces were saved and writes
// it into the trainer's own placement, so any data-parallel size and any ZeRO stage can resume any
// checkpoint. Every file is written atomically, into <dir>/incoming.partial, which is renamed to
// the step directory only once complete, and `latest` moves only after that, so a crash or a full
// disk mid-save never touches the previous checkpoint.
//
// Errors: a missing checkpoint is NotFound naming the path; a truncated or corrupted piece or
// manifest is DataLoss naming the file and what is wrong; a checkpoint of another model shape
// is InvalidArgument naming the field.
//
// 1-bit Adam's error buffers (its compressed phase) are saved per rank like any piece; loading
// past the freeze step puts the trainer in that phase and restores them: on as many data ranks,
// each rank's own (the run goes on exactly); on another number, resharded so that what the
// compressed all-reduce still owes the true averages is kept (every rank's worker error the
// saving ranks' mean; the server errors joined in chunk order and cut into the new chunks).
//
// The manifest's "model" is the model's ModelSpec::config as a JSON object when it has one (the
// transformer language model's {"channels", "heads", "layers", "max_seq_len", "vocab"}, as its
// checkpoints have always recorded it), else {"name", "layer_groups": [{"name", "numel"}, ...]};
// loading compares every field of the trainer's own with the saved one. So a checkpoint moves
// between implementations of one description (fused or primitive layers).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"
#include "training/trainer.h"

namespace tessera {

// Model state gathered from the pieces some plan held (a checkpoint's files, a peer snapshot's
// copies), as whole groups padded as that plan padded them: by layer name and kind, with the
// elements the pieces covered. Replicas are left out by the caller (each element once).
struct GatheredState {
  std::map<std::pair<std::string, StateKind>, std::vector<float>> groups;
  std::map<std::pair<std::string, StateKind>, int64_t> covered;
  // A piece: `numel` values at `begin` of a group of `padded` elements. DataLoss when it does not
  // fit the group.
  Status Add(const std::string& layer, StateKind kind, int64_t padded, int64_t begin,
             const float* values, int64_t numel);
};
// Writes every group the trainer's plan holds from `state`, re-padded for that plan. DataLoss
// naming `source` and the group when one is missing or not whole; then nothing is written.
Status WriteGathered(Trainer& trainer, const GatheredState& state, const std::string& source);

// 1-bit and 0/1 Adam's error buffers as some plan held them (a checkpoint's files, a peer
// snapshot's copies): per layer name, each rank's worker error (its group) and server error (its
// chunk of the group).
struct SavedErrors {
  std::map<std::string, std::map<int, std::vector<float>>> worker, server;
};
// Writes the trainer's error buffers from `saved`, the state of step `step`: 1-bit Adam's once
// past its warm-up (entering the compressed phase), 0/1 Adam's whatever the step; nothing for
// other optimizers. The same number of data ranks: each rank's own, exactly (whatever the ZeRO
// stage). Another number: what the compressed all-reduce still owes the true averages kept
// (collectives/compressed.h's invariant): every rank's worker error the saving ranks' mean, and
// the server errors, joined in chunk order, cut into the new chunks. A layer without saved
// errors keeps zeros.
Status RestoreErrors(Trainer& trainer, const SavedErrors& saved, int64_t step);

struct CheckpointInfo {
  std::string path;           // the step directory
  int64_t step = 0;           // steps taken when saved
  std::string sampler_state;  // BatchSampler::SaveState, for the data position
};

// Saves the trainer's state after trainer.steps_taken() steps; returns the step directory.
Result<std::string> SaveCheckpoint(Trainer& trainer, const std::string& dir,
                                   const std::string& sampler_state);
// Loads `path`: a step directory, or a checkpoint directory (its `latest`). Sets the trainer's
// state and step count.
Result<CheckpointInfo> LoadCheckpoint(Trainer& trainer, const std::string& path);

}  // namespace tessera
