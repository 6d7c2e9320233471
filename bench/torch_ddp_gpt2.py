#!/usr/bin/python3
"""PyTorch DistributedDataParallel (gloo, CPU) GPT-2 training step, the baseline bench_zero
compares Tessera's data parallel and ZeRO plans with. The model and step are Tessera's:
learned position embeddings, pre-norm blocks, GELU (tanh), final layer norm, tied classifier,
causal attention, mean cross-entropy, global-norm clipping (1.0) and AdamW (lr 1e-3, betas
0.9/0.95, weight decay 0.1 on matrices only), on random tokens.

Spawns --workers processes (one thread each, OpenBLAS included), each taking batch/workers rows
of the global batch. A step's time is the slowest rank's; the figure is the median over --steps
steps after --warmup steps.

With --powersgd-rank K, DDP's PowerSGD communication hook (Vogels et al. 2019; rank-K low-rank
gradients with error feedback, vanilla all-reduce for its first --start-powersgd-iter steps and
for 1-D tensors) replaces the plain all-reduce: the peer of Tessera's 1-bit Adam on slow links.

One process per host (the multinode rig's network namespaces): --rank R --init-method
tcp://HEAD:PORT on each host, every rank with the same flags; rank 0 prints the figure.

usage: torch_ddp_gpt2.py --workers N --layers L --channels C --heads H --vocab V --seq-len T
                         --batch B [--steps 20] [--warmup 3] [--powersgd-rank K
                         --start-powersgd-iter S] [--rank R --init-method URL]
prints one JSON line: {"workers": N, "median_ms": ..., "params": ..., "torch": "..."}
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread per rank, as Tessera's workers
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from torch_gpt2_step import GPT  # the same model as the single-process comparison


def member(rank, a, init_method, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank,
                            world_size=a.workers)
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)
    if a.powersgd_rank > 0:
        # One bucket, the first one included (DDP's first is 1 MB): torch 1.13's PowerSGD hook
        # chains each bucket's all-reduces in future callbacks, so with two buckets in flight
        # ranks can launch them in different orders (a gloo size mismatch, seen on the rig).
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(a.bucket_mb * 2**20)
    model = DistributedDataParallel(GPT(a.layers, a.channels, a.heads, a.vocab, a.seq_len),
                                    bucket_cap_mb=a.bucket_mb)
    if a.powersgd_rank > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=a.powersgd_rank,
                                            start_powerSGD_iter=a.start_powersgd_iter)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95))
    rows = a.batch // a.workers
    generator = torch.Generator().manual_seed(1 + rank)
    idx = torch.randint(0, a.vocab, (rows, a.seq_len), generator=generator)
    targets = torch.randint(0, a.vocab, (rows, a.seq_len), generator=generator)
    times = []
    dist.barrier()
    for _ in range(a.warmup + a.steps):
        start = time.perf_counter()
        loss = model(idx, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients in buckets here
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    steps = torch.tensor(times[a.warmup:], dtype=torch.float64)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # each step as the slowest rank took it
    if rank == 0:
        params = sum(p.numel() for p in model.module.parameters())
        figure = {"workers": a.workers, "median_ms": statistics.median(steps.tolist()) * 1e3,
                  "params": params, "final_loss": loss.item(), "torch": torch.__version__,
                  "powersgd_rank": a.powersgd_rank}
        if queue is None:
            print(json.dumps(figure), flush=True)
        else:
            queue.put(figure)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("workers", "layers", "channels", "heads", "vocab", "seq-len", "batch"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25,
                        help="DDP's gradient bucket size (its default: 25)")
    parser.add_argument("--powersgd-rank", type=int, default=0,
                        help="PowerSGD's matrix approximation rank (0: plain all-reduce)")
    parser.add_argument("--start-powersgd-iter", type=int, default=10,
                        help="steps of plain all-reduce before PowerSGD compresses (>= 2)")
    parser.add_argument("--rank", type=int, default=-1,
                        help="this process's rank, one process per host (with --init-method)")
    parser.add_argument("--init-method", default="",
                        help="tcp://HEAD:PORT that every rank's process meets at")
    a = parser.parse_args()
    if a.batch % a.workers != 0:
        sys.exit(f"--batch {a.batch} is not divisible by --workers {a.workers}")
    if (a.rank >= 0) != bool(a.init_method):
        sys.exit("--rank and --init-method go together (one process per host)")
    if a.powersgd_rank > 0 and a.start_powersgd_iter < 2:
        sys.exit("--start-powersgd-iter must be >= 2 (PowerSGD's own requirement)")
    if a.rank >= 0:
        member(a.rank, a, a.init_method, None)
        return
    with tempfile.TemporaryDirectory() as directory:
        context = mp.get_context("spawn")
        queue = context.SimpleQueue()
        mp.spawn(member, args=(a, "file://" + os.path.join(directory, "init"), queue), nprocs=a.workers,
                 join=True)
        print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
