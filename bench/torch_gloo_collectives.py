#!/usr/bin/python3
"""PyTorch's CPU collectives (torch.distributed, gloo) measured the way bench_collectives
measures Tessera's: the same message size and worker count, each figure the median over
--iterations of the slowest rank's time. Prints name=value lines:

  torch_gloo_p2p_gbps               every rank sends to its right neighbour and receives from its
                                    left (isend/irecv), bytes / time
  torch_gloo_allreduce_busbw_gbps   all-reduce (sum, f32): bytes / time x 2(n-1)/n
  torch_gloo_allreduce_small_us     all-reduce of 1 KiB

usage: bench/torch_gloo_collectives.py [--workers 4] [--bytes 67108864] [--iterations 10]
       (apt-get install python3-torch, or scripts/install_deps.sh --bench)
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def median_seconds(body, iterations):
    times = []
    barrier = torch.zeros(1)
    for i in range(iterations + 1):
        dist.all_reduce(barrier)
        start = time.perf_counter()
        body()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i > 0:  # the first run warms up
            times.append(elapsed.item())
    return statistics.median(times)


def member(rank, args, init_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=args.workers)
    n = args.workers
    count = args.bytes // 4
    buffer = torch.ones(count)
    other = torch.zeros(count)

    def sendrecv():
        requests = [dist.isend(buffer, (rank + 1) % n), dist.irecv(other, (rank - 1) % n)]
        for request in requests:
            request.wait()

    p2p = median_seconds(sendrecv, args.iterations)
    allreduce = median_seconds(lambda: dist.all_reduce(buffer), args.iterations)
    small = torch.ones(256)
    small_time = median_seconds(lambda: dist.all_reduce(small), max(args.iterations, 50))
    if rank == 0:
        print(f"torch_version={torch.__version__}")
        print(f"torch_gloo_p2p_gbps={count * 4 / p2p / 1e9:.2f}")
        busbw = count * 4 / allreduce * 2 * (n - 1) / n / 1e9
        print(f"torch_gloo_allreduce_busbw_gbps={busbw:.2f}")
        print(f"torch_gloo_allreduce_ms={allreduce * 1e3:.2f}")
        print(f"torch_gloo_allreduce_small_us={small_time * 1e6:.1f}")
        sys.stdout.flush()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(member, args=(args, os.path.join(directory, "init")), nprocs=args.workers)


if __name__ == "__main__":
    main()
