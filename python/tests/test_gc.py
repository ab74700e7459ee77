"""Garbage collection is safe at any moment (issue 45, finding 3).

An engine whose forward raised leaves its ``RankCache``, an open request and torch tensors of
the cache's pools reachable only through a reference cycle (the exception's traceback). The
collector may free that cycle at any allocation, including inside another cache's call: its
constructor or its ``begin``, while the call is in its group's ``exchange``. torch runs a
DLPack deleter with the GIL released; the cache's deleter once trusted PyO3's record that the
thread was attached (it was, inside the other cache's round) and freed the cache object
without the GIL: a segmentation fault, every time. Each case runs in a fresh interpreter with
a timeout, so a regression fails instead of killing the test run.

Also here: a new cache removes the shared-memory segments a crashed process left behind
(``/dev/shm/cp-hicache-<pid>-*`` of a process that is gone), and only those."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

import cp_hicache  # noqa: E402

PRELUDE = '''
import gc, json, os, sys, threading, weakref
import torch
import cp_hicache

def segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"cp-hicache-{os.getpid()}-"))

class Group:
    """A group of one rank whose exchange runs the collector while armed."""
    rank, size = 0, 1
    def __init__(self, collect=False):
        self.collect = collect
    def exchange(self, what, payload, why):
        if self.collect:
            gc.collect()
        return [(what, payload, why)]

def abandon(dep, group, rank=0, refs=None):
    """An engine rank whose forward raised: its cache, an open request and tensors of every
    pool it reaches are left in a cycle through the exception's traceback."""
    rc = cp_hicache.RankCache(dep, rank, group, device_pages=64 * dep.cp, host_pages=64,
                              backend="host")
    req = rc.begin(list(range(100)), allocate=True, chunk=40)
    tensors = [torch.from_dlpack(rc.pool(b, owner=o)) for b in dep.buffers
               for o in range(dep.cp)]
    tensors[0][0, 0, 0] = 7  # the engine was writing KV
    holder = {}
    try:
        raise RuntimeError("the forward failed")
    except RuntimeError as e:
        holder["error"] = e  # error -> traceback -> this frame -> holder -> error
    if refs is not None:
        refs.append(weakref.ref(rc._native))
'''


def run(code: str, timeout: float = 180) -> dict:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model, page_size", [("mla", 16), ("nsa", 64)])
def test_a_cache_collected_inside_another_caches_constructor_and_begin(model, page_size):
    v = run(f"""
        dep = cp_hicache.Deployment(model={model!r}, page_size={page_size}, cp=1, layers=2)
        gc.disable()  # the collections happen where this test says
        refs, served = [], []
        for i in range(3):
            abandon(dep, Group(), refs=refs)
            # collected inside the new cache's constructor (its start-up round) ...
            rc = cp_hicache.RankCache(dep, 0, Group(collect=True), device_pages=64,
                                      host_pages=64, backend="host")
            abandon(dep, Group(), refs=refs)
            # ... and inside its begin (the step's round)
            req = rc.begin(list(range(1000 * i, 1000 * i + 50)), allocate=True)
            rc.synthesise(req)
            served.append(rc.finish(req)["mismatched_tokens"])
            rc.close()
        gc.collect()
        print(json.dumps({{"collected": [r() is None for r in refs], "served": served,
                          "segments": segments()}}))
    """)
    assert v["collected"] == [True] * 6, v
    assert v["served"] == [0, 0, 0], v
    assert v["segments"] == [], v


def test_a_cache_collected_while_ranks_are_threads_in_a_group():
    """Two ranks as threads of one process over a Python group: the abandoned pair (each
    holding tensors of its own and its peer's pool) is collected inside the new pair's
    start-up and begin rounds, on both threads."""
    v = run("""
        class Pair:
            def __init__(self):
                self.slots, self.barrier = [None, None], threading.Barrier(2)
                self.collect = False
            def member(self, rank):
                pair = self
                class Member:
                    size = 2
                    def __init__(self):
                        self.rank = rank
                    def exchange(self, what, payload, why):
                        pair.slots[rank] = (what, payload, why)
                        pair.barrier.wait()
                        out = list(pair.slots)
                        if pair.collect:
                            gc.collect()
                        pair.barrier.wait()
                        return out
                return Member()

        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=2, layers=2)
        refs, served, errors = [], [], []

        def ranks(target):
            pair = Pair()
            threads = [threading.Thread(target=target, args=(pair, r)) for r in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return pair

        def failing(pair, rank):
            try:
                abandon(dep, pair.member(rank), rank, refs)
            except BaseException as e:
                errors.append(repr(e))

        def serving(pair, rank):
            try:
                pair.collect = True
                rc = cp_hicache.RankCache(dep, rank, pair.member(rank), device_pages=128,
                                          host_pages=64, backend="host")
                req = rc.begin(list(range(300)), allocate=True)
                rc.synthesise(req)
                served.append(rc.finish(req)["mismatched_tokens"])
                pair.collect = False
                rc.close()
            except BaseException as e:
                errors.append(repr(e))

        gc.disable()
        for _ in range(3):
            ranks(failing)
            ranks(serving)
        gc.collect()
        print(json.dumps({"collected": [r() is None for r in refs], "served": served,
                          "errors": errors, "segments": segments()}))
    """)
    assert v["errors"] == [], v
    assert v["collected"] == [True] * 6, v
    assert v["served"] == [0] * 6, v
    assert v["segments"] == [], v


def test_a_tensor_freed_with_the_gil_released_inside_a_call_keeps_the_cache_safe():
    """The cause itself, without the collector: a tensor of an abandoned cache's pool dies
    inside another cache's round, and torch frees it (running the DLPack deleter) with the
    GIL released."""
    v = run("""
        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)
        doomed = []

        class Drops(Group):
            def exchange(self, what, payload, why):
                doomed.clear()  # the last reference to the old cache goes with its tensor
                return [(what, payload, why)]

        for _ in range(3):
            old = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
            doomed.append(torch.from_dlpack(old.pool("mla_kv")))
            ref = weakref.ref(old._native)
            del old
            rc = cp_hicache.RankCache(dep, 0, Drops(), device_pages=64, host_pages=64,
                                      backend="host")
            assert ref() is None
            rc.close()
        print(json.dumps({"segments": segments()}))
    """)
    assert v["segments"] == [], v


class _Echo:
    """A group of two whose peer is this rank itself: a CP 2 cache (shared pools) in one
    process."""

    rank, size = 0, 2

    def exchange(self, what, payload, why):
        return [(what, payload, why)] * 2


def test_a_new_cache_removes_the_segments_of_processes_that_are_gone():
    """A process that crashed before its pools were sealed leaves ``cp-hicache-<pid>-*`` in
    /dev/shm for good; the next cache to make shared pools removes them, and nothing else:
    a live process's (this one's, its parent's), names of another shape, other programs'."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)  # reaped: no process has this pid now (unless reused at once)
    names = {
        "dead": f"cp-hicache-{dead}-3-1f2e",
        "mine": f"cp-hicache-{os.getpid()}-999999-ab",
        "parent": f"cp-hicache-{os.getppid()}-999999-cd",
        "odd": "cp-hicache-notapid-1-ef",
        "other": f"fake-cuda-{dead}-999999",
    }
    made = []
    try:
        for n in names.values():
            path = os.path.join("/dev/shm", n)
            with open(path, "xb") as f:
                f.write(b"left behind")
            made.append(path)
        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=2, layers=2)
        rc = cp_hicache.RankCache(dep, 0, _Echo(), device_pages=64, host_pages=16,
                                  backend="host")
        rc.close()
        there = {k: os.path.exists(os.path.join("/dev/shm", n)) for k, n in names.items()}
        assert there == {"dead": False, "mine": True, "parent": True, "odd": True,
                         "other": True}, there
    finally:
        for path in made:
            if os.path.exists(path):
                os.unlink(path)


def _gloo_rank(rank, size, port, out):
    """One engine process over gloo: its first cache's forward raises (the cache, an open
    request and tensors of every pool it reaches left in a traceback cycle); the collector
    runs inside each round of the next cache's constructor and begin."""
    import gc
    import weakref
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=60))
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=size, layers=2)
    exchange = cp_hicache.TorchCollective.exchange
    collect = [False]

    def collecting(self, *args):
        if collect[0]:
            gc.collect()
        return exchange(self, *args)

    cp_hicache.TorchCollective.exchange = collecting

    def failing(group):
        rc = cp_hicache.RankCache(dep, rank, group, device_pages=64 * size, host_pages=64,
                                  backend="host")
        req = rc.begin(list(range(200)), allocate=True)  # noqa: F841 - open when abandoned
        tensors = [torch.from_dlpack(rc.pool("mla_kv", owner=o))  # noqa: F841
                   for o in range(size)]
        holder = {}
        try:
            raise RuntimeError("the forward failed")
        except RuntimeError as e:
            holder["error"] = e
        return weakref.ref(rc._native)

    gc.disable()
    log = {"collected": [], "mismatched": []}
    for _ in range(2):
        ref = failing(dist.new_group(backend="gloo"))
        collect[0] = True
        rc = cp_hicache.RankCache(dep, rank, dist.new_group(backend="gloo"),
                                  device_pages=64 * size, host_pages=64, backend="host")
        req = rc.begin(list(range(300)), allocate=True)
        rc.synthesise(req)
        log["mismatched"].append(rc.finish(req)["mismatched_tokens"])
        collect[0] = False
        log["collected"].append(ref() is None)
        rc.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


def test_a_cache_collected_inside_another_caches_rounds_over_gloo(tmp_path):
    """The case as reported: ranks as gloo processes, the abandoned cache collected inside
    the rounds of the cache an engine builds next (it died with SIGSEGV, 3 runs in 3)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_gloo_rank, args=(2, port, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for r in range(2):
        log = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert log == {"collected": [True, True], "mismatched": [0, 0]}, log


def test_a_cycle_through_a_pool_is_collected():
    """A ``Pool`` holds its cache (so the memory outlives it), and the cache holds its group.
    An engine that keeps a pool on the object that is its cache's group closes a cycle the
    collector could not see into (the pool did not traverse its cache): the cache was never
    freed. (A tensor taken from a pool holds the cache through its DLPack context, which
    neither a capsule nor torch shows the collector: drop such tensors, or close the cache.)"""
    v = run("""
        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)
        gc.disable()
        refs = []
        for i in range(3):
            group = Group()
            rc = cp_hicache.RankCache(dep, 0, group, device_pages=64, host_pages=64,
                                      backend="host")
            group.pool = rc.pool("mla_kv")  # group -> pool -> cache -> group
            refs.append(weakref.ref(rc._native))
            del rc, group
        gc.collect()
        print(json.dumps({"collected": [r() is None for r in refs]}))
    """)
    assert v["collected"] == [True] * 3, v
