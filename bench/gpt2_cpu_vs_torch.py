#!/usr/bin/python3
"""Tessera vs PyTorch (CPU) on the same GPT-2 training steps, measured side by side.

For each configuration, runs build/bin/train_gpt2 (random tokens) and bench/torch_gpt2_step.py
alternately, `--rounds` times each, and reports the median step time of each and their ratio
(Tessera / PyTorch: below 1.0 means Tessera is faster). PyTorch is given its best thread setup
of the ones tried (its default OpenMP + OpenBLAS threads, and OpenBLAS restricted to one thread),
so the comparison is against the faster PyTorch.

usage: bench/gpt2_cpu_vs_torch.py [--threads 2] [--rounds 3] [--configs small,124m]
       (apt-get install python3-torch, or scripts/install_deps.sh --bench)
"""
import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
from datetime import date

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    # name: (layers, channels, heads, vocab, seq_len, batch, steps)
    "small": (4, 256, 4, 50257, 64, 4, 12),
    "124m": (12, 768, 12, 50257, 64, 4, 5),
}


def run(command, env=None):
    result = subprocess.run(command, capture_output=True, text=True,
                            env={**os.environ, **(env or {})})
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stdout}{result.stderr}")
    match = re.search(r"step_ms_median=([0-9.]+)", result.stdout)
    if not match:
        sys.exit(f"no step_ms_median in the output of {' '.join(command)}:\n{result.stdout}")
    return float(match.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="small,124m")
    parser.add_argument("--binary", default=os.path.join(ROOT, "build", "bin", "train_gpt2"))
    args = parser.parse_args()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"# {date.today()} {platform.node()} {cpu}, {os.cpu_count()} cores, threads={args.threads}")
    for name in args.configs.split(","):
        layers, channels, heads, vocab, seq_len, batch, steps = CONFIGS[name]
        shape = ["--layers", str(layers), "--channels", str(channels), "--heads", str(heads),
                 "--vocab", str(vocab), "--seq-len", str(seq_len), "--batch", str(batch)]
        tessera_cmd = [args.binary, *shape, "--data", "synthetic", "--steps", str(steps),
                       "--threads", str(args.threads), "--log-every", "1000"]
        torch_cmd = [sys.executable, os.path.join(ROOT, "bench", "torch_gpt2_step.py"), *shape,
                     "--steps", str(steps), "--threads", str(args.threads)]
        tessera, torch_default, torch_blas1 = [], [], []
        for _ in range(args.rounds):
            tessera.append(run(tessera_cmd))
            torch_default.append(run(torch_cmd))
            torch_blas1.append(run(torch_cmd, {"OPENBLAS_NUM_THREADS": "1"}))
        t = statistics.median(tessera)
        p_default, p_blas1 = statistics.median(torch_default), statistics.median(torch_blas1)
        p = min(p_default, p_blas1)
        print(f"config={name} layers={layers} channels={channels} heads={heads} vocab={vocab} "
              f"seq_len={seq_len} batch={batch}: tessera_ms={t:.1f} torch_ms={p:.1f} "
              f"(default {p_default:.1f}, openblas-1-thread {p_blas1:.1f}) ratio={t / p:.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
