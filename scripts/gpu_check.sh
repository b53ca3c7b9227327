#!/usr/bin/env bash
# The GPU half of issue #17, on a machine with NVIDIA GPUs, a driver, NCCL and a Rust toolchain
# whose cargo can build the workspace (dependencies fetched or vendored):
#   1. makes cudarc find NCCL: it loads `libnccl.so`, while pip's nvidia-nccl-cu12 and Debian's
#      libnccl2 ship only `libnccl.so.2`, so a link is made in a private directory if needed;
#   2. prints what `starling node --gpus` finds;
#   3. runs the averager's local-collective tests with the cuda feature, where
#      STARLING_REQUIRE_GPU=1 turns "no GPU / no NCCL" into a failure instead of a skip: NCCL
#      all-reduce (sum, mean, weighted mean), reduce, broadcast and all-gather on every GPU
#      against f64 references (sizes 1, 1000, 2^20);
#   4. runs `starling bench local --backend nccl` on every GPU, and the CPU bench beside it.
# Exits non-zero on the first failure. Usage: scripts/gpu_check.sh [ELEMENTS, default 1e8]
set -euo pipefail
cd "$(dirname "$0")/.."
size="${1:-100000000}"

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "nvidia-smi not found; going on" >&2

find_nccl() {
  local d
  for d in ${LD_LIBRARY_PATH//:/ } /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/lib64 /usr/local/lib; do
    [ -e "$d/libnccl.so" ] && return 0
  done
  ldconfig -p 2>/dev/null | grep -q 'libnccl\.so ' && return 0
  return 1
}
if ! find_nccl; then
  versioned=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.[0-9]/ {print $NF; exit}')
  if [ -z "$versioned" ]; then
    versioned=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()]
for d in dirs:
    for f in sorted(glob.glob(os.path.join(d, "nvidia", "nccl", "lib", "libnccl.so.*"))):
        print(f); sys.exit(0)
PY
)
  fi
  if [ -z "$versioned" ]; then
    echo "no NCCL found: install it (pip install nvidia-nccl-cu12, or apt-get install libnccl2)" >&2
    exit 1
  fi
  linkdir=$(mktemp -d)
  trap 'rm -rf "$linkdir"' EXIT
  ln -s "$versioned" "$linkdir/libnccl.so"
  export LD_LIBRARY_PATH="$linkdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "linked $versioned as $linkdir/libnccl.so"
fi

cargo build --release -p starling-cli --features cuda
bin=target/release/starling
"$bin" node --gpus

STARLING_REQUIRE_GPU=1 cargo test --release -p starling-averager --features cuda --lib local -- --nocapture

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
"$bin" bench local --backend nccl --devices "$gpus" --size "$size"
"$bin" bench local --backend cpu --devices 4 --size 10000000
echo "gpu_check: all NCCL checks passed on $gpus GPU(s)"
