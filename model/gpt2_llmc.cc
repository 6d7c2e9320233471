#include "model/gpt2_llmc.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "core/atomic_file.h"
#include "ops/flat_layout.h"

namespace tessera {

namespace {

namespace fs = std::filesystem;

constexpr int32_t kLlmcMagic = 20240326;
constexpr int32_t kLlmcVersionFp32 = 3;
constexpr int32_t kLlmcTokenFileMagic = 20240520;  // llm.c's token files (training/token_dataset.h)
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

int64_t LlmcPaddedVocab(int64_t vocab) { return (vocab + 127) / 128 * 128; }

// llm.c's tensor order: the slot's name, and whether llm.c stores one per block.
struct LlmcTensor {
  const char* slot;  // "wte", "ln1_w", ...
  bool per_layer;
};
constexpr LlmcTensor kLlmcOrder[] = {
    {"wte", false},     {"wpe", false},     {"ln1_w", true},  {"ln1_b", true},
    {"qkv_w", true},    {"qkv_b", true},    {"proj_w", true}, {"proj_b", true},
    {"ln2_w", true},    {"ln2_b", true},    {"fc_w", true},   {"fc_b", true},
    {"fcproj_w", true}, {"fcproj_b", true}, {"lnf_w", false}, {"lnf_b", false}};

// A tensor of the file: the layer whose group holds it (BuildGpt2's order) and its slot there.
struct LlmcPlace {
  size_t layer;
  const FlatSlot* slot;
};

// GPT-2's groups by layer index: the embedding, one block layout for every block, the head.
struct Gpt2Layouts {
  FlatLayout embedding, block, head;
  int64_t layers;
  explicit Gpt2Layouts(const Gpt2Config& c)
      : embedding(TokenPositionEmbeddingParamLayout(c.vocab, c.max_seq_len, c.channels)),
        block(TransformerBlockParamLayout(c.channels)),
        head(TiedLmHeadParamLayout(c.channels)),
        layers(c.layers) {}
  size_t count() const { return static_cast<size_t>(layers) + 2; }
  const FlatLayout& of(size_t layer) const {
    if (layer == 0) return embedding;
    return layer + 1 == count() ? head : block;
  }
  // The tensors in llm.c's file order.
  std::vector<LlmcPlace> FileOrder() const {
    std::vector<LlmcPlace> places;
    for (const LlmcTensor& tensor : kLlmcOrder) {
      if (!tensor.per_layer) {
        const bool in_embedding = embedding.Find(tensor.slot).ok();
        const size_t layer = in_embedding ? 0 : count() - 1;
        places.push_back({layer, &of(layer).slot(tensor.slot)});
        continue;
      }
      for (int64_t l = 0; l < layers; ++l) {
        places.push_back({static_cast<size_t>(l) + 1, &block.slot(tensor.slot)});
      }
    }
    return places;
  }
};

struct LlmcHeader {
  Gpt2Config config;
  int64_t padded_vocab = 0;
};

// The model `path`'s header describes, checked against what llm.c writes and against the file's
// size (exactly the header and that model's tensors).
Result<LlmcHeader> ParseLlmcHeader(const std::string& path, const int32_t* header,
                                   uintmax_t file_size) {
  if (header[0] != kLlmcMagic) {
    return InvalidArgument(
        "'{}' is not an llm.c GPT-2 checkpoint: it starts with {} where llm.c's magic number is "
        "{}{}",
        path, header[0], kLlmcMagic,
        header[0] == kLlmcTokenFileMagic ? " (it is an llm.c token file, for --data)" : "");
  }
  if (header[1] != kLlmcVersionFp32) {
    return InvalidArgument(
        "'{}' is an llm.c checkpoint of version {}: only version {} (fp32 weights) is supported{}",
        path, header[1], kLlmcVersionFp32, header[1] == 5 ? "; version 5 holds bf16 weights" : "");
  }
  LlmcHeader parsed;
  Gpt2Config& c = parsed.config;
  c.max_seq_len = header[2];
  c.vocab = header[3];
  c.layers = header[4];
  c.heads = header[5];
  c.channels = header[6];
  parsed.padded_vocab = header[7];
  // Bounds far beyond any GPT-2 keep the size arithmetic below from overflowing.
  const auto in_range = [](int64_t value, int log2_limit) {
    return value > 0 && value <= (int64_t{1} << log2_limit);
  };
  if (!in_range(c.max_seq_len, 24) || !in_range(c.vocab, 24) || !in_range(c.layers, 12) ||
      !in_range(c.heads, 16) || !in_range(c.channels, 16) || !in_range(parsed.padded_vocab, 24) ||
      parsed.padded_vocab < c.vocab) {
    return DataLoss(
        "'{}' has a damaged llm.c header: max_seq_len={} vocab={} layers={} heads={} channels={} "
        "padded_vocab={}",
        path, c.max_seq_len, c.vocab, c.layers, c.heads, c.channels, parsed.padded_vocab);
  }
  TESSERA_RETURN_IF_ERROR(c.Validate().WithContext(path));
  const uintmax_t expected =
      kLlmcHeaderBytes +
      sizeof(float) *
          static_cast<uintmax_t>(c.NumParameters() + (parsed.padded_vocab - c.vocab) * c.channels);
  if (file_size < expected) {
    return DataLoss(
        "'{}' is truncated: {} bytes, but the checkpoint of the model its header "
        "describes ({}) has {}",
        path, file_size, c.ToString(), expected);
  }
  if (file_size > expected) {
    return DataLoss(
        "'{}' has {} bytes after the last tensor of the model its header describes "
        "({}): not an llm.c GPT-2 checkpoint",
        path, file_size - expected, c.ToString());
  }
  return parsed;
}

}  // namespace

Result<Gpt2Config> ReadLlmcConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open '{}': {}", path, std::strerror(errno));
  std::error_code error;
  if (!fs::is_regular_file(path, error)) {
    return InvalidArgument("'{}' is not a regular file{}: an llm.c checkpoint is one file", path,
                           fs::is_directory(path, error) ? " but a directory" : "");
  }
  const uintmax_t size = fs::file_size(path, error);
  if (error) return Unavailable("cannot read the size of '{}': {}", path, error.message());
  if (size < kLlmcHeaderBytes) {
    return DataLoss(
        "'{}' has {} bytes: too short for an llm.c checkpoint (its header alone has {})", path,
        size, kLlmcHeaderBytes);
  }
  int32_t header[kLlmcHeaderInts];
  if (!in.read(reinterpret_cast<char*>(header), kLlmcHeaderBytes)) {
    return Unavailable("cannot read the header of '{}'", path);
  }
  TESSERA_ASSIGN_OR_RETURN(LlmcHeader parsed, ParseLlmcHeader(path, header, size));
  return parsed.config;
}

Status ExportLlmc(const Gpt2Config& c, const Gpt2ParameterGroups& groups, const std::string& path) {
  TESSERA_RETURN_IF_ERROR(c.Validate());
  std::string out(kLlmcHeaderBytes, '\0');
  auto* header = reinterpret_cast<int32_t*>(out.data());
  header[0] = kLlmcMagic;
  header[1] = kLlmcVersionFp32;
  header[2] = static_cast<int32_t>(c.max_seq_len);
  header[3] = static_cast<int32_t>(c.vocab);
  header[4] = static_cast<int32_t>(c.layers);
  header[5] = static_cast<int32_t>(c.heads);
  header[6] = static_cast<int32_t>(c.channels);
  header[7] = static_cast<int32_t>(LlmcPaddedVocab(c.vocab));
  // Whole groups, each read once, then the tensors in llm.c's order.
  const Gpt2Layouts layouts(c);
  std::vector<std::vector<float>> read(layouts.count());
  for (size_t layer = 0; layer < layouts.count(); ++layer) {
    TESSERA_ASSIGN_OR_RETURN(read[layer], groups.read(layer));
    if (static_cast<int64_t>(read[layer].size()) < layouts.of(layer).numel()) {
      return InvalidArgument("group {} has {} elements, fewer than GPT-2's {} ({})", layer,
                             read[layer].size(), layouts.of(layer).numel(), c.ToString());
    }
  }
  for (const LlmcPlace& place : layouts.FileOrder()) {
    const float* begin = read[place.layer].data() + place.slot->offset;
    out.append(reinterpret_cast<const char*>(begin),
               static_cast<size_t>(place.slot->shape.numel()) * sizeof(float));
    if (place.slot->name == "wte") {  // llm.c pads the vocabulary rows with zeros
      out.append(
          static_cast<size_t>((LlmcPaddedVocab(c.vocab) - c.vocab) * c.channels) * sizeof(float),
          '\0');
    }
  }
  return WriteFileAtomically(path, out);
}

Status ImportLlmc(const Gpt2Config& c, const Gpt2ParameterGroups& groups, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path, "llm.c checkpoint"));
  if (bytes.size() < kLlmcHeaderBytes) {
    return DataLoss(
        "'{}' has {} bytes: too short for an llm.c checkpoint (its header alone has {})", path,
        bytes.size(), kLlmcHeaderBytes);
  }
  TESSERA_ASSIGN_OR_RETURN(
      LlmcHeader header,
      ParseLlmcHeader(path, reinterpret_cast<const int32_t*>(bytes.data()), bytes.size()));
  const Gpt2Config& saved = header.config;
  // The activation type is not part of the file: a GPU run may load a CPU run's weights.
  Gpt2Config wanted = c;
  wanted.activations = saved.activations;
  if (saved != wanted) {
    return InvalidArgument("'{}' holds a model with {}, but this model is {}", path,
                           saved.ToString(), c.ToString());
  }
  // Every group assembled from the file first: a bad file changes nothing. The header check
  // made sure every tensor is there.
  const Gpt2Layouts layouts(c);
  std::vector<std::vector<float>> values(layouts.count());
  for (size_t layer = 0; layer < layouts.count(); ++layer) {
    values[layer].assign(static_cast<size_t>(layouts.of(layer).numel()), 0.0f);
  }
  size_t offset = kLlmcHeaderBytes;
  for (const LlmcPlace& place : layouts.FileOrder()) {
    const size_t count = static_cast<size_t>(place.slot->shape.numel());
    std::memcpy(values[place.layer].data() + place.slot->offset, bytes.data() + offset,
                count * sizeof(float));
    offset += count * sizeof(float);
    if (place.slot->name == "wte") {
      offset += static_cast<size_t>((header.padded_vocab - c.vocab) * c.channels) * sizeof(float);
    }
  }
  for (size_t layer = 0; layer < layouts.count(); ++layer) {
    TESSERA_RETURN_IF_ERROR(groups.write(layer, values[layer]));
  }
  return Status::Ok();
}

}  // namespace tessera
