#include "training/checkpoint.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/checksum.h"

namespace tessera {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kFormatVersion = 1;

Result<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot open '{}': {}", path, std::strerror(errno));
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

json ConfigJson(const Gpt2Config& c) {
  return json{{"layers", c.layers},
              {"channels", c.channels},
              {"heads", c.heads},
              {"vocab", c.vocab},
              {"max_seq_len", c.max_seq_len}};
}

// GPT-2: its configuration (the format of earlier checkpoints). Other models: the name and the
// layers with their parameter counts.
json ModelJson(const Trainer& trainer) {
  if (trainer.gpt2_config()) return ConfigJson(*trainer.gpt2_config());
  const ModelSpec& model = trainer.model();
  json layers = json::array();
  for (const LayerSpec& layer : model.layers) {
    layers.push_back(json{{"name", layer.name}, {"numel", layer.params.numel()}});
  }
  return json{{"name", model.name}, {"layer_groups", layers}};
}

Status CheckSameModel(const json& saved, const Trainer& trainer, const std::string& path) {
  const json expected = ModelJson(trainer);
  for (const auto& [field, value] : expected.items()) {
    if (!saved.contains(field) || saved[field] != value) {
      return InvalidArgument(
          "checkpoint '{}' is of a model with {}={} but this model has {}={}: resume with the "
          "same model",
          path, field, saved.contains(field) ? saved[field].dump() : "?", field, value.dump());
    }
  }
  return Status::Ok();
}

Result<StateKind> KindFromName(const std::string& name) {
  for (StateKind kind : {StateKind::kParameter, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    if (name == StateKindName(kind)) return kind;
  }
  return DataLoss("unknown state kind '{}'", name);
}

}  // namespace

Status GatheredState::Add(const std::string& layer, StateKind kind, int64_t padded, int64_t begin,
                          const float* values, int64_t numel) {
  if (begin < 0 || numel < 0 || padded < 0 || begin > padded || numel > padded - begin) {
    return DataLoss("a piece of {} of layer '{}' at {} of {} elements lies outside its group of {}",
                    StateKindName(kind), layer, begin, numel, padded);
  }
  auto [it, inserted] = groups.try_emplace({layer, kind});
  if (inserted) it->second.assign(static_cast<size_t>(padded), 0.0f);
  if (static_cast<int64_t>(it->second.size()) != padded) {
    return DataLoss("pieces of {} of layer '{}' disagree on its size ({} and {} elements)",
                    StateKindName(kind), layer, it->second.size(), padded);
  }
  std::copy_n(values, numel, it->second.begin() + begin);
  covered[{layer, kind}] += numel;
  return Status::Ok();
}

Status WriteGathered(Trainer& trainer, const GatheredState& state, const std::string& source) {
  // Every group checked before anything is written: a state that lacks one changes nothing.
  const ModelSpec& model = trainer.model();
  const bool adamw = trainer.plan().optimizer.kind == OptimizerConfig::Kind::kAdamW;
  std::vector<std::tuple<size_t, StateKind, const std::vector<float>*>> writes;
  for (size_t l = 0; l < model.layers.size(); ++l) {
    if (model.layers[l].params.numel() == 0) continue;  // a layer without parameters
    for (StateKind kind : {StateKind::kParameter, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      if (kind != StateKind::kParameter && !adamw) continue;
      auto it = state.groups.find({model.layers[l].name, kind});
      auto covered = state.covered.find({model.layers[l].name, kind});
      if (it == state.groups.end() || covered == state.covered.end() ||
          covered->second < model.layers[l].params.numel() ||
          static_cast<int64_t>(it->second.size()) < model.layers[l].params.numel()) {
        return DataLoss("{} lacks {} of layer '{}'", source, StateKindName(kind),
                        model.layers[l].name);
      }
      writes.emplace_back(l, kind, &it->second);
    }
  }
  const StepGraph& step = trainer.step_graph();
  for (const auto& [layer, kind, group] : writes) {
    const int64_t numel = model.layers[layer].params.numel();
    std::vector<float> values(static_cast<size_t>(step.group_numel[layer]), 0.0f);
    std::copy_n(group->begin(), numel, values.begin());  // re-padded for this plan
    TESSERA_RETURN_IF_ERROR(trainer.WriteGroup(layer, kind, values));
  }
  return Status::Ok();
}

Result<std::string> SaveCheckpoint(Trainer& trainer, const std::string& dir,
                                   const std::string& sampler_state) {
  const StepGraph& step = trainer.step_graph();
  const std::string name = fmt::format("step_{:08d}", trainer.steps_taken());
  const fs::path final_dir = fs::path(dir) / name;
  std::error_code error;
  if (fs::exists(final_dir / "manifest.json", error)) return final_dir.string();  // already saved
  // The pieces go to a staging directory (always the same one, so the workers' write graph is
  // planned once per checkpoint directory) that becomes the step directory once complete.
  // Absolute: the workers' working directories are not the driver's.
  const fs::path partial = fs::absolute(fs::path(dir) / "incoming.partial", error);
  if (error) return InvalidArgument("bad checkpoint directory '{}': {}", dir, error.message());
  fs::remove_all(partial, error);
  if (!fs::create_directories(partial, error) && error) {
    return Unavailable("cannot create checkpoint directory '{}': {}", partial.string(),
                       error.message());
  }
  std::vector<size_t> indices;
  std::vector<std::string> files, paths;
  for (size_t i = 0; i < step.state.size(); ++i) {
    const StateObject& object = step.state[i];
    // Master copies equal the parameters between steps (which the checkpoint keeps); a loading
    // plan that offloads rebuilds them from the parameters (Trainer::WriteGroup).
    if (object.kind == StateKind::kMasterParameter) continue;
    const std::string& layer = trainer.model().layers[object.piece.layer].name;
    indices.push_back(i);
    files.push_back(
        fmt::format("rank{}/{}.{}.bin", object.piece.rank, layer, StateKindName(object.kind)));
    paths.push_back((partial / files.back()).string());
  }
  // Each worker writes the pieces it holds, atomically, and says what it wrote.
  TESSERA_ASSIGN_OR_RETURN(std::vector<Trainer::FileReceipt> receipts,
                           trainer.WriteState(indices, paths));
  json pieces = json::array();
  for (size_t j = 0; j < indices.size(); ++j) {
    const StateObject& object = step.state[indices[j]];
    const int64_t expected = 4 * object.piece.numel;
    if (receipts[j].bytes != expected) {
      return DataLoss("checkpoint piece '{}' was written with {} bytes, expected {}", paths[j],
                      receipts[j].bytes, expected);
    }
    pieces.push_back(json{{"layer", trainer.model().layers[object.piece.layer].name},
                          {"kind", StateKindName(object.kind)},
                          {"rank", object.piece.rank},
                          {"begin", object.piece.begin},
                          {"numel", object.piece.numel},
                          {"file", files[j]},
                          {"bytes", receipts[j].bytes},
                          {"fnv1a", receipts[j].fnv1a}});
  }
  json groups = json::object();
  for (size_t l = 0; l < step.group_numel.size(); ++l) {
    groups[trainer.model().layers[l].name] = json{
        {"numel", trainer.model().layers[l].params.numel()}, {"padded_numel", step.group_numel[l]}};
  }
  const json manifest{{"format", "tessera-checkpoint"},
                      {"version", kFormatVersion},
                      {"model", ModelJson(trainer)},
                      {"step", trainer.steps_taken()},
                      {"sampler_state", sampler_state},
                      {"plan", step.parallel.ToString()},
                      {"groups", groups},
                      {"pieces", pieces}};
  TESSERA_RETURN_IF_ERROR(
      WriteFileAtomically((partial / "manifest.json").string(), manifest.dump(1)));
  fs::rename(partial, final_dir, error);
  if (error) {
    return Unavailable("cannot rename '{}' to '{}': {}", partial.string(), final_dir.string(),
                       error.message());
  }
  TESSERA_RETURN_IF_ERROR(WriteFileAtomically((fs::path(dir) / "latest").string(), name + "\n"));
  return final_dir.string();
}

Result<CheckpointInfo> LoadCheckpoint(Trainer& trainer, const std::string& path) {
  fs::path step_dir = path;
  std::error_code error;
  if (!fs::exists(step_dir / "manifest.json", error)) {
    if (!fs::exists(step_dir / "latest", error)) {
      return NotFound(
          "'{}' holds no checkpoint (neither a manifest.json nor a 'latest' pointer): pass a "
          "--checkpoint-dir that a run saved into",
          path);
    }
    TESSERA_ASSIGN_OR_RETURN(std::string latest, ReadWholeFile((step_dir / "latest").string()));
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == '\r')) latest.pop_back();
    step_dir /= latest;
  }
  const std::string manifest_path = (step_dir / "manifest.json").string();
  TESSERA_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(manifest_path));
  json manifest;
  try {
    manifest = json::parse(text);
  } catch (const json::exception& e) {
    return DataLoss("checkpoint manifest '{}' is damaged: {}", manifest_path, e.what());
  }
  if (manifest.value("format", "") != "tessera-checkpoint" ||
      manifest.value("version", 0) != kFormatVersion) {
    return DataLoss("'{}' is not a version-{} Tessera checkpoint manifest", manifest_path,
                    kFormatVersion);
  }
  TESSERA_RETURN_IF_ERROR(CheckSameModel(manifest["model"], trainer, manifest_path));
  // Every group of the trainer's plan, assembled from the saved pieces; only then is anything
  // written into the trainer (a damaged checkpoint leaves it as it was).
  GatheredState gathered;
  try {
    for (const json& piece : manifest.at("pieces")) {
      const std::string layer = piece.at("layer");
      TESSERA_ASSIGN_OR_RETURN(StateKind kind, KindFromName(piece.at("kind")));
      const int64_t begin = piece.at("begin"), numel = piece.at("numel");
      const int64_t padded = manifest.at("groups").at(layer).at("padded_numel");
      if (piece.at("rank") != 0 && begin == 0 && numel == padded) continue;  // a replica
      const std::string file = (step_dir / piece.at("file").get<std::string>()).string();
      TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(file));
      if (static_cast<int64_t>(bytes.size()) != numel * 4) {
        return DataLoss("checkpoint piece '{}' has {} bytes but the manifest says {} (truncated?)",
                        file, bytes.size(), numel * 4);
      }
      if (Fnv1a(bytes.data(), bytes.size()) != piece.at("fnv1a").get<uint64_t>()) {
        return DataLoss("checkpoint piece '{}' is corrupted (checksum mismatch)", file);
      }
      TESSERA_RETURN_IF_ERROR(
          gathered
              .Add(layer, kind, padded, begin, reinterpret_cast<const float*>(bytes.data()), numel)
              .WithContext(file));
    }
  } catch (const json::exception& e) {
    return DataLoss("checkpoint manifest '{}' is damaged: {}", manifest_path, e.what());
  }
  TESSERA_RETURN_IF_ERROR(
      WriteGathered(trainer, gathered, "checkpoint '" + step_dir.string() + "'"));
  CheckpointInfo info;
  info.path = step_dir.string();
  info.step = manifest.at("step");
  info.sampler_state = manifest.value("sampler_state", "");
  trainer.set_steps_taken(info.step);
  return info;
}

namespace {

constexpr int32_t kLlmcMagic = 20240326;
constexpr int32_t kLlmcVersionFp32 = 3;
constexpr int32_t kLlmcTokenFileMagic = 20240520;  // llm.c's token files (training/token_dataset.h)
constexpr size_t kLlmcHeaderInts = 256;
constexpr size_t kLlmcHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);

int64_t PaddedVocab(int64_t vocab) { return (vocab + 127) / 128 * 128; }

// llm.c's tensor order: our slot name, and whether llm.c stores one per block (h.<l>.<name>).
struct LlmcTensor {
  std::string prefix_free_name;  // "wte", "ln1_w", ...
  bool per_layer;
};
const LlmcTensor kLlmcOrder[] = {
    {"wte", false},     {"wpe", false},     {"ln1_w", true},  {"ln1_b", true},
    {"qkv_w", true},    {"qkv_b", true},    {"proj_w", true}, {"proj_b", true},
    {"ln2_w", true},    {"ln2_b", true},    {"fc_w", true},   {"fc_b", true},
    {"fcproj_w", true}, {"fcproj_b", true}, {"lnf_w", false}, {"lnf_b", false}};

// Our parameter names in llm.c's file order.
std::vector<std::string> LlmcNames(const Gpt2Config& c) {
  std::vector<std::string> names;
  for (const LlmcTensor& tensor : kLlmcOrder) {
    if (!tensor.per_layer) {
      names.push_back(tensor.prefix_free_name);
      continue;
    }
    for (int64_t l = 0; l < c.layers; ++l) {
      names.push_back(fmt::format("h.{}.{}", l, tensor.prefix_free_name));
    }
  }
  return names;
}

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

namespace {

// The GPT-2 configuration of a trainer, for llm.c's format. InvalidArgument for other models.
Result<Gpt2Config> Gpt2ConfigOf(const Trainer& trainer) {
  if (!trainer.gpt2_config()) {
    return InvalidArgument("model '{}' is not GPT-2 (fused): llm.c's format holds GPT-2 only",
                           trainer.model().name);
  }
  return *trainer.gpt2_config();
}

}  // namespace

Status ExportLlmc(Trainer& trainer, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(const Gpt2Config c, Gpt2ConfigOf(trainer));
  std::string out(kLlmcHeaderBytes, '\0');
  auto* header = reinterpret_cast<int32_t*>(out.data());
  header[0] = kLlmcMagic;
  header[1] = kLlmcVersionFp32;
  header[2] = static_cast<int32_t>(c.max_seq_len);
  header[3] = static_cast<int32_t>(c.vocab);
  header[4] = static_cast<int32_t>(c.layers);
  header[5] = static_cast<int32_t>(c.heads);
  header[6] = static_cast<int32_t>(c.channels);
  header[7] = static_cast<int32_t>(PaddedVocab(c.vocab));
  // Whole groups, each read once, then the tensors in llm.c's order.
  std::map<size_t, std::vector<float>> groups;
  for (const std::string& name : LlmcNames(c)) {
    TESSERA_ASSIGN_OR_RETURN(Trainer::ParameterRef ref, trainer.FindParameter(name));
    if (!groups.contains(ref.group)) {
      TESSERA_ASSIGN_OR_RETURN(groups[ref.group],
                               trainer.ReadGroup(ref.group, StateKind::kParameter));
    }
    const float* begin = groups[ref.group].data() + ref.slot->offset;
    out.append(reinterpret_cast<const char*>(begin),
               static_cast<size_t>(ref.slot->shape.numel()) * sizeof(float));
    if (name == "wte") {  // llm.c pads the vocabulary rows with zeros
      out.append(static_cast<size_t>((PaddedVocab(c.vocab) - c.vocab) * c.channels) * sizeof(float),
                 '\0');
    }
  }
  return WriteFileAtomically(path, out);
}

Status ImportLlmc(Trainer& trainer, const std::string& path) {
  TESSERA_ASSIGN_OR_RETURN(const Gpt2Config c, Gpt2ConfigOf(trainer));
  TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(path));
  if (bytes.size() < kLlmcHeaderBytes) {
    return DataLoss(
        "'{}' has {} bytes: too short for an llm.c checkpoint (its header alone has {})", path,
        bytes.size(), kLlmcHeaderBytes);
  }
  TESSERA_ASSIGN_OR_RETURN(
      LlmcHeader header,
      ParseLlmcHeader(path, reinterpret_cast<const int32_t*>(bytes.data()), bytes.size()));
  const Gpt2Config& saved = header.config;
  if (saved != c) {
    return InvalidArgument("'{}' holds a model with {}, but this model is {}", path,
                           saved.ToString(), c.ToString());
  }
  // Every group assembled from the file first: a bad file changes nothing. The header check
  // made sure every tensor is there.
  std::map<size_t, std::vector<float>> groups;
  size_t offset = kLlmcHeaderBytes;
  for (const std::string& name : LlmcNames(c)) {
    TESSERA_ASSIGN_OR_RETURN(Trainer::ParameterRef ref, trainer.FindParameter(name));
    std::vector<float>& group = groups[ref.group];
    group.resize(static_cast<size_t>(trainer.step_graph().group_numel[ref.group]));
    const size_t count = static_cast<size_t>(ref.slot->shape.numel());
    std::memcpy(group.data() + ref.slot->offset, bytes.data() + offset, count * sizeof(float));
    offset += count * sizeof(float);
    if (name == "wte") {
      offset += static_cast<size_t>((header.padded_vocab - c.vocab) * c.channels) * sizeof(float);
    }
  }
  for (const auto& [layer, values] : groups) {
    TESSERA_RETURN_IF_ERROR(trainer.WriteGroup(layer, StateKind::kParameter, values));
  }
  return Status::Ok();
}

}  // namespace tessera
