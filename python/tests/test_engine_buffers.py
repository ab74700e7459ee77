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
