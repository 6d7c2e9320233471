#!/usr/bin/env bash
# Runs a test binary with OpenBLAS forced to another CPU family's kernels, so that one machine
# checks what Tessera computes on the others:
#   tests/run_with_coretype.sh Haswell build/bin/cluster_test [args]
# OpenBLAS's kernels sum in different orders on different CPUs (Haswell/Zen: AVX2; SkylakeX:
# AVX-512), and results that are meant to be bit-identical across thread counts and placements
# must stay so under each. Exits 77 (CTest's "skipped") when this CPU cannot run those kernels
# or this OpenBLAS cannot be forced (a build without DYNAMIC_ARCH), saying why.
set -euo pipefail
coretype=$1
shift
case "$coretype" in
  SkylakeX | CooperLake | SapphireRapids) needs=avx512f ;;
  Haswell | Zen) needs=avx2 ;;
  *) needs= ;;
esac
if [[ -n "$needs" ]] && ! grep -qw "$needs" /proc/cpuinfo; then
  echo "skipped: OpenBLAS's $coretype kernels need $needs, which this CPU lacks"
  exit 77
fi
export OPENBLAS_CORETYPE=$coretype
# OpenBLAS names the kernels it loaded when asked; make sure they are the ones forced.
picked=$(OPENBLAS_VERBOSE=2 "$1" --gtest_list_tests 2>&1 | sed -n 's/^Core: //p' | head -n 1)
if [[ "${picked,,}" != "${coretype,,}" ]]; then
  echo "skipped: OpenBLAS did not take OPENBLAS_CORETYPE=$coretype (it reports '${picked:-nothing}';" \
    "a build without DYNAMIC_ARCH?)"
  exit 77
fi
echo "OpenBLAS kernels: $picked"
# A --gtest_filter of whole test names (tessera_add_coretype_runs' FILTER) must name tests that
# exist: a renamed test would otherwise leave the rerun quietly running nothing.
for arg in "${@:2}"; do
  [[ "$arg" == --gtest_filter=* ]] || continue
  filter=${arg#--gtest_filter=}
  [[ "$filter" == *[*?-]* ]] && continue
  IFS=: read -r -a wanted <<<"$filter"
  listed=$("$1" "$arg" --gtest_list_tests | grep -c '^  ' || true)
  if [[ "$listed" -ne ${#wanted[@]} ]]; then
    echo "the filter names ${#wanted[@]} tests but $(basename "$1") has $listed of them:" \
      "$filter (tests/CMakeLists.txt, tessera_add_coretype_runs)" >&2
    exit 1
  fi
done
exec "$@"
