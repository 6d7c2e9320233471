#!/usr/bin/env python3
"""PyTorch 2.x GPT-2 training step on one CUDA GPU: the peer of Tessera's `bench_gpt2_cuda`.

The same model and step as train_gpt2 --device cuda: pre-norm blocks, GELU (tanh), tied
classifier, mean cross-entropy, global-norm clipping (1.0) and AdamW (betas 0.9/0.95, eps 1e-8,
weight decay 0.1 on matrices, fp32 master weights and state), under bf16 autocast with flash
attention (scaled_dot_product_attention, is_causal), fused AdamW. Every step trains on one batch
of tokens made by an LCG that bench_gpt2_cuda computes alike (shared_tokens), so the mean loss
of the timed steps (loss_timed) compares the two on the same data.

usage:
  torch_gpt2_cuda.py speed [--layers 12 --channels 768 --heads 12 --vocab 50257 --seq-len 1024]
                           [--batch 16] [--steps 30] [--compile [--activation-budget F]]
                           [--fsdp-cpu-offload]
      prints: torch_step ... tok_s=<tokens/s> mfu=<fraction> mfu_llmc=<fraction>
              step_ms=<median> loss=<last> loss_timed=<mean of the timed steps>
  torch_gpt2_cuda.py max-model [--seq-len 1024 --batch 1 --from-shape K]
      tries GPT-2-shaped models of growing size (one subprocess each) and prints the largest
      that trains one step: torch_max_model layers=.. channels=.. params=..

--gpu-memory-gib G caps PyTorch's caching allocator at G GiB (set_per_process_memory_fraction):
a smaller card's capacity on a larger one, as bench_gpt2_cuda --gpu-memory-gib caps Tessera's.
--activation-budget F (with --compile) sets torch.compile's activation memory budget, the peer
of train_gpt2 --activation-budget F. --fsdp-cpu-offload trains under FSDP2 on this one GPU with
CPUOffloadPolicy (parameters, gradients and Adam state on the host; the peer of Tessera's
--offload parameters), also in max-model.

MFU by two counts of flops per token (N: every parameter, the tied wte once) against the H100
SXM's dense bf16 peak, 989.4e12 flop/s (--peak-flops to change): mfu, 6 N + 12 L C T
(attention's matmuls at full T x T, as PaLM's appendix B and Tessera's bench_gpt2_cuda count
them); mfu_llmc, 6 N + 6 L C T (llm.c's gpt2_estimate_mfu, the causal half).
"""
import argparse
import math
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.fc, self.fcproj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = [z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v)]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, c, heads, vocab, max_t):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(max_t, c)
        self.h = nn.ModuleList([Block(c, heads) for _ in range(layers)])
        self.lnf = nn.LayerNorm(c)
        self.reset()

    def reset(self):
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, tgt):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), tgt.view(-1))


def fsdp_cpu_offload_model(args):
    """The model under FSDP2 (fully_shard) over this one GPU with CPUOffloadPolicy: parameters,
    gradients and optimizer state live on the host, each block's parameters copied to the GPU for
    its forward and backward (PyTorch's way of training states beyond the GPU)."""
    import os
    import torch.distributed as dist
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError:  # PyTorch 2.4-2.5
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, fully_shard
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    with torch.device("meta"):
        model = GPT(args.layers, args.channels, args.heads, args.vocab, args.seq_len)
    for block in model.h:
        fully_shard(block, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    model.to_empty(device="cpu")  # built on meta: each module initialised again in place
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
                module.reset_parameters()
        model.reset()
    return model


def make_step(args):
    if args.activation_budget > 0:
        # torch.compile's activation memory budget: the share of activations its min-cut
        # partitioner keeps, recomputing the rest (the peer of Tessera's --activation-budget).
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = args.activation_budget
    if args.fsdp_cpu_offload:
        model = fsdp_cpu_offload_model(args)
    else:
        with torch.device("cuda"):  # built on the GPU: a large model's init would crawl on the CPU
            model = GPT(args.layers, args.channels, args.heads, args.vocab, args.seq_len)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                            fused=not args.fsdp_cpu_offload)
    forward = torch.compile(model) if args.compile else model

    def step(idx, tgt):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    params = sum(p.numel() for p in model.parameters())
    return step, params


def shared_tokens(start, count, vocab):
    """Tokens start .. start+count-1 of the LCG bench_gpt2_cuda's SharedToken computes."""
    i = torch.arange(start, start + count, dtype=torch.int64)
    return ((i * 1103515245 + 12345) % 2**31) % vocab


def speed(args):
    if args.gpu_memory_gib > 0:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / total))
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    step, params = make_step(args)
    n = args.batch * args.seq_len
    idx = shared_tokens(0, n, args.vocab).view(args.batch, args.seq_len).cuda()
    tgt = shared_tokens(n, n, args.vocab).view(args.batch, args.seq_len).cuda()
    for _ in range(args.warmup):
        step(idx, tgt)
    torch.cuda.synchronize()
    times = []
    losses = []
    loss = None
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(idx, tgt)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        losses.append(loss.item())
    times.sort()
    median = times[len(times) // 2]
    tokens = args.batch * args.seq_len
    attention = args.layers * args.channels * args.seq_len
    tok_s = tokens / median
    mfu = tok_s * (6 * params + 12 * attention) / args.peak_flops
    mfu_llmc = tok_s * (6 * params + 6 * attention) / args.peak_flops
    print(f"torch_step torch={torch.__version__} compile={int(args.compile)} "
          f"budget={args.activation_budget:g} fsdp_cpu_offload={int(args.fsdp_cpu_offload)} "
          f"device='{torch.cuda.get_device_name()}' params={params} vocab={args.vocab} "
          f"B={args.batch} T={args.seq_len} step_ms={median * 1e3:.2f} tok_s={tok_s:.0f} "
          f"mfu={mfu:.4f} mfu_llmc={mfu_llmc:.4f} "
          f"peak_mem_gib={torch.cuda.max_memory_allocated() / 2**30:.2f} "
          f"loss={loss.item():.4f} loss_timed={sum(losses) / len(losses):.4f}", flush=True)


# GPT-2-shaped models (layers, channels, heads), growing; head sizes 64 or 128 (Tessera's
# attention kernels take 16, 32, 64 and 128), the same list as bench_gpt2_cuda's.
SHAPES = [(12, 768, 12), (24, 1024, 16), (36, 1280, 20), (48, 1600, 25), (32, 2560, 20),
          (40, 3072, 24), (32, 4096, 32), (40, 4096, 32), (44, 4096, 32), (48, 4096, 32),
          (40, 5120, 40), (48, 5120, 40), (60, 5120, 40), (48, 6144, 48), (64, 6144, 48)]


def max_model(args):
    best = None
    for layers, channels, heads in SHAPES[args.from_shape:]:
        cmd = [sys.executable, __file__, "speed", "--layers", str(layers), "--channels",
               str(channels), "--heads", str(heads), "--seq-len", str(args.seq_len), "--batch",
               str(args.batch), "--steps", "1", "--warmup", "1",
               "--gpu-memory-gib", str(args.gpu_memory_gib)]
        if args.fsdp_cpu_offload:
            cmd.append("--fsdp-cpu-offload")
        run = subprocess.run(cmd, capture_output=True, text=True)
        ok = run.returncode == 0 and "torch_step" in run.stdout
        line = run.stdout.strip().splitlines()[-1] if ok else run.stderr.strip()[-200:]
        print(f"try layers={layers} channels={channels}: {'ok' if ok else 'failed'} {line}",
              flush=True)
        if not ok:
            break
        best = (layers, channels, line)
    if best:
        params = best[2].split("params=")[1].split()[0]
        print(f"torch_max_model layers={best[0]} channels={best[1]} params={params} "
              f"B={args.batch} T={args.seq_len}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["speed", "max-model"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--channels", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--from-shape", type=int, default=0,
                        help="max-model: start the search at this index of SHAPES (smaller "
                             "shapes are assumed to fit)")
    parser.add_argument("--peak-flops", type=float, default=989.4e12)
    parser.add_argument("--gpu-memory-gib", type=float, default=0,
                        help="cap the caching allocator at this many GiB (0: the whole card)")
    parser.add_argument("--activation-budget", type=float, default=0,
                        help="with --compile: torch._functorch.config.activation_memory_budget, "
                             "the share of activations kept (0: PyTorch's default)")
    parser.add_argument("--fsdp-cpu-offload", action="store_true",
                        help="FSDP2 over this one GPU with CPUOffloadPolicy (parameters, "
                             "gradients and optimizer state on the host)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_gpt2_cuda: no CUDA device visible to PyTorch")
    speed(args) if args.mode == "speed" else max_model(args)


if __name__ == "__main__":
    main()
