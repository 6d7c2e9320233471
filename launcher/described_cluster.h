// Described clusters: the hardware of a cluster that is not at hand (a DGX SuperPOD, a rack of
// commodity GPU servers), read from a YAML file for the plan search at scale
// (planner/scale_search.h, `tessera plan --cluster FILE`).
//
//   name: selene                  # optional; default: the file's stem
//   nodes: 128
//   gpus_per_node: 8
//   gpu: A100-SXM4-80GB           # optional, for the report
//   gpu_memory_gib: 80
//   peak_tflops: 312              # dense bf16 per GPU
//   memory_gb_per_s: 2039         # HBM
//   nvlink_gb_per_s: 300          # per GPU, each way, inside a node
//   network_gb_per_s: 25          # per GPU, each way, between nodes
//   # optional, with their defaults (DescribedCluster):
//   gemm_efficiency: 0.8          # fraction of peak a layer's matrix multiplies reach
//   reserved_gib: 2               # CUDA context, library workspaces
//   nvlink_latency_us: 5
//   network_latency_us: 10
//   pcie_gb_per_s: 25
//   host_memory_gib: 1024         # per node
//   host_memory_gb_per_s: 200     # per node
//
// Every error names the file, the line and the key, and what a valid value looks like.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"
#include "planner/scale_search.h"

namespace tessera::launcher {

// Parses YAML text; `file` names it in errors and its stem is the default name.
Result<DescribedCluster> ParseDescribedCluster(std::string_view text, const std::string& file);
// Reads and parses `path`: NotFound naming it when it cannot be read.
Result<DescribedCluster> ReadDescribedCluster(const std::string& path);

}  // namespace tessera::launcher
