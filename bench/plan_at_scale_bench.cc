// bench_plan_at_scale: the plan search at scale, by simulation (planner/scale_search.h), next to
// the published hand-tuned plans.
//
// On a described cluster (--cluster, default examples/clusters/dgx-a100-80gb.yaml: the DGX A100
// SuperPOD where Megatron-LM's runs were measured), for GPT-3 175B (global batch 1536, as
// Narayanan et al. 2021's Table 2), Megatron-LM's 76.1B (batch 1792, their Table 1) and
// Llama 2 70B (batch 1024 of 4096 tokens) on --gpus counts, it prints per count the searched
// plans' best few with predicted step time, TFLOP/s per GPU (by the model's FLOPs, 3 x forward,
// and by Megatron-LM's eq. 3, which counts activation recompute) and peak memory, and the search
// time; then each published plan beside it: its achieved TFLOP/s (Megatron's count), and where
// the paper gives its micro-batch size, the same plan's predicted TFLOP/s (Megatron-LM's PTD-P
// plans with their vocabulary-parallel embedding and head, no ZeRO, 1F1B assumed; DeepSpeed's
// ZeRO-3 plans without model parallelism).
// --out DIR writes scale_search.tsv (the best plan per model and count) and published.tsv.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "core/version.h"
#include "launcher/described_cluster.h"
#include "planner/scale_search.h"

namespace {

constexpr const char* kProgram = "bench_plan_at_scale";
template <typename T>
T Check(tessera::Result<T> result, const std::string& what) {
  return tessera::bench::Check(kProgram, std::move(result), what);
}

struct Workload {
  std::string model;
  int64_t global_batch;
};

// A published plan and its achieved throughput (Megatron-LM's FLOP count, per GPU).
struct Published {
  std::string model;
  int gpus;
  int64_t global_batch;
  std::string plan;  // as the paper gives it
  double tflops;     // achieved, per GPU
  std::string source;
  // The same plan in Tessera's dimensions (D x T x P, b, the ZeRO stage); micro_batch_size 0:
  // not given by the paper, not predicted.
  int data_parallel = 0, tensor_parallel = 1, pipeline_stages = 1, micro_batch_size = 0;
  int zero_stage = 0;
};

const std::vector<Published>& PublishedPlans() {
  static const std::vector<Published> plans = {
      {"gpt3-175b", 384, 1536, "TP 8 x PP 12 x DP 4, micro-batch 1", 153,
       "Narayanan et al. 2021, Table 2 (PTD-P)", 4, 8, 12, 1},
      {"gpt3-175b", 768, 1536, "TP 8 x PP 12 x DP 8, micro-batch 1", 149,
       "Narayanan et al. 2021, Table 2 (PTD-P)", 8, 8, 12, 1},
      {"gpt3-175b", 1536, 1536, "TP 8 x PP 12 x DP 16, micro-batch 1", 141,
       "Narayanan et al. 2021, Table 2 (PTD-P)", 16, 8, 12, 1},
      {"gpt3-175b", 384, 1536, "DeepSpeed ZeRO-3 x DP 384, micro-batch 4", 144,
       "Narayanan et al. 2021, Table 2 (ZeRO-3 without model parallelism)", 384, 1, 1, 4, 3},
      {"gpt3-175b", 768, 1536, "DeepSpeed ZeRO-3 x DP 768, micro-batch 2", 88,
       "Narayanan et al. 2021, Table 2 (ZeRO-3 without model parallelism)", 768, 1, 1, 2, 3},
      {"gpt3-175b", 1536, 1536, "DeepSpeed ZeRO-3 x DP 1536, micro-batch 1", 44,
       "Narayanan et al. 2021, Table 2 (ZeRO-3 without model parallelism)", 1536, 1, 1, 1, 3},
      {"megatron-76b", 1024, 1792, "TP 8 x PP 4 x DP 32", 140,
       "Narayanan et al. 2021, Table 1 (76.1B row)"},
  };
  return plans;
}

struct Flags {
  std::string cluster = "examples/clusters/dgx-a100-80gb.yaml";
  std::vector<int> gpus = {64, 128, 256, 384, 512, 768, 1024};
  std::vector<std::string> models = {"gpt3-175b", "megatron-76b", "llama2-70b"};
  int top = 3;
  std::string out;
};

int Main(int argc, char** argv) {
  using namespace tessera;
  Flags flags;
  CLI::App app{"The plan search at scale (simulated) beside the published hand-tuned plans",
               kProgram};
  app.add_option("--cluster", flags.cluster, "A described cluster (YAML)");
  app.add_option("--gpus", flags.gpus, "GPU counts to plan for");
  app.add_option("--models", flags.models, "gpt3-175b, megatron-76b, llama2-70b, gpt2-1.5b");
  app.add_option("--top", flags.top, "Plans listed per count");
  app.add_option("--out", flags.out, "Write scale_search.tsv and published.tsv here");
  app.set_version_flag("--version", VersionLine(kProgram));
  CLI11_PARSE(app, argc, argv);

  const DescribedCluster cluster =
      Check(launcher::ReadDescribedCluster(flags.cluster), "--cluster");
  std::printf(
      "bench_plan_at_scale %s: cluster %s (%d nodes x %d %s, %.0f GiB, %.0f TFLOP/s peak, "
      "gemm efficiency %.2f, NVLink %.0f GB/s, network %.1f GB/s per GPU)\n",
      TesseraVersion(), cluster.name.c_str(), cluster.nodes, cluster.gpus_per_node,
      cluster.gpu.c_str(), cluster.gpu_memory_gib, cluster.peak_tflops, cluster.gemm_efficiency,
      cluster.nvlink_gb_per_s, cluster.network_gb_per_s);

  std::string searched_tsv =
      "model\tgpus\tglobal_batch\tplan\tstep_s\tmodel_tflops\tmegatron_tflops\tpeak_gib\t"
      "bubble\tbottleneck\tconsidered\tfit\tsearch_ms\n";
  double slowest_search_ms = 0;
  for (const std::string& name : flags.models) {
    const TransformerShape shape = Check(TransformerShape::Preset(name), "--models");
    ScaleTraining training;
    training.global_batch = shape.published_batch;
    std::printf("\n== %s: %.1fB parameters, %ld layers x %ld, sequence %ld, global batch %ld\n",
                name.c_str(), static_cast<double>(shape.Parameters()) / 1e9, shape.layers,
                shape.hidden, shape.seq_len, training.global_batch);
    for (int gpus : flags.gpus) {
      ScaleSpace space;
      space.gpus = {gpus};
      const Result<std::vector<ScaleSearchResult>> results =
          SearchAtScale(cluster, shape, training, space);
      if (!results.ok()) {
        std::printf("%d GPUs: %s\n", gpus, results.status().message().c_str());
        searched_tsv += fmt::format("{}\t{}\t{}\tnone fits\t\t\t\t\t\t\t\t\t\n", name, gpus,
                                    training.global_batch);
        continue;
      }
      const ScaleSearchResult& result = results->front();
      slowest_search_ms = std::max(slowest_search_ms, result.search_ms);
      std::printf("%s", DescribeScaleSearch(result, flags.top).c_str());
      const ScalePlan& best = result.ranked.front();
      searched_tsv += fmt::format(
          "{}\t{}\t{}\t{}\t{:.3f}\t{:.1f}\t{:.1f}\t{:.1f}\t{:.3f}\t{}\t{}\t{}\t{:.1f}\n", name,
          gpus, training.global_batch, best.Name(), best.step_ms / 1e3, best.model_tflops,
          best.megatron_tflops, best.peak_gib, best.costs.bubble, BottleneckName(best.bottleneck),
          result.considered, result.ranked.size(), result.search_ms);
    }
  }
  std::printf("\nslowest search: %.0f ms\n", slowest_search_ms);

  std::printf(
      "\n== published plans (achieved TFLOP/s per GPU by Megatron-LM's count) beside "
      "Tessera's search on the same GPUs and batch; predictions with the collectives "
      "overlapping the compute (Tessera's runtime) and without\n");
  std::string published_tsv =
      "model\tgpus\tglobal_batch\tpublished_plan\tpublished_tflops\tsame_plan_overlap\t"
      "same_plan_no_overlap\tsearched_plan_overlap\tsearched_tflops_overlap\t"
      "searched_plan_no_overlap\tsearched_tflops_no_overlap\tsource\n";
  for (const Published& row : PublishedPlans()) {
    const TransformerShape shape = Check(TransformerShape::Preset(row.model), row.model);
    std::string same[2] = {"-", "-"}, searched[2] = {"none fits", "none fits"},
                searched_tflops[2] = {"-", "-"};
    for (const bool overlap : {true, false}) {
      ScaleTraining training;
      training.global_batch = row.global_batch;
      training.overlap_communication = overlap;
      const size_t k = overlap ? 0 : 1;
      if (row.micro_batch_size > 0) {
        PlanChoice choice;
        choice.data_parallel = row.data_parallel;
        choice.tensor_parallel = row.tensor_parallel;
        choice.pipeline_stages = row.pipeline_stages;
        choice.micro_batches = static_cast<int>(
            row.global_batch / (static_cast<int64_t>(row.data_parallel) * row.micro_batch_size));
        choice.zero_stage = row.zero_stage;
        // Megatron-LM splits the embedding and the head by vocabulary, as the runtime does
        // (ScaleTraining::vocab_parallel, the default).
        const Result<ScalePlan> plan = EvaluateScalePlan(
            cluster, shape, training, choice, row.micro_batch_size, RankLayout::kStagesInNode);
        same[k] = plan.ok() ? fmt::format("{:.1f}", plan->megatron_tflops) : "does not fit";
      }
      if (row.gpus <= cluster.gpus()) {
        ScaleSpace space;
        space.gpus = {row.gpus};
        const Result<std::vector<ScaleSearchResult>> results =
            SearchAtScale(cluster, shape, training, space);
        if (results.ok()) {
          const ScalePlan& best = results->front().ranked.front();
          searched[k] = best.Name();
          searched_tflops[k] = fmt::format("{:.1f}", best.megatron_tflops);
        }
      }
    }
    std::printf(
        "%s on %d GPUs, batch %ld: published %s: %.1f (%s)\n"
        "  same plan predicted: %s with overlap, %s without\n"
        "  searched with overlap: %s: %s\n  searched without: %s: %s\n",
        row.model.c_str(), row.gpus, row.global_batch, row.plan.c_str(), row.tflops,
        row.source.c_str(), same[0].c_str(), same[1].c_str(), searched[0].c_str(),
        searched_tflops[0].c_str(), searched[1].c_str(), searched_tflops[1].c_str());
    published_tsv +=
        fmt::format("{}\t{}\t{}\t{}\t{:.1f}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\n", row.model, row.gpus,
                    row.global_batch, row.plan, row.tflops, same[0], same[1], searched[0],
                    searched_tflops[0], searched[1], searched_tflops[1], row.source);
  }

  if (!flags.out.empty()) {
    std::filesystem::create_directories(flags.out);
    for (const auto& [file, text] : {std::pair{std::string("scale_search.tsv"), searched_tsv},
                                     std::pair{std::string("published.tsv"), published_tsv}}) {
      const std::string path = flags.out + "/" + file;
      const std::string temp = path + ".tmp";
      std::ofstream(temp) << text;
      std::filesystem::rename(temp, path);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return tessera::bench::RunMain(kProgram, [&] { return Main(argc, argv); });
}
