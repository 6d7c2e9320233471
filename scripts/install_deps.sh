#!/usr/bin/env bash
# Installs the Debian 12 packages Tessera builds and tests with. Idempotent: packages already
# present are skipped, and apt-get runs only when something is missing.
#   scripts/install_deps.sh            build and test dependencies
#   scripts/install_deps.sh --main     only what building and running the drivers needs (the
#                                      README's first command, scripts/train.sh)
#   scripts/install_deps.sh --bench    also PyTorch (CPU) for the side-by-side benchmarks
#   ... --list                         print the packages of that set, one a line, and install
#                                      nothing (tests/main_packages_test.sh reads --main's)
set -euo pipefail

mode=""
list=0
for argument in "$@"; do
  case "$argument" in
    --main | --bench) mode=$argument ;;
    --list) list=1 ;;
    *) echo "install_deps: unknown option '$argument' (--main, --bench, --list)" >&2; exit 2 ;;
  esac
done

# What the library, the tessera binary and the example drivers build with.
packages=(
  g++ cmake ninja-build pkg-config
  libtbb-dev libspdlog-dev libfmt-dev libcli11-dev nlohmann-json3-dev
  capnproto libcapnp-dev libboost-dev libucx-dev libssl-dev
  libopenblas-dev libopenblas-pthread-dev
  libyaml-cpp-dev
  libnifti2-dev  # NIfTI volumes for train_unet3d (data/nifti.h)
  zlib1g-dev  # which cmake/Nifti.cmake links (libnifti2-dev does not depend on it)
  procps  # pgrep/pkill: tessera stop and down
)
if [[ "$mode" != --main ]]; then
  packages+=(
    build-essential ccache git clang-format
    # Clang for the sanitizer builds (with the thread-safety analysis) and clang-tidy. Version
    # 15: Debian 12's default (14) lacks the builtin behind libstdc++ 12's
    # std::source_location, and 16 rejects Cap'n Proto 0.9's headers in C++20.
    clang-15 clang-tidy-15
    llvm-15  # llvm-symbolizer: sanitizer reports name functions (and suppressions can match them)
    libfuzzer-15-dev  # libFuzzer for the fuzz targets (scripts/fuzz.sh)
    libgtest-dev libgmock-dev libbenchmark-dev
    openssh-client openssh-server iproute2  # the launcher (ssh) and the multinode tests
    slurmctld slurmd slurm-client munge  # a Slurm cluster for `tessera up --slurm` (multinode_slurm)
    chromium  # the dashboard's browser test (tests/browser)
  )
  # Node.js and npm for the same test, from Debian unless a node with its own npm is there
  # already (NodeSource's nodejs bundles npm and conflicts with Debian's npm package).
  if ! command -v npm >/dev/null; then
    packages+=(nodejs npm)
  fi
fi
if [[ "$mode" == --bench ]]; then
  packages+=(python3-torch)
fi
if [[ $list -eq 1 ]]; then
  printf '%s\n' "${packages[@]}"
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
# The browser test's playwright-core (npm), when the registry is reachable; without it that test
# skips with a message.
install_playwright() {
  local dir
  dir="$(cd "$(dirname "$0")/../tests/browser" && pwd)"
  if [[ "$mode" == --main || -d "$dir/node_modules/playwright-core" ]]; then return 0; fi
  if ! command -v npm >/dev/null; then return 0; fi
  (cd "$dir" && npm ci --no-audit --no-fund) ||
    echo "install_deps: npm could not install playwright-core; the browser test will skip" >&2
}
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install_deps: all ${#packages[@]} packages present"
  install_playwright
  exit 0
fi

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install_deps: run as root or install sudo" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install_deps: installing ${missing[*]}"
"${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
  "${missing[@]}"
install_playwright
