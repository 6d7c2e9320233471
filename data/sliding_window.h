// Sliding-window inference over a whole volume, as nnU-Net predicts: the volume is tiled with
// patches of the size the model was trained on, overlapping by half a patch (the last tile along
// each axis aligned with the volume's end), each patch's class probabilities are weighted by a
// Gaussian centred on the patch (centres predict better than borders, which see less context),
// summed per voxel, and the prediction is the class of the largest sum.
//
// The model is the caller's: SlidingWindowTiles says where the patches are, CropPatch
// (data/volume_dataset.h) cuts one, Add takes the model's logits for it. Dice per
// class compares a prediction with the label map.
//
// Thread-compatible.
#pragma once

#include <cstdint>
#include <vector>

#include "core/status.h"
#include "data/volume_dataset.h"

namespace tessera {

// The patches that tile a width x height x depth volume with patch^3 patches, `step` apart along
// each axis (nnU-Net: half a patch), the last one along an axis ending at the volume's end. A
// volume smaller than the patch along an axis gets one patch there, centred.
std::vector<PatchOrigin> SlidingWindowTiles(int64_t width, int64_t height, int64_t depth,
                                            int64_t patch, int64_t step);

class SlidingWindowPrediction {
 public:
  // REQUIRES: classes >= 2, patch >= 1.
  SlidingWindowPrediction(int64_t width, int64_t height, int64_t depth, int64_t classes,
                          int64_t patch);

  // Adds one patch's logits ([classes][patch^3], the model's output for the patch at `origin`):
  // their softmax, Gaussian-weighted, to the voxels of the volume the patch covers.
  void Add(PatchOrigin origin, const float* logits);

  // The predicted class of every voxel ([depth][height][width]); a voxel no patch covered is
  // background.
  std::vector<int32_t> Classes() const;

 private:
  int64_t width_, height_, depth_, classes_, patch_;
  std::vector<float> importance_;  // patch^3: the Gaussian, sigma = patch / 8, peak 1
  std::vector<float> sums_;        // [classes][volume]
};

// Dice per class 1..classes-1 (index 0 is class 1): 2|P n G| / (|P| + |G|), NaN where neither the
// prediction nor the labels have the class. InvalidArgument when the sizes differ.
Result<std::vector<double>> DicePerClass(const std::vector<int32_t>& predicted,
                                         const std::vector<int32_t>& labels, int64_t classes);

}  // namespace tessera
