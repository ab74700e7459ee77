"""A RankCache over the engine's own device tensors (``device_buffers=``): per-layer lists
(SGLang), one layer-major tensor, and one page-major tensor (vLLM's cross-layer cache). The
cache serves as it does over its own pools, byte for byte, in the engine's memory."""

from __future__ import annotations

import numpy as np
import pytest

import cp_hicache
from cp_hicache.ops import PageMajor

torch = pytest.importorskip("torch")

DEP = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)
PAGES = 9


def prompt(pages, seed):
    return [t * 7 + seed for t in range(pages * 16)]


def engine(order, pb):
    """The engine's tensors in ``order`` and a function giving layer ``l`` as [pages, pb]."""
    fill = 0x5A
    if order == "per_layer":
        ts = [torch.full((PAGES * 16, pb // 16), fill, dtype=torch.uint8) for _ in range(2)]
        return ts, lambda l: ts[l].reshape(PAGES, pb)
    if order == "layer_major":
        t = torch.full((2, PAGES, pb), fill, dtype=torch.uint8)
        return t, lambda l: t[l]
    t = torch.full((PAGES, 2, pb), fill, dtype=torch.uint8)
    return PageMajor(t), lambda l: t[:, l]


@pytest.mark.parametrize("order", ["per_layer", "layer_major", "page_major"])
def test_a_cache_over_engine_tensors_serves_like_its_own_pools(order):
    pb = DEP.page_bytes("mla_kv")
    tensors, layer = engine(order, pb)
    own = cp_hicache.RankCache(DEP, device_pages=PAGES, host_pages=4, backend="host")
    rc = cp_hicache.RankCache(
        DEP, device_pages=PAGES, host_pages=4, backend="host", device_buffers=[tensors]
    )
    assert rc.adopts_device and not own.adopts_device
    # Adopting poisons the pages, as the cache's own pools start.
    assert all((layer(l).numpy() == 0xA5).all() for l in range(2))
    host_hits = 0
    for _ in range(3):
        for p in (prompt(3, 1), prompt(5, 2), prompt(2, 1)):
            a, b = own.serve(p), rc.serve(p)
            assert a == b
            assert b["mismatched_tokens"] == 0
            host_hits += b["host_hit_tokens"]
        assert own.digest() == rc.digest()
        own.evict(1 << 30)
        rc.evict(1 << 30)
    assert host_hits > 0
    mine = torch.from_dlpack(own.pool("mla_kv")).numpy()
    for l in range(2):
        assert (layer(l).numpy() == mine[l]).all(), l
    with pytest.raises(cp_hicache.UsageError, match="engine's own memory"):
        rc.pool("mla_kv")
    rc.close()
    own.close()


@pytest.mark.parametrize(
    "buffers, message",
    [
        (lambda pb: [[torch.zeros((PAGES, pb), dtype=torch.uint8)]], "1 per-layer tensors for 2 layers"),
        (lambda pb: [torch.zeros((2, PAGES - 1, pb), dtype=torch.uint8)], "fewer than the 9 local pages"),
        (lambda pb: [torch.zeros((2, PAGES, pb), dtype=torch.uint8)[:, :, ::2]], "not contiguous"),
        (lambda pb: [torch.zeros((2, PAGES, pb), dtype=torch.uint8)] * 2, "2 entries"),
        (lambda pb: [np.zeros((2, PAGES, pb // 7 + 1), dtype="V7")], "tile"),
    ],
)
def test_engine_buffers_that_break_a_rule_are_refused(buffers, message):
    pb = DEP.page_bytes("mla_kv")
    with pytest.raises(cp_hicache.UsageError, match=message):
        cp_hicache.RankCache(
            DEP, device_pages=PAGES, host_pages=4, backend="host", device_buffers=buffers(pb)
        )


def _engine_rank(rank, size, port, out, order):
    """One engine process: its own torch tensors adopted as this rank's pools."""
    import json
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=60))
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=size, layers=2)
    pb = dep.page_bytes("mla_kv")
    tensors, layer = engine(order, pb)
    log = {}
    with cp_hicache.RankCache(dep, rank, dist.group.WORLD, device_pages=PAGES * size,
                              host_pages=8, backend="host", device_buffers=[tensors]) as rc:
        stats = []
        for p in (prompt(3, 1), prompt(6, 2), prompt(3, 1)):
            stats.append(rc.serve(p))
            rc.evict(1 << 30)
        stats.append(rc.serve(prompt(4, 3)))
        log["mismatched"] = sum(s["mismatched_tokens"] for s in stats)
        log["host hits"] = sum(s["host_hit_tokens"] for s in stats)
        log["gathered"] = sum(s["bytes_gathered"] for s in stats)
        log["peer pools"] = rc.peer_pools
        if rank == 1:
            # The engine overwrites its own pages: both ranks must see it.
            for l in range(2):
                layer(l).fill_(0)
        again = rc.serve(prompt(4, 3))
        log["device hit"] = again["device_hit_tokens"]
        log["after"] = rc.last_verdict()["by_rank"]
        log["digests agree"] = len(set(rc.all_digests())) == 1
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


@pytest.mark.parametrize("order", ["per_layer", "page_major"])
def test_engine_tensors_in_separate_processes_verify_through_the_group(tmp_path, order):
    """Two engine processes over gloo, each with its own torch tensors as its pools: no
    process can map the other's memory, so each sends the pages it owns through the group
    and both verify every token; an engine that overwrites its pages is seen by both."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    size = 2
    mp.start_processes(_engine_rank, args=(size, port, str(tmp_path), order), nprocs=size,
                       start_method="spawn")
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
    pb = DEP.page_bytes("mla_kv")
    for log in logs:
        assert log["mismatched"] == 0, log
        assert log["host hits"] > 0, log
        assert log["peer pools"] == "gathered", log
        assert log["digests agree"], log
        assert log["device hit"] == 4 * 16, log
        # Rank 1's half of the 4 pages were overwritten: both ranks count their 32 tokens.
        assert log["after"] == [32, 32], log
    # Every page of the 16 served went through the group once, in both layers.
    assert sum(log["gathered"] for log in logs) == 16 * 2 * pb
