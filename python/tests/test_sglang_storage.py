"""`cp_hicache.sglang.CpHiCacheStorage` through SGLang's own `StorageBackendFactory` and
`HiCacheStorage` (the published sglang wheel, `python/tests/requirements.txt`): built from a
`dynamic` config, pages of a host pool round-trip byte for byte through `batch_set_v1` /
`batch_get_v1` as CP ranks call them, each record has one writer, another CP degree reads
them, and a damaged record is refused.

SGLang's package `__init__` imports the whole engine, and its host pool classes need its
engine dependencies (msgspec, ...), so only the storage modules are loaded, under their own
names, and the host pool is ours (`FlatHostPool`), following `get_page_buffer_meta`'s
contract: token indices in, one `(address, bytes)` list per page of the `page_first` layout
(one buffer per page for MLA, `k` and `v` for MHA)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest

torch = pytest.importorskip("torch")


def _load_sglang_storage():
    """SGLang's storage modules without running `sglang/__init__` (the whole engine)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("the sglang wheel (python/tests/requirements.txt) is not installed")
    if "sglang" not in sys.modules or not hasattr(sys.modules["sglang"], "__path__"):
        stub = types.ModuleType("sglang")
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = stub
    from sglang.srt.mem_cache import hicache_storage
    from sglang.srt.mem_cache.storage import backend_factory

    return hicache_storage, backend_factory


hicache_storage, backend_factory = _load_sglang_storage()
HiCacheStorageConfig = hicache_storage.HiCacheStorageConfig

from mooncake_fixture import mooncake_master  # noqa: E402,F401  (the fixture)

PAGE = 16
LAYERS = 3


class FlatHostPool:
    """A host pool of `pages` pages in SGLang's `page_first` layout: MLA, one
    `[layers, page_size, dim]` buffer per page; MHA, `k` then `v` per page."""

    layout = "page_first"

    def __init__(self, pages: int, dim: int, mla: bool = True, seed: int = 0):
        self.page_size = PAGE
        self.layer_num = LAYERS
        self.dtype = torch.bfloat16
        self.mla = mla
        parts = 1 if mla else 2
        g = torch.Generator().manual_seed(seed)
        self.kv = torch.randint(-30000, 30000, (pages, parts, LAYERS, PAGE, dim),
                                generator=g, dtype=torch.int16).view(torch.bfloat16)
        self.part_bytes = LAYERS * PAGE * dim * 2

    def page(self, i: int) -> torch.Tensor:
        return self.kv[i]

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        base = self.kv.data_ptr()
        ptrs, sizes = [], []
        for first in indices[:: self.page_size]:
            page = int(first) // self.page_size
            for part in range(self.kv.shape[1]):
                ptrs.append(base + (page * self.kv.shape[1] + part) * self.part_bytes)
                sizes.append(self.part_bytes)
        return ptrs, sizes


def config(path, cp_rank=0, cp_size=1, mla=True, tp_rank=0, tp_size=1, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
        attn_cp_rank=cp_rank, attn_cp_size=cp_size, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="tiny-mla",
        extra_config={
            "backend_name": "cp_hicache", "module_path": "cp_hicache.sglang",
            "class_name": "CpHiCacheStorage", "interface_v1": 1, "path": str(path),
            "capacity_bytes": 1 << 30, **extra,
        },
    )


def backend(path, pool, **kw):
    """Built as SGLang's HiCacheController builds it: the factory, the host pool, then the
    end of the pools' registration."""
    b = backend_factory.StorageBackendFactory.create_backend(
        "dynamic", config(path, **kw), pool)
    assert isinstance(b, hicache_storage.HiCacheStorage)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def indices(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


KEYS = [f"{i:064x}" for i in range(1, 9)]  # SGLang's keys: hex page hashes


# SGLang's rank layout (dp, cp, tp), tp fastest: with attention DP off the config's TP rank
# is the global one, (cp_rank * attn_tp + attn_tp_rank); with it on, attention TP's.
TOPOLOGIES = {
    # MLA, prefill CP 2 without attention DP: only TP rank 0 (CP rank 0) is a writer.
    "mla-cp2": dict(mla=True, cp=2, attn_tp=1, attention_dp=False),
    # MLA under attention DP: attention-TP rank 0 of every CP rank is a writer.
    "mla-cp2-attention-dp": dict(mla=True, cp=2, attn_tp=1, attention_dp=True),
    # MHA, TP 4 = CP 2 x attention TP 2: every rank writes, CP peers share a head shard.
    "mha-cp2-tp2": dict(mla=False, cp=2, attn_tp=2, attention_dp=False),
}


def ranks_of(store, mla, cp, attn_tp, attention_dp, seed=1):
    """Every rank of the group: its backend, its host pool (bytes of its head shard), and
    its head shard."""
    out = []
    for cp_rank in range(cp):
        for shard in range(attn_tp):
            tp_rank, tp_size = (shard, attn_tp) if attention_dp else (
                cp_rank * attn_tp + shard, cp * attn_tp)
            pool = FlatHostPool(16, 64, mla=mla, seed=seed + (0 if mla else 10 * shard))
            extra = {"attention_dp": True} if attention_dp else {}
            b = backend(store, pool, cp_rank=cp_rank, cp_size=cp, mla=mla,
                        tp_rank=tp_rank, tp_size=tp_size, **extra)
            out.append((b, pool, shard))
    return out


@pytest.mark.parametrize("topology", list(TOPOLOGIES), ids=list(TOPOLOGIES))
def test_cp_ranks_write_each_record_once_and_another_cp_degree_reads_it(tmp_path, topology):
    t = TOPOLOGIES[topology]
    store = tmp_path / "store"
    # Attention-CP ranks' host pools hold the same pages (the KV they attend).
    ranks = ranks_of(store, **t)
    for b, _, _ in ranks:
        assert type(b).__name__ == "CpHiCacheStorage"
        # As SGLang's backup thread: only its storage writers call batch_set_v1.
        if b.is_writer():
            assert all(b.batch_set_v1(KEYS, indices(range(8))))
    writers = [b for b, _, _ in ranks if b.is_writer()]
    if t["mla"] and not t["attention_dp"]:
        assert len(writers) == 1
    written = [b.get_stats()["records_written"] for b in writers]
    shards = 1 if t["mla"] else t["attn_tp"]
    assert sum(written) == len(KEYS) * shards and all(w > 0 for w in written), written
    assert all(b.get_stats()["already_present"] == 0 for b in writers)
    # Every rank reads every page of its shard, those written by its CP peers included.
    for b, pool, _ in ranks:
        assert b.batch_exists(KEYS) == len(KEYS)
    # A fresh group at CP 1 (another degree), host pools empty, reads every page.
    for one, fresh, shard in ranks_of(store, t["mla"], 1, t["attn_tp"], False, seed=99):
        src = next(pool for b, pool, s in ranks if s == shard)
        assert one.batch_exists(KEYS) == len(KEYS)
        dst = list(range(8, 16))
        assert one.batch_get_v1(KEYS, indices(dst)) == [True] * len(KEYS)
        for i, d in zip(range(8), dst):
            assert torch.equal(fresh.page(d).view(torch.int16), src.page(i).view(torch.int16))
        # The legacy per-page interface reads the same bytes.
        flat = torch.zeros_like(src.page(0)).flatten()
        assert one.get(KEYS[3], flat) is flat
        assert torch.equal(flat.view(torch.int16), src.page(3).flatten().view(torch.int16))
        assert one.exists(KEYS[0]) and not one.exists("f" * 64)


def test_decode_context_parallel_is_refused(tmp_path):
    cfg = config(tmp_path / "s", tp_rank=1, tp_size=2)
    cfg.dcp_size, cfg.dcp_rank = 2, 1
    with pytest.raises(ValueError, match="decode-context-parallel"):
        backend_factory.StorageBackendFactory.create_backend("dynamic", cfg, FlatHostPool(4, 32))


def test_a_missing_or_damaged_record_ends_the_run_and_is_counted(tmp_path):
    store = tmp_path / "store"
    pool = FlatHostPool(16, 32)
    b = backend(store, pool)
    assert all(b.batch_set_v1(KEYS, indices(range(8))))
    # A flipped payload byte in page 5's record: refused, removed, and the run stops there.
    path = b.store.path_of(KEYS[5])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x5A
    path.write_bytes(bytes(data))
    fresh = FlatHostPool(16, 32, seed=3)
    reader = backend(store, fresh)
    got = reader.batch_get_v1(KEYS, indices(range(8, 16)))
    assert got == [True] * 5 + [False] * 3
    assert reader.get_stats()["refused_checksum"] == 1
    assert reader.batch_exists(KEYS) == 5  # the refused record is gone
    for i in range(5):
        assert torch.equal(fresh.page(8 + i).view(torch.int16), pool.page(i).view(torch.int16))


def test_bad_configurations_are_refused_clearly(tmp_path):
    pool = FlatHostPool(4, 32)
    cfg = config(tmp_path / "s")
    del cfg.extra_config["path"]
    with pytest.raises(ValueError, match="extra_config\\['path'\\]"):
        backend_factory.StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b = backend(tmp_path / "s", pool)
    with pytest.raises(ValueError, match="host indices"):
        b.batch_set_v1(KEYS[:2], indices([0]))
    # Pages of another format under the same path: a store of their own beside it.
    other = backend(tmp_path / "s", FlatHostPool(4, 64))
    assert other.store_path != b.store_path
    assert all(other.batch_set_v1(KEYS[:2], indices([0, 1])))
    assert b.batch_exists(KEYS[:2]) == 0


def test_indexer_pages_are_committed_in_the_record_of_their_kv_page(tmp_path):
    """As SGLang's controller calls a backend for DSA: the indexer pool through v2 just
    before the kv pages through v1 (backup), and kv then indexer (load)."""
    PoolTransfer = hicache_storage.PoolTransfer
    INDEXER = hicache_storage.PoolName.INDEXER

    def rank(store, seed, **kw):
        kv, idx = FlatHostPool(16, 64, seed=seed), FlatHostPool(16, 8, seed=seed + 100)
        b = backend_factory.StorageBackendFactory.create_backend(
            "dynamic", config(store, **kw), kv)
        b.register_mem_pool_host(kv)
        b.register_mem_host_pool_v2(idx, INDEXER)
        b.on_host_pools_registered()
        return b, kv, idx

    store = tmp_path / "store"
    writers = [rank(store, 1, cp_rank=r, cp_size=2, attention_dp=True) for r in range(2)]
    for b, kv, idx in writers:
        src = indices(range(8))
        assert b.batch_set_v2([PoolTransfer(name=INDEXER, host_indices=src, keys=KEYS)]) == {
            "indexer": [True] * 8}
        assert all(b.batch_set_v1(KEYS, src))
    assert sum(b.get_stats()["records_written"] for b, _, _ in writers) == 8
    # A kv page whose indexer page never came is not written.
    b0 = writers[0][0]
    lone = [k for k in ("a" * 64, "b" * 64, "c" * 64, "d" * 64) if b0.writes(k)][:1]
    assert lone and b0.batch_set_v1(lone, indices([9])) == [False]

    reader, kv, idx = rank(store, 7)
    hit = reader.batch_exists_v2(KEYS, [PoolTransfer(name=INDEXER, keys=KEYS)])
    assert hit.kv_hit_pages == 8 and hit.extra_pool_hit_pages["indexer"] == 8
    dst = indices(range(8, 16))
    assert reader.batch_get_v1(KEYS, dst) == [True] * 8
    got = reader.batch_get_v2([PoolTransfer(name=INDEXER, host_indices=dst, keys=KEYS)])
    assert got == {"indexer": [True] * 8}
    _, kv0, idx0 = writers[0]
    for i in range(8):
        assert torch.equal(kv.page(8 + i).view(torch.int16), kv0.page(i).view(torch.int16))
        assert torch.equal(idx.page(8 + i).view(torch.int16), idx0.page(i).view(torch.int16))
    # A kv-only store is another format: none of these records are its.
    assert backend(store, FlatHostPool(16, 64)).batch_exists(KEYS) == 0
    with pytest.raises(ValueError, match="'mamba' pool is not built"):
        reader.register_mem_host_pool_v2(FlatHostPool(4, 8), hicache_storage.PoolName.MAMBA)


def test_sglang_pages_in_mooncake_are_read_back_under_another_cp_degree(mooncake_master):
    """`"path": "mooncake://HOST:PORT"`: SGLang's factory builds the backend over Mooncake
    Store (issue 44); CP rank 0 of CP 2 writes, a fresh CP 1 backend reads byte for byte."""
    from cp_hicache.mooncake import MooncakeStore

    # The holder's segment keeps the objects; the backends contribute none.
    holder = MooncakeStore(mooncake_master.url, **mooncake_master.options)
    opts = dict(mooncake_master.options, segment_bytes=0)
    pool = FlatHostPool(16, 64, seed=1)
    w = backend(mooncake_master.url, pool, cp_rank=0, cp_size=2, tp_size=2, mooncake=opts)
    assert w.is_writer()
    assert all(w.batch_set_v1(KEYS, indices(range(8))))
    assert w.get_stats()["records_written"] == 8
    fresh = FlatHostPool(16, 64, seed=99)
    r = backend(mooncake_master.url, fresh, mooncake=opts)
    assert r.batch_exists(KEYS) == len(KEYS)
    assert r.batch_get_v1(KEYS, indices(range(8, 16))) == [True] * len(KEYS)
    for i in range(8):
        assert torch.equal(fresh.page(8 + i).view(torch.int16), pool.page(i).view(torch.int16))
    assert r.get_stats()["records_read"] == 8
    holder.close()


def test_sglang_kv_and_indexer_pages_round_trip_through_mooncake(mooncake_master):
    """`"path": "mooncake://HOST:PORT"`, DSA's two pools: SGLang's factory builds
    `CpHiCacheStorage` over Mooncake Store; the writer (CP rank 0 of CP 2) backs up the
    `indexer` pages (`batch_set_v2`) then their `kv` pages (`batch_set_v1`), one record each
    in Mooncake; a fresh CP 1 backend, another process's pools, reads `kv`
    (`batch_get_v1`) then `indexer` (`batch_get_v2`) back byte for byte."""
    from cp_hicache.mooncake import MooncakeStore

    PoolTransfer = hicache_storage.PoolTransfer
    INDEXER = hicache_storage.PoolName.INDEXER
    holder = MooncakeStore(mooncake_master.url, **mooncake_master.options)
    opts = dict(mooncake_master.options, segment_bytes=0)

    def rank(seed, **kw):
        kv, idx = FlatHostPool(16, 64, seed=seed), FlatHostPool(16, 8, seed=seed + 100)
        b = backend_factory.StorageBackendFactory.create_backend(
            "dynamic", config(mooncake_master.url, mooncake=opts, **kw), kv)
        b.register_mem_pool_host(kv)
        b.register_mem_host_pool_v2(idx, INDEXER)
        b.on_host_pools_registered()
        assert type(b).__name__ == "CpHiCacheStorage"
        return b, kv, idx

    w, kv0, idx0 = rank(1, cp_rank=0, cp_size=2, tp_size=2)
    assert w.is_writer()
    src = indices(range(8))
    assert w.batch_set_v2([PoolTransfer(name=INDEXER, host_indices=src, keys=KEYS)]) == {
        "indexer": [True] * 8}
    assert w.batch_set_v1(KEYS, src) == [True] * 8
    assert w.get_stats()["records_written"] == 8

    r, kv, idx = rank(7)
    hit = r.batch_exists_v2(KEYS, [PoolTransfer(name=INDEXER, keys=KEYS)])
    assert hit.kv_hit_pages == 8 and hit.extra_pool_hit_pages["indexer"] == 8
    dst = indices(range(8, 16))
    assert r.batch_get_v1(KEYS, dst) == [True] * 8
    assert r.batch_get_v2([PoolTransfer(name=INDEXER, host_indices=dst, keys=KEYS)]) == {
        "indexer": [True] * 8}
    for i in range(8):
        assert torch.equal(kv.page(8 + i).view(torch.int16), kv0.page(i).view(torch.int16))
        assert torch.equal(idx.page(8 + i).view(torch.int16), idx0.page(i).view(torch.int16))
    assert r.get_stats()["records_read"] == 8
    assert r.get_stats()["refused_checksum"] == 0
    holder.close()
