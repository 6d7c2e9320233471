#include "model/unet3d.h"

#include <cmath>
#include <vector>

#include <fmt/format.h>

#include "model/model.h"

namespace tessera {

namespace {

constexpr int64_t kMaxDepth = 8;  // 2^8 = 256 voxels per axis at least: far beyond any use here
constexpr int64_t kMaxChannels = int64_t{1} << 16;  // the deepest level's; keeps shapes in range

// Kaiming normal for layers followed by a rectifier-like activation.
ParamInit Kaiming(int64_t fan_in) {
  return ParamInit::Normal(std::sqrt(2.0 / static_cast<double>(fan_in)));
}

// The parameters of one conv block: conv3d (kernel 3, padding 1) -> group_norm -> SiLU.
struct ConvBlock {
  LayerValue conv_w, conv_b, norm_w, norm_b;
};

// Declares block `n`'s parameters ("conv<n>.w", "conv<n>.b", "norm<n>.w", "norm<n>.b").
ConvBlock DeclareBlock(LayerBuilder& l, int n, int64_t in, int64_t out) {
  ConvBlock block;
  block.conv_w = l.Param(fmt::format("conv{}.w", n), Shape{out, in, 3, 3, 3}, Kaiming(in * 27),
                         /*decay=*/true);
  block.conv_b = l.Param(fmt::format("conv{}.b", n), Shape{out}, ParamInit::Zeros());
  block.norm_w = l.Param(fmt::format("norm{}.w", n), Shape{out}, ParamInit::Ones());
  block.norm_b = l.Param(fmt::format("norm{}.b", n), Shape{out}, ParamInit::Zeros());
  return block;
}

LayerValue ApplyBlock(LayerBuilder& l, const ConvBlock& block, int n, LayerValue x,
                      int64_t groups) {
  LayerValue y = l.Call("conv3d_forward", {x, block.conv_w, block.conv_b},
                        Attrs{{"padding", int64_t{1}}}, fmt::format("conv{}", n));
  y = l.Call("group_norm_forward", {y, block.norm_w, block.norm_b}, Attrs{{"groups", groups}},
             fmt::format("norm{}", n));
  return l.Call("silu_forward", {y}, {}, fmt::format("act{}", n));
}

// A layer of two conv blocks, in -> out -> out channels. With `skip`, the layer reads two inputs
// and concatenates them along channels first (in counts both).
SingleOutputLayerFn TwoBlocks(int64_t in, int64_t out, int64_t groups, bool skip) {
  return [=](LayerBuilder& l) {
    const ConvBlock first = DeclareBlock(l, 1, in, out);
    const ConvBlock second = DeclareBlock(l, 2, out, out);
    LayerValue x = l.input(0);
    if (skip) x = l.Call("concat_forward", {l.input(0), l.input(1)}, {}, "skip");
    return ApplyBlock(l, second, 2, ApplyBlock(l, first, 1, x, groups), groups);
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
  TESSERA_RETURN_IF_ERROR(at_least("in_channels", in_channels, 1));
  TESSERA_RETURN_IF_ERROR(at_least("classes", classes, 2));
  TESSERA_RETURN_IF_ERROR(at_least("base_channels", base_channels, 1));
  TESSERA_RETURN_IF_ERROR(at_least("depth", depth, 1));
  TESSERA_RETURN_IF_ERROR(at_least("groups", groups, 1));
  TESSERA_RETURN_IF_ERROR(at_least("volume", volume, 1));
  if (depth > kMaxDepth) {
    return InvalidArgument("unet3d: depth must be <= {}, got {}", kMaxDepth, depth);
  }
  if (base_channels > (kMaxChannels >> depth)) {
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
  if (base_channels % groups != 0) {
    return InvalidArgument(
        "unet3d: groups ({}) must divide base_channels ({}) so that group norm splits every "
        "level's channels evenly",
        groups, base_channels);
  }
  return Status::Ok();
}

std::string UNet3dConfig::ToString() const {
  return fmt::format("in_channels={} classes={} base_channels={} depth={} groups={} volume={}",
                     in_channels, classes, base_channels, depth, groups, volume);
}

Result<UNet3dConfig> UNet3dConfig::Preset(std::string_view name) {
  if (name == "tiny") {
    return UNet3dConfig{.base_channels = 4, .depth = 1, .volume = 8};
  }
  if (name == "small") {
    return UNet3dConfig{.base_channels = 8, .depth = 2, .volume = 16};
  }
  return NotFound("unknown unet3d preset '{}' (expected tiny or small)", name);
}

Result<ModelSpec> BuildUNet3d(const UNet3dConfig& config, const OpRegistry& registry) {
  TESSERA_RETURN_IF_ERROR(config.Validate());
  const int64_t v = config.volume;
  const int64_t groups = config.groups;
  auto channels = [&](int64_t level) { return config.base_channels << level; };

  ModelBuilder model("unet3d", registry);
  ModelValue volume = model.Input("volume", DType::kF32, Shape{1, config.in_channels, v, v, v});
  ModelValue labels = model.Input("labels", DType::kI32, Shape{1, v, v, v}, /*label=*/true);

  // Encoder: enc{i} at full resolution of its level, down{i} halves it.
  std::vector<ModelValue> encoded;
  ModelValue x = volume;
  int64_t in = config.in_channels;
  for (int64_t i = 0; i < config.depth; ++i) {
    encoded.push_back(
        model.Layer(fmt::format("enc{}", i), {x}, TwoBlocks(in, channels(i), groups, false)));
    x = model.Layer(fmt::format("down{}", i), {encoded.back()}, [](LayerBuilder& l) {
      return l.Call("max_pool3d_forward", {l.input(0)}, Attrs{{"kernel", int64_t{2}}}, "pool");
    });
    in = channels(i);
  }
  x = model.Layer("bottleneck", {x}, TwoBlocks(in, channels(config.depth), groups, false));

  // Decoder: up{i} doubles the resolution back, dec{i} joins it with enc{i}'s output.
  for (int64_t i = config.depth - 1; i >= 0; --i) {
    const int64_t from = channels(i + 1), to = channels(i);
    ModelValue up = model.Layer(fmt::format("up{}", i), {x}, [=](LayerBuilder& l) {
      // Each output voxel of a kernel-2 stride-2 transposed conv sums exactly `from` products.
      LayerValue w = l.Param("w", Shape{from, to, 2, 2, 2}, Kaiming(from), /*decay=*/true);
      LayerValue b = l.Param("b", Shape{to}, ParamInit::Zeros());
      return l.Call("conv_transpose3d_forward", {l.input(0), w, b}, Attrs{{"stride", int64_t{2}}},
                    "upconv");
    });
    x = model.Layer(fmt::format("dec{}", i), {up, encoded[static_cast<size_t>(i)]},
                    TwoBlocks(2 * to, to, groups, /*skip=*/true));
  }

  const int64_t c0 = channels(0), classes = config.classes;
  ModelValue logits = model.Layer("head", {x}, [=](LayerBuilder& l) {
    LayerValue w = l.Param("w", Shape{classes, c0, 1, 1, 1}, Kaiming(c0), /*decay=*/true);
    LayerValue b = l.Param("b", Shape{classes}, ParamInit::Zeros());
    return l.Call("conv3d_forward", {l.input(0), w, b}, {}, "classifier");
  });
  model.Loss("loss", {logits, labels}, [](LayerBuilder& l) {
    return l.Call("voxel_cross_entropy", {l.input(0), l.input(1)}, {}, "cross_entropy");
  });
  return model.Build();
}

}  // namespace tessera
