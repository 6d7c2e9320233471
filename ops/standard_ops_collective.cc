// The standard ops' collective members (see core/collective_task.h for the attributes): the
// ops a collective task's members run, all_reduce, reduce_scatter, all_gather(_in_place),
// all_to_all, broadcast and compressed_all_reduce, and the two that pack gradient buckets for them
// (pack_shards, split).
#include <limits>
#include <string>

#include "core/block_quantization.h"
#include "core/collective_task.h"
#include "core/sign_compression.h"
#include "ops/op_def_util.h"
#include "ops/standard_ops_internal.h"

namespace tessera::detail {

using op_def::Bytes;
namespace {

Status CheckCollective(const TensorMeta& x, const Attrs& attrs, bool reduces) {
  TESSERA_ASSIGN_OR_RETURN(int64_t size, PositiveAttr(attrs, kGroupSizeAttr));
  TESSERA_ASSIGN_OR_RETURN(int64_t rank, attrs.GetInt(kRankAttr));
  TESSERA_RETURN_IF_ERROR(attrs.GetInt(kCollectiveAttr).status());
  if (rank < 0 || rank >= size) {
    return InvalidArgument("attribute 'rank' is {} but the group has {} members", rank, size);
  }
  if (reduces) {
    if (x.dtype != DType::kF32 && x.dtype != DType::kBF16 && x.dtype != DType::kF16 &&
        x.dtype != DType::kI32) {
      return InvalidArgument("input 'x' is {}; collectives reduce f32, bf16, f16 and i32",
                             x.ToString());
    }
    TESSERA_ASSIGN_OR_RETURN(std::string op, attrs.GetString("reduce"));
    if (op != "sum" && op != "avg" && op != "max" && op != "min") {
      return InvalidArgument("attribute 'reduce' is '{}'; use sum, avg, max or min", op);
    }
  }
  return Status::Ok();
}

// The group size, for a member whose x holds one equal block per member (reduce-scatter,
// all-gather in place, all-to-all); InvalidArgument when it does not divide.
Result<int64_t> BlockCount(const TensorMeta& x, const Attrs& attrs) {
  const int64_t size = attrs.GetInt(kGroupSizeAttr, 1);
  if (x.numel() % size != 0) {
    return InvalidArgument(
        "input 'x' has {} elements, not a multiple of the group's {} members (pad it)", x.numel(),
        size);
  }
  return size;
}

// A quantized all-gather or reduce-scatter (kQuantizeBitsAttr): f32, flat, summed.
Status CheckQuantized(const TensorMeta& x, const Attrs& attrs) {
  if (!attrs.Has(kQuantizeBitsAttr)) return Status::Ok();
  TESSERA_ASSIGN_OR_RETURN(int64_t bits, attrs.GetInt(kQuantizeBitsAttr));
  TESSERA_RETURN_IF_ERROR(CheckQuantizationBits(bits));
  TESSERA_RETURN_IF_ERROR(op_def::CheckDType("x", x, DType::kF32));
  TESSERA_ASSIGN_OR_RETURN(const bool sequence, SplitsSequence(attrs));
  const Result<std::string> reduce = attrs.GetString("reduce");
  if (sequence || (reduce.ok() && *reduce != "sum")) {
    return InvalidArgument(
        "attribute '{}': quantized collectives gather or sum flat buffers (no layout, reduce sum)",
        kQuantizeBitsAttr);
  }
  return Status::Ok();
}

// The share of an f32 payload a quantized one sends (1 when exact).
double QuantizedShare(const Attrs& attrs) {
  const int64_t bits = attrs.GetInt(kQuantizeBitsAttr, 32);
  return bits >= 32 ? 1.0 : static_cast<double>(bits) / 32.0;
}

// Bytes one member sends: a ring moves (n-1)/n of the buffer per phase.
CostFn CollectiveCost(double phases) {
  return [phases](const Metas& in, const Attrs& attrs) {
    const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
    return OpCost{static_cast<double>(in[0].numel()), phases * Bytes(in) * (n - 1) / n};
  };
}

// Copying costs no flops: read and write every byte once.
OpCost CopyCost(const Metas& in, const Attrs&) { return OpCost{0, 2.0 * Bytes(in)}; }

// The planner's gradient buckets: several groups' gradients packed into one buffer for one
// collective, and the result split back.
Status AddBucketOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "pack_shards",
      .doc = "x... (flat, one dtype and device, each a multiple of attribute 'ranks' elements) "
             "packed shard by shard: out holds shard 0 of every x in order, then shard 1 of "
             "every x, ... A reduce-scatter of out over 'ranks' members leaves member r shard r "
             "of every x, in order; with 'ranks' 1 it is the concatenation",
      .input_names = {"x"},
      .output_names = {"out"},
      .variadic_inputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(int64_t ranks, PositiveAttr(attrs, "ranks"));
        int64_t total = 0;
        for (size_t i = 0; i < in.size(); ++i) {
          if (in[i].dtype != in[0].dtype || in[i].device != in[0].device) {
            return InvalidArgument("input {} is {} but input 0 is {}: pack one dtype on one device",
                                   i, in[i].ToString(), in[0].ToString());
          }
          if (in[i].numel() % ranks != 0) {
            return InvalidArgument(
                "input {} has {} elements, not a multiple of the {} shards (pad the group)", i,
                in[i].numel(), ranks);
          }
          if (in[i].numel() > std::numeric_limits<int64_t>::max() - total) {
            return InvalidArgument("the inputs hold more than 2^63 elements");
          }
          total += in[i].numel();
        }
        return Metas{TensorMeta{Shape{total}, in[0].dtype, in[0].device}};
      },
      .cost = CopyCost,
  }));
  return r.AddOp(OpDef{
      .name = "split",
      .doc = "x (flat) cut into consecutive flat pieces of attribute 'sizes' elements, which "
             "must add up to x's",
      .input_names = {"x"},
      .output_names = {"out"},
      .variadic_outputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> sizes, attrs.GetInts("sizes"));
        Metas out;
        int64_t total = 0;
        for (int64_t size : sizes) {
          if (size <= 0) return InvalidArgument("attribute 'sizes' holds {}: use sizes > 0", size);
          if (size > in[0].numel() - total) {
            return InvalidArgument("attribute 'sizes' adds up to more than input 'x''s {} elements",
                                   in[0].numel());
          }
          total += size;
          out.push_back(TensorMeta{Shape{size}, in[0].dtype, in[0].device});
        }
        if (out.empty() || total != in[0].numel()) {
          return InvalidArgument("attribute 'sizes' adds up to {} but input 'x' has {} elements",
                                 total, in[0].numel());
        }
        return out;
      },
      .cost = CopyCost,
  });
}

}  // namespace

Status AddCollectiveOps(OpRegistry& r) {
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_reduce",
      .doc = "member of an all-reduce: out = reduce (attribute 'reduce') of every member's x",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/true));
        return Metas{in[0]};
      },
      .cost = CollectiveCost(2),
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "reduce_scatter",
      .doc = "member of a reduce-scatter: x (flat, group_size blocks) reduced over the members; "
             "rank r keeps block r. Attribute layout 'sequence' (core/exchange_layout.h): x "
             "[B, S, ...], rank r keeps part r of every row's S positions, out [B, S/size, ...]. "
             "Attribute quantize_bits 8|4: the blocks sent block-quantized (ZeRO++'s qgZ)",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/true));
        TESSERA_RETURN_IF_ERROR(CheckQuantized(in[0], attrs));
        TESSERA_ASSIGN_OR_RETURN(const int64_t size, BlockCount(in[0], attrs));
        TESSERA_ASSIGN_OR_RETURN(const bool sequence, SplitsSequence(attrs));
        if (!sequence) {
          return Metas{TensorMeta{Shape{in[0].numel() / size}, in[0].dtype, in[0].device}};
        }
        TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> dims,
                                 SequenceSplitDims(in[0].shape.dims(), size, /*gather=*/false));
        return Metas{TensorMeta{Shape(std::move(dims)), in[0].dtype, in[0].device}};
      },
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            OpCost cost = CollectiveCost(1)(in, attrs);
            cost.bytes *= QuantizedShare(attrs);
            return cost;
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_gather",
      .doc = "member of an all-gather: out (flat) holds every member's x, in rank order. "
             "Attribute layout 'sequence' (core/exchange_layout.h): x [B, S, ...] is part r of "
             "every row's positions, out [B, size S, ...] the rows joined. Attribute "
             "quantize_bits 8|4: x sent block-quantized, every member's decoded (ZeRO++'s qwZ)",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_RETURN_IF_ERROR(CheckQuantized(in[0], attrs));
        const int64_t size = attrs.GetInt(kGroupSizeAttr, 1);
        TESSERA_ASSIGN_OR_RETURN(const bool sequence, SplitsSequence(attrs));
        if (!sequence) {
          return Metas{TensorMeta{Shape{in[0].numel() * size}, in[0].dtype, in[0].device}};
        }
        TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> dims,
                                 SequenceSplitDims(in[0].shape.dims(), size, /*gather=*/true));
        return Metas{TensorMeta{Shape(std::move(dims)), in[0].dtype, in[0].device}};
      },
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
            return OpCost{0, Bytes(in) * (n - 1) * QuantizedShare(attrs)};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_gather_in_place",
      .doc = "member of an all-gather within one buffer: x (flat, group_size blocks) holds this "
             "member's block at rank r; out = x with every member's block (ZeRO-1/2 parameters "
             "after a sharded update)",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_RETURN_IF_ERROR(BlockCount(in[0], attrs).status());
        return Metas{in[0]};
      },
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
            return OpCost{0, Bytes(in) * (n - 1) / n};
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "all_to_all",
      .doc = "member of an all-to-all: x, read flat, is group_size equal contiguous blocks; "
             "block j goes to rank j, and out (x's shape) holds in block j what rank j's x held "
             "in block r (this member's rank). Any dtype. Attribute layout (core/"
             "exchange_layout.h): blocks (that), to_sequence ([P, B, S, ...] -> [B, P S, ...]: "
             "the received blocks joined along each row's sequence) or from_sequence (its "
             "adjoint), ring_next (x whole to member r + 1, out from r - 1) or ring_previous "
             "(its adjoint), halo_next (x whole to member r + 1, out from r - 1, zeros on the "
             "first member) or halo_previous (its adjoint). Sequence parallelism uses it to turn "
             "a sequence split into a head split and back (Ulysses), to rotate keys and values "
             "(ring attention) and to pass a volume's slabs their neighbours' boundary planes",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_ASSIGN_OR_RETURN(ExchangeLayout layout, ExchangeLayoutOf(attrs));
        if (RotatesRing(layout) || PassesHalo(layout)) return Metas{in[0]};  // whole: no blocks
        TESSERA_ASSIGN_OR_RETURN(const int64_t size, BlockCount(in[0], attrs));
        TESSERA_ASSIGN_OR_RETURN(std::vector<int64_t> dims,
                                 ExchangedDims(in[0].shape.dims(), layout, size));
        TensorMeta out = in[0];
        out.shape = Shape(std::move(dims));
        return Metas{out};
      },
      // A ring rotation sends the whole buffer once; the others (n - 1) / n of it.
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            Result<ExchangeLayout> layout = ExchangeLayoutOf(attrs);
            if (layout.ok() && (RotatesRing(*layout) || PassesHalo(*layout))) {
              return OpCost{static_cast<double>(in[0].numel()), Bytes(in)};
            }
            return CollectiveCost(1)(in, attrs);
          },
  }));
  TESSERA_RETURN_IF_ERROR(r.AddOp(OpDef{
      .name = "compressed_all_reduce",
      .doc = "member of an error-feedback compressed all-reduce (1-bit Adam's: "
             "collectives/compressed.h): out = the members' average of x sent as signs, "
             "worker_error (x's elements) and server_error (core/sign_compression.h's "
             "SignChunkElements of count) updated in place; attribute 'count' (default: all) "
             "the leading elements compressed, the rest padding passed through",
      .input_names = {"x", "worker_error", "server_error"},
      .output_names = {"out", "worker_error_out", "server_error_out"},
      .control_inputs = true,
      .in_place = {{0, 0}, {1, 1}, {2, 2}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_RETURN_IF_ERROR(op_def::CheckDType("x", in[0], DType::kF32));
        TESSERA_RETURN_IF_ERROR(op_def::CheckDType("worker_error", in[1], DType::kF32));
        TESSERA_RETURN_IF_ERROR(op_def::CheckDType("server_error", in[2], DType::kF32));
        if (in[1].numel() != in[0].numel()) {
          return InvalidArgument(
              "input 'worker_error' is {} but input 'x' is {}: one error an "
              "element",
              in[1].ToString(), in[0].ToString());
        }
        TESSERA_ASSIGN_OR_RETURN(int64_t count, CompressedCount(attrs, in[0].numel()));
        const int64_t chunk =
            SignChunkElements(count, static_cast<int>(attrs.GetInt(kGroupSizeAttr, 1)));
        if (in[2].numel() != chunk) {
          return InvalidArgument(
              "input 'server_error' is {} but a chunk of {} elements over {} members holds {}",
              in[2].ToString(), count, attrs.GetInt(kGroupSizeAttr, 1), chunk);
        }
        return Metas{in[0], in[1], in[2]};
      },
      // Two phases, each (n-1) blocks of a bit an element.
      .cost =
          [](const Metas& in, const Attrs& attrs) {
            const double n = static_cast<double>(attrs.GetInt(kGroupSizeAttr, 1));
            const auto count =
                static_cast<double>(attrs.GetInt(kCompressedCountAttr, in[0].numel()));
            return OpCost{4.0 * count, 2 * count / 8 * (n - 1) / n};
          },
  }));
  TESSERA_RETURN_IF_ERROR(AddBucketOps(r));
  return r.AddOp(OpDef{
      .name = "broadcast",
      .doc = "member of a broadcast: out = x of the member whose rank is attribute 'root'",
      .input_names = {"x"},
      .output_names = {"out"},
      .control_inputs = true,
      .in_place = {{0, 0}},
      .infer = [](const Metas& in, const Attrs& attrs) -> Result<Metas> {
        TESSERA_RETURN_IF_ERROR(CheckCollective(in[0], attrs, /*reduces=*/false));
        TESSERA_ASSIGN_OR_RETURN(int64_t root, attrs.GetInt("root"));
        if (root < 0 || root >= attrs.GetInt(kGroupSizeAttr, 1)) {
          return InvalidArgument("attribute 'root' is {}, not a rank of the group", root);
        }
        return Metas{in[0]};
      },
      .cost = CollectiveCost(1),
  });
}

}  // namespace tessera::detail
