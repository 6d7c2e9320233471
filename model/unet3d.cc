#include "model/unet3d.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "model/model.h"
#include "ops/standard_ops.h"
#include "ops/volume_ops.h"

namespace tessera {

namespace {

constexpr int64_t kMaxDepth = 8;  // 2^8 = 256 voxels per axis at least: far beyond any use here
constexpr int64_t kMaxChannels = int64_t{1} << 16;  // the deepest level's; keeps shapes in range

// Kaiming normal for layers followed by a rectifier-like activation.
ParamInit Kaiming(int64_t fan_in) {
  return ParamInit::Normal(std::sqrt(2.0 / static_cast<double>(fan_in)));
}

// The parameters of conv block `n` (conv3d kernel 3 padding 1 -> group_norm -> SiLU), in -> out
// channels, named "<prefix>conv<n>.w", "conv<n>.b", "norm<n>.w", "norm<n>.b": the prefix is ""
// in the whole model (the layer's name prefixes it), "<layer>." in the split one. Each declared
// as `split` says (the whole model: replicated, i.e. whole).
struct BlockParams {
  std::string prefix;
  int n = 1;
  int64_t in = 1, out = 1;

  LayerValue ConvWeight(LayerBuilder& l, SlotSplit split = {}) const {
    return l.SlicedParam(Name("conv", "w"), Shape{out, in, 3, 3, 3}, split, Kaiming(in * 27),
                         /*decay=*/true);
  }
  LayerValue ConvBias(LayerBuilder& l, SlotSplit split = {}) const {
    return l.SlicedParam(Name("conv", "b"), Shape{out}, split, ParamInit::Zeros());
  }
  LayerValue NormWeight(LayerBuilder& l, SlotSplit split = {}) const {
    return l.SlicedParam(Name("norm", "w"), Shape{out}, split, ParamInit::Ones());
  }
  LayerValue NormBias(LayerBuilder& l, SlotSplit split = {}) const {
    return l.SlicedParam(Name("norm", "b"), Shape{out}, split, ParamInit::Zeros());
  }

 private:
  std::string Name(const char* what, const char* tensor) const {
    return fmt::format("{}{}{}.{}", prefix, what, n, tensor);
  }
};

// How a layer's conv blocks run: the norm's groups, the activation op, and the stride of the
// first convolution (2 where a level starts with a strided convolution).
struct BlockStyle {
  int64_t groups = 1;
  std::string activation = "silu_forward";
  int64_t first_stride = 1;
  // The layer reads the f32 volume into bf16 activations first (UNet3dConfig::activations).
  bool casts_input = false;
};

// A layer's style in `config`: its norm's groups (instance norm: one per output channel, `out`),
// activation and first stride.
BlockStyle StyleOf(const UNet3dConfig& config, int64_t out, int64_t first_stride) {
  return BlockStyle{.groups = config.norm == UNetNorm::kInstance ? out : config.groups,
                    .activation = config.activation == UNetActivation::kLeakyRelu
                                      ? "leaky_relu_forward"
                                      : "silu_forward",
                    .first_stride = first_stride};
}

// Group norm (`groups`) then the activation over block `n`'s convolution output `y`.
LayerValue NormAndActivate(LayerBuilder& l, int n, LayerValue y, LayerValue norm_w,
                           LayerValue norm_b, int64_t groups, const std::string& activation) {
  y = l.Call("group_norm_forward", {y, norm_w, norm_b}, Attrs{{"groups", groups}},
             fmt::format("norm{}", n));
  return l.Call(activation, {y}, {}, fmt::format("act{}", n));
}

Attrs FirstConvAttrs(const BlockStyle& style) {
  Attrs attrs{{"padding", int64_t{1}}};
  if (style.first_stride != 1) attrs.Set("stride", style.first_stride);
  return attrs;
}

// The input of a layer of two conv blocks: with `skip`, its two inputs concatenated along
// channels; the volume cast to bf16 where `style` says.
LayerValue BlocksInput(LayerBuilder& l, bool skip, const BlockStyle& style) {
  if (skip) return l.Call("concat_forward", {l.input(0), l.input(1)}, {}, "skip");
  if (style.casts_input) {
    return l.Call("cast_forward", {l.input(0)}, Attrs{{"dtype", std::string("bf16")}}, "cast");
  }
  return l.input(0);
}

// A layer of two conv blocks, in -> out -> out channels. With `skip`, the layer reads two inputs
// and concatenates them along channels first (in counts both).
SingleOutputLayerFn TwoBlocks(int64_t in, int64_t out, const BlockStyle& style, bool skip) {
  return [=](LayerBuilder& l) {
    const BlockParams first{.n = 1, .in = in, .out = out}, second{.n = 2, .in = out, .out = out};
    // Every parameter before the first op.
    const LayerValue w1 = first.ConvWeight(l), b1 = first.ConvBias(l);
    const LayerValue g1 = first.NormWeight(l), beta1 = first.NormBias(l);
    const LayerValue w2 = second.ConvWeight(l), b2 = second.ConvBias(l);
    const LayerValue g2 = second.NormWeight(l), beta2 = second.NormBias(l);
    const Attrs padding{{"padding", int64_t{1}}};
    LayerValue y = l.Call("conv3d_forward", {BlocksInput(l, skip, style), w1, b1},
                          FirstConvAttrs(style), "conv1");
    y = NormAndActivate(l, 1, y, g1, beta1, style.groups, style.activation);
    y = l.Call("conv3d_forward", {y, w2, b2}, padding, "conv2");
    return NormAndActivate(l, 2, y, g2, beta2, style.groups, style.activation);
  };
}

// The same two blocks split over `ranks` tensor ranks (Megatron-LM's pairing of a column- and a
// row-parallel linear, for convolutions), as two layers:
//   <name>.convs  conv1 split by output channels (this rank's out/T filters, their biases and
//                 group norm gains: groups/T whole groups), group norm, SiLU, then conv2 split by
//                 input channels (its filters' slices over this rank's out/T channels) without
//                 its bias: a partial sum; its inputs' gradients are partial sums too
//   <name>        the sum + conv2's bias, group norm, SiLU (replicated)
// `model_inputs`: the first layer reads the volume, a model input with no gradient.
ModelValue SplitTwoBlocks(ModelBuilder& model, const std::string& name,
                          const std::vector<ModelValue>& inputs, int64_t in, int64_t out,
                          const BlockStyle& style, int ranks, bool reads_model_input) {
  const bool skip = inputs.size() == 2;
  const std::string convs = name + ".convs";
  const BlockParams first{.prefix = name + ".", .n = 1, .in = in, .out = out};
  const BlockParams second{.prefix = name + ".", .n = 2, .in = out, .out = out};
  model.Layer(convs, inputs, [=](LayerBuilder& l) {
    const SlotSplit filters{.dim = 0}, input_channels{.dim = 1};
    const LayerValue w1 = first.ConvWeight(l, filters), b1 = first.ConvBias(l, filters);
    const LayerValue g1 = first.NormWeight(l, filters), beta1 = first.NormBias(l, filters);
    const LayerValue w2 = second.ConvWeight(l, input_channels);
    if (!reads_model_input) {
      for (int i = 0; i < static_cast<int>(inputs.size()); ++i) l.PartialGradient(i);
    }
    const Attrs padding{{"padding", int64_t{1}}};
    LayerValue y = l.Call("conv3d_forward", {BlocksInput(l, skip, style), w1, b1},
                          FirstConvAttrs(style), "conv1");
    y = NormAndActivate(l, 1, y, g1, beta1, style.groups / ranks, style.activation);
    const LayerValue part = l.Call("conv3d_no_bias_forward", {y, w2}, padding, "conv2");
    l.PartialSum(part);
    return part;
  });
  return model.Layer(name, {ModelBuilder::LayerOutput(convs)}, [=](LayerBuilder& l) {
    const LayerValue b2 = second.ConvBias(l);
    const LayerValue g2 = second.NormWeight(l), beta2 = second.NormBias(l);
    const LayerValue y = l.Call("channel_bias_add_forward", {l.input(0), b2}, {}, "conv2_bias");
    return NormAndActivate(l, 2, y, g2, beta2, style.groups, style.activation);
  });
}

// up{i}: a kernel-2 stride-2 transposed convolution, from -> to channels, doubling each extent.
// Parameters named `weight` and `bias`.
SingleOutputLayerFn UpConvolution(int64_t from, int64_t to, const std::string& weight,
                                  const std::string& bias) {
  return [=](LayerBuilder& l) {
    // Each output voxel of a kernel-2 stride-2 transposed conv sums exactly `from` products.
    LayerValue w = l.Param(weight, Shape{from, to, 2, 2, 2}, Kaiming(from), /*decay=*/true);
    LayerValue b = l.Param(bias, Shape{to}, ParamInit::Zeros());
    return l.Call("conv_transpose3d_forward", {l.input(0), w, b}, Attrs{{"stride", int64_t{2}}},
                  "upconv");
  };
}

// A head: a kernel-1 convolution from `channels` to `classes` (the logits).
SingleOutputLayerFn Classifier(int64_t channels, int64_t classes, const std::string& weight,
                               const std::string& bias) {
  return [=](LayerBuilder& l) {
    LayerValue w =
        l.Param(weight, Shape{classes, channels, 1, 1, 1}, Kaiming(channels), /*decay=*/true);
    LayerValue b = l.Param(bias, Shape{classes}, ParamInit::Zeros());
    return l.Call("conv3d_forward", {l.input(0), w, b}, {}, "classifier");
  };
}

// The loss over inputs (the full-resolution logits, the labels, then head{i}'s logits for
// i = 1, 2, ...): each level's cross-entropy, weighted as `weights` say.
SingleOutputLayerFn SegmentationLoss(std::vector<double> weights) {
  return [weights = std::move(weights)](LayerBuilder& l) {
    // One level (no deep supervision) is the plain cross-entropy: no weight attribute, so the
    // program is the one checkpoints of that model were written with.
    const auto weighted = [&weights](size_t i) {
      return weights.size() == 1 ? Attrs{} : Attrs{{"weight", weights[i]}};
    };
    LayerValue loss =
        l.Call("voxel_cross_entropy", {l.input(0), l.input(1)}, weighted(0), "cross_entropy");
    for (size_t i = 1; i < weights.size(); ++i) {
      const LayerValue targets =
          l.Call("downsample_labels", {l.input(1)}, Attrs{{"factor", int64_t{1} << i}},
                 fmt::format("labels{}", i));
      const LayerValue term =
          l.Call("voxel_cross_entropy", {l.input(static_cast<int>(i) + 1), targets}, weighted(i),
                 fmt::format("cross_entropy{}", i));
      loss = l.Call("add_forward", {loss, term}, {}, fmt::format("sum{}", i));
    }
    return loss;
  };
}

}  // namespace

Status UNet3dConfig::Validate() const {
  auto at_least = [](const char* field, int64_t value, int64_t minimum) -> Status {
    if (value < minimum) {
      return InvalidArgument("unet3d: {} must be >= {}, got {}", field, minimum, value);
    }
    return Status::Ok();
  };
  if (activations != DType::kF32 && activations != DType::kBF16) {
    return InvalidArgument("unet3d: activations must be f32 or bf16, got {}",
                           DTypeName(activations));
  }
  TESSERA_RETURN_IF_ERROR(at_least("in_channels", in_channels, 1));
  TESSERA_RETURN_IF_ERROR(at_least("classes", classes, 2));
  TESSERA_RETURN_IF_ERROR(at_least("base_channels", base_channels, 1));
  TESSERA_RETURN_IF_ERROR(at_least("depth", depth, 1));
  TESSERA_RETURN_IF_ERROR(at_least("groups", groups, 1));
  TESSERA_RETURN_IF_ERROR(at_least("volume", volume, 1));
  if (max_channels != 0 && max_channels < base_channels) {
    return InvalidArgument(
        "unet3d: max_channels ({}) must be at least base_channels ({}), or 0 for no cap",
        max_channels, base_channels);
  }
  if (depth > kMaxDepth) {
    return InvalidArgument("unet3d: depth must be <= {}, got {}", kMaxDepth, depth);
  }
  if (base_channels > kMaxChannels || Channels(depth) > kMaxChannels) {
    return InvalidArgument(
        "unet3d: base_channels ({}) * 2^depth ({}) must be <= {}: the deepest level has that many "
        "channels",
        base_channels, int64_t{1} << depth, kMaxChannels);
  }
  const int64_t factor = int64_t{1} << depth;
  if (volume % factor != 0) {
    return InvalidArgument(
        "unet3d: volume ({}) must be divisible by 2^depth = {} (each of the {} levels halves it); "
        "use volume {} or a smaller depth",
        volume, factor, depth, (volume / factor + 1) * factor);
  }
  if (norm == UNetNorm::kGroup && max_channels != 0 && max_channels % groups != 0) {
    return InvalidArgument("unet3d: groups ({}) must divide max_channels ({}) for group norm",
                           groups, max_channels);
  }
  if (deep_supervision && depth < 3) {
    return InvalidArgument(
        "unet3d: deep supervision needs depth >= 3, got {} (it supervises decoder levels 1 to "
        "depth - 2 beside the full-resolution head; nnU-Net leaves the coarsest unsupervised)",
        depth);
  }
  if (norm == UNetNorm::kGroup && base_channels % groups != 0) {
    return InvalidArgument(
        "unet3d: groups ({}) must divide base_channels ({}) so that group norm splits every "
        "level's channels evenly",
        groups, base_channels);
  }
  return Status::Ok();
}

int64_t UNet3dConfig::Channels(int64_t level) const {
  const int64_t doubled = base_channels << std::min<int64_t>(level, kMaxDepth);
  return max_channels > 0 ? std::min(doubled, max_channels) : doubled;
}

std::string UNet3dConfig::ToString() const {
  // The default variant's description is what checkpoints were written with: unchanged.
  std::string text =
      fmt::format("in_channels={} classes={} base_channels={} depth={} groups={} volume={}",
                  in_channels, classes, base_channels, depth, groups, volume);
  if (max_channels != 0) text += fmt::format(" max_channels={}", max_channels);
  if (norm == UNetNorm::kInstance) text += " norm=instance";
  if (activation == UNetActivation::kLeakyRelu) text += " activation=leaky_relu";
  if (downsample == UNetDownsample::kStridedConv) text += " downsample=strided_conv";
  if (deep_supervision) text += " deep_supervision";
  return text;
}

std::vector<double> UNet3dConfig::DeepSupervisionWeights() const {
  const int64_t levels = deep_supervision ? std::max<int64_t>(1, depth - 1) : 1;
  std::vector<double> weights;
  double sum = 0;
  for (int64_t i = 0; i < levels; ++i) {
    weights.push_back(std::ldexp(1.0, static_cast<int>(-i)));
    sum += weights.back();
  }
  for (double& w : weights) w /= sum;
  return weights;
}

Result<UNet3dConfig> UNet3dConfig::Preset(std::string_view name) {
  if (name == "tiny") {
    return UNet3dConfig{.base_channels = 4, .depth = 1, .volume = 8};
  }
  if (name == "small") {
    return UNet3dConfig{.base_channels = 8, .depth = 2, .volume = 16};
  }
  if (name == "nnunet") {
    return UNet3dConfig{.base_channels = 32,
                        .depth = 5,
                        .volume = 128,
                        .max_channels = 320,
                        .norm = UNetNorm::kInstance,
                        .activation = UNetActivation::kLeakyRelu,
                        .downsample = UNetDownsample::kStridedConv};
  }
  return NotFound("unknown unet3d preset '{}' (expected tiny, small or nnunet)", name);
}

namespace {

// The whole U-Net (ranks 1), or what each of `ranks` tensor ranks runs: every pair of conv
// blocks split (SplitTwoBlocks), the pooling, up-convolutions, head and loss replicated, the
// parameters keeping the whole model's names. `registry` holds the ops.
Result<ModelSpec> BuildFor(const UNet3dConfig& config, const OpRegistry& registry, int ranks) {
  TESSERA_RETURN_IF_ERROR(config.Validate());
  const int64_t v = config.volume;
  auto channels = [&](int64_t level) { return config.Channels(level); };
  auto style = [&](int64_t out, int64_t first_stride) {
    return StyleOf(config, out, first_stride);
  };
  if (ranks > 1 && config.norm == UNetNorm::kGroup && config.groups % ranks != 0) {
    return InvalidArgument(
        "unet3d: its {} group-norm groups do not split over {} tensor-parallel ranks (each rank "
        "normalizes whole groups of its channels): use a degree that divides {}, or a config whose "
        "groups are a multiple of {}",
        config.groups, ranks, config.groups, ranks);
  }
  for (int64_t level = 0; ranks > 1 && level <= config.depth; ++level) {
    if (config.norm == UNetNorm::kInstance && channels(level) % ranks != 0) {
      return InvalidArgument(
          "unet3d: level {}'s {} channels do not split over {} tensor-parallel ranks (each rank "
          "normalizes whole channels): use a degree that divides every level's channels",
          level, channels(level), ranks);
    }
  }
  const bool split = ranks > 1;
  // A parameter's name: the layer's prefix adds the layer's name in the whole model; in the split
  // one every prefix is empty and the name says it.
  auto named = [split](const std::string& layer, const char* param) {
    return split ? fmt::format("{}.{}", layer, param) : std::string(param);
  };
  ModelBuilder model("unet3d", registry);
  if (split) model.SplitOver(ranks);
  ModelValue volume = model.Input("volume", DType::kF32, Shape{1, config.in_channels, v, v, v});
  ModelValue labels = model.Input("labels", DType::kI32, Shape{1, v, v, v}, /*label=*/true);
  auto blocks = [&](const std::string& name, std::vector<ModelValue> inputs, int64_t in,
                    int64_t out, int64_t first_stride = 1) {
    const bool skip = inputs.size() == 2;
    const bool reads_volume = inputs.front().input >= 0;
    BlockStyle layer_style = style(out, first_stride);
    layer_style.casts_input = reads_volume && config.activations == DType::kBF16;
    if (split) {
      return SplitTwoBlocks(model, name, inputs, in, out, layer_style, ranks, reads_volume);
    }
    return model.Layer(name, std::move(inputs), TwoBlocks(in, out, layer_style, skip));
  };

  // Encoder: enc{i} at full resolution of its level; down{i} halves it (pooling), or the next
  // level's first convolution does (stride 2).
  const bool strided = config.downsample == UNetDownsample::kStridedConv;
  std::vector<ModelValue> encoded;
  ModelValue x = volume;
  int64_t in = config.in_channels;
  for (int64_t i = 0; i < config.depth; ++i) {
    encoded.push_back(
        blocks(fmt::format("enc{}", i), {x}, in, channels(i), strided && i > 0 ? 2 : 1));
    x = strided ? encoded.back()
                : model.Layer(fmt::format("down{}", i), {encoded.back()}, [](LayerBuilder& l) {
                    return l.Call("max_pool3d_forward", {l.input(0)}, Attrs{{"kernel", int64_t{2}}},
                                  "pool");
                  });
    in = channels(i);
  }
  x = blocks("bottleneck", {x}, in, channels(config.depth), strided ? 2 : 1);

  // Decoder: up{i} doubles the resolution back, dec{i} joins it with enc{i}'s output.
  const std::vector<double> weights = config.DeepSupervisionWeights();
  std::vector<ModelValue> coarse_logits;  // deep supervision: head{i}'s, i = weights.size()-1..1
  const int64_t classes = config.classes;
  for (int64_t i = config.depth - 1; i >= 0; --i) {
    const int64_t from = channels(i + 1), to = channels(i);
    const std::string up_name = fmt::format("up{}", i);
    ModelValue up = model.Layer(up_name, {x},
                                UpConvolution(from, to, named(up_name, "w"), named(up_name, "b")));
    x = blocks(fmt::format("dec{}", i), {up, encoded[static_cast<size_t>(i)]}, 2 * to, to);
    if (i >= 1 && i < static_cast<int64_t>(weights.size())) {
      const std::string head = fmt::format("head{}", i);
      coarse_logits.push_back(
          model.Layer(head, {x}, Classifier(to, classes, named(head, "w"), named(head, "b"))));
    }
  }

  const int64_t c0 = channels(0);
  ModelValue logits =
      model.Layer("head", {x}, Classifier(c0, classes, named("head", "w"), named("head", "b")));
  // Inputs: the full-resolution logits, the labels, then head{i}'s logits for i = 1, 2, ...
  std::vector<ModelValue> inputs{logits, labels};
  inputs.insert(inputs.end(), coarse_logits.rbegin(), coarse_logits.rend());
  model.Loss("loss", std::move(inputs), SegmentationLoss(weights));
  TESSERA_ASSIGN_OR_RETURN(ModelSpec built, model.Build());
  if (split) {
    for (LayerSpec& layer : built.layers) layer.param_prefix = "";
    return built;
  }
  // Split over T ranks: a registry of the standard ops of its own (the caller's need not live
  // as long as the model).
  built.split_for_tensor_parallel = [config](int tensor_ranks) -> Result<ModelSpec> {
    OpRegistry ops;
    TESSERA_RETURN_IF_ERROR(RegisterStandardOps(ops));
    return BuildFor(config, ops, tensor_ranks);
  };
  return built;
}

// ---- spatial parallelism: the U-Net over P slabs of each volume's depth ----

// A slab's activation as a convolution reads it: the layer making it outputs it (0), its first
// D-plane passed to the rank before (1, kHaloPrevious) and its last to the rank after (2,
// kHaloNext), so that a reader receives the plane above its slab (the previous rank's last) and
// the one below (the next rank's first), zeros past the volume's ends.
struct Haloed {
  std::string layer;
  std::vector<ModelValue> Reads() const {
    return {ModelBuilder::LayerOutput(layer, 0), ModelBuilder::LayerOutput(layer, 2),
            ModelBuilder::LayerOutput(layer, 1)};
  }
};

// The outputs of a layer whose output `x` (of `depth` D-planes) a convolution reads: x and its
// two planes, exchanged.
std::vector<LayerValue> WithHalos(LayerBuilder& l, LayerValue x, int64_t depth) {
  std::vector<LayerValue> planes =
      l.CallAll("slab_planes_forward", {x}, Attrs{{"depth", depth}}, "planes");
  l.Exchange(planes[0], ExchangeLayout::kHaloPrevious);
  l.Exchange(planes[1], ExchangeLayout::kHaloNext);
  return {x, planes[0], planes[1]};
}

// Inputs 3 k .. 3 k + 2 (a Haloed's reads): the slab joined with the planes above and below it.
// With two haloed inputs (a decoder level: up{i}, then the skip) they are concatenated along
// channels first, as the whole model's concat_forward does.
LayerValue JoinedInput(LayerBuilder& l, int haloed) {
  if (haloed == 1) {
    return l.Call("halo_join_forward", {l.input(1), l.input(0), l.input(2)}, {}, "halo");
  }
  const auto concat = [&](int part, const char* label) {
    return l.Call("concat_forward", {l.input(part), l.input(3 + part)}, {}, label);
  };
  const LayerValue x = concat(0, "skip"), above = concat(1, "skip_above");
  const LayerValue below = concat(2, "skip_below");
  return l.Call("halo_join_forward", {above, x, below}, {}, "halo");
}

// One conv block over slabs, as three layers (a layer boundary where the halos and where the
// norm's statistics cross between ranks):
//   <name>.conv<n>   the input joined with its halos, conv3d (depth_padding 0)
//   <name>.stats<n>  the convolution's group-norm statistics over this slab, exchanged by blocks
//   <out>            group norm with every slab's statistics, the activation; with `halos`, its
//                    output's planes for the next convolution
// Parameters keep the whole model's names ("<name>.conv<n>.w", "<name>.norm<n>.b", ...).
std::string SlabConvBlock(ModelBuilder& model, const std::string& name, const std::string& out,
                          const BlockParams& params, const std::vector<ModelValue>& inputs,
                          const BlockStyle& style, int64_t first_stride, int ranks, bool halos,
                          int64_t depth) {
  const std::string conv = fmt::format("{}.conv{}", name, params.n);
  const std::string stats = fmt::format("{}.stats{}", name, params.n);
  model.Layer(conv, inputs, [=, haloed = static_cast<int>(inputs.size() / 3)](LayerBuilder& l) {
    const LayerValue w = params.ConvWeight(l), b = params.ConvBias(l);
    Attrs attrs{{"padding", int64_t{1}}, {kDepthPaddingAttr, int64_t{0}}};
    if (first_stride != 1) attrs.Set("stride", first_stride);
    return l.Call("conv3d_forward", {JoinedInput(l, haloed), w, b}, attrs, "conv");
  });
  // A layer of its own, reading the convolution's output as the norm layer does: the one object
  // both backwards read (in the convolution's layer its backward would keep a copy of it).
  model.Layer(stats, {ModelBuilder::LayerOutput(conv)}, [=](LayerBuilder& l) {
    const LayerValue sums =
        l.Call("group_norm_stats_forward", {l.input(0)},
               Attrs{{"groups", style.groups}, {"ranks", int64_t{ranks}}}, "stats");
    l.Exchange(sums, ExchangeLayout::kBlocks);
    return sums;
  });
  model.LayerWithOutputs(out, {ModelBuilder::LayerOutput(conv), ModelBuilder::LayerOutput(stats)},
                         [=](LayerBuilder& l) {
                           const LayerValue g = params.NormWeight(l), beta = params.NormBias(l);
                           LayerValue y =
                               l.Call("group_norm_slab_forward", {l.input(0), l.input(1), g, beta},
                                      Attrs{{"groups", style.groups}}, "norm");
                           y = l.Call(style.activation, {y}, {}, "act");
                           return halos ? WithHalos(l, y, depth) : std::vector<LayerValue>{y};
                         });
  return out;
}

// A whole-model layer of two conv blocks (`TwoBlocks`) over slabs: six layers, the last named
// `name` (what readers read), its output (of `depth` D-planes a slab) with halos when `halos`
// says a convolution reads it.
std::string SlabTwoBlocks(ModelBuilder& model, const std::string& name,
                          const std::vector<Haloed>& inputs, int64_t in, int64_t out,
                          const BlockStyle& style, int ranks, bool halos, int64_t depth) {
  std::vector<ModelValue> reads;
  for (const Haloed& input : inputs) {
    for (ModelValue& read : input.Reads()) reads.push_back(std::move(read));
  }
  const std::string prefix = name + ".";
  const std::string first = SlabConvBlock(
      model, name, name + ".block1", BlockParams{.prefix = prefix, .n = 1, .in = in, .out = out},
      reads, style, style.first_stride, ranks, /*halos=*/true, depth);
  return SlabConvBlock(model, name, name,
                       BlockParams{.prefix = prefix, .n = 2, .in = out, .out = out},
                       Haloed{first}.Reads(), style, 1, ranks, halos, depth);
}

// The U-Net for `ranks` slabs: what each rank runs on its 1/P of every volume's depth (inputs
// split along it: ModelInput::split_axis), every parameter whole (named as in the whole model).
// Convolutions read their neighbours' boundary planes and norms every slab's statistics through
// the exchanges above; pooling, up-convolutions, heads and the loss (each rank's mean over its
// voxels: the slabs are equal, so their mean is the volume's) stay within the slab.
Result<ModelSpec> BuildSlabs(const UNet3dConfig& config, int ranks) {
  TESSERA_RETURN_IF_ERROR(config.Validate());
  const int64_t v = config.volume, factor = int64_t{1} << config.depth;
  if (ranks < 2 || v % (factor * ranks) != 0) {
    return InvalidArgument(
        "unet3d: a volume of depth {} does not split into {} slabs that each level halves "
        "evenly: --spatial-parallel must divide {} / 2^depth = {} (or use a volume that is a "
        "multiple of {})",
        v, ranks, v, v / factor, factor * ranks);
  }
  if (config.activations != DType::kF32) {
    return InvalidArgument(
        "unet3d: spatial parallelism (slabs) computes in f32 activations, not {}: use "
        "--activations f32 with --spatial-parallel",
        DTypeName(config.activations));
  }
  OpRegistry registry;
  TESSERA_RETURN_IF_ERROR(RegisterStandardOps(registry));
  auto style = [&](int64_t out, int64_t first_stride) {
    return StyleOf(config, out, first_stride);
  };
  auto channels = [&](int64_t level) { return config.Channels(level); };
  ModelBuilder model("unet3d", registry);
  model.SplitSequenceOver(ranks, SequenceAttention::kHalo);
  const int64_t slab = v / ranks;
  const ModelValue volume =
      model.Input("volume", DType::kF32, Shape{1, config.in_channels, slab, v, v});
  const ModelValue labels =
      model.Input("labels", DType::kI32, Shape{1, slab, v, v}, /*label=*/true);
  // The volume's own halos, for the first convolution.
  model.LayerWithOutputs("volume.halo", {volume}, [slab](LayerBuilder& l) {
    return WithHalos(l, l.Call("identity", {l.input(0)}, {}, "slab"), slab);
  });
  const bool strided = config.downsample == UNetDownsample::kStridedConv;
  std::vector<std::string> encoded;
  Haloed x{"volume.halo"};
  int64_t in = config.in_channels;
  for (int64_t i = 0; i < config.depth; ++i) {
    const std::string enc = fmt::format("enc{}", i);
    // Its output is read by the next level's strided convolution, or by pooling; and by the
    // decoder's first convolution either way (the skip).
    encoded.push_back(SlabTwoBlocks(model, enc, {x}, in, channels(i),
                                    style(channels(i), strided && i > 0 ? 2 : 1), ranks,
                                    /*halos=*/true, slab >> i));
    if (strided) {
      x = Haloed{enc};
    } else {
      const std::string down = fmt::format("down{}", i);
      const int64_t pooled = slab >> (i + 1);
      model.LayerWithOutputs(down, {ModelBuilder::LayerOutput(enc)}, [pooled](LayerBuilder& l) {
        return WithHalos(
            l, l.Call("max_pool3d_forward", {l.input(0)}, Attrs{{"kernel", int64_t{2}}}, "pool"),
            pooled);
      });
      x = Haloed{down};
    }
    in = channels(i);
  }
  std::string deepest = SlabTwoBlocks(model, "bottleneck", {x}, in, channels(config.depth),
                                      style(channels(config.depth), strided ? 2 : 1), ranks,
                                      /*halos=*/false, slab >> config.depth);
  const std::vector<double> weights = config.DeepSupervisionWeights();
  std::vector<ModelValue> coarse_logits;
  const int64_t classes = config.classes;
  for (int64_t i = config.depth - 1; i >= 0; --i) {
    const int64_t from = channels(i + 1), to = channels(i);
    const std::string up = fmt::format("up{}", i), dec = fmt::format("dec{}", i);
    const SingleOutputLayerFn upconv = UpConvolution(from, to, up + ".w", up + ".b");
    const int64_t planes = slab >> i;
    model.LayerWithOutputs(
        up, {ModelBuilder::LayerOutput(deepest)},
        [upconv, planes](LayerBuilder& l) { return WithHalos(l, upconv(l), planes); });
    deepest = SlabTwoBlocks(model, dec, {Haloed{up}, Haloed{encoded[static_cast<size_t>(i)]}},
                            2 * to, to, style(to, 1), ranks, /*halos=*/false, planes);
    if (i >= 1 && i < static_cast<int64_t>(weights.size())) {
      const std::string head = fmt::format("head{}", i);
      coarse_logits.push_back(model.Layer(head, {ModelBuilder::LayerOutput(deepest)},
                                          Classifier(to, classes, head + ".w", head + ".b")));
    }
  }
  const ModelValue logits = model.Layer("head", {ModelBuilder::LayerOutput(deepest)},
                                        Classifier(channels(0), classes, "head.w", "head.b"));
  std::vector<ModelValue> inputs{logits, labels};
  inputs.insert(inputs.end(), coarse_logits.rbegin(), coarse_logits.rend());
  model.Loss("loss", std::move(inputs), SegmentationLoss(weights));
  TESSERA_ASSIGN_OR_RETURN(ModelSpec built, model.Build());
  for (LayerSpec& layer : built.layers) layer.param_prefix = "";
  built.inputs[0].split_axis = 2;  // volume [N, C, D, H, W]
  built.inputs[1].split_axis = 1;  // labels [N, D, H, W]
  return built;
}

}  // namespace

Result<ModelSpec> BuildUNet3d(const UNet3dConfig& config, const OpRegistry& registry) {
  TESSERA_ASSIGN_OR_RETURN(ModelSpec model, BuildFor(config, registry, 1));
  model.split_into_slabs = [config](int ranks) { return BuildSlabs(config, ranks); };
  return model;
}

}  // namespace tessera
