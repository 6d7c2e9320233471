// A 3D U-Net for volumetric segmentation, defined with the model API (model/model.h): every
// layer is a program of the volume ops (ops/volume_ops.h) and its backward is derived from their
// gradient rules, so the model trains under every plan the planners make (data parallel, ZeRO
// 1-3, offload, accumulation) with no hand-written backward.
//
// Inputs: "volume" f32 [N, in_channels, V, V, V] and "labels" i32 [N, V, V, V] (a label input:
// read by the loss only). Channels double at each level: c_i = base_channels * 2^i. Layers, in
// forward order (for depth 2):
//
//   enc0 ─► down0 ─► enc1 ─► down1 ─► bottleneck ─► up1 ─► dec1 ─► up0 ─► dec0 ─► head ─► loss
//    │                 └───────── skip ──────────────────────┘             │
//    └─────────────────────────── skip ────────────────────────────────────┘
//
//   enc{i}      two conv blocks to c_i channels (input: the volume, or down{i-1})
//   down{i}     max_pool3d, kernel 2: halves each extent (no parameters)
//   bottleneck  two conv blocks to c_depth channels at V / 2^depth
//   up{i}       conv_transpose3d kernel 2 stride 2: c_{i+1} -> c_i channels, doubles each extent
//   dec{i}      concat(up{i}, enc{i}) along channels (the skip connection), two conv blocks to c_i
//   head        conv3d kernel 1 to `classes` channels: the logits [N, classes, V, V, V]
//   loss        voxel_cross_entropy(logits, labels): mean over voxels
//
// A conv block is conv3d (kernel 3, padding 1) -> group_norm (`groups`) -> SiLU by default. The
// nnU-Net-shaped variant (preset "nnunet", Isensee et al. 2021's 3d_fullres network) changes four
// things: channels stop doubling at `max_channels` (320), the norm is instance norm (group norm
// with a group per channel), the activation leaky ReLU (slope 0.01), and levels are reached by
// strided convolutions instead of pooling: enc{i} for i >= 1 and the bottleneck start with a
// stride-2 conv block reading the level above, and there are no down{i} layers. With
// deep_supervision (nnU-Net's, off by default), head{i} layers on decoder levels 1 to depth - 2
// give logits at coarser levels too, and the loss layer reads them after the labels: the sum of
// each level's voxel_cross_entropy (attribute weight) against downsample_labels of the labels,
// add_forward'ed. Conv weights
// start Normal(sqrt(2 / fan_in)) (Kaiming, for the rectifier-like SiLU) and are weight-decayed;
// biases start at zero, group-norm gains at one. Parameters are named
// "<layer>.<block>.<tensor>": "enc0.conv1.w", "dec0.norm2.b", "up0.w", "head.b".
//
// Tensor parallelism (ModelSpec::SplitForTensorParallel, T dividing `groups`): each layer of two
// conv blocks becomes two, Megatron-LM's column- and row-parallel pair for convolutions:
//   <layer>.convs  conv1 split by output channels (each rank's C/T filters and their group norm:
//                  groups/T whole groups), SiLU, conv2 split by input channels without its bias:
//                  a partial sum, all-reduced over the ranks (forward; its input's gradient is
//                  all-reduced in the backward)
//   <layer>        conv2's bias, group norm, SiLU on the sum (replicated)
// Pooling, up-convolutions, the head and the loss run replicated; parameters keep their names.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "model/model_spec.h"
#include "ops/op_registry.h"

namespace tessera {

enum class UNetNorm { kGroup, kInstance };
enum class UNetActivation { kSilu, kLeakyRelu };
enum class UNetDownsample { kMaxPool, kStridedConv };

struct UNet3dConfig {
  int64_t in_channels = 1;
  int64_t classes = 3;        // including background (class 0)
  int64_t base_channels = 8;  // c_0; level i has base_channels * 2^i
  int64_t depth = 2;          // down-sampling levels
  int64_t groups = 4;         // group norm groups (divides base_channels, hence every level)
  int64_t volume = 16;        // D = H = W of the example shape; divisible by 2^depth
  int64_t max_channels = 0;   // a level's channels stop doubling here (nnU-Net: 320); 0: never
  UNetNorm norm = UNetNorm::kGroup;  // kInstance: one group per channel (`groups` unused)
  UNetActivation activation = UNetActivation::kSilu;
  UNetDownsample downsample = UNetDownsample::kMaxPool;
  // Deep supervision (nnU-Net's): a kernel-1 head to `classes` on each decoder level i from 1 to
  // depth - 2 as well ("head<i>"; the coarsest decoder level, depth - 1, unsupervised as
  // nnU-Net's weight 0 leaves it), each level's cross-entropy against the label map sampled down
  // 2^i (downsample_labels), the loss their sum weighted 2^-i, normalised to sum 1
  // (DeepSupervisionWeights). Needs depth >= 3.
  bool deep_supervision = false;
  // The activations' type: f32, or bf16 (mixed precision: parameters, their gradients, norm
  // statistics and the loss stay f32; the first layer casts the f32 volume to bf16; the GPU's
  // kernels compute in f32 from bf16 storage, the CPU's in f32 copies, rounding alike). Not part
  // of ToString: parameters are f32 either way, so a checkpoint resumes in either. Spatial
  // parallelism (split_into_slabs) takes f32 only.
  DType activations = DType::kF32;

  // Level i's channels: base_channels * 2^i, at most max_channels.
  int64_t Channels(int64_t level) const;
  // The loss's weight of decoder level i's cross-entropy, i = 0 (the full-resolution head) to
  // depth - 2 with deep supervision (else only level 0, weight 1).
  std::vector<double> DeepSupervisionWeights() const;

  // InvalidArgument naming the field and what to change: activations other than f32 or bf16,
  // non-positive sizes, fewer than two classes, depth above 8, more than 65536 channels at the
  // deepest level, a volume not divisible by 2^depth, groups not dividing base_channels (group
  // norm), max_channels below base_channels.
  Status Validate() const;
  std::string ToString() const;
  // "tiny" (base 4, depth 1, volume 8), "small" (base 8, depth 2, volume 16) or "nnunet" (6
  // resolution stages: base 32, depth 5, at most 320 channels, instance norm, leaky ReLU, strided
  // convolutions, patch 128); NotFound listing the presets otherwise.
  static Result<UNet3dConfig> Preset(std::string_view name);
};

// The U-Net above as a ModelSpec named "unet3d". `registry` must hold the volume ops and the
// layer program ops (RegisterStandardOps). InvalidArgument when the config is invalid (its
// Validate message) or when the model API refuses a layer (naming it).
Result<ModelSpec> BuildUNet3d(const UNet3dConfig& config, const OpRegistry& registry);

}  // namespace tessera
