#include "training/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <variant>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/checksum.h"

namespace tessera {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kFormatVersion = 1;

// A model's configuration (its attributes) as a JSON object.
json ConfigJson(const Attrs& config) {
  json out = json::object();
  for (const auto& [name, value] : config.values()) {
    // `&name = name`: Clang 15 cannot capture a structured binding.
    std::visit([&out, &name = name](const auto& v) { out[name] = v; }, value);
  }
  return out;
}

// The model's configuration when it has one (the language model's five dimensions: what its
// checkpoints have always recorded). Other models: the name and the layers' parameter counts.
json ModelJson(const Trainer& trainer) {
  const ModelSpec& model = trainer.model();
  if (!model.config.values().empty()) return ConfigJson(model.config);
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
  for (StateKind kind :
       {StateKind::kParameter, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kWorkerError,
        StateKind::kServerError, StateKind::kIntervalStart}) {
    if (name == StateKindName(kind)) return kind;
  }
  return DataLoss("unknown state kind '{}'", name);
}

}  // namespace

Status RestoreErrors(Trainer& trainer, const SavedErrors& saved, int64_t step) {
  const OptimizerConfig& optimizer = trainer.plan().optimizer;
  if (optimizer.kind == OptimizerConfig::Kind::kOneBitAdam) {
    if (step < optimizer.freeze_step) {
      if (!optimizer.compressed_phase) return Status::Ok();
      return InvalidArgument(
          "the checkpoint is of step {}, in 1-bit Adam's warm-up, but this trainer is past its "
          "freeze step {}: load it into a fresh trainer",
          step, optimizer.freeze_step);
    }
    TESSERA_RETURN_IF_ERROR(trainer.EnterCompressedPhase());
  } else if (optimizer.kind != OptimizerConfig::Kind::kZeroOneAdam) {
    return Status::Ok();
  }
  const StepGraph& graph = trainer.step_graph();
  for (size_t i = 0; i < graph.state.size(); ++i) {
    const StateObject& object = graph.state[i];
    const bool worker = object.kind == StateKind::kWorkerError;
    if (!worker && object.kind != StateKind::kServerError) continue;
    const LayerSpec& layer = trainer.model().layers[object.piece.layer];
    const auto& by_layer = worker ? saved.worker : saved.server;
    auto found = by_layer.find(layer.name);
    if (found == by_layer.end() || found->second.empty()) continue;
    const std::map<int, std::vector<float>>& ranks = found->second;
    const int64_t numel = layer.params.numel();
    std::vector<float> values(static_cast<size_t>(object.piece.numel), 0.0f);
    // The same ranks: each its own errors. Their lengths may differ by padding (a worker error
    // saved under ZeRO-1/2 is the padded group's), which holds no error.
    const bool same = static_cast<int>(ranks.size()) == graph.parallel.data_parallel &&
                      ranks.contains(object.piece.rank);
    if (same) {
      const std::vector<float>& own = ranks.at(object.piece.rank);
      std::copy_n(own.begin(), std::min(own.size(), values.size()), values.begin());
    } else if (worker) {
      for (int64_t k = 0; k < std::min<int64_t>(numel, object.piece.numel); ++k) {
        double sum = 0;
        for (const auto& [rank, error] : ranks) {
          if (k < static_cast<int64_t>(error.size())) sum += error[static_cast<size_t>(k)];
        }
        values[static_cast<size_t>(k)] =
            static_cast<float>(sum / static_cast<double>(ranks.size()));
      }
    } else {
      const auto old_chunk = static_cast<int64_t>(ranks.begin()->second.size());
      const int64_t begin = object.piece.numel * object.piece.rank;
      for (int64_t j = 0; j < object.piece.numel && begin + j < numel && old_chunk > 0; ++j) {
        const int64_t k = begin + j;
        auto chunk = ranks.find(static_cast<int>(k / old_chunk));
        if (chunk != ranks.end())
          values[static_cast<size_t>(j)] = chunk->second[static_cast<size_t>(k % old_chunk)];
      }
    }
    TESSERA_RETURN_IF_ERROR(trainer.WriteStateObject(i, values));
  }
  return Status::Ok();
}

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
  const bool adamw = trainer.plan().optimizer.has_moments();
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
  for (const auto& [layer, kind, group] : writes) {
    const int64_t numel = model.layers[layer].params.numel();
    std::vector<float> values(static_cast<size_t>(trainer.GroupNumel(layer)), 0.0f);
    std::copy_n(group->begin(), numel, values.begin());  // re-padded for this plan
    TESSERA_RETURN_IF_ERROR(trainer.WriteGroup(layer, kind, values));
  }
  return Status::Ok();
}

namespace {

// Each state object's piece written by the worker that holds it ("rank<r>/<layer>.<kind>.bin"
// under `partial`), atomically; returns the manifest's pieces.
Result<json> WritePieces(Trainer& trainer, const fs::path& partial) {
  const StepGraph& step = trainer.step_graph();
  std::vector<size_t> indices;
  std::vector<std::string> files, paths;
  for (size_t i = 0; i < step.state.size(); ++i) {
    const StateObject& object = step.state[i];
    // Master copies equal the parameters between steps (which the checkpoint keeps); a loading
    // plan that offloads rebuilds them from the parameters (Trainer::WriteGroup). 0/1 Adam's
    // interval starts are the parameters at every synchronised step, the only ones saved.
    if (object.kind == StateKind::kMasterParameter || object.kind == StateKind::kIntervalStart) {
      continue;
    }
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
  return pieces;
}

// Under tensor parallelism: each whole group gathered here and written as one piece
// ("whole/<layer>.<kind>.bin"), so that any plan, of any tensor-parallel degree, loads it.
Result<json> WriteWholeGroups(Trainer& trainer, const fs::path& partial) {
  const bool adamw = trainer.plan().optimizer.has_moments();
  std::error_code error;
  if (!fs::create_directories(partial / "whole", error) && error) {
    return Unavailable("cannot create checkpoint directory '{}': {}", (partial / "whole").string(),
                       error.message());
  }
  json pieces = json::array();
  for (size_t l = 0; l < trainer.model().layers.size(); ++l) {
    const LayerSpec& layer = trainer.model().layers[l];
    if (layer.params.numel() == 0) continue;
    for (StateKind kind : {StateKind::kParameter, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      if (kind != StateKind::kParameter && !adamw) continue;
      TESSERA_ASSIGN_OR_RETURN(std::vector<float> group, trainer.ReadGroup(l, kind));
      const std::string file = fmt::format("whole/{}.{}.bin", layer.name, StateKindName(kind));
      const std::string_view bytes(reinterpret_cast<const char*>(group.data()),
                                   group.size() * sizeof(float));
      TESSERA_RETURN_IF_ERROR(WriteFileAtomically((partial / file).string(), bytes));
      pieces.push_back(json{{"layer", layer.name},
                            {"kind", StateKindName(kind)},
                            {"rank", 0},
                            {"begin", 0},
                            {"numel", static_cast<int64_t>(group.size())},
                            {"file", file},
                            {"bytes", static_cast<int64_t>(bytes.size())},
                            {"fnv1a", Fnv1a(bytes.data(), bytes.size())}});
    }
  }
  return pieces;
}

}  // namespace

Result<std::string> SaveCheckpoint(Trainer& trainer, const std::string& dir,
                                   const std::string& sampler_state) {
  const StepGraph& step = trainer.step_graph();
  if (!trainer.parameters_synchronized()) {
    return InvalidArgument(
        "step {} is one of 0/1 Adam's local steps: each rank holds its own parameters until "
        "the synchronisation at step {}; save a checkpoint then (or lower --local-step-clipper)",
        trainer.steps_taken(), trainer.NextSynchronizedStep());
  }
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
  json pieces = json::array();
  json groups = json::object();
  if (trainer.planned_model().rewritten()) {  // tensor or sequence parallelism
    TESSERA_ASSIGN_OR_RETURN(pieces, WriteWholeGroups(trainer, partial));
  } else {
    TESSERA_ASSIGN_OR_RETURN(pieces, WritePieces(trainer, partial));
  }
  for (size_t l = 0; l < trainer.model().layers.size(); ++l) {
    const LayerSpec& layer = trainer.model().layers[l];
    groups[layer.name] =
        json{{"numel", layer.params.numel()}, {"padded_numel", trainer.GroupNumel(l)}};
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
    TESSERA_ASSIGN_OR_RETURN(std::string latest,
                             ReadWholeFile((step_dir / "latest").string(), "checkpoint file"));
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == '\r')) latest.pop_back();
    step_dir /= latest;
  }
  const std::string manifest_path = (step_dir / "manifest.json").string();
  TESSERA_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(manifest_path, "checkpoint manifest"));
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
  SavedErrors errors;
  try {
    for (const json& piece : manifest.at("pieces")) {
      const std::string layer = piece.at("layer");
      TESSERA_ASSIGN_OR_RETURN(StateKind kind, KindFromName(piece.at("kind")));
      const int64_t begin = piece.at("begin"), numel = piece.at("numel");
      const int64_t padded = manifest.at("groups").at(layer).at("padded_numel");
      const bool error_buffer = kind == StateKind::kWorkerError || kind == StateKind::kServerError;
      if (!error_buffer && piece.at("rank") != 0 && begin == 0 && numel == padded) {
        continue;  // a replica
      }
      const std::string file = (step_dir / piece.at("file").get<std::string>()).string();
      TESSERA_ASSIGN_OR_RETURN(std::string bytes, ReadWholeFile(file, "checkpoint file"));
      if (static_cast<int64_t>(bytes.size()) != numel * 4) {
        return DataLoss("checkpoint piece '{}' has {} bytes but the manifest says {} (truncated?)",
                        file, bytes.size(), numel * 4);
      }
      if (Fnv1a(bytes.data(), bytes.size()) != piece.at("fnv1a").get<uint64_t>()) {
        return DataLoss("checkpoint piece '{}' is corrupted (checksum mismatch)", file);
      }
      const auto* values = reinterpret_cast<const float*>(bytes.data());
      if (error_buffer) {  // each rank's own
        (kind == StateKind::kWorkerError ? errors.worker : errors.server)[layer][piece.at("rank")] =
            std::vector<float>(values, values + numel);
        continue;
      }
      TESSERA_RETURN_IF_ERROR(
          gathered.Add(layer, kind, padded, begin, values, numel).WithContext(file));
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
  TESSERA_RETURN_IF_ERROR(RestoreErrors(trainer, errors, info.step)
                              .WithContext("restoring the compressed all-reduces' error buffers"));
  return info;
}

}  // namespace tessera
