// bench_cuda_layers: where a GPT-2 step's GPU time goes. Times each GEMM of a block (cuBLASLt,
// as the layers call it), the attention, layernorm, GELU and classifier kernels, and the whole
// block / head forward and backward, with CUDA events (median of --repeat after warm-up), at
// GPT-2's shapes. Prints one line each with TFLOP/s or GB/s, then the sum over a 12-block step
// next to nothing else: compare it with bench_gpt2_cuda's step time to see the runtime's share.
//
//   bench_cuda_layers [--batch 32] [--seq-len 1024] [--channels 768] [--heads 12]
//                     [--vocab 50257] [--repeat 20]
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "bench/bench_util.h"
#include "core/version.h"
#include "ops/cuda/cuda_context.h"
#include "ops/cuda/kernels.h"
#include "ops/cuda/matmul.h"
#include "ops/cuda/transformer_layers.h"
#include "ops/flat_layout.h"

namespace tessera::bench {
namespace {

using cuda::bf16;
using cuda::CudaContext;

struct Options {
  int64_t batch = 32, seq_len = 1024, channels = 768, heads = 12, vocab = 50257;
  int layers = 12;
  int repeat = 20;
};

// Device memory filled with small values (never zeros: see the device notes on timing zeros).
template <typename T>
T* Filled(int64_t n) {
  T* p = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&p), static_cast<size_t>(n) * sizeof(T)) != cudaSuccess) {
    std::fprintf(stderr, "bench_cuda_layers: cudaMalloc of %lld elements failed\n",
                 static_cast<long long>(n));
    std::exit(1);
  }
  std::vector<float> host(static_cast<size_t>(std::min<int64_t>(n, 1 << 20)));
  for (size_t i = 0; i < host.size(); ++i)
    host[i] = 0.01f * static_cast<float>((i * 37) % 101) - 0.5f;
  std::vector<T> typed(host.size());
  for (size_t i = 0; i < host.size(); ++i) typed[i] = static_cast<T>(host[i]);
  for (int64_t done = 0; done < n; done += static_cast<int64_t>(typed.size())) {
    const size_t chunk = static_cast<size_t>(std::min<int64_t>(n - done, typed.size()));
    cudaMemcpy(p + done, typed.data(), chunk * sizeof(T), cudaMemcpyHostToDevice);
  }
  return p;
}

// Median milliseconds of `body` on the context's stream.
double Time(CudaContext& context, int repeat, const std::function<Status()>& body) {
  for (int i = 0; i < 3; ++i) {
    if (Status s = body(); !s.ok()) Die("bench_cuda_layers", s, "a warm-up call");
  }
  cudaEvent_t start, end;
  cudaEventCreate(&start);
  cudaEventCreate(&end);
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    cudaEventRecord(start, context.stream());
    if (Status s = body(); !s.ok()) Die("bench_cuda_layers", s, "a timed call");
    cudaEventRecord(end, context.stream());
    cudaEventSynchronize(end);
    float elapsed = 0;
    cudaEventElapsedTime(&elapsed, start, end);
    ms.push_back(elapsed);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  return Median(ms);
}

struct Row {
  std::string name;
  double ms;
  double flops;  // 0: memory-bound, report bytes
  double bytes;
  int per_step;  // how many times a step runs it
};

// One run: the shapes, the device buffers every timed call shares (sized for the largest; made
// in this order), and the rows timed so far.
struct LayersBench {
  LayersBench(const Options& options, CudaContext& context);
  // The four GEMMs of a block: forward, dx and dW.
  void TimeGemms();
  // Attention, layernorm, GELU and the bias sums.
  void TimeKernels();
  // The whole block, head and embedding, and the classifier.
  void TimeLayers();
  // A line per row, then the sum over a step.
  void Print() const;

  const Options o;
  CudaContext& ctx;
  const int64_t n = o.batch * o.seq_len, c = o.channels, v = o.vocab;
  const int64_t vp = TiedLmHeadPaddedVocab(v);
  const TransformerDims dims{o.batch, o.seq_len, c, o.heads, v, o.seq_len};
  const FlatLayout block = TransformerBlockParamLayout(c);
  const FlatLayout saved = TransformerBlockSavedLayoutBf16(o.batch, o.seq_len, c, o.heads);
  const FlatLayout head_saved = TiedLmHeadSavedLayoutBf16(o.batch, o.seq_len, c, v);
  const FlatLayout emb = TokenPositionEmbeddingParamLayout(v, o.seq_len, c);
  const int64_t weights = std::max(v * c, 4 * c * c);  // elements of the largest weight

  bf16* x = Filled<bf16>(n * 4 * c);
  bf16* y = Filled<bf16>(n * 4 * c);
  bf16* w = Filled<bf16>(weights);
  bf16* bias = Filled<bf16>(4 * c);
  float* dw = Filled<float>(weights);
  bf16* qkv = Filled<bf16>(n * 3 * c);
  bf16* att = Filled<bf16>(n * c);
  float* lse = Filled<float>(n * o.heads);
  float* stats = Filled<float>(2 * n);
  float* params = Filled<float>(block.numel());
  float* dparams = Filled<float>(block.numel());
  bf16* saved_buf = Filled<bf16>(saved.numel());
  bf16* head_buf = Filled<bf16>(head_saved.numel());
  float* emb_params = Filled<float>(emb.numel());
  float* demb = Filled<float>(emb.numel());
  float* head_params = Filled<float>(2 * c);
  float* dhead = Filled<float>(2 * c);
  float* loss = Filled<float>(1);
  float* scratch = Filled<float>(std::max<int64_t>(n * 4 * c, 1 << 24));
  int32_t* ids = nullptr;

  std::vector<Row> rows;
};

LayersBench::LayersBench(const Options& options, CudaContext& context) : o(options), ctx(context) {
  std::vector<int32_t> host_ids(static_cast<size_t>(n));
  for (size_t i = 0; i < host_ids.size(); ++i) host_ids[i] = static_cast<int32_t>((i * 7919) % v);
  cudaMalloc(reinterpret_cast<void**>(&ids), host_ids.size() * sizeof(int32_t));
  cudaMemcpy(ids, host_ids.data(), host_ids.size() * sizeof(int32_t), cudaMemcpyHostToDevice);
  // The block forward needs real saved activations for its backward: run it once.
  if (Status s = cuda::TransformerBlockForward(ctx, y, saved_buf, x, params, dims); !s.ok()) {
    Die("bench_cuda_layers", s, "the block forward");
  }
}

void LayersBench::TimeGemms() {
  auto gemm = [&](const char* name, int64_t k, int64_t oc) {
    const double flops = 2.0 * n * k * oc;
    rows.push_back(
        {std::string(name) + " fwd",
         Time(ctx, o.repeat,
              [&] { return cuda::LinearForward(ctx, y, x, w, bias, nullptr, n, k, oc, oc); }),
         flops, 0, o.layers});
    rows.push_back(
        {std::string(name) + " dx",
         Time(ctx, o.repeat,
              [&] { return cuda::LinearBackwardInput(ctx, y, x, w, n, k, oc, oc, false); }),
         flops, 0, o.layers});
    rows.push_back(
        {std::string(name) + " dW",
         Time(ctx, o.repeat,
              [&] { return cuda::LinearBackwardWeight(ctx, dw, x, y, n, k, oc, oc, false); }),
         flops, 0, o.layers});
  };
  gemm("qkv", c, 3 * c);
  gemm("proj", c, c);
  gemm("fc", c, 4 * c);
  gemm("fcproj", 4 * c, c);
}

void LayersBench::TimeKernels() {
  const auto head_size = c / o.heads;
  const double attention_flops = 4.0 * o.batch * o.heads * o.seq_len * o.seq_len * head_size / 2;
  rows.push_back({"attention fwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::AttentionForward(att, lse, qkv, o.batch, o.seq_len, c,
                                                       o.heads, ctx.stream());
                       }),
                  attention_flops, 0, o.layers});
  rows.push_back({"attention bwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::AttentionBackward(qkv, scratch, att, att, qkv, lse, o.batch,
                                                        o.seq_len, c, o.heads, ctx.stream());
                       }),
                  2.5 * attention_flops, 0, o.layers});
  const double act = 2.0 * n * c;  // bytes of one bf16 [N, C]
  rows.push_back({"layernorm fwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::LayerNormForward(y, stats, stats + n, x, params, params, n, c,
                                                       ctx.stream());
                       }),
                  0, 2 * act, 2 * o.layers});
  rows.push_back({"layernorm bwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::LayerNormBackward(y, dw, dw + c, scratch, x, x, params, stats,
                                                        stats + n, n, c, true, ctx.stream());
                       }),
                  0, 4 * act, 2 * o.layers});
  rows.push_back(
      {"gelu fwd",
       Time(ctx, o.repeat, [&] { return cuda::GeluForward(y, x, n * 4 * c, ctx.stream()); }), 0,
       8 * act, o.layers});
  rows.push_back(
      {"gelu bwd",
       Time(ctx, o.repeat, [&] { return cuda::GeluBackward(y, y, x, n * 4 * c, ctx.stream()); }), 0,
       12 * act, o.layers});
  rows.push_back(
      {"bias sums (4C)",
       Time(ctx, o.repeat,
            [&] { return cuda::SumRows(dw, scratch, x, n, 4 * c, false, ctx.stream()); }),
       0, 4 * act, o.layers});
}

void LayersBench::TimeLayers() {
  rows.push_back(
      {"block fwd",
       Time(ctx, o.repeat,
            [&] { return cuda::TransformerBlockForward(ctx, y, saved_buf, x, params, dims); }),
       0, 0, o.layers});
  rows.push_back({"block bwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::TransformerBlockBackward(ctx, y, dparams, x, saved_buf,
                                                               params, dims);
                       }),
                  0, 0, o.layers});
  rows.push_back({"head fwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::TiedLmHeadForward(ctx, loss, head_buf, x, head_params,
                                                        emb_params + emb.offset("wte"), ids, dims,
                                                        1.0f);
                       }),
                  2.0 * n * c * v, 0, 1});
  rows.push_back({"head bwd",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::TiedLmHeadBackward(ctx, y, dhead, demb, x, head_buf,
                                                         head_params,
                                                         emb_params + emb.offset("wte"), dims);
                       }),
                  4.0 * n * c * v, 0, 1});
  rows.push_back({"classifier (softmax+CE)",
                  Time(ctx, o.repeat,
                       [&] {
                         return cuda::SoftmaxCrossEntropy(head_buf + head_saved.offset("dlogits"),
                                                          scratch, nullptr, ids, n, v, vp, 1.0f,
                                                          true, ctx.stream());
                       }),
                  0, 2.0 * 2 * n * vp, 1});
  rows.push_back({"embedding fwd+bwd",
                  Time(ctx, o.repeat,
                       [&] {
                         TESSERA_RETURN_IF_ERROR(
                             cuda::TokenPositionEmbeddingForward(ctx, y, ids, emb_params, dims));
                         return cuda::TokenPositionEmbeddingBackward(ctx, demb, y, ids, dims);
                       }),
                  0, 0, 1});
}

void LayersBench::Print() const {
  std::printf("%-26s %10s %12s %14s\n", "what (B x T = N rows)", "ms", "TFLOP/s", "GB/s");
  double step_ms = 0;
  for (const Row& r : rows) {
    std::printf("%-26s %10.3f %12s %14s\n", r.name.c_str(), r.ms,
                r.flops > 0 ? fmt::format("{:.0f}", r.flops / (r.ms * 1e9)).c_str() : "",
                r.bytes > 0 ? fmt::format("{:.0f}", r.bytes / (r.ms * 1e6)).c_str() : "");
    if (r.name == "block fwd" || r.name == "block bwd" || r.name.starts_with("head") ||
        r.name.starts_with("embedding")) {
      step_ms += r.ms * r.per_step;
    }
  }
  std::printf(
      "layers_sum_ms=%.2f (%d blocks + head + embedding, without AdamW and clipping) "
      "N=%lld\n",
      step_ms, o.layers, static_cast<long long>(n));
}

int Main(int argc, char** argv) {
  Options o;
  CLI::App app{"GPU time of GPT-2's GEMMs, kernels and layers (CUDA events)"};
  app.set_version_flag("--version", tessera::VersionLine("bench_cuda_layers"));
  app.add_option("--batch", o.batch);
  app.add_option("--seq-len", o.seq_len);
  app.add_option("--channels", o.channels);
  app.add_option("--heads", o.heads);
  app.add_option("--vocab", o.vocab);
  app.add_option("--layers", o.layers, "Blocks per step (for the per-step sum)");
  app.add_option("--repeat", o.repeat);
  CLI11_PARSE(app, argc, argv);

  auto made = CudaContext::Create({});
  if (!made.ok()) Die("bench_cuda_layers", made.status(), "opening the GPU");
  LayersBench bench(o, **made);
  bench.TimeGemms();
  bench.TimeKernels();
  bench.TimeLayers();
  bench.Print();
  return 0;
}

}  // namespace
}  // namespace tessera::bench

int main(int argc, char** argv) {
  return tessera::bench::RunMain("bench_cuda_layers",
                                 [&] { return tessera::bench::Main(argc, argv); });
}
