// Microbenchmarks of the CPU kernels on the hot path of a GPT-2 step, at GPT-2 124M and
// bench-config sizes. Reports GFLOP/s (GEMM-bound kernels) or elements/s (AdamW).
//   build/bin/bench_kernels --benchmark_filter=Block
#include <benchmark/benchmark.h>
#include <tbb/global_control.h>

#include <vector>

#include "ops/cpu/kernels.h"
#include "ops/cpu/transformer_layers.h"
#include "ops/flat_layout.h"

namespace tessera::cpu {
namespace {

std::vector<float> Filled(int64_t n, float value) {
  return std::vector<float>(static_cast<size_t>(n), value);
}

TransformerDims Dims(int64_t channels, int64_t vocab) {
  return TransformerDims{.batch = 4,
                         .seq_len = 64,
                         .channels = channels,
                         .heads = channels / 64,
                         .vocab = vocab,
                         .max_seq_len = 1024};
}

double BlockFlops(const TransformerDims& d) {
  const double n = static_cast<double>(d.rows()), c = static_cast<double>(d.channels);
  return 2.0 * n * 12.0 * c * c + 4.0 * d.batch * d.seq_len * d.seq_len * c;
}

void BM_BlockForward(benchmark::State& state) {
  const TransformerDims d = Dims(state.range(0), 50257);
  auto x = Filled(d.rows() * d.channels, 0.1f), y = x;
  auto params = Filled(TransformerBlockParamLayout(d.channels).numel(), 0.01f);
  auto saved =
      Filled(TransformerBlockSavedLayout(d.batch, d.seq_len, d.channels, d.heads).numel(), 0);
  for (auto _ : state) {
    TransformerBlockForward(y.data(), saved.data(), nullptr, x.data(), params.data(), d, 4'000'000);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(BlockFlops(d) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// range(1): what the backward rebuilds first (BlockRebuild: 0 nothing, 1 norms and GELU, 2 with
// attention too): its cost is the difference to 0.
void BM_BlockBackward(benchmark::State& state) {
  TransformerDims d = Dims(state.range(0), 50257);
  d.rebuild = static_cast<BlockRebuild>(state.range(1));
  auto x = Filled(d.rows() * d.channels, 0.1f), dy = x;
  auto params = Filled(TransformerBlockParamLayout(d.channels).numel(), 0.01f), dparams = params;
  auto saved = Filled(
      TransformerBlockSavedLayout(d.batch, d.seq_len, d.channels, d.heads, d.rebuild).numel(), 0);
  auto workspace = Filled(TransformerBlockBackwardWorkspace(d), 0);
  auto forward_workspace = Filled(TransformerBlockForwardWorkspace(d), 0);
  TransformerBlockForward(dy.data(), saved.data(), forward_workspace.data(), x.data(),
                          params.data(), d, 4'000'000);
  for (auto _ : state) {
    std::fill(dy.begin(), dy.end(), 0.01f);
    TransformerBlockBackward(dy.data(), dparams.data(), workspace.data(), x.data(), saved.data(),
                             params.data(), d, 4'000'000);
    benchmark::DoNotOptimize(dparams.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(2 * BlockFlops(d) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_HeadForwardBackward(benchmark::State& state) {
  const TransformerDims d = Dims(state.range(0), 50257);
  auto x = Filled(d.rows() * d.channels, 0.1f), dx = x;
  auto head = Filled(2 * d.channels, 1.0f), dhead = head;
  auto emb =
      Filled(TokenPositionEmbeddingParamLayout(d.vocab, d.max_seq_len, d.channels).numel(), 0.01f);
  auto demb = emb;
  auto saved = Filled(TiedLmHeadSavedLayout(d.batch, d.seq_len, d.channels, d.vocab).numel(), 0);
  auto workspace = Filled(TiedLmHeadWorkspace(d), 0);
  std::vector<int32_t> targets(static_cast<size_t>(d.rows()), 7);
  for (auto _ : state) {
    auto loss = TiedLmHeadForward(saved.data(), x.data(), head.data(), emb.data(), targets.data(),
                                  d, 1.0f, 4'000'000);
    TiedLmHeadBackward(dx.data(), dhead.data(), demb.data(), workspace.data(), x.data(),
                       saved.data(), head.data(), emb.data(), d, 4'000'000);
    benchmark::DoNotOptimize(loss);
  }
  const double flops = 3 * 2.0 * static_cast<double>(d.rows() * d.channels * d.vocab);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_AdamW(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto p = Filled(n, 0.1f), g = Filled(n, 0.01f), m = Filled(n, 0), v = Filled(n, 0);
  const int64_t ranges[] = {0, n};
  int64_t step = 0;
  for (auto _ : state) {
    AdamWUpdate(p.data(), m.data(), v.data(), g.data(), n, AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f},
                1e-3f, ++step, 1.0f, ranges, 1, 0);
    benchmark::DoNotOptimize(p.data());
  }
  state.SetItemsProcessed(state.iterations() * n);
}

BENCHMARK(BM_BlockForward)
    ->Arg(256)
    ->Arg(384)
    ->Arg(768)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_BlockBackward)
    ->ArgsProduct({{256, 384, 768}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_HeadForwardBackward)->Arg(256)->Arg(768)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamW)->Arg(1 << 24)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace tessera::cpu

BENCHMARK_MAIN();
