"""`cp_hicache.ops` with `backend="cuda"` from Python, without a GPU: on the repository's
stand-in CUDA driver (`tests/fake_cuda/libcuda.cpp`, built here), which keeps device memory
on the host, queues work per stream and runs it only when something waits for it, and runs
host-built kernels behind `cuLaunchKernel`. The memory and the stream are the caller's
(allocated through the driver, wrapped in tensor-like objects as a CUDA torch tensor would
be), and the bytes are the host backend's on the same inputs.

What this shows: the Python ops (transfer, and select/release on owner lanes held in device
memory) reach the CUDA executor with the caller's device and pinned addresses and stream, and order themselves after the caller's queued work and the
caller's stream after them. What it cannot show: the CUBINs and the hardware."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def stand_in_driver(tmp: Path) -> Path:
    """Builds the stand-in driver as `libcuda.so` and `libcuda.so.1` in `tmp`."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        if os.environ.get("CP_HICACHE_REQUIRE_HOSTCC"):
            pytest.fail(f"no C++ compiler ({cxx}) and CP_HICACHE_REQUIRE_HOSTCC is set")
        pytest.skip(f"no C++ compiler ({cxx}) to build the stand-in driver")
    out = tmp / "libcuda.so"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-o", str(out),
         str(ROOT / "tests" / "fake_cuda" / "libcuda.cpp"), "-ldl"],
        check=True, capture_output=True,
    )
    shutil.copy(out, tmp / "libcuda.so.1")
    return tmp


# Runs in a process of its own whose libcuda is the stand-in.
SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys, types
    import numpy as np
    import cp_hicache
    from cp_hicache.ops import Ops

    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=2, layers=2)
    ops = Ops(dep, backend="cuda")  # opens the device; its context is current here
    cu = ctypes.CDLL("libcuda.so")
    cu.fake_cuda_cross_stream_waits.restype = ctypes.c_ulonglong

    def check(r, what):
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    class Memory:
        '''The parts of a torch tensor that cp_hicache.ops reads.'''
        def __init__(self, ptr, nbytes, device, itemsize=1):
            self.ptr, self.nbytes, self.itemsize = ptr, nbytes, itemsize
            self.device = types.SimpleNamespace(type=device)
        def data_ptr(self): return self.ptr
        def is_contiguous(self): return True
        def is_pinned(self): return self.device.type == "cpu"
        def numel(self): return self.nbytes // self.itemsize
        def element_size(self): return self.itemsize

    def on_device(a):
        '''A device copy of numpy array `a` (uploaded on the caller's stream).'''
        p = ctypes.c_uint64()
        check(cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(a.nbytes)), "cuMemAlloc")
        check(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(p.value), a.ctypes.data_as(ctypes.c_void_p),
                                      ctypes.c_size_t(a.nbytes), stream), "upload")
        return Memory(p.value, a.nbytes, "cuda", a.itemsize)

    def fetch(m, dtype):
        out = np.empty(m.nbytes // np.dtype(dtype).itemsize, dtype=dtype)
        check(cu.cuMemcpyDtoHAsync_v2(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(m.ptr),
                                      ctypes.c_size_t(m.nbytes), stream), "read back")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return out

    pb = ops.page_bytes("mla_kv")
    dev_bytes, host_bytes = 2 * 4 * pb, 2 * 6 * pb
    dptr = ctypes.c_uint64()
    check(cu.cuMemAlloc_v2(ctypes.byref(dptr), ctypes.c_size_t(dev_bytes)), "cuMemAlloc")
    hptr = ctypes.c_void_p()
    check(cu.cuMemHostAlloc(ctypes.byref(hptr), ctypes.c_size_t(host_bytes), 2),  # DEVICEMAP
          "cuMemHostAlloc")
    stream = ctypes.c_void_p()
    check(cu.cuStreamCreate(ctypes.byref(stream), 0), "cuStreamCreate")

    rng = np.random.default_rng(7)
    host = rng.integers(0, 256, host_bytes, dtype=np.uint8)
    ctypes.memmove(hptr.value, host.ctypes.data, host_bytes)
    # The caller's work queued on its stream and not run yet: the device's first bytes.
    first = rng.integers(0, 256, dev_bytes, dtype=np.uint8)
    check(cu.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dptr.value), first.ctypes.data_as(ctypes.c_void_p),
                                  ctypes.c_size_t(dev_bytes), stream), "upload")

    before = cu.fake_cuda_cross_stream_waits()
    src, dst = [5, 0, 2], [3, 1, 0]
    moved = ops.transfer("h2d", [Memory(dptr.value, dev_bytes, "cuda")],
                         [Memory(hptr.value, host_bytes, "cpu")], src, dst,
                         stream=stream.value)
    waits = cu.fake_cuda_cross_stream_waits() - before
    # Read back on the caller's stream: after the op, as the caller's own next work is.
    got = np.empty(dev_bytes, dtype=np.uint8)
    check(cu.cuMemcpyDtoHAsync_v2(got.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(dptr.value),
                                  ctypes.c_size_t(dev_bytes), stream), "read back")
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    # The host backend on the same inputs.
    want = first.copy()
    Ops(dep, backend="host").transfer("h2d", [want], [host.copy()], src, dst)

    # A torch-style stream object (.cuda_stream) names the same stream.
    later = Ops(dep, backend="cuda").transfer(
        "d2h", [Memory(dptr.value, dev_bytes, "cuda")], [Memory(hptr.value, host_bytes, "cpu")],
        [3], [4], stream=types.SimpleNamespace(cuda_stream=stream.value))
    check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    back = np.ctypeslib.as_array((ctypes.c_uint8 * host_bytes).from_address(hptr.value)).copy()
    want_host = host.copy()
    Ops(dep, backend="host").transfer("d2h", [want.copy()], [want_host], [3], [4])

    # The engine's owner lanes in device memory: select and release against the host
    # backend on the same lanes.
    from cp_hicache.ops import Lanes
    host_lanes = Lanes.of([2, 4, 6, 1, 3, 5, 7, 9], cp=2, lane_cap=8)
    lanes = Lanes(on_device(host_lanes.stacks), on_device(host_lanes.tops),
                  on_device(host_lanes.status))
    owners = [1, 0, 1, 1]
    n = len(owners)
    out_pages = on_device(np.zeros(n, dtype=np.uint32))
    out_locs = on_device(np.zeros(n * 16, dtype=np.int64))
    before = cu.fake_cuda_cross_stream_waits()
    ops.select(lanes, owners, out_pages=out_pages, out_locs=out_locs, stream=stream.value)
    select_waits = cu.fake_cuda_cross_stream_waits() - before
    host_ops = Ops(dep, backend="host")
    want_pages, want_locs = host_ops.select(host_lanes, owners)
    got_pages, got_locs = fetch(out_pages, np.uint32), fetch(out_locs, np.int64)
    selected = bool((got_pages == want_pages).all() and (got_locs == want_locs).all())
    # A short lane: all or nothing, on the device as on the host.
    short = None
    try:
        ops.select(lanes, [0] * 5, out_pages=on_device(np.zeros(5, dtype=np.uint32)),
                   out_locs=on_device(np.zeros(80, dtype=np.int64)), stream=stream.value)
    except cp_hicache.CacheFullError as e:
        short = str(e)
    # On the CUDA backend the outputs are the caller's device tensors: none given is refused.
    try:
        ops.select(lanes, owners, stream=stream.value)
        no_outputs = None
    except cp_hicache.UsageError as e:
        no_outputs = str(e)
    ops.release(lanes, got_pages[::-1], stream=stream.value)
    host_ops.release(host_lanes, want_pages[::-1])
    released = bool((fetch(lanes.tops, np.uint32) == host_lanes.tops).all()
                    and (fetch(lanes.stacks, np.uint32) == host_lanes.stacks.ravel()).all())
    # From the same lanes, out_pages alone runs the kernel without slots: the same pages.
    only_pages = on_device(np.zeros(n, dtype=np.uint32))
    _, no_locs = ops.select(lanes, owners, out_pages=only_pages, stream=stream.value)
    pages_only = bool(no_locs is None and (fetch(only_pages, np.uint32) == want_pages).all())

    print(json.dumps({
        "selected": selected, "select_waits": select_waits, "short": short,
        "released": released, "pages": got_pages.tolist(), "no_outputs": no_outputs,
        "pages_only": pages_only,
        "moved": moved, "expected_moved": 3 * 2 * pb, "waits": waits,
        "same": bool((got == want).all()), "changed": bool((got != first).any()),
        "later": later, "back_same": bool((back == want_host).all()),
        "backend": ops._native.backend,
    }))
    """
)


def test_cuda_ops_run_on_the_callers_memory_and_stream(tmp_path):
    lib = stand_in_driver(tmp_path)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    env.setdefault("CP_HICACHE_CACHE_DIR", str(tmp_path / "jit"))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["backend"] == "cuda"
    assert r["moved"] == r["expected_moved"]
    # After the caller's queued upload (else the upload would overwrite the op's pages), and
    # the caller's stream after the op: two cross-stream waits.
    assert r["waits"] == 2, r
    assert r["same"] and r["changed"], r
    assert r["back_same"], r
    # Owner lanes in device memory: the host backend's pages and slots, all or nothing.
    assert r["selected"] and r["select_waits"] == 2, r
    assert r["pages"] and all(p % 2 == o for p, o in zip(r["pages"], [1, 0, 1, 1])), r
    assert r["short"] and "lane 0" in r["short"], r
    assert r["released"], r
    assert r["no_outputs"] and "writes into out_pages" in r["no_outputs"], r
    assert r["pages_only"], r


# An engine's loop on the stand-in: a RankCache on the CUDA backend whose forward's stream is
# handed to extend and finish, so the backups wait for it on the device (no host sync).
ENGINE_SCRIPT = textwrap.dedent(
    """
    import ctypes, json
    import cp_hicache

    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)
    rc = cp_hicache.RankCache(dep, device_pages=32, host_pages=64, backend="cuda")
    cu = ctypes.CDLL("libcuda.so")
    for hook in ("fake_cuda_cross_stream_waits", "fake_cuda_ctx_syncs", "fake_cuda_races"):
        getattr(cu, hook).restype = ctypes.c_ulonglong
    stream = ctypes.c_void_p()
    assert cu.cuStreamCreate(ctypes.byref(stream), 1) == 0
    before = (cu.fake_cuda_cross_stream_waits(), cu.fake_cuda_ctx_syncs())
    req = rc.begin(list(range(40)), allocate=True)
    rc.synthesise(req)
    rc.extend(req, list(range(40, 60)), stream=stream.value)
    rc.synthesise(req)
    stats = rc.finish(req, stream=stream.value)
    again = rc.begin(list(range(60)), allocate=True)
    mismatched = rc.synthesise_and_verify(again)
    rc.finish(again)
    # begin hands pages out with the cache's work on them queued (poison of freed pages):
    # with the engine's stream, that stream waits for it on the device.
    w0 = cu.fake_cuda_cross_stream_waits()
    plain = rc.begin(list(range(300, 340)), allocate=True)
    w1 = cu.fake_cuda_cross_stream_waits()
    led = rc.begin(list(range(400, 440)), allocate=True, stream=stream.value)
    w2 = cu.fake_cuda_cross_stream_waits()
    rc.finish(plain, ok=False)
    rc.finish(led, ok=False)
    try:
        rc.finish(again, stream="not a stream")
        refused = None
    except cp_hicache.UsageError as e:
        refused = str(e)
    print(json.dumps({
        "waits": cu.fake_cuda_cross_stream_waits() - before[0],
        "ctx_syncs": cu.fake_cuda_ctx_syncs() - before[1],
        "races": cu.fake_cuda_races(),
        "cached": again.cached_pages,
        "mismatched": mismatched,
        "refused": refused,
        "begin_waits": [w1 - w0, w2 - w1],
    }))
    """
)


def test_finish_and_extend_order_the_cache_after_the_engines_stream(tmp_path):
    lib = stand_in_driver(tmp_path)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    env.setdefault("CP_HICACHE_CACHE_DIR", str(tmp_path / "jit"))
    env["FAKE_CUDA_SCHED"] = "adversarial"
    out = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    # One wait of the cache's stream on the engine's for extend, one for finish.
    assert r["waits"] >= 2, r
    assert r["ctx_syncs"] == 0, r
    assert r["races"] == 0, r
    assert r["cached"] > 0 and r["mismatched"] == 0, r
    assert r["refused"] and "stream=" in r["refused"], r
    # Only the begin given the stream orders it.
    assert r["begin_waits"][1] == r["begin_waits"][0] + 1, r
