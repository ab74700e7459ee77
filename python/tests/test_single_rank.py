"""One rank (cp=1, no group): warm-up, serving with verification, pools as DLPack tensors,
and clear exceptions for bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

import cp_hicache

DEP = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)


def make(**kw) -> cp_hicache.RankCache:
    args = dict(device_pages=64, host_pages=64, backend="host")
    args.update(kw)
    return cp_hicache.RankCache(DEP, **args)


def test_warm_up_reports_every_kernel_and_a_warm_second_call():
    first = cp_hicache.warm_up(DEP, backend="host")
    again = cp_hicache.warm_up(DEP, backend="host")
    assert first.deployment == "mla_ps16_cp1"
    assert first.backend == "host"
    assert first.kernels >= 5  # transfer h2d/d2h, materialise, synthesise, verify
    assert again.kernels == first.kernels
    assert again.cache_hits == again.kernels  # every kernel from the JIT cache
    assert again.milliseconds > 0


def test_a_prompt_is_computed_then_hit_on_the_device_then_loaded_back_and_verified():
    rc = make()
    prompt = np.arange(160, dtype=np.uint32)  # 10 pages
    cold = rc.serve(prompt)
    assert cold["computed_tokens"] == 160 and cold["mismatched_tokens"] == 0
    warm = rc.serve(prompt)
    assert warm["device_hit_tokens"] == 160 and warm["mismatched_tokens"] == 0
    m = rc.match_prefix(prompt)
    assert m.matched_tokens == 160 and m.device_pages.dtype == np.uint32
    assert len(m.device_pages) == 10
    assert rc.evict(1 << 30) >= 1
    assert len(rc.match_prefix(prompt).device_pages) == 0
    loaded = rc.serve(prompt)
    assert loaded["host_hit_tokens"] == 160
    assert loaded["pages_loaded"] == 10
    assert loaded["mismatched_tokens"] == 0
    assert loaded["load_path_syncs"] == 0
    rc.check_invariants()
    assert rc.digest() == rc.all_digests()[0]
    assert rc.group_kind == "local"


def test_pools_are_the_cache_memory_in_place():
    """A byte written through the DLPack view is what verification reads: corrupting a page of
    a cached prefix makes the next hit mismatch, so the tensor is the pool, not a copy."""
    torch = pytest.importorskip("torch")
    rc = make()
    prompt = list(range(64))  # 4 pages
    assert rc.serve(prompt)["mismatched_tokens"] == 0
    pool = rc.pool("mla_kv")
    assert pool.shape == (2, 64, 16 * 1152)  # [layers][local pages][page bytes]
    assert pool.__dlpack_device__() == (1, 0)
    arr = np.from_dlpack(pool)  # NumPy's view is read-only; torch's is writable
    assert arr.dtype == np.uint8 and arr.shape == pool.shape
    t = torch.from_dlpack(rc.pool("mla_kv"))
    assert tuple(t.shape) == pool.shape and t.dtype == torch.uint8
    page = int(rc.match_prefix(prompt).device_pages[1])  # CP 1: local page == page id
    t[1, page, :] ^= 0xFF  # layer 1 of the prompt's second page
    assert int(arr[1, page, 0]) == int(t[1, page, 0])  # one memory, two views
    hit = rc.serve(prompt)
    assert hit["device_hit_tokens"] == 64
    assert hit["mismatched_tokens"] == 16  # exactly the corrupted page's tokens
    assert hit["first_mismatched_token"] == 16
    assert rc.last_verdict()["by_rank"] == [16]


def test_a_pool_outlives_its_cache_object():
    import gc
    import weakref

    rc = make()
    rc.serve(range(32))
    native = weakref.ref(rc._native)
    arr = np.from_dlpack(rc.pool("mla_kv"))
    before = bytes(arr[0, 1, :8])
    del rc
    gc.collect()
    assert native() is not None  # the exported tensor holds the cache
    assert bytes(arr[0, 1, :8]) == before
    del arr
    gc.collect()
    assert native() is None  # and lets it go with the last tensor


def test_a_request_belongs_to_its_cache():
    a, b = make(), make()
    req = a.begin(range(32))
    with pytest.raises(cp_hicache.UsageError, match="another RankCache"):
        b.allocate(req)
    a.allocate(req)
    a.finish(req)
    a.synchronize()


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: cp_hicache.Deployment(model="gpt"), "unknown model"),
        (lambda: cp_hicache.Deployment(model="nsa", page_size=16), "64"),
        (lambda: cp_hicache.Deployment(model="mla", page_size=3), "power of two"),
        (lambda: cp_hicache.Deployment(model="mla", layers=0), "layers"),
        (lambda: cp_hicache.Deployment(model="mla", cp=2, page_size=16).cp and
         cp_hicache.RankCache(cp_hicache.Deployment(model="mla", cp=2, page_size=16),
                              device_pages=64, host_pages=64, backend="host"), "group"),
        (lambda: make(policy="sometimes"), "write policy"),
        (lambda: make(backend="tpu"), "tpu"),
        (lambda: make(fault="gremlins"), "unknown fault"),
        (lambda: make(rank=1), "rank 1"),
        (lambda: make().serve(np.zeros((2, 2), dtype=np.uint32)), "one-dimensional"),
        (lambda: make().serve([1.5, 2.5]), "integers"),
        (lambda: make().serve([-1]), "u32"),
        (lambda: make().pool("index_k"), "no `index_k` pool"),
        (lambda: make().evict(-1), ">= 0"),
    ],
)
def test_bad_arguments_raise_usage_errors_with_the_reason(build, message):
    with pytest.raises(cp_hicache.UsageError, match=message):
        build()


def test_too_small_a_pool_is_memory_pressure_and_the_cache_stays_usable():
    rc = make(device_pages=4)
    with pytest.raises(cp_hicache.CacheFullError, match="device_pages"):
        rc.serve(range(16 * 8))
    assert rc.serve(range(16))["mismatched_tokens"] == 0


def test_a_request_in_steps_equals_serve():
    whole, steps = make(), make()
    prompt = np.arange(100, dtype=np.uint32)
    for cached in (0, 6):  # cold, then the 6 whole pages loaded back from the host
        a = whole.serve(prompt)
        req = steps.begin(prompt)
        assert req.cached_pages == cached
        steps.allocate(req)
        assert len(req.pages) == 7  # ceil(100 / 16)
        owners, local = steps.locate(req.pages)
        assert (owners == 0).all() and (local == req.pages).all()  # CP 1
        assert steps.synthesise_and_verify(req) == 0
        b = steps.finish(req)
        assert a == b
        assert whole.digest() == steps.digest()
        whole.evict(1 << 30)
        steps.evict(1 << 30)
    assert b["host_hit_tokens"] == 96
    with pytest.raises(cp_hicache.UsageError, match="already finished"):
        steps.finish(req)


def test_an_abandoned_request_frees_its_pages():
    rc = make()
    free = rc.lane_free_counts()
    req = rc.begin(range(64))
    rc.allocate(req)
    assert rc.lane_free_counts() != free
    rc.abandon(req)
    assert rc.lane_free_counts() == free
    rc.check_invariants()


def test_token_locations_index_the_pool_by_token():
    torch = pytest.importorskip("torch")
    rc = make()
    req = rc.begin(range(40))  # 2 whole pages and 8 tokens
    rc.allocate(req)
    owners, slots = rc.token_locations(req)
    assert len(owners) == len(slots) == 40 and (owners == 0).all()
    pages = req.pages
    assert (slots[:16] == pages[0] * 16 + np.arange(16)).all()
    assert (slots[32:] == pages[2] * 16 + np.arange(8)).all()
    # The engine writes token 17's KV by slot; it lands in page 1 at offset 1.
    pool = torch.from_dlpack(rc.pool("mla_kv"))
    by_token = pool.view(pool.shape[0], pool.shape[1] * 16, 1152)
    by_token[0, int(slots[17])] = 42
    assert int(pool[0, int(pages[1]), 1152]) == 42
    rc.abandon(req)


def test_the_layout_is_a_deployment_argument_checked_by_name():
    rr = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2, layout="round-robin")
    assert rr.layout == "round-robin" and rr.interleave_size is None
    rc = cp_hicache.RankCache(rr, device_pages=64, host_pages=64, backend="host")
    assert rc.serve(range(100))["mismatched_tokens"] == 0
    with pytest.raises(cp_hicache.UsageError, match='layout="diagonal"'):
        cp_hicache.Deployment(model="mla", page_size=16, cp=1, layout="diagonal")
    with pytest.raises(cp_hicache.UsageError, match="token-interleave only"):
        cp_hicache.Deployment(model="mla", page_size=16, cp=1, interleave_size=2)
    with pytest.raises(cp_hicache.UsageError, match="interleave size 32"):
        cp_hicache.Deployment(model="mla", page_size=16, cp=1, layout="token-interleave",
                              interleave_size=32)
    ti = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2,
                               layout="token-interleave", interleave_size=4)
    assert ti.name == "mla_ps16_cp1_ti4" and ti.interleave_size == 4
    rc = cp_hicache.RankCache(ti, device_pages=64, host_pages=64, backend="host")
    assert rc.serve(range(100))["mismatched_tokens"] == 0


def test_faults_without_owners_to_lose_are_refused_under_interleaved_layouts():
    pi = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2,
                               layout="page-interleave")
    for fault in ["plain-alloc-on-load", "lane-exhaustion"]:
        with pytest.raises(cp_hicache.UsageError, match="positional|lockstep"):
            cp_hicache.RankCache(pi, device_pages=64, host_pages=64, backend="host",
                                 fault=fault)


def test_a_live_request_grows_by_chunks_and_decode_tokens_keeping_its_partial_page():
    rc = make()
    prompt = np.arange(1000, 1100, dtype=np.uint32)
    req = rc.begin(prompt, allocate=True, chunk=40)
    assert len(req.tokens) == 40 and len(req.pages) == 3 and req.computed_from == 0
    rc.synthesise(req)
    for lo, hi in ((40, 70), (70, 100)):
        partial = req.pages[lo // 16]  # tokens 32..40, then 64..70
        rc.extend(req, prompt[lo:hi])
        assert req.computed_from == lo
        assert req.pages[lo // 16] == partial  # the partial page is kept
        # Before the forward writes them, exactly the new tokens fail verification.
        assert rc.verify(req) == hi - lo
        rc.synthesise(req)
    assert rc.verify(req) == 0
    answer = np.arange(5000, 5020, dtype=np.uint32)
    for t in answer:
        rc.extend(req, [int(t)])
        rc.synthesise(req)
    assert req.pages_in_tree == 7  # whole pages written before the last extend
    assert rc.verify(req) == 0
    stats = rc.finish(req)
    assert stats["extended_tokens"] == 80 and stats["extends"] == 22
    # Only the two verifications made before the forward wrote their chunks found any.
    assert stats["mismatched_tokens"] == 60
    # The next turn hits the prompt and the whole pages of the answer.
    turn = rc.serve(np.concatenate([prompt, answer, np.arange(9000, 9010, dtype=np.uint32)]))
    assert turn["device_hit_tokens"] == 112 and turn["mismatched_tokens"] == 0
    rc.check_invariants()
    with pytest.raises(cp_hicache.UsageError, match="already finished"):
        rc.extend(req, [1])
    req = rc.begin(prompt, allocate=True)
    with pytest.raises(cp_hicache.UsageError, match="at least one token"):
        rc.extend(req, [])
    with pytest.raises(cp_hicache.UsageError, match="allocate=True"):
        rc.begin(prompt, chunk=16)
    rc.abandon(req)
