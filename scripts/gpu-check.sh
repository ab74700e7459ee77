#!/usr/bin/env bash
# One prepared GPU acceptance run for an H200 (or any sm_90) machine that has no cargo and no
# network: it runs a cp-hicache binary built elsewhere and carried over, and prints a short
# table last. Every step has a timeout; a failing step does not stop the others, and the exit
# status is 1 when any step failed.
#
# Steps: info; compile (NVRTC) or, without NVRTC, the carried CUBIN cache with
# CP_HICACHE_JIT=off; every kernel family on the CUDA executor against the Rust references on
# random inputs with poisoned outputs, plus each transfer's DMA path (`bench --check --backend
# cuda`); `tune --backend cuda --quick` (two DMA transfer candidates: `dma`, one
# cuMemcpyBatchAsync per batch, and `dma-each`, one cuMemcpyAsync per merged run of pages);
# `tune --sweep --backend cuda` on nsa_ps64_cp8 (each buffer alone and both, both ways, at
# 128/256/512 threads x 1/2/4/8/16 blocks and on the three DMA paths, each alone and beside
# the ALU and HBM busy kernels, with where each ran); `bench --backend cuda --json` with that
# tuning file (baseline: pinned cuMemcpyAsync; select
# and release at 2,048 and 16,384 pages against the Rust reference); a short `replay --backend
# cuda` with the kernel and the DMA transfer path; the same with each of 4 ranks in a
# process of its own (`--processes`: CUDA IPC pools and interprocess-event fences, with and
# without a scheduler's batches); compute-sanitizer memcheck of the check
# when compute-sanitizer is on PATH, and its racecheck and synccheck of the allocator kernels
# (`bench --check --family`). Before the summary it prints again (format: BENCHMARKS.md
# "gpu-check transfers", so the rows can be pasted there unchanged):
#   - the tune step's transfer rows (capped-grid kernels, uncapped kernels, `dma` and
#     `dma-each`, each timed beside the ALU busy kernel, with the GB/s alone and beside the
#     HBM busy kernel, each busy kernel's slowdown and where each ran against the transfers),
#     also saved as transfers.txt, with a note for a DMA row that is missing;
#   - the sweep step's rows, also saved as sweep.txt, with a note for a buffer set, shape or
#     DMA path that has no row;
#   - the bench step's select and release rows at 2,048 pages (8,192 bytes: 4 per requested
#     page), also saved as allocator.txt;
#   - the bench step's DMA transfer rows (`dma`, `dma-each`, `dma-staged`, with the host's
#     submission time) and the link's ceiling rows (config `link`), also saved as dma.txt.
#
# Prepare on the build machine (has cargo and network; no GPU needed):
#   cargo build --release
#   export CP_HICACHE_NVRTC="$(scripts/install-nvrtc.sh | tail -n1)"
#   CP_HICACHE_CACHE_DIR=gpu-cache target/release/cp-hicache compile --deployment all
#   CP_HICACHE_CACHE_DIR=gpu-cache target/release/cp-hicache bench --prebuild
#   # carry target/release/cp-hicache, scripts/gpu-check.sh and gpu-cache/ (a few MB)
# Run on the GPU machine:
#   CP_HICACHE_CACHE_DIR=gpu-cache scripts/gpu-check.sh [path/to/cp-hicache]
#
# Environment:
#   CP_HICACHE_BIN        binary (default: first argument, else target/release/cp-hicache)
#   CP_HICACHE_CACHE_DIR  JIT cache (carried, or a fresh one when NVRTC is present)
#   CP_HICACHE_NVRTC      libnvrtc.so.12 to compile with (optional)
#   GPU_CHECK_OUT         output folder for logs and JSON (default: $OUT, else a temp dir)
#   GPU_CHECK_TIMEOUT     seconds per step (default 240)
#   GPU_CHECK_BUDGET      seconds for the whole run (default 540, so one run fits a 10-minute
#                         lease with room to fetch the output): a step gets at most what is
#                         left, and a step with under 10 s left is not started (its row
#                         says so, and the run fails as incomplete)
set -euo pipefail

bin="${1:-${CP_HICACHE_BIN:-target/release/cp-hicache}}"
out="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d -t cp-hicache-gpu-check.XXXXXX)}}"
step_timeout="${GPU_CHECK_TIMEOUT:-240}"
deadline=$(($(date +%s) + ${GPU_CHECK_BUDGET:-540}))
mkdir -p "$out"

if [[ ! -x "$bin" ]]; then
  echo "error: cp-hicache binary not found or not executable: $bin" >&2
  echo "       build it with 'cargo build --release' and carry target/release/cp-hicache" >&2
  exit 2
fi
if ! command -v timeout >/dev/null 2>&1; then
  echo "error: coreutils 'timeout' is required" >&2
  exit 2
fi

export RUST_LOG="${RUST_LOG:-warn}"
# The sweep's deployment: NSA has two buffers of different page sizes.
sweep_deployment=nsa_ps64_cp8
rows=()
failed=0

# step NAME COMMAND... : runs with a timeout, logs to $out/NAME.log, records ok/FAIL/TIMEOUT.
step() {
  local name="$1"
  shift
  local log="$out/$name.log" start end rc status limit
  start=$(date +%s)
  limit=$((deadline - start))
  if ((limit < 10)); then
    rows+=("$(printf '%-10s %-9s %5s   %s' "$name" "NO-TIME" "-" "GPU_CHECK_BUDGET spent")")
    echo "== $name: not started (GPU_CHECK_BUDGET spent)"
    failed=1
    return
  fi
  ((limit < step_timeout)) || limit="$step_timeout"
  echo "== $name: $*"
  set +e
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  set -e
  end=$(date +%s)
  case "$rc" in
    0) status="ok" ;;
    124 | 137) status="TIMEOUT"; failed=1 ;;
    *) status="FAIL($rc)"; failed=1 ;;
  esac
  tail -n 25 "$log" | sed 's/^/   /'
  rows+=("$(printf '%-10s %-9s %5ss  %s' "$name" "$status" "$((end - start))" "$log")")
}

skip() {
  rows+=("$(printf '%-10s %-9s %5s   %s' "$1" "skipped" "-" "$2")")
  echo "== $1: skipped ($2)"
}

echo "binary: $bin"
echo "output: $out"
echo "cache:  ${CP_HICACHE_CACHE_DIR:-(default)}"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader \
    >"$out/nvidia-smi.txt" 2>&1 || true
  sed 's/^/gpu:    /' "$out/nvidia-smi.txt"
else
  echo "gpu:    nvidia-smi not on PATH"
fi

step info "$bin" info

# NVRTC present: compile (fills the cache). Otherwise the carried cache with JIT off.
# The report is captured before matching: under pipefail, `info | grep -q` could take a
# writer stopped by the early-closed pipe for "no match".
info_text="$("$bin" info 2>/dev/null || true)"
if grep -q "NVRTC *not found" <<<"$info_text"; then
  if [[ -z "${CP_HICACHE_CACHE_DIR:-}" ]]; then
    echo "warning: no NVRTC and no CP_HICACHE_CACHE_DIR: kernels cannot be compiled or found" >&2
  fi
  export CP_HICACHE_JIT=off
  skip compile "no NVRTC: using the carried cache with CP_HICACHE_JIT=off"
else
  step compile "$bin" compile --deployment all --arch sm_90 --json "$out/compile.json"
fi

step check "$bin" bench --check --backend cuda
step tune "$bin" tune --backend cuda --quick --out "$out/tuning.json"
# What the transfer mapping rests on: each buffer alone and both, both ways, at 128/256/512
# threads x 1-16 blocks, and dma / dma-each / dma-staged, alone and beside both busy kernels.
step sweep "$bin" tune --sweep --backend cuda --deployment "$sweep_deployment"
tuning_args=()
if [[ -f "$out/tuning.json" ]]; then
  tuning_args=(--tuning "$out/tuning.json")
fi
step bench "$bin" bench --backend cuda "${tuning_args[@]}" --json "$out/bench.json" \
  --plot "$out/bench.svg"
# The whole cache on the GPU, verified on every hit, with either transfer path.
step replay "$bin" replay --backend cuda --requests 96 --quiet --json "$out/replay.json"
step replay-dma "$bin" replay --backend cuda --requests 96 --quiet --transfer dma \
  --json "$out/replay-dma.json"
# Write-back with a small device pool: evictions back pages up on the backup stream while
# loads are in flight on the load stream, and loads begin back to back (issue 42's C1 shape).
step replay-writeback "$bin" replay --backend cuda --requests 48 --quiet --policy write_back \
  --device-pages 96 --json "$out/replay-writeback.json"
# The same inside a scheduler's steps: several loads, evictions and backups per step.
step replay-batch "$bin" replay --backend cuda --requests 48 --quiet --policy write_back \
  --device-pages 96 --batch 4 --chunk-tokens 256 --decode-tokens 16 \
  --json "$out/replay-batch.json"
# Each rank a process of its own (`--processes`), as engines run them: pools mapped through
# CUDA IPC, fences as interprocess events (serve's and, with --batch, the step's), every
# rank verifying through its mappings of its peers' pools; in batches, loads layer by layer
# with a per-layer interprocess fence (`--layer-waits`). Four ranks share the one GPU.
step replay-procs "$bin" replay --backend cuda --processes --cp 4 --model mla \
  --page-size 16 --layers 4 --requests 32 --device-pages 512 --quiet \
  --json "$out/replay-procs.json"
step replay-procs-batch "$bin" replay --backend cuda --processes --cp 4 --model mla \
  --page-size 16 --layers 4 --requests 48 --device-pages 512 --quiet --policy write_back \
  --batch 4 --chunk-tokens 256 --decode-tokens 16 --layer-waits \
  --json "$out/replay-procs-batch.json"

if command -v compute-sanitizer >/dev/null 2>&1; then
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$bin" bench --check --backend cuda --deployment nsa_ps64_cp8
  # Shared-memory races and barrier misuse where kernels share memory and barriers: the
  # allocator's one-block kernels (select and release), and the transfer (its groups of
  # lanes walk shared work items); the others share neither.
  for tool in racecheck synccheck; do
    step "$tool" compute-sanitizer --tool "$tool" --error-exitcode 3 \
      "$bin" bench --check --backend cuda --deployment nsa_ps64_cp8 \
      --family select_owner_pages --family release_pages --family transfer_pages
  done
else
  for tool in memcheck racecheck synccheck; do
    skip "$tool" "compute-sanitizer not on PATH"
  done
fi

# Transfers on the GPU: each candidate's GB/s beside the ALU busy kernel, alone and beside
# the HBM one, each busy kernel's slowdown, and in the note where each ran against the
# transfers (tune's rows for transfer_pages; docs/KERNELS.md "busy"). Both DMA
# candidates have a row: `dma` says so itself where the driver lacks cuMemcpyBatchAsync.
if [[ -f "$out/tune.log" ]]; then
  echo
  echo "transfers (tune): kernel  candidate  ms  GB/s-beside-alu  GB/s-alone  GB/s-beside-hbm  alu-slowdown  hbm-slowdown  note"
  grep -E '^transfer_pages' "$out/tune.log" | tee "$out/transfers.txt" || true
  for candidate in dma dma-each; do
    if ! awk -v c="$candidate" '$2 == c { found = 1 } END { exit !found }' "$out/transfers.txt"; then
      echo "note: tune printed no '$candidate' transfer row"
    fi
  done
fi

# The sweep (tune --sweep): every row, and a note for a buffer set or path with no row.
if [[ -f "$out/sweep.log" ]]; then
  echo
  echo "sweep ($sweep_deployment): kernel  buffers  candidate  ms  GB/s-beside-alu  GB/s-alone  GB/s-beside-hbm  alu-slowdown  hbm-slowdown  note"
  grep -E '^transfer_pages' "$out/sweep.log" | tee "$out/sweep.txt" || true
  for buffers in nsa_kv nsa_idx nsa_kv+nsa_idx; do
    for candidate in t128_ppb1_v16_u8_g1 t256_ppb1_v16_u8_g4 t512_ppb1_v16_u8_g16 dma dma-each dma-staged; do
      if ! awk -v b="$buffers" -v c="$candidate" '$2 == b && $3 == c { found = 1 } END { exit !found }' \
        "$out/sweep.txt"; then
        echo "note: the sweep printed no '$buffers' '$candidate' row"
      fi
    done
  done
fi

# Select and release at 2,048 pages: bench's table rows whose kernel is select_owner_pages_* or
# release_pages_* and whose bytes column is 8192 (4 bytes per requested page).
if [[ -f "$out/bench.log" ]]; then
  echo
  echo "allocator at 2,048 pages (bench): deployment  config  kernel  bytes  ms  GB/s  base  ratio  baseline"
  awk '$3 ~ /^(select_owner_pages|release_pages)_/ && $4 == 8192' "$out/bench.log" \
    | tee "$out/allocator.txt" || true
fi

# The DMA path against the link: bench's dma, dma-each and dma-staged transfer rows (GB/s of
# the copy engines, and the host's time submitting the copies, the last column) and the link's
# ceiling (one 256 MiB pinned cuMemcpyAsync each way, config `link`).
if [[ -f "$out/bench.log" ]]; then
  echo
  echo "dma and the link (bench): deployment  config  kernel  bytes  ms  GB/s  base  ratio  baseline  submit-ms"
  awk '$3 ~ /^dma(-each|-staged)?\(/ || $2 == "link"' "$out/bench.log" | tee "$out/dma.txt" || true
fi

echo
echo "step       result     time  log"
for r in "${rows[@]}"; do
  echo "$r"
done
if [[ "$failed" -ne 0 ]]; then
  echo "gpu-check: FAILED (see the logs in $out)"
  exit 1
fi
echo "gpu-check: all steps passed"
