"""cp_hicache.vllm.CpHiCacheConnector driven by vLLM 0.34's real scheduler on the CPU.

vLLM's own ``Scheduler`` loads the connector by module path (``kv_connector_module_path=
"cp_hicache.vllm"``) through its connector factory; a worker-side connector, made by the same
factory, executes each step's metadata on CPU KV tensors, with a stand-in forward that writes
KV as a function of each token's prefix and layer (what a model's forward would write for the
same prefix), in the order vLLM's model runner calls the hooks (``ActiveKVConnector``:
``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv``, forward,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``get_kv_connector_stats``).

Needs vLLM 0.34 and its test helpers (``tests.v1.kv_connector.unit.utils``), which
``scripts/vllm-env.sh`` installs into a cached environment; ``scripts/test-vllm.sh`` runs this
file there. Elsewhere the whole file is skipped, saying so.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time

import pytest

_vllm_env = os.environ.get("CP_HICACHE_VLLM_TESTS")
if _vllm_env and _vllm_env not in sys.path:
    sys.path.insert(0, _vllm_env)  # the folder whose tests/ is vLLM's own test package

try:
    import torch
    import vllm  # noqa: F401
    from tests.v1.kv_connector.unit.utils import (
        assert_scheduler_empty,
        create_model_runner_output,
        create_request,
        create_scheduler,
        create_vllm_config,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"vLLM 0.34 and its test helpers are not importable here ({e}): "
        "scripts/test-vllm.sh builds their environment (scripts/vllm-env.sh) and runs "
        "this file in it",
        allow_module_level=True,
    )

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput

from cp_hicache.vllm import CpHiCacheConnector, CpHiCacheMetadata, block_names

BS = 16
NUM_BLOCKS = 48
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
HEADS, HEAD_SIZE = 2, 8
SLOT_BYTES = HEADS * HEAD_SIZE * 2  # one token's K (or V) in one layer, float16


def kv_cache_config(num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                list(LAYERS),
                FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                                  dtype=torch.float16),
            )
        ],
    )


def vllm_config(path, policy="recompute", **extra):
    return create_vllm_config(
        block_size=BS,
        kv_connector="CpHiCacheConnector",
        kv_connector_module_path="cp_hicache.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"path": str(path), **extra},
        kv_load_failure_policy=policy,
    )


def slot_bytes(tokens, pos: int, layer: int, kv: int) -> bytes:
    """What the stand-in forward writes for token ``pos`` of ``tokens`` in ``layer`` (K for
    ``kv`` 0, V for 1): a function of the prefix up to and including the token."""
    h = hashlib.sha256(f"{layer}/{kv}/".encode())
    h.update(bytes(memoryview(torch.tensor(tokens[:pos + 1], dtype=torch.int64).numpy())))
    return h.digest()[:SLOT_BYTES]


class Engine:
    """vLLM's real scheduler, with a worker-side connector on CPU KV tensors and a
    stand-in forward, stepped as vLLM's engine core and model runner step them."""

    def __init__(self, path, policy="recompute", num_blocks=NUM_BLOCKS, verify=False):
        self.cfg = vllm_config(path, policy)
        self.kcc = kv_cache_config(num_blocks)
        self.sched = create_scheduler(self.cfg, num_blocks=num_blocks, kv_cache_config=self.kcc)
        self.verify = verify
        self.worker = KVConnectorFactory.create_connector(
            self.cfg, KVConnectorRole.WORKER, self.kcc)
        # vLLM 0.34's per-layer view is blocks first: [blocks, K/V, block_size, heads, head].
        self.kv = {n: torch.zeros((num_blocks, 2, BS, HEADS, HEAD_SIZE), dtype=torch.float16)
                   for n in LAYERS}
        self.worker.register_kv_caches(self.kv)
        self.metas = []
        self.outputs = []
        self.forwarded = []  # (req_id, first token, tokens) per forward

    @property
    def connector(self) -> CpHiCacheConnector:
        return self.sched.connector

    def poison(self) -> None:
        """Fills every block with garbage, so a block a load did not write shows."""
        for t in self.kv.values():
            t.view(torch.uint8).fill_(0xA5)

    def block(self, block_id: int) -> bytes:
        return b"".join(bytes(t[block_id].contiguous().view(torch.uint8).numpy())
                        for t in self.kv.values())

    def expected_block(self, tokens, index: int) -> bytes:
        """The bytes the stand-in forward gives block ``index`` of ``tokens``."""
        out = []
        for li in range(len(LAYERS)):
            for kv in (0, 1):
                for j in range(BS):
                    out.append(slot_bytes(tokens, index * BS + j, li, kv))
        # [K/V, block_size, ...] per layer: K's slots then V's.
        return b"".join(out)

    def _forward(self, so) -> None:
        starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens))
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            tokens = list(req.all_token_ids)
            (block_ids,) = self.sched.kv_cache_manager.get_block_ids(rid)
            first = starts[rid]
            self.forwarded.append((rid, first, n))
            for pos in range(first, min(first + n, len(tokens))):
                b, off = block_ids[pos // BS], pos % BS
                for li, name in enumerate(LAYERS):
                    u8 = self.kv[name].view(torch.uint8)
                    for kv in (0, 1):
                        u8[b, kv, off].view(-1)[:] = torch.frombuffer(
                            bytearray(slot_bytes(tokens, pos, li, kv)), dtype=torch.uint8)

    def _verify(self, so) -> None:
        """Every whole block a scheduled request has computed (loaded, or written by a
        forward) holds the KV the forward gives its tokens."""
        for rid in so.num_scheduled_tokens:
            req = self.sched.requests[rid]
            tokens = list(req.all_token_ids)
            (block_ids,) = self.sched.kv_cache_manager.get_block_ids(rid)
            for i in range(min(req.num_computed_tokens, len(tokens)) // BS):
                assert self.block(block_ids[i]) == self.expected_block(tokens, i), (
                    f"{rid} block {i} (block id {block_ids[i]}) holds other KV")

    def step(self, on_loaded=None):
        """One engine step; returns the scheduler output."""
        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        assert isinstance(meta, CpHiCacheMetadata)
        self.metas.append(meta)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        if on_loaded is not None:
            on_loaded(so, meta)
        self._forward(so)
        if self.verify:
            self._verify(so)
        w.wait_for_save()
        sending, recving = w.get_finished(so.finished_req_ids)
        out = KVConnectorOutput(
            finished_sending=sending, finished_recving=recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats())
        w.clear_connector_metadata()
        self.outputs.append(out)
        reqs = [self.sched.requests[r] for r in so.num_scheduled_tokens]
        mro = create_model_runner_output(reqs)
        mro.kv_connector_output = out
        self.sched.update_from_output(so, mro)
        return so

    def run(self, timeout_s=60.0, on_loaded=None):
        """Steps until every request finished and every block is free (vLLM's engine core
        keeps stepping while requests wait for their saves: so does this, pausing briefly
        on steps that scheduled nothing)."""
        deadline = time.monotonic() + timeout_s
        while self.sched.requests:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still there after {timeout_s} s: "
                                     f"{list(self.sched.requests)}")
            so = self.step(on_loaded)
            if not so.num_scheduled_tokens:
                time.sleep(0.01)
        # One more (empty) step: the scheduler hands the last finished ids to the worker.
        self.step()

    def stats(self):
        total = {}
        for o in self.outputs:
            if o.kv_connector_stats is not None:
                for k, v in o.kv_connector_stats.data.items():
                    total[k] = total.get(k, 0) + v
        return total


def assert_clean(engine: Engine) -> None:
    assert_scheduler_empty(engine.sched)
    ps = engine.connector.planner_stats()
    assert ps["tracked"] == 0 and ps["delayed"] == 0, ps


def test_vllm_loads_the_connector_by_module_path(tmp_path):
    e = Engine(tmp_path / "store")
    assert type(e.connector) is CpHiCacheConnector
    assert e.connector.role == KVConnectorRole.SCHEDULER
    assert type(e.worker) is CpHiCacheConnector and e.worker.role == KVConnectorRole.WORKER
    # Scheduler and worker open the same store (the same fingerprint).
    assert e.connector.store_path == e.worker.store_path
    assert e.connector.page_bytes == len(LAYERS) * 2 * BS * SLOT_BYTES


def test_a_miss_is_computed_and_saved_and_nothing_is_left_behind(tmp_path):
    e = Engine(tmp_path / "store")
    req = create_request(request_id=1, num_tokens=40, max_tokens=2, block_size=BS)
    e.sched.add_request(req)
    so = e.step()
    assert so.num_scheduled_tokens == {"id-1": 40}
    assert e.metas[0].loads == {}
    # The forward completes blocks 0 and 1 of the prompt: both are saved.
    names = block_names(req.all_token_ids, BS)
    assert [n for n, _ in e.metas[0].saves["id-1"]] == names[:2]
    e.run()
    assert_clean(e)
    assert e.worker.store.present_run(names[:2]) == 2
    assert e.stats().get("records_saved") == 2


@pytest.mark.parametrize("restart", [False, True], ids=["same-engine", "after-restart"])
def test_shared_prefix_is_loaded_byte_for_byte(tmp_path, restart):
    """Request 1 computes a 64-token prefix (chunked: 64 + 6 tokens) and saves its 4 blocks;
    request 2, sharing the prefix, gets 64 matched tokens from the connector, and its blocks
    hold request 1's saved KV byte for byte, in other blocks of a poisoned cache."""
    e = Engine(tmp_path / "store")
    a = create_request(request_id=1, num_tokens=70, common_prefix_len=64, max_tokens=3,
                       block_size=BS)
    e.sched.add_request(a)
    saved = {}

    def snapshot(so, meta):
        for rid, jobs in meta.saves.items():
            for _, b in jobs:
                saved[b] = None

    e.step(snapshot)  # the first chunk: 64 tokens, blocks 0..3 complete
    (a_blocks,) = e.sched.kv_cache_manager.get_block_ids("id-1")
    a_bytes = [e.block(b) for b in a_blocks[:4]]
    assert sorted(saved) == sorted(a_blocks[:4])
    for i, got in enumerate(a_bytes):
        assert got == e.expected_block(list(a.all_token_ids), i)
    e.run()
    assert_clean(e)

    if restart:
        e = Engine(tmp_path / "store")
    else:
        assert e.sched.reset_prefix_cache()  # vLLM's own prefix cache would hit first
        e.outputs.clear()
    e.poison()
    b = create_request(request_id=2, num_tokens=80, common_prefix_len=64, max_tokens=2,
                       block_size=BS)
    e.sched.add_request(b)
    loaded = {}

    def check(so, meta):
        if meta.loads:
            (bb,) = e.sched.kv_cache_manager.get_block_ids("id-2")
            loaded.update({i: e.block(bb[i]) for i in range(4)})
            loaded["jobs"] = meta.loads["id-2"]
            loaded["ids"] = bb[:4]

    so = e.step(check)
    # 64 of the 80 tokens come from the connector: only 16 are computed.
    assert so.num_scheduled_tokens == {"id-2": 16}
    assert [n for n, _ in loaded["jobs"]] == block_names(b.all_token_ids, BS)[:4]
    assert [blk for _, blk in loaded["jobs"]] == loaded["ids"]
    for i in range(4):
        assert loaded[i] == a_bytes[i], f"block {i} differs from request 1's saved KV"
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("records_loaded") == 4 and not st.get("load_errors"), st
    # Only the new block (tokens 64..79) was saved; the loaded ones were not written again.
    assert st.get("records_saved") == 1, st


def _damage(path):
    """Flips a byte in the middle of a record file."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _io_error(path):
    """Makes the record unreadable: a directory where its file was (EISDIR on read)."""
    os.remove(path)
    os.mkdir(path)


@pytest.mark.parametrize("fault", [_damage, _io_error], ids=["corrupted", "io-error"])
def test_a_failed_load_is_reported_and_recomputed_never_served(tmp_path, fault):
    """Block 2 of a 4-block hit is refused: blocks 2 and 3 are reported by
    get_block_ids_with_load_errors, vLLM's scheduler recomputes from block 2, and every
    block ends with the KV the forward gives it (never the damaged record's bytes)."""
    e = Engine(tmp_path / "store")
    a = create_request(request_id=1, num_tokens=70, common_prefix_len=64, max_tokens=2,
                       block_size=BS)
    e.sched.add_request(a)
    e.run()
    names = block_names(a.all_token_ids, BS)
    fault(str(e.worker.store.path_of(names[2])))

    e = Engine(tmp_path / "store")
    e.poison()
    b = create_request(request_id=2, num_tokens=80, common_prefix_len=64, max_tokens=2,
                       block_size=BS)
    e.sched.add_request(b)
    seen = {}

    def after_load(so, meta):
        if meta.loads and "ids" not in seen:
            (bb,) = e.sched.kv_cache_manager.get_block_ids("id-2")
            seen["ids"] = list(bb[:4])
            seen["blocks"] = [e.block(x) for x in bb[:4]]

    so = e.step(after_load)
    assert so.num_scheduled_tokens == {"id-2": 16}  # the planner offered 4 blocks
    out = e.outputs[-1]
    assert out.invalid_block_ids == set(seen["ids"][2:])
    # Blocks 0 and 1 were loaded; 2 and 3 were not written (still poisoned).
    for i in (0, 1):
        assert seen["blocks"][i] == e.expected_block(list(b.all_token_ids), i)
    for i in (2, 3):
        assert seen["blocks"][i] == b"\xa5" * len(seen["blocks"][i])
    so = e.step()
    # vLLM recomputes from block 2: tokens 32..79.
    assert so.num_scheduled_tokens == {"id-2": 48}, so.num_scheduled_tokens
    (bb,) = e.sched.kv_cache_manager.get_block_ids("id-2")
    for i in range(5):
        assert e.block(bb[i]) == e.expected_block(list(b.all_token_ids), i)
    e.run()
    assert_clean(e)
    assert e.stats().get("load_errors") == 1


def test_abort_while_saving_leaves_nothing_behind(tmp_path):
    """An aborted request's blocks are freed only once its writes are reported done."""
    from vllm.v1.request import RequestStatus

    e = Engine(tmp_path / "store")
    a = create_request(request_id=1, num_tokens=64, max_tokens=10, block_size=BS)
    e.sched.add_request(a)
    e.step()
    e.sched.finish_requests(["id-1"], RequestStatus.FINISHED_ABORTED)
    assert e.connector.planner_stats()["delayed"] == 1  # its writes may still run
    e.run()
    assert_clean(e)
    assert e.connector.planner_stats()["finished_sending"] == 1


def test_preemption_resumes_from_the_store_and_every_block_holds_its_kv(tmp_path):
    """Two requests outgrow 9 usable blocks while decoding: vLLM preempts one, whose
    writes are waited for before its blocks are reused; resumed, it gets its blocks back
    from its local prefix cache and the store. After every step every computed block of
    every scheduled request holds the KV its tokens give (loads included)."""
    e = Engine(tmp_path / "store", num_blocks=10, verify=True)
    for rid in (1, 2):
        e.sched.add_request(create_request(request_id=rid, num_tokens=48, max_tokens=40,
                                           block_size=BS))
    e.run()
    assert_clean(e)
    assert any(m.preempted for m in e.metas), "no request was preempted"
    st = e.stats()
    # The resumed request got at least one block back from the store, verified above.
    assert st.get("records_loaded", 0) >= 1 and not st.get("load_errors"), st


def test_refuses_what_is_not_built(tmp_path):
    cfg = vllm_config(tmp_path / "store")
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="decode_context_parallel_size = 2 is not built"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    cfg = create_vllm_config(block_size=BS, kv_connector="CpHiCacheConnector",
                             kv_connector_module_path="cp_hicache.vllm", kv_role="kv_both")
    with pytest.raises(ValueError, match=r"needs kv_connector_extra_config\['path'\]"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
