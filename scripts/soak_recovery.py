#!/usr/bin/env python3
"""Soak test of training that survives faults (not run by CI; the figures go in docs/benchmarks.md).

Trains GPT-2 tiny with ZeRO-3 on a local cluster of 4 workers (train_gpt2 --max-restarts
--replace-workers) for --minutes, while a random worker is SIGKILLed or SIGSTOPped every
--min-gap..--max-gap seconds. Checks that the run never hangs (the step counter never stands
still longer than --stall seconds), that it recovers from every fault, and that memory stays
flat (summed RSS of the driver, the scheduler and the workers, sampled every 30 s). Prints one
line per event and a summary; exits 1 if any check fails.

    scripts/soak_recovery.py --minutes 30 [--snapshot-every 1]
"""
import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def children(pid):
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def rss_mb(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024.0


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--min-gap", type=float, default=20, help="seconds between faults, at least")
    parser.add_argument("--max-gap", type=float, default=60)
    parser.add_argument("--stall", type=float, default=60,
                        help="seconds without a new step that count as a hang")
    parser.add_argument("--binary", default=os.path.join(ROOT, "build", "bin", "train_gpt2"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="train_gpt2 --snapshot-every: recover from peer snapshots (0: the disk)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="tessera_soak_")
    log_path = os.path.join(work, "train.log")
    command = [args.binary, "--workers", "4", "--zero-stage", "3", "--batch", "12", "--steps",
               "100000000", "--threads", "1", "--log-every", "1", "--checkpoint-dir",
               os.path.join(work, "checkpoints"), "--checkpoint-every", "50",
               "--max-restarts", "100000", "--replace-workers"]
    if args.snapshot_every > 0:
        command += ["--snapshot-every", str(args.snapshot_every)]
    print(f"# soak: {' '.join(command)}\n# log: {log_path}", flush=True)
    log = open(log_path, "w")
    driver = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    start = time.time()
    end = start + args.minutes * 60
    next_fault = start + rng.uniform(args.min_gap, args.max_gap)
    next_sample = start
    step_re = re.compile(r"^step (\d+)/", re.M)
    last_step, last_step_at, longest_stall = 0, start, 0.0
    faults, samples, stopped = [], [], []
    failed = []
    offset = 0
    while time.time() < end:
        time.sleep(0.5)
        now = time.time()
        if driver.poll() is not None:
            failed.append(f"train_gpt2 exited with {driver.returncode}")
            break
        with open(log_path) as f:
            f.seek(offset)
            text = f.read()
            offset = f.tell()
        for match in step_re.finditer(text):
            step = int(match.group(1))
            if step > last_step:
                last_step, last_step_at = step, now
        longest_stall = max(longest_stall, now - last_step_at)
        if now - last_step_at > args.stall:
            failed.append(f"no new step for {now - last_step_at:.0f} s after step {last_step}")
            break
        # A stopped worker is recovered from within seconds; then it goes (it would hold memory).
        for victim, stopped_at in list(stopped):
            if now - stopped_at > 15:
                try:
                    os.kill(victim, signal.SIGKILL)
                except OSError:
                    pass
                stopped.remove((victim, stopped_at))
        processes = children(driver.pid)
        if now >= next_sample:
            samples.append((now - start, rss_mb([driver.pid] + processes)))
            next_sample = now + 30
        if now >= next_fault:
            workers = [p for p in processes if " worker " in cmdline(p)]
            if workers:
                victim = rng.choice(workers)
                sig = rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP])
                os.kill(victim, sig)
                if sig == signal.SIGSTOP:
                    stopped.append((victim, now))
                faults.append((now - start, victim, sig.name, last_step))
                print(f"{now - start:7.1f} s  step {last_step:6d}  {sig.name} worker pid {victim}",
                      flush=True)
            next_fault = now + rng.uniform(args.min_gap, args.max_gap)
    driver.send_signal(signal.SIGTERM)
    try:
        driver.wait(timeout=30)
    except subprocess.TimeoutExpired:
        driver.kill()
        failed.append("train_gpt2 did not stop within 30 s of SIGTERM")
    for pid, _ in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    log.close()
    with open(log_path) as f:
        text = f.read()
    recoveries = re.findall(r"train_gpt2: recovery (\d+): step (\d+) completed ([0-9.]+) s", text)
    times = sorted(float(r[2]) for r in recoveries)
    replayed = [int(n) for n in re.findall(r"^train_gpt2: recovery \d+: .*replaying (\d+) step", text, re.M)]
    from_snapshot = len(re.findall(r"^train_gpt2: recovery \d+: .*from peer snapshot", text, re.M))
    if len(recoveries) < len(faults) - 1:  # the last fault may be cut by the end of the soak
        failed.append(f"{len(faults)} faults but {len(recoveries)} recoveries completed")
    first_mb = samples[1][1] if len(samples) > 1 else (samples[0][1] if samples else 0)
    last_mb = samples[-1][1] if samples else 0
    print(f"summary: minutes={args.minutes:g} faults={len(faults)} "
          f"(SIGKILL {sum(f[2] == 'SIGKILL' for f in faults)}, "
          f"SIGSTOP {sum(f[2] == 'SIGSTOP' for f in faults)}) recoveries={len(recoveries)} "
          f"steps={last_step} longest_stall_s={longest_stall:.1f} "
          f"recovery_s_median={times[len(times) // 2] if times else 0:.2f} "
          f"recovery_s_max={times[-1] if times else 0:.2f} "
          f"from_snapshot={from_snapshot} replayed_steps={sum(replayed)} "
          f"rss_mb_first={first_mb:.0f} rss_mb_last={last_mb:.0f}")
    for where, mb in samples:
        print(f"# rss {where:7.0f} s  {mb:8.1f} MB")
    if failed:
        print("FAILED: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
