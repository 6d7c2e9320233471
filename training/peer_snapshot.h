// PeerSnapshot: a trainer's state kept in memory on the workers, so that recovering from a lost
// worker neither reads the disk nor replays the steps since the last checkpoint.
//
// A disk checkpoint (training/checkpoint.h) survives anything, but it is written every S steps and
// a recovery replays the steps since. A peer snapshot is cheap enough to take every step or few:
// each piece of state the loader needs (parameters and Adam moments; of a replicated group, rank
// 0's copy) is copied twice, on the worker that holds it and on its buddy, the worker of the next
// rank (rank r's buddy is rank (r + 1) mod N). The copies are new objects, so the steps after
// leave them as they were. A snapshot lives as long as this object (it holds the references); a
// new one replaces it only once complete.
//
// Survival: a piece is lost only when its holder and its buddy both are. With N >= 2 ranks one
// lost worker never loses the snapshot; two lose it only when they are neighbours (r and r + 1).
// A lost scheduler loses it (the workers start anew); then the disk checkpoint is what is left.
//
// Restore gathers every piece from a surviving copy (the one on a worker not known dead first,
// the other if that fails) and writes the groups into a trainer of any plan, as LoadCheckpoint
// does (GatheredState). Unavailable naming the piece and both workers when neither copy
// survived: the caller goes back to the disk checkpoint.
//
// Cost: memory for two copies of the model state, spread over the workers (each holds its own
// pieces and its neighbour's; up to four while a new snapshot replaces the old one), and one
// transfer of each rank's pieces to its buddy per snapshot. In process (no workers) there is one
// copy, in this process.
//
// Thread safety: none; the driver's training thread uses it.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "core/ids.h"
#include "core/status.h"
#include "training/checkpoint.h"
#include "training/trainer.h"

namespace tessera {

class PeerSnapshot {
 public:
  // The state of `trainer` after trainer.steps_taken() steps, with the data position
  // `sampler_state` (BatchSampler::SaveState).
  static Result<PeerSnapshot> Take(Trainer& trainer, std::string sampler_state);

  // Writes the snapshot into `trainer` (any plan of the same model) and sets its step count.
  // `dead`: workers known lost, whose copies are not asked for. The result's path names the
  // snapshot ("peer snapshot of step S").
  Result<CheckpointInfo> Restore(Trainer& trainer, const std::set<WorkerId>& dead) const;

  int64_t step() const { return step_; }
  // Bytes of model state held (each copy counts once).
  int64_t bytes() const { return bytes_; }
  // Copies per piece: 2, or 1 without a buddy (one rank, or in process).
  int copies() const { return copies_; }

 private:
  struct Piece {
    std::string layer;
    StateKind kind = StateKind::kParameter;
    int64_t padded = 0;  // the group's elements in the plan that held it
    int64_t begin = 0;
    int64_t numel = 0;
    int rank = 0;
    WorkerId holder, buddy;  // where `own` and `spare` are (invalid in process)
    Value own, spare;        // spare: undefined without a buddy
  };
  int64_t step_ = 0;
  std::string sampler_state_;
  std::vector<Piece> pieces_;
  int64_t bytes_ = 0;
  int copies_ = 1;
};

}  // namespace tessera
