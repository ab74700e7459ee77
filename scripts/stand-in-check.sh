#!/usr/bin/env bash
# The whole cache on the CUDA executor, over the stand-in driver (tests/fake_cuda/libcuda.cpp)
# with its streams scheduled adversarially (the lowest-priority ready stream first, so the
# load stream is held back as long as allowed) and its happens-before race checker on: the
# replay in every layout, write-back (evictions during loads), chunked prefill with decode, batches
# through `step`, the storage tier, every peer-pool mode, and ranks in processes of their own. A race makes the process exit with status 86;
# every request is verified byte for byte, and a mismatch fails the run too.
#
# Usage: scripts/stand-in-check.sh [path to cp-hicache] (default: target/release/cp-hicache,
# built if missing). FAKE_CUDA_SCHED and FAKE_CUDA_SEED may be set to override the mode;
# STAND_IN_ONE_MODE=1 skips the second pass under `lazy`.
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${1:-target/release/cp-hicache}"
[ -x "$bin" ] || cargo build --release --quiet
driver="$(mktemp -d)"
trap 'rm -rf "$driver"' EXIT
"${CXX:-c++}" -std=c++17 -O1 -fPIC -shared -o "$driver/libcuda.so" tests/fake_cuda/libcuda.cpp -ldl
cp "$driver/libcuda.so" "$driver/libcuda.so.1"
export LD_LIBRARY_PATH="$driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FAKE_CUDA_SCHED="${FAKE_CUDA_SCHED:-adversarial}"
export FAKE_CUDA_SEED="${FAKE_CUDA_SEED:-1}"

storage="$driver/storage"
runs=(
  "the default replay (8 ranks, zigzag, kernel transfers, every rank verifying)|"
  "write-back: evictions back pages up while loads are in flight|--policy write_back --device-pages 96 --requests 48"
  "round-robin layout, DMA transfers|--layout round-robin --transfer dma --requests 40"
  "page-interleave layout, one DMA call per region|--layout page-interleave --transfer dma-each --requests 40"
  "token-interleave layout (vLLM decode CP)|--layout token-interleave --interleave-size 16 --requests 40"
  "chunked prefill and decode (live requests)|--chunk-tokens 256 --decode-tokens 32 --requests 32"
  "batches of 4 through step, write-back: loads and evictions inside steps|--batch 4 --chunk-tokens 256 --decode-tokens 16 --policy write_back --requests 48"
  "the storage tier, written then read back|--storage $storage --requests 40"
  "gathered peer pools, CP 4, MLA|--peer-pools gathered --cp 4 --model mla --page-size 16 --requests 40"
  "ranks as processes: CUDA IPC pools, interprocess-event fences (gpu-check's replay-procs)|--processes --cp 4 --model mla --page-size 16 --layers 4 --requests 32 --device-pages 512"
  "ranks as processes in batches, write-back, per-layer fences (gpu-check's replay-procs-batch)|--processes --cp 4 --model mla --page-size 16 --layers 4 --requests 48 --device-pages 512 --policy write_back --batch 4 --chunk-tokens 256 --decode-tokens 16 --layer-waits"
)
# One replay under the scheduling mode in FAKE_CUDA_SCHED.
replay() {
  local what="$1" args="$2"
  echo "== [${SECONDS}s in] stand-in CUDA ($FAKE_CUDA_SCHED): $what"
  local out
  # shellcheck disable=SC2086
  out="$("$bin" replay --backend cuda $args 2>&1)" || {
    echo "$out" | tail -40
    echo "FAILED (exit status $?): FAKE_CUDA_SCHED=$FAKE_CUDA_SCHED cp-hicache replay --backend cuda $args" >&2
    exit 1
  }
  echo "$out" | grep -E "pages loaded|mismatched tokens|throughput" | sed 's/^/  /'
  if ! echo "$out" | grep -qE "mismatched tokens +0$"; then
    echo "$out" | tail -40
    echo "FAILED: mismatches (FAKE_CUDA_SCHED=$FAKE_CUDA_SCHED cp-hicache replay --backend cuda $args)" >&2
    exit 1
  fi
}
for run in "${runs[@]}"; do
  replay "${run%%|*}" "${run#*|}"
done
echo "stand-in CUDA ($FAKE_CUDA_SCHED): ${#runs[@]} replays, 0 races, 0 mismatched tokens"
# `adversarial` runs the least-priority ready stream first, which puts backups (on a stream
# of least priority) early; `lazy` runs a stream's work only when something waits for it,
# so a backup is as late as allowed and a free or load that does not wait for it shows.
# The replays where backups meet evictions and loads, again under `lazy`.
if [ -z "${STAND_IN_ONE_MODE:-}" ]; then
  FAKE_CUDA_SCHED=lazy
  replay "${runs[1]%%|*}" "${runs[1]#*|}"
  replay "${runs[6]%%|*}" "${runs[6]#*|}"
  echo "stand-in CUDA (lazy): 2 replays, 0 races, 0 mismatched tokens"
fi
