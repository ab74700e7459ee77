"""A GQA/MHA model's cache from Python: ``Deployment(model="gqa", kv_heads=..., head_dim=...)``
names its one buffer by its shard shape, its K and V pages round-trip through the host tier
and through the store into a fresh process with 0 mismatched tokens, and a store of another
shard shape is refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cp_hicache
from test_object_store import DictStore


def test_a_gqa_deployment_describes_its_shard():
    dep = cp_hicache.Deployment(model="gqa", kv_heads=4, head_dim=32, page_size=16, cp=1,
                                layers=2)
    assert dep.name == "gqa4x32_ps16_cp1"
    assert (dep.model, dep.kv_heads, dep.head_dim) == ("gqa", 4, 32)
    assert dep.buffers == ["gqa4x32_kv"]
    assert dep.page_bytes("gqa4x32_kv") == 16 * 4 * 4 * 32  # a page's K then V, bf16
    assert "kv_heads=4, head_dim=32" in repr(dep)
    default = cp_hicache.Deployment(model="gqa", page_size=16, cp=4, layers=1)
    assert (default.kv_heads, default.head_dim, default.name) == (8, 128, "gqa8x128_ps16_cp4")
    mla = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=1)
    assert mla.kv_heads is None and mla.head_dim is None
    with pytest.raises(cp_hicache.UsageError, match='give model="gqa"'):
        cp_hicache.Deployment(model="mla", kv_heads=4, page_size=16, cp=1, layers=1)
    with pytest.raises(cp_hicache.UsageError, match="at least 1 KV head"):
        cp_hicache.Deployment(model="gqa", kv_heads=0, page_size=16, cp=1, layers=1)


def test_gqa_pages_round_trip_through_the_host_tier_and_the_store(tmp_path):
    dep = cp_hicache.Deployment(model="gqa", kv_heads=4, head_dim=32, page_size=16, cp=1,
                                layers=2)
    prompt = np.arange(160, dtype=np.uint32)  # 10 pages
    rc = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    rc.attach_storage(tmp_path / "store", capacity_bytes=64 << 20)
    cold = rc.serve(prompt)
    assert cold["computed_tokens"] == 160 and cold["mismatched_tokens"] == 0
    assert cold["storage_records_written"] == 10
    assert rc.evict(1 << 30) >= 1
    loaded = rc.serve(prompt)
    assert loaded["host_hit_tokens"] == 160 and loaded["pages_loaded"] == 10
    assert loaded["mismatched_tokens"] == 0
    rc.check_invariants()
    del rc
    code = f"""
import numpy as np, cp_hicache
dep = cp_hicache.Deployment(model="gqa", kv_heads=4, head_dim=32, page_size=16, cp=1, layers=2)
rc = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
rc.attach_storage({str(tmp_path / "store")!r})
s = rc.serve(np.arange(160, dtype=np.uint32))
assert s["storage_hit_tokens"] == 160, s
assert s["storage_records_read"] == 10 and s["mismatched_tokens"] == 0, s
rc.check_invariants()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    other = cp_hicache.RankCache(
        cp_hicache.Deployment(model="gqa", kv_heads=2, head_dim=64, page_size=16, cp=1,
                              layers=2),
        device_pages=64, host_pages=64, backend="host")
    with pytest.raises(ValueError, match="holds records of"):
        other.attach_storage(tmp_path / "store")


def test_a_gqa_deployment_names_its_tp_shard():
    dep = cp_hicache.Deployment(model="gqa", kv_heads=4, head_dim=32, page_size=16, cp=1,
                                layers=2, tp_rank=1, tp_size=2)
    assert (dep.tp_rank, dep.tp_size) == (1, 2)
    assert dep.name == "gqa4x32_ps16_cp1"  # the kernels are the shard shape's
    assert "kv_heads=4, head_dim=32, tp_rank=1, tp_size=2" in repr(dep)
    whole = cp_hicache.Deployment(model="gqa", kv_heads=4, head_dim=32, page_size=16, cp=1,
                                  layers=2)
    assert (whole.tp_rank, whole.tp_size) == (0, 1)
    assert "tp_" not in repr(whole)
    for bad, match in [
        (dict(tp_rank=2, tp_size=2), "TP rank 2 is not below the TP size 2"),
        (dict(tp_size=0), "TP size 0"),
        (dict(tp_rank=1), "give tp_size too"),
    ]:
        with pytest.raises(cp_hicache.UsageError, match=match):
            cp_hicache.Deployment(model="gqa", page_size=16, cp=1, layers=1, **bad)
    with pytest.raises(cp_hicache.UsageError, match="same latent KV on every TP rank"):
        cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=1, tp_rank=1,
                              tp_size=2)


def _shard(rank):
    dep = cp_hicache.Deployment(model="gqa", kv_heads=4, head_dim=32, page_size=16, cp=1,
                                layers=2, tp_rank=rank, tp_size=2)
    return cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")


def test_tp_shards_of_one_model_share_a_store_and_each_reads_back_only_its_own(tmp_path):
    prompt = np.arange(160, dtype=np.uint32)  # 10 pages
    store = DictStore()  # one object store for every TP shard (Mooncake Store's shape)
    zero = _shard(0)
    zero.attach_storage(store)
    s = zero.serve(prompt)
    assert s["storage_records_written"] == 10 and s["mismatched_tokens"] == 0, s
    zero.close()
    # Shard 1 finds none of shard 0's records (other heads), computes and writes its own.
    one = _shard(1)
    one.attach_storage(store)
    s = one.serve(prompt)
    assert s["storage_hit_tokens"] == 0 and s["storage_records_read"] == 0, s
    assert s["computed_tokens"] == 160 and s["mismatched_tokens"] == 0, s
    assert s["storage_records_written"] == 10, s
    one.close()
    assert len(store.objects) == 20
    for rank in (0, 1):
        rc = _shard(rank)
        rc.attach_storage(store)
        s = rc.serve(prompt)
        assert s["storage_hit_tokens"] == 160 and s["storage_records_read"] == 10, (rank, s)
        assert s["mismatched_tokens"] == 0, (rank, s)
        rc.check_invariants()
        rc.close()
    # A directory holds one deployment's records: shard 0's is refused to shard 1.
    zero = _shard(0)
    zero.attach_storage(tmp_path / "store")
    assert zero.serve(prompt)["storage_records_written"] == 10
    zero.close()
    with pytest.raises(ValueError, match=r"holds records of .*tp=0/2.*tp=1/2"):
        _shard(1).attach_storage(tmp_path / "store")
