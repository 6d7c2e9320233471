// `tessera plan`: the plan search (training/auto_plan.h) from the command line, without
// training: the best plans of a model on N workers with their predicted step time, peak per tier
// and bottleneck, and the flags that run the best one.
//
//   tessera plan --model gpt2 [--preset small] [--layers L ...] --batch B --seq-len T
//                --workers N [--host-memory-gib G] [--device-memory-gib G] [--top K]
//                [--address HOST:PORT | --no-probe] [--recalibrate] [--calibration-rounds R]
//                [--fewer-workers]
//   tessera plan --cluster FILE.yaml --model gpt3-175b [--gpus N ...] [--batch B] [--top K]
//                [--no-overlap]
//
// With --cluster the cluster is described, not probed (launcher/described_cluster.h), and the
// model is a transformer by its shape (gpt3-175b, megatron-76b, llama2-70b, gpt2-1.5b; --layers,
// --channels, --heads, --vocab and --seq-len change it): the search at scale
// (planner/scale_search.h) simulates every plan on the described hardware.
//
// The calibration is measured where the plan would run: on the cluster at --address, else on a
// local cluster of N CPU workers started for the probes (--no-probe: only this process's layer
// profile; the links and the workers' sharing are then not priced, and it says so). It is cached
// like a driver's (setting cache_dir), under the same key as `train_gpt2 --plan auto` on the same
// setup, so either reuses the other's.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace tessera {

struct PlanCommandFlags {
  std::string model = "gpt2";
  std::string preset = "tiny";
  int64_t layers = 0, channels = 0, heads = 0, vocab = 0;  // GPT-2 overrides (0: the preset's)
  int64_t batch = 0;    // 0: 8, or with --cluster the model's published global batch
  int64_t seq_len = 0;  // 0: 64 for gpt2, the preset's with --cluster
  int workers = 1;
  double host_memory_gib = 0, device_memory_gib = 0;
  std::string device = "cpu";
  int top = 10;
  std::string address, token_file;
  bool no_probe = false;
  bool recalibrate = false;
  int calibration_rounds = 3;
  bool fewer_workers = false;
  int threads = 0;  // per worker (0: the machine's cores over the workers, as a local cluster's)
  bool bind_cores = false;  // the probes' local workers each on cores of their own
  // The search at scale: a described cluster, the GPU counts (empty: all of it), whether the
  // collectives overlap the compute.
  std::string cluster;
  std::vector<int> gpus;
  bool no_overlap = false;
  // The degrees T to plan (empty: with --cluster 1, 2, 4, 8; else 1 and the workers' divisors
  // the model splits over).
  std::vector<int> tensor_parallel;
  // "auto" (plans with T > 1 with and without Megatron-LM's sequence parallelism), "megatron"
  // (only with), "none" (only without).
  std::string sequence_parallel = "auto";
};

CLI::App* AddPlanCommand(CLI::App& app, PlanCommandFlags& flags);
// Prints the search; 0 on success, 1 with the error on stderr ("tessera plan: ...").
int RunPlanCommand(const PlanCommandFlags& flags);

}  // namespace tessera
