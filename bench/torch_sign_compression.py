#!/usr/bin/python3
"""DeepSpeed's 1-bit compression arithmetic in PyTorch on the CPU: the peer bench_compression
compares Tessera's sign compression (core/sign_compression.h) with.

DeepSpeed's compressed_allreduce (1-bit Adam, 0/1 Adam) does, per rank and call, with torch ops
and packed bits (cupy on a GPU; numpy's packbits here, its CPU equivalent), here into buffers
allocated once:
  worker:  buffer += worker_error; scale = ||buffer|| / sqrt(n); worker_error = buffer - scale *
           sign(buffer) (sign: +1 where >= 0); the signs packed 8 to a byte, in `ranks` chunks
  server:  this rank's chunk from every rank unpacked to +-1, each times its scale / ranks,
           summed over the ranks, + server_error; compressed alike (its error kept)
  decode:  every chunk's packed signs unpacked to +-1 times its server's scale
One process, one thread (torch.set_num_threads(1), like Tessera's one communication thread): the
three phases of one rank's share of a call on a buffer of --count f32 elements over --ranks
ranks, without the network; --warmup untimed calls, then --repeats timed ones, medians.

usage: torch_sign_compression.py --count N [--ranks 4] [--repeats 9] [--warmup 2]
prints one JSON line:
  {"impl": "torch", "count": N, "ranks": R, "worker_ms": ..., "server_ms": ..., "decode_ms": ...,
   "total_ms": ...}
"""
import argparse
import json
import math
import statistics
import time

import numpy as np
import torch


class Workspace:
    """Buffers allocated once (the peer at its best: the ops write into them with out=, so that
    no call page-faults fresh temporaries of the buffer's size, which cost more than the
    arithmetic on this VM: DeepSpeed's expressions as written take ~50x longer here)."""

    def __init__(self, count, chunk):
        self.positive = torch.empty(count, dtype=torch.bool)
        self.signed = torch.empty(count)
        self.server = torch.empty(chunk)
        self.server_positive = torch.empty(chunk, dtype=torch.bool)
        self.term = torch.empty(chunk)


def compress(values, error, positive, signed):
    """values -> +-scale by sign (scale: ||values|| / sqrt(n), DeepSpeed's); error = values - that.
    Returns the scale; `positive` holds the signs (>= 0: -0 and +0 are positive)."""
    scale = float(torch.linalg.norm(values)) / math.sqrt(values.numel())
    torch.ge(values, 0, out=positive)
    signed.copy_(positive).mul_(2.0 * scale).sub_(scale)
    torch.sub(values, signed, out=error)
    return scale


def unpacked_into(out, bits, scale):
    """out = +-scale by the packed signs."""
    out.copy_(torch.from_numpy(np.unpackbits(bits, count=out.numel()))).mul_(2.0 * scale).sub_(scale)


def call(buffer, worker_error, server_error, others, ranks, chunk, w):
    """One rank's share of a call; returns the phases' seconds."""
    start = time.perf_counter()
    buffer.add_(worker_error)
    scale = compress(buffer, worker_error, w.positive, w.signed)
    signs = w.positive.numpy()
    chunks = [np.packbits(signs[j * chunk:(j + 1) * chunk]) for j in range(ranks)]
    worker_end = time.perf_counter()
    # This rank serves chunk 0: its own block and the other ranks' (prepared, like received).
    blocks = [(chunks[0], scale)] + others
    w.server.zero_()
    for bits, s in blocks:
        unpacked_into(w.term, bits, s / ranks)
        w.server.add_(w.term)
    w.server.add_(server_error)
    server_scale = compress(w.server, server_error, w.server_positive, w.term)
    served = np.packbits(w.server_positive.numpy())
    server_end = time.perf_counter()
    # Every server's block decoded (here: this rank's served block in each chunk's place).
    for j in range(ranks):
        unpacked_into(buffer[j * chunk:(j + 1) * chunk], served, server_scale)
    end = time.perf_counter()
    return worker_end - start, server_end - worker_end, end - server_end


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    chunk = (args.count + args.ranks - 1) // args.ranks
    chunk = (chunk + 31) // 32 * 32  # DeepSpeed pads the buffer to a multiple of 8 * ranks too
    count = chunk * args.ranks
    buffer0 = torch.randn(count)
    worker_error = torch.zeros(count)
    server_error = torch.zeros(chunk)
    others = [(np.packbits(torch.randn(chunk).ge(0).numpy()), 1.0) for _ in range(args.ranks - 1)]
    workspace = Workspace(count, chunk)
    buffer = torch.empty(count)
    phases = []
    for i in range(args.warmup + args.repeats):
        buffer.copy_(buffer0)
        times = call(buffer, worker_error, server_error, others, args.ranks, chunk, workspace)
        if i >= args.warmup:
            phases.append(times)
    worker, server, decode = (statistics.median(p[k] for p in phases) for k in range(3))
    print(json.dumps({"impl": "torch", "count": args.count, "ranks": args.ranks,
                      "worker_ms": 1e3 * worker, "server_ms": 1e3 * server,
                      "decode_ms": 1e3 * decode,
                      "total_ms": 1e3 * statistics.median(sum(p) for p in phases),
                      "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
