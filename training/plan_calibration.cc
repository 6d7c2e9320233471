#include "training/plan_calibration.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <set>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "training/collective_link.h"
#include "training/layer_profile.h"

namespace tessera {
namespace {

using nlohmann::json;

std::string HostName() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
  return name;
}

json LinkJson(const CollectiveLink& link) {
  return json{{"latency_us", link.latency_us}, {"bytes_per_us", link.bytes_per_us}};
}

CollectiveLink LinkFrom(const json& j) {
  return CollectiveLink{j.at("latency_us").get<double>(), j.at("bytes_per_us").get<double>()};
}

}  // namespace

std::vector<int64_t> CandidateRows(const ModelSpec& model, const TrainingPlan& base,
                                   const SearchSpace& space) {
  std::set<int64_t> rows;
  for (const PlanChoice& c : EnumerateCandidates(model, base, space)) {
    rows.insert(base.batch / (int64_t{c.data_parallel} * c.micro_batches));
  }
  return {rows.begin(), rows.end()};
}

Result<Calibration> Calibrate(const ModelSpec& model, const TrainingPlan& base,
                              const CalibrationRequest& request, const ExecutorOptions& executor,
                              GraphBackend* backend,
                              const std::function<void(const std::string&)>& progress) {
  if (request.rows.empty()) {
    return InvalidArgument("calibrating: no micro-batch row counts to profile the layers at");
  }
  Calibration calibration;
  LayerProfileOptions options;
  options.split_backwards = true;
  options.steps = std::max(1, request.profile_steps);
  double overhead_sum = 0;
  for (int64_t rows : request.rows) {
    TrainingPlan shape = base;
    shape.batch = rows;
    shape.parallel = ParallelConfig{};
    shape.memory = MemoryCaps{};
    Result<StepProfile> profile = ProfileStep(model, shape, executor, options);
    if (!profile.ok()) {
      return profile.status().WithContext(fmt::format("calibrating the layers at {} rows", rows));
    }
    double step_layers = 0;
    for (OpCosts& ms : profile->layer_ms) {
      // A layer too fast to time still costs something.
      ms.forward = std::max(ms.forward, 1e-3);
      ms.backward = std::max(ms.backward, 1e-3);
      step_layers += ms.forward + ms.backward + ms.weight;
    }
    if (progress) {
      progress(fmt::format("layers at {} rows a micro-batch: {:.1f} ms forward + backward", rows,
                           step_layers));
    }
    overhead_sum += profile->TaskOverheadMs();
    calibration.layers.push_back(LayerTimesAtRows{rows, std::move(profile->layer_ms)});
  }
  calibration.task_overhead_ms = overhead_sum / static_cast<double>(request.rows.size());
  if (backend != nullptr && request.link.size() >= 2) {
    TESSERA_ASSIGN_OR_RETURN(CollectiveLink link,
                             MeasureCollectiveLink(*backend, request.link, base.device));
    calibration.links.collective = link;
    calibration.links.collective_group = static_cast<int>(request.link.size());
    if (progress) {
      progress(fmt::format("collectives among {} workers: {:.0f} us + {:.2f} GB/s (all-reduce)",
                           request.link.size(), link.latency_us, link.bytes_per_us / 1e3));
    }
  }
  return calibration;
}

std::string CalibrationKey(const ModelSpec& model, const TrainingPlan& base,
                           const CalibrationRequest& request, int threads) {
  std::string layers;
  for (const LayerSpec& layer : model.layers) {
    layers += fmt::format("{}:{}:{};", layer.name, layer.forward_op, layer.params.numel());
  }
  std::string rows;
  for (int64_t r : request.rows) rows += fmt::format("{},", r);
  return fmt::format(
      "model {:016x} ({} layers) seq {} device {} rows [{}] workers {} host {} threads {}",
      std::hash<std::string>()(layers), model.layers.size(), base.seq_len, base.device.ToString(),
      rows, request.link.size(), HostName(), threads);
}

std::string CalibrationPath(const std::string& cache_dir, const std::string& key) {
  return fmt::format("{}/calibration-{:016x}.json", cache_dir, std::hash<std::string>()(key));
}

std::string DefaultCacheDir(const std::string& setting) {
  if (!setting.empty()) return setting;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && xdg[0] != '\0') {
    return std::string(xdg) + "/tessera";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && home[0] != '\0') {
    return std::string(home) + "/.cache/tessera";
  }
  return "/tmp/tessera/cache";
}

Status SaveCalibration(const std::string& path, const std::string& key,
                       const Calibration& calibration) {
  json layers = json::array();
  for (const LayerTimesAtRows& at : calibration.layers) {
    json ms = json::array();
    for (const OpCosts& c : at.layer_ms) ms.push_back({c.forward, c.backward, c.weight});
    layers.push_back({{"rows", at.rows}, {"layer_ms", ms}});
  }
  const json file = {{"key", key},
                     {"layers", layers},
                     {"task_overhead_ms", calibration.task_overhead_ms},
                     {"collective", LinkJson(calibration.links.collective)},
                     {"collective_group", calibration.links.collective_group},
                     {"point_to_point", LinkJson(calibration.links.point_to_point)}};
  std::error_code error;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), error);
  if (error) {
    return Unavailable("saving the calibration: cannot make the directory of {}: {}", path,
                       error.message());
  }
  return WriteFileAtomically(path, file.dump(1) + "\n").WithContext("saving the calibration");
}

Result<Calibration> LoadCalibration(const std::string& path, const std::string& key) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) {
    return NotFound("no calibration cached at {}", path);
  }
  TESSERA_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path, "calibration file"));
  try {
    const json file = json::parse(text);
    if (file.at("key").get<std::string>() != key) {
      return InvalidArgument("the calibration at {} is for another setup ({}), not this one", path,
                             file.at("key").get<std::string>());
    }
    Calibration calibration;
    for (const json& at : file.at("layers")) {
      LayerTimesAtRows rows{at.at("rows").get<int64_t>(), {}};
      for (const json& ms : at.at("layer_ms")) {
        rows.layer_ms.push_back(
            OpCosts{ms.at(0).get<double>(), ms.at(1).get<double>(), ms.at(2).get<double>()});
      }
      calibration.layers.push_back(std::move(rows));
    }
    calibration.task_overhead_ms = file.at("task_overhead_ms").get<double>();
    calibration.links.collective = LinkFrom(file.at("collective"));
    calibration.links.collective_group = file.at("collective_group").get<int>();
    calibration.links.point_to_point = LinkFrom(file.at("point_to_point"));
    if (calibration.layers.empty())
      return DataLoss("the calibration at {} holds no layer times", path);
    return calibration;
  } catch (const json::exception& e) {
    return DataLoss("the calibration at {} cannot be read ({}); delete it to measure again", path,
                    e.what());
  }
}

}  // namespace tessera
