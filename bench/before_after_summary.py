#!/usr/bin/env python3
"""Summarises bench/before_after.sh's raw outputs: per metric, the median over the rounds of each
build and their ratio (after / before).

    bench/before_after_summary.py OUT_DIR
"""
import collections
import glob
import os
import re
import statistics
import sys


def runtime_metrics(text):
    keys = ("tasks_per_s_dynamic", "task_latency_us_p50", "task_latency_us_p99",
            "tasks_per_s_graph", "transfer_gbps")
    found = dict(re.findall(r"^(\w+)=([0-9.]+)$", text, re.M))
    return {f"bench_runtime {k}": float(found[k]) for k in keys if k in found}


def zero_metrics(text):
    rows = re.findall(r"^\s+(\d+)\s+(\d)\s+([0-9.]+)\s", text, re.M)
    metrics = {f"bench_zero {w} workers ZeRO-{s} ms": float(ms) for w, s, ms in rows}
    if rows:
        metrics["bench_zero mean of the rows ms"] = statistics.mean(float(r[2]) for r in rows)
    return metrics


def pipeline_metrics(text):
    metrics = {}
    for workers, rest in re.findall(r"^(\d+) workers: (.*)$", text, re.M):
        for name, ms in re.findall(r"(pipeline \S+ \(M=\d+\)|data parallel|ZeRO-3) ([0-9.]+)", rest):
            metrics[f"bench_pipeline {workers} workers {name} ms"] = float(ms)
    return metrics


def step_metrics(text):
    found = re.search(r"step_ms_median=([0-9.]+)", text)
    return {"train_gpt2 L4 C256 V50257 T64 B4 step ms": float(found.group(1))} if found else {}


PARSERS = {"runtime": runtime_metrics, "zero": zero_metrics, "pipeline": pipeline_metrics,
           "step": step_metrics}


def main():
    out = sys.argv[1]
    values = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(glob.glob(os.path.join(out, "*_*_*.txt"))):
        match = re.match(r"(\w+?)_(before|after)_(\d+)\.txt$", os.path.basename(path))
        if not match or match.group(1) not in PARSERS:
            continue
        name, label = match.group(1), match.group(2)
        for metric, value in PARSERS[name](open(path).read()).items():
            values[metric][label].append(value)
    print(f"{'metric':<52} {'before':>12} {'after':>12} {'after/before':>13}  rounds")
    for metric in sorted(values):
        before, after = values[metric]["before"], values[metric]["after"]
        if not before or not after:
            continue
        b, a = statistics.median(before), statistics.median(after)
        spread = (f"before {min(before):.4g}-{max(before):.4g}, "
                  f"after {min(after):.4g}-{max(after):.4g}")
        print(f"{metric:<52} {b:>12.4g} {a:>12.4g} {a / b:>13.3f}  {len(before)}/{len(after)} "
              f"({spread})")


if __name__ == "__main__":
    main()
