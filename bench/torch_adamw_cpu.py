#!/usr/bin/python3
"""PyTorch's CPU AdamW update rate, the peer bench_adamw compares Tessera's CPU AdamW with.

One flat fp32 parameter of --numel elements with a gradient, betas 0.9/0.95, eps 1e-8, weight
decay 0.1, lr 1e-3: the settings of Tessera's GPT-2 training. Times optimizer.step() for each of
torch.optim.AdamW's CPU implementations in this PyTorch (foreach=False: one tensor at a time;
foreach=True: the multi-tensor path), with --threads intra-op threads, --warmup untimed steps
then --repeats timed ones; the figure is the median.

usage: torch_adamw_cpu.py --numel N [--threads T] [--repeats 10] [--warmup 2]
prints one JSON line per implementation:
  {"impl": "torch foreach=False", "numel": N, "threads": T, "median_s": ..., "params_per_s": ...}
"""
import argparse
import json
import statistics
import time

import torch


def time_step(numel, foreach, repeats, warmup):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel) * 0.02)
    param.grad = torch.randn(numel) * 0.01
    optimizer = torch.optim.AdamW([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1, foreach=foreach)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        optimizer.step()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for foreach in (False, True):
        median = time_step(args.numel, foreach, args.repeats, args.warmup)
        print(json.dumps({"impl": f"torch foreach={foreach}", "numel": args.numel,
                          "threads": args.threads, "median_s": median,
                          "params_per_s": args.numel / median, "torch": torch.__version__}),
              flush=True)


if __name__ == "__main__":
    main()
