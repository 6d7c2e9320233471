#!/usr/bin/env bash
# Experiment only: pins each local "tessera worker" process to core (index % ncores), where the
# index is the N of its --spill-dir .../spill-N (the launch order).
declare -A done
n=$(nproc)
while true; do
  for pid in $(pgrep -f ' worker --address'); do
    [[ -n "${done[$pid]:-}" ]] && continue
    cmd=$(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null) || continue
    idx=$(grep -oE 'spill-([a-z0-9]+-)?[0-9]+' <<< "$cmd" | grep -oE '[0-9]+$')
    [[ -z "$idx" ]] && continue
    taskset -a -p -c $((idx % n)) "$pid" > /dev/null 2>&1 && done[$pid]=1 && echo "pinned $pid idx $idx -> $((idx % n))"
  done
  sleep 0.1
done
