"""cp_hicache.vllm.CpHiCacheConnector driven by vLLM 0.34's real scheduler on the CPU.

vLLM's own ``Scheduler`` loads the connector by module path (``kv_connector_module_path=
"cp_hicache.vllm"``) through its connector factory; a worker-side connector, made by the same
factory, executes each step's metadata on CPU KV tensors, driven by vLLM's own model-runner
glue (``ActiveKVConnector``: ``register_kv_caches``, then per step ``handle_preemptions``,
``bind_connector_metadata``, ``start_load_kv``, the forward (``wait_for_layer_load`` before
each layer, ``save_kv_layer`` after it), ``wait_for_save``,
``get_finished``, ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``), with a
stand-in forward that writes KV as a function of each token's prefix and layer (what a
model's forward would write for the same prefix).

Needs vLLM 0.34 and its test helpers (``tests.v1.kv_connector.unit.utils``), which
``scripts/vllm-env.sh`` installs into a cached environment; ``scripts/test-vllm.sh`` runs this
file there. Elsewhere the whole file is skipped, saying so.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from types import SimpleNamespace

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
    why = (
        f"vLLM 0.34 and its test helpers are not importable here ({e}): "
        "scripts/test-vllm.sh builds their environment (scripts/vllm-env.sh) and runs "
        "this file in it"
    )
    # scripts/test-vllm.sh built that environment: a skip there would pass CI with none of
    # these tests run, so there it is a failure.
    if os.environ.get("CP_HICACHE_REQUIRE_VLLM") == "1":
        pytest.fail(f"CP_HICACHE_REQUIRE_VLLM=1 but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)

from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

from cp_hicache.vllm import (
    CpHiCacheConnector,
    CpHiCacheMetadata,
    CpHiCacheWorkerMeta,
    block_names,
    head_shard_key,
)

BS = 16
NUM_BLOCKS = 48
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]
HEADS, HEAD_SIZE = 2, 8
SLOT_BYTES = HEADS * HEAD_SIZE * 2  # one token's K (or V) in one layer, float16

#: The per-layer KV tensor shapes the worker is given, each as the tensor and the view of it
#: as ``[blocks, K/V, tokens, heads, head]`` the stand-in forward writes through:
#: ``blocks_first`` ``[B, 2, N, H, D]``; ``kv_first`` ``[2, B, N, H, D]`` (K and V apart:
#: FlashAttention-style GQA/MHA); vLLM 0.34's ``[B, H, N, C]`` view (``C`` a head's K then V)
#: with the layouts ``LBHNC`` (``bhnc``: blocks contiguous), ``LBNHC`` (``bnhc``: tokens
#: outside heads) and ``LHBNC`` (``hbnc``: heads outside blocks, a block in pieces); and
#: MLA's ``[B, N, C]`` (``mla``: one latent entry per token, here ``K|V`` of one head).
LAYOUTS = ["blocks_first", "kv_first", "bhnc", "bnhc", "hbnc", "mla"]


def make_kv(layout: str, num_blocks: int, heads: int):
    """A zeroed layer tensor of ``layout`` and its ``[B, 2, N, H, D]`` view."""
    nb, h, d = num_blocks, heads, HEAD_SIZE
    f16 = torch.float16
    if layout == "blocks_first":
        t = torch.zeros((nb, 2, BS, h, d), dtype=f16)
        return t, t
    if layout == "kv_first":
        t = torch.zeros((2, nb, BS, h, d), dtype=f16)
        return t, t.movedim(0, 1)
    if layout == "bhnc":
        t = torch.zeros((nb, h, BS, 2 * d), dtype=f16)
    elif layout == "bnhc":
        t = torch.zeros((nb, BS, h, 2 * d), dtype=f16).permute(0, 2, 1, 3)
    elif layout == "hbnc":
        t = torch.zeros((h, nb, BS, 2 * d), dtype=f16).permute(1, 0, 2, 3)
    elif layout == "mla":
        assert h == 1
        t = torch.zeros((nb, BS, 2 * d), dtype=f16)
        return t, t.view(nb, BS, 1, 2, d).permute(0, 3, 1, 2, 4)
    else:
        raise ValueError(layout)
    return t, t.view(nb, h, BS, 2, d).permute(0, 3, 2, 1, 4)


def kv_cache_config(num_blocks: int = NUM_BLOCKS, heads: int = HEADS,
                    replicated: bool = True, mla: bool = False) -> KVCacheConfig:
    """One KV cache group of ``LAYERS``: GQA/MHA blocks of ``heads`` KV heads a rank
    (``replicated``: the spec declares every TP rank holds the same heads, vLLM's
    ``max_tp_shards = 1``), or MLA's latent KV."""
    if mla:
        spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2 * HEAD_SIZE,
                                dtype=torch.float16)
    else:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=HEAD_SIZE,
                                 dtype=torch.float16,
                                 max_tp_shards=1 if replicated else None)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])


def vllm_config(path, policy="recompute", budget=64, **extra):
    """vLLM's config with the connector over a store in ``path`` (None: no store), ``extra``
    its ``kv_connector_extra_config`` keys (the host tier off unless ``host_bytes`` is
    given: the tests of the storage tier see every hit read from the store), and ``budget``
    tokens a step."""
    extra = {"host_bytes": 0, **extra}
    if path is not None:
        extra["path"] = str(path)
    return create_vllm_config(
        block_size=BS,
        max_num_batched_tokens=budget,
        kv_connector="CpHiCacheConnector",
        kv_connector_module_path="cp_hicache.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy=policy,
    )


def slot_bytes(tokens, pos: int, layer: int, kv: int, shard: int = 0,
               heads: int = HEADS) -> bytes:
    """What the stand-in forward writes for token ``pos`` of ``tokens`` in ``layer`` (K for
    ``kv`` 0, V for 1) on a rank holding KV head shard ``shard`` (``heads`` heads, the
    model's heads ``shard * heads`` on): a function of the prefix up to and including the
    token, and of each head (so a head's KV is the same whatever the head split)."""
    prefix = hashlib.sha256(
        bytes(memoryview(torch.tensor(tokens[:pos + 1], dtype=torch.int64).numpy()))).digest()
    n = HEAD_SIZE * 2
    out = []
    for head in range(shard * heads, (shard + 1) * heads):
        h = hashlib.sha256(f"{layer}/{kv}/{head}/".encode() + prefix).digest()
        out.append((h * (n // 32 + 1))[:n])
    return b"".join(out)


def rank_position(vblock: int, rank: int, slot: int, dcp: int, interleave: int) -> int:
    """The token a DCP rank's slot holds (vLLM's ``block_table.py``): slot ``s`` of the
    rank's block of virtual block ``v`` holds token ``v * BS * dcp + (s // I) * I * dcp +
    rank * I + s % I``."""
    i = interleave
    return vblock * BS * dcp + (slot // i) * i * dcp + rank * i + slot % i


#: The engines the running test made (shut down after it: ``_no_thread_left_behind``).
_ENGINES = []


class Engine:
    """vLLM's real scheduler, with ``tp`` worker-side connectors (one per TP rank; TP rank
    ``w`` is DCP rank ``w % dcp``, as vLLM groups them) on CPU KV tensors and a stand-in
    forward, stepped as vLLM's engine core and model runner step them. Under DCP the
    scheduler works in virtual blocks of ``BS * dcp`` tokens, built as vLLM's
    ``EngineCore`` builds it (``resolve_kv_cache_block_sizes``: vLLM's stock
    ``create_scheduler`` asserts there), and each rank's block of a virtual block holds its
    interleaved tokens. ``shards`` is how many KV head shards the TP ranks hold (vLLM's
    split: the model has ``heads * shards`` KV heads, TP rank ``w`` holds shard ``w // (tp /
    shards)``); 1 with ``mla`` or by default (the spec declares the KV the same on every TP
    rank). Several TP ranks run in one process here: each worker's ranks are given to it
    as vLLM's TP and DCP groups would (``tp_rank_and_size``, ``dcp_rank_and_size``)."""

    def __init__(self, path, policy="recompute", num_blocks=NUM_BLOCKS, verify=False,
                 dcp=1, interleave=1, ranks=None, monkeypatch=None, tp=None, shards=1,
                 heads=HEADS, layout="blocks_first", mla=False, tp_ranks=None,
                 layerwise=True, budget=64, extra=None, prefix_caching=True,
                 replicated=None, async_scheduling=False):
        self.layerwise = layerwise
        self.cfg = vllm_config(path, policy, budget, **(extra or {}))
        # vLLM's AsyncScheduler (``create_scheduler`` picks it): each step is planned before
        # the last one's output is seen (``step``).
        self.async_scheduling = async_scheduling
        self.cfg.scheduler_config.async_scheduling = async_scheduling
        self._unseen = None  # (scheduler output, model runner output) not yet given back
        assert dcp == 1 or not async_scheduling
        # Off: a request sharing a running request's prefix asks the connector for it.
        self.cfg.cache_config.enable_prefix_caching = prefix_caching
        tp = dcp if tp is None else tp
        if mla:
            heads, layout = 1, "mla"
        # ``replicated``: the spec declares every TP rank's KV the same (by default with one
        # shard); not with one shard: a GQA model's KV heads at TP 1, whose records are read
        # at other head splits.
        replicated = shards == 1 if replicated is None else replicated
        self.kcc = kv_cache_config(num_blocks, heads, replicated=replicated, mla=mla)
        self.dcp, self.interleave, self.tp = dcp, interleave, tp
        self.heads, self.shards, self.layout = heads, shards, layout
        # The model's KV heads, as vLLM's model config gives them.
        self.cfg.model_config.model_arch_config.total_num_kv_heads = heads * shards
        self.verify = verify
        pc = self.cfg.parallel_config
        pc.tensor_parallel_size = tp
        if dcp == 1:
            self.sched = create_scheduler(self.cfg, num_blocks=num_blocks,
                                          kv_cache_config=self.kcc)
        else:
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
            from vllm.v1.core.sched.scheduler import Scheduler
            from vllm.v1.structured_output import StructuredOutputManager

            pc.decode_context_parallel_size = dcp
            pc.cp_kv_cache_interleave_size = interleave
            self.cfg.cache_config.num_gpu_blocks = num_blocks
            block_size, hash_block_size = resolve_kv_cache_block_sizes(self.kcc, self.cfg)
            assert block_size == BS * dcp
            self.sched = Scheduler(
                vllm_config=self.cfg, kv_cache_config=self.kcc, log_stats=True,
                structured_output_manager=StructuredOutputManager(self.cfg),
                block_size=block_size, hash_block_size=hash_block_size)
        self.sblock = BS * dcp
        # Worker w believes it is DCP rank ranks[w] and TP rank tp_ranks[w] (vLLM's
        # grouping unless a test says).
        self.ranks = list(ranks or [w % dcp for w in range(tp)])
        self.tp_ranks = list(tp_ranks or range(tp))
        self.workers = []
        self.runners = []
        self.kvs = []
        self.views = []  # per worker: {layer: [blocks, K/V, tokens, heads, head] view}
        for w in range(tp):
            if monkeypatch is not None:
                import cp_hicache.vllm as cv

                monkeypatch.setattr(cv, "dcp_rank_and_size",
                                    lambda r=self.ranks[w]: (r, dcp))
                monkeypatch.setattr(cv, "tp_rank_and_size",
                                    lambda r=self.tp_ranks[w]: (r, tp))
            else:
                assert tp == 1, "more than one worker needs monkeypatch"
            worker = KVConnectorFactory.create_connector(
                self.cfg, KVConnectorRole.WORKER, self.kcc)
            made = {n: make_kv(layout, num_blocks, heads) for n in LAYERS}
            kv = {n: t for n, (t, _) in made.items()}
            # vLLM's own model-runner glue drives each worker's connector (it registers the
            # KV tensors, and calls the hooks around each forward); it takes the process's
            # connector when built, so each worker gets its own.
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            try:
                self.runners.append(ActiveKVConnector(self.cfg, kv))
            finally:
                kv_transfer_state._KV_CONNECTOR_AGENT = None
            self.workers.append(worker)
            self.kvs.append(kv)
            self.views.append({n: v for n, (_, v) in made.items()})
        self.metas = []
        self.outputs = []
        _ENGINES.append(self)
        # The workers' outputs of a step are merged as vLLM's executor merges them: a
        # request's saves are done once every worker has said so; failed blocks, stats and
        # the workers' reports to the planner are merged.
        self.aggregator = KVOutputAggregator(len(self.workers))

    @property
    def worker(self) -> CpHiCacheConnector:
        return self.workers[0]

    @property
    def kv(self):
        return self.kvs[0]

    @property
    def connector(self) -> CpHiCacheConnector:
        return self.sched.connector

    def shard(self, w: int) -> int:
        """The KV head shard TP rank ``w`` holds (vLLM's split)."""
        return w // (self.tp // self.shards)

    def poison(self) -> None:
        """Fills every block with garbage, so a block a load did not write shows."""
        for kv in self.kvs:
            for t in kv.values():
                t.view(torch.uint8).fill_(0xA5)

    def block(self, block_id: int, rank: int = 0) -> bytes:
        """Worker ``rank``'s block ``block_id``, ``[K/V, tokens, heads, head]`` per layer."""
        return b"".join(bytes(v[block_id].contiguous().view(torch.uint8).numpy())
                        for v in self.views[rank].values())

    def expected_block(self, tokens, index: int, rank: int = 0) -> bytes:
        """The bytes the stand-in forward gives worker ``rank``'s block of scheduler block
        ``index`` of ``tokens`` (at DCP 1: block ``index``), as :meth:`block` reads them."""
        out = []
        # The tokens and heads rank ``rank`` holds in vLLM's layout (whatever the worker
        # believes its ranks are).
        dr, shard = rank % self.dcp, self.shard(rank)
        for li in range(len(LAYERS)):
            for kv in (0, 1):
                for j in range(BS):
                    pos = rank_position(index, dr, j, self.dcp, self.interleave)
                    out.append(slot_bytes(tokens, pos, li, kv, shard, self.heads))
        # [K/V, block_size, ...] per layer: K's slots then V's.
        return b"".join(out)

    def expected_record(self, tokens, record: int, shard: int = 0) -> bytes:
        """The bytes of the store's record ``record`` of ``tokens`` (head shard
        ``shard``): each layer's ``[heads, tokens, K then V of a head]``."""
        out = []
        for li in range(len(LAYERS)):
            kvb = torch.tensor([[list(slot_bytes(tokens, record * BS + j, li, kv, shard,
                                                 self.heads)) for j in range(BS)]
                                for kv in (0, 1)], dtype=torch.uint8)
            kvb = kvb.view(2, BS, self.heads, HEAD_SIZE * 2)
            out.append(bytes(kvb.permute(2, 1, 0, 3).contiguous().numpy()))
        return b"".join(out)

    def _where(self, pos: int, block_ids):
        """Where token ``pos`` is: its block id, its slot, and the DCP rank holding it."""
        d, i = self.dcp, self.interleave
        vo = pos % self.sblock
        return block_ids[pos // self.sblock], (vo // (i * d)) * i + vo % i, (vo // i) % d

    def _prefix_intact(self, tokens, block_ids, upto: int, layer: int) -> bool:
        """Whether layer ``layer`` of every rank's blocks holds, for each token before
        ``upto`` (what attention reads: computed in earlier steps, or loaded), the KV the
        forward gives it."""
        name = LAYERS[layer]
        n = self.heads * HEAD_SIZE * 2
        blocks = {}
        for pos in range(upto):
            b, off, owner = self._where(pos, block_ids)
            for w in range(self.tp):
                if w % self.dcp != owner:
                    continue
                if (w, b) not in blocks:
                    blocks[(w, b)] = bytes(
                        self.views[w][name][b].contiguous().view(torch.uint8).numpy())
                raw = blocks[(w, b)]
                for kv in (0, 1):
                    at = (kv * BS + off) * n
                    if raw[at:at + n] != slot_bytes(tokens, pos, layer, kv, self.shard(w),
                                                    self.heads):
                        return False
        return True

    def _forward(self, so, layer: int) -> None:
        """Writes layer ``layer``'s KV of every scheduled token, as the model's attention
        layer ``layer`` would: a function of the token's prefix and of the KV attention
        reads, that of the tokens before the step's (loaded, or computed by earlier steps).
        Where that KV is not the forward's for those tokens (a block a load did not fill,
        computed over garbage), every token of the step gets other KV (``slot_bytes`` of
        a tainted prefix), as a model's would: a save over garbage shows on a later read."""
        starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        starts.update(zip(c.req_ids, c.num_computed_tokens))
        d, i = self.dcp, self.interleave
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            tokens = list(req.all_token_ids)
            (block_ids,) = self.sched.kv_cache_manager.get_block_ids(rid)
            first = starts[rid]
            intact = self._prefix_intact(tokens, block_ids, first, layer)
            for pos in range(first, min(first + n, len(tokens))):
                vo = pos % self.sblock
                owner = (vo // i) % d
                b, off = block_ids[pos // self.sblock], (vo // (i * d)) * i + vo % i
                for w in range(self.tp):
                    if w % d != owner:
                        continue
                    for li, name in enumerate(LAYERS):
                        if li != layer:
                            continue
                        view = self.views[w][name]
                        for kv in (0, 1):
                            data = slot_bytes(tokens, pos, li, kv, self.shard(w), self.heads)
                            if not intact:
                                bad = hashlib.sha256(b"over garbage" + data).digest()
                                data = (bad * (len(data) // 32 + 1))[:len(data)]
                            view[b, kv, off] = torch.frombuffer(
                                bytearray(data), dtype=torch.float16).view(self.heads, -1)

    def _verify(self, so) -> None:
        """Every whole block a scheduled request has computed (loaded, or written by a
        forward) holds, on every rank, the KV the forward gives its tokens."""
        for rid in so.num_scheduled_tokens:
            req = self.sched.requests[rid]
            tokens = list(req.all_token_ids)
            (block_ids,) = self.sched.kv_cache_manager.get_block_ids(rid)
            for v in range(min(req.num_computed_tokens, len(tokens)) // self.sblock):
                for r in range(self.tp):
                    assert self.block(block_ids[v], r) == self.expected_block(tokens, v, r), (
                        f"{rid} block {v} (block id {block_ids[v]}) holds other KV on rank {r}")

    def step(self, on_loaded=None, before_forward=None):
        """One engine step, every worker's connector driven by vLLM's model-runner glue
        (``ActiveKVConnector``: ``pre_forward`` runs ``handle_preemptions``, binds the
        metadata and, when the step has synchronous loads, ``start_load_kv``; the forward
        calls ``wait_for_layer_load`` before each layer and ``save_kv_layer`` after it (not
        with ``layerwise=False``: ``wait_for_save`` then copies the saved blocks); after the
        forward, ``post_forward`` runs ``wait_for_save``, ``get_finished``,
        ``get_block_ids_with_load_errors``, ``get_kv_connector_stats`` and
        ``build_connector_worker_meta``). The workers' outputs are merged by vLLM's own
        ``KVOutputAggregator``: a request's saves are done once every worker has said so.
        Under ``async_scheduling`` a step's output goes back to the scheduler only once the
        next step is planned (vLLM's engine core then overlaps the two), before that step
        runs on the workers (which have the last step's sampled tokens). Returns the
        scheduler output."""
        so = self.sched.schedule()
        self.flush()
        meta = so.kv_connector_metadata
        assert isinstance(meta, CpHiCacheMetadata)
        self.metas.append(meta)
        for r in self.runners:
            r.pre_forward(so)
        if before_forward is not None:
            before_forward(so, meta)
        if on_loaded is not None:
            for w in self.workers:
                for name in LAYERS:
                    w.wait_for_layer_load(name)
            on_loaded(so, meta)
        for li, name in enumerate(LAYERS):
            for w in self.workers:
                w.wait_for_layer_load(name)
            self._forward(so, li)
            if self.layerwise:
                for w, kv in zip(self.workers, self.kvs):
                    w.save_kv_layer(name, kv[name], None)
        if self.verify:
            self._verify(so)
        outs = []
        for r in self.runners:
            r.finish_forward()
            outs.append(SimpleNamespace(kv_connector_output=r.post_forward(so.finished_req_ids)))
        out = self.aggregator.aggregate(outs).kv_connector_output
        self.outputs.append(out)
        reqs = [self.sched.requests[r] for r in so.num_scheduled_tokens]
        mro = create_model_runner_output(reqs)
        mro.kv_connector_output = out
        if self.async_scheduling:
            self._unseen = (so, mro)
        else:
            self.sched.update_from_output(so, mro)
        return so

    def flush(self) -> None:
        """Gives the scheduler the last step's output if it has not seen it yet
        (``async_scheduling``)."""
        if self._unseen is not None:
            so, mro = self._unseen
            self._unseen = None
            self.sched.update_from_output(so, mro)

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
            if self.async_scheduling and not self.sched.requests:
                self.flush()  # a request may still wait for its last output
        # One more (empty) step: the scheduler hands the last finished ids to the worker.
        self.step()
        self.flush()

    def stats(self):
        total = {}
        for o in self.outputs:
            if o.kv_connector_stats is not None:
                for k, v in o.kv_connector_stats.data.items():
                    total[k] = total.get(k, 0) + v
        return total


@pytest.fixture(autouse=True)
def _no_thread_left_behind():
    """After each test: every worker of every engine it made shuts down (draining its loads
    and writes), and no thread of a connector is left."""
    yield
    engines, _ENGINES[:] = list(_ENGINES), []
    for e in engines:
        for w in e.workers:
            w.shutdown()
    left = [t.name for t in threading.enumerate() if t.name.startswith("cp-hicache-")]
    assert not left, f"connector threads left behind: {left}"


def assert_clean(engine: Engine) -> None:
    assert_scheduler_empty(engine.sched)
    ps = engine.connector.planner_stats()
    assert ps["tracked"] == 0 and ps["delayed"] == 0 and ps["unsettled"] == 0, ps
    for w in engine.workers:
        assert not w._held, "saves still held after every request was freed"


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
    assert [ns for ns, _ in e.metas[0].saves["id-1"]] == [[n] for n in names[:2]]
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
    assert [ns for ns, _ in loaded["jobs"]] == [[n] for n in block_names(b.all_token_ids, BS)[:4]]
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


def _on_disk(damage):
    """A fault applied to the record's file after the writing run."""
    def fault(engine, name, when):
        if when == "written":
            damage(str(engine.worker.store.path_of(name)))
    return fault


class _FailingReads:
    """The worker's store, whose reads of one record fail with the I/O error the native
    store raises for a read the file system fails (``UsageError``: ``storage: cannot
    read ...``); present_run still finds the record."""

    def __init__(self, store, name):
        self._store, self._name = store, name

    def get(self, name, parts):
        if name == self._name:
            from cp_hicache import UsageError

            raise UsageError(f"storage: cannot read records/{name}.rec: Input/output error "
                             "(os error 5)")
        return self._store.get(name, parts)

    def __getattr__(self, attr):
        return getattr(self._store, attr)


def _io_error(engine, name, when):
    if when == "reading":
        for w in engine.workers:
            w.store = _FailingReads(w.store, name)


@pytest.mark.parametrize("fault", [_on_disk(_damage), _io_error], ids=["corrupted", "io-error"])
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
    fault(e, names[2], "written")

    e = Engine(tmp_path / "store")
    fault(e, names[2], "reading")
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
    if fault is not _io_error:
        # The store removed the refused record; the recomputed block was saved again.
        out = torch.empty(e.worker.page_bytes, dtype=torch.uint8)
        assert e.worker.store.get(names[2], [(out.data_ptr(), out.numel())])
        assert bytes(out.numpy()) == e.expected_record(list(b.all_token_ids), 2)


def _stored(engine, name):
    """The bytes of record ``name`` in the engine's store, or None."""
    out = torch.empty(engine.worker.page_bytes, dtype=torch.uint8)
    if not engine.worker.store.get(name, [(out.data_ptr(), out.numel())]):
        return None
    return bytes(out.numpy())


@pytest.mark.parametrize("sharer", [False, True], ids=["alone", "prefix-cache-sharer"])
def test_kv_computed_over_a_failed_load_is_never_saved(tmp_path, sharer):
    """Block 2 of request 2's 4-block hit is refused: the step's forward computes block 4
    over blocks 2 and 3, which were not filled, so its KV is wrong (the stand-in forward's
    KV depends on the KV it reads). Nothing of that step is saved: vLLM recomputes from
    block 2, and the store (which keeps a record's first writer) ends with every block's
    right KV. With ``sharer``, request 3 shares request 2's blocks through vLLM's prefix
    cache in the same step, and computes its own blocks over them: none of its blocks of
    that step is saved either, the failed block 2 above all."""
    _save_prefix(tmp_path / "store")
    a_names = block_names(_prefix_hit().all_token_ids, BS)
    _damage(str(Engine(tmp_path / "store").worker.store.path_of(a_names[2])))
    e = Engine(tmp_path / "store")
    e.poison()
    b = _prefix_hit()
    e.sched.add_request(b)
    reqs = [b]
    if sharer:
        c = create_request(request_id=3, num_tokens=96, common_prefix_len=64, max_tokens=2,
                           block_size=BS)
        e.sched.add_request(c)
        reqs.append(c)
    so = e.step()
    assert so.num_scheduled_tokens["id-2"] == 16
    if sharer:  # request 3's 64-token prefix hit request 2's blocks in vLLM's prefix cache
        assert so.num_scheduled_tokens["id-3"] == 32, so.num_scheduled_tokens
    assert e.outputs[-1].invalid_block_ids, "the load of block 2 did not fail"
    e.run()
    assert_clean(e)
    for r in reqs:
        tokens = list(r.all_token_ids)
        names = block_names(tokens, BS)
        for k in range(len(tokens) // BS):
            got = _stored(e, names[k])
            assert got is None or got == e.expected_record(tokens, k), (
                f"{r.request_id}: block {k}'s record holds KV computed over a failed load")
        # The recompute saved every block again.
        assert e.worker.store.present_run(names) == len(tokens) // BS
    assert e.stats().get("saves_dropped"), e.stats()


def _check_all_blocks_recomputed(e, b, ids):
    """After a step whose loads all failed: every block of the hit was reported, vLLM
    recomputes them, and every block and record ends with its tokens' KV."""
    assert e.outputs[-1].invalid_block_ids == set(ids)
    so = e.step()
    # From token 0, within vLLM's token budget of 64.
    assert so.num_scheduled_tokens == {"id-2": 64}, so.num_scheduled_tokens
    assert e.sched.requests["id-2"].num_computed_tokens == 64
    e.run()
    assert_clean(e)
    tokens = list(b.all_token_ids)
    names = block_names(tokens, BS)
    for k in range(5):
        got = _stored(e, names[k])
        assert got is None or got == e.expected_record(tokens, k), k
    st = e.stats()
    assert st.get("loader_failures") == 1 and st.get("load_errors") == 4, st


def test_a_loader_failing_while_reading_fails_every_block_not_filled(tmp_path, monkeypatch):
    """An unexpected exception in the loader's read phase (a bug) after one block was read:
    every block of the step's loads is reported, not only those staged (the others' layer
    events are set all the same, so they would be served unfilled)."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store")
    e.poison()
    w = e.worker
    orig, reads = w._read_block, []

    def read_block(names, block_id):
        reads.append(block_id)
        if len(reads) == 2:
            raise RuntimeError("injected: a bug in the read phase")
        return orig(names, block_id)

    monkeypatch.setattr(w, "_read_block", read_block)
    b = _prefix_hit()
    e.sched.add_request(b)
    ids = {}

    def before_forward(so, meta):
        ids["load"] = [blk for _, blk in meta.loads["id-2"]]

    e.step(before_forward=before_forward)
    monkeypatch.setattr(w, "_read_block", orig)
    _check_all_blocks_recomputed(e, b, ids["load"])


def test_loads_that_cannot_be_started_fail_every_block_and_nothing_waits(tmp_path,
                                                                        monkeypatch):
    """The loader refuses the step's task (``submit`` raises): every block of the step's
    loads is reported, and no wait for a layer (or for the step's end) hangs."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store")
    e.poison()
    w = e.worker

    def refuse(*args, **kwargs):
        raise RuntimeError("injected: cannot schedule new futures")

    monkeypatch.setattr(w._loader, "submit", refuse)
    b = _prefix_hit()
    e.sched.add_request(b)
    ids = {}

    def before_forward(so, meta):
        ids["load"] = [blk for _, blk in meta.loads["id-2"]]

    e.step(before_forward=before_forward)
    monkeypatch.undo()
    _check_all_blocks_recomputed(e, b, ids["load"])


def test_a_rank_whose_load_succeeded_saves_nothing_computed_over_another_ranks_failure(
        tmp_path, monkeypatch):
    """TP 2 with two KV head shards: rank 0's record of block 2 is refused, rank 1's loads.
    Both ranks computed block 4 over rank 0's unfilled block 2 (the all-reduce mixes their
    heads); neither may write it."""
    kw = dict(tp=2, shards=2, monkeypatch=monkeypatch)
    a = Engine(tmp_path / "store", **kw)
    a.sched.add_request(create_request(request_id=1, num_tokens=70, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    a.run()
    b = _prefix_hit()
    names = block_names(b.all_token_ids, BS)
    _damage(str(a.worker.store.path_of(head_shard_key(names[2], 0, 2))))
    e = Engine(tmp_path / "store", **kw)
    e.poison()
    e.sched.add_request(b)
    e.run()
    assert_clean(e)
    tokens = list(b.all_token_ids)
    for shard in range(2):
        got = _stored(e, head_shard_key(names[4], shard, 2))
        assert got is None or got == e.expected_record(tokens, 4, shard=shard), shard


class _RecordingWrites:
    """The worker's store, noting the bytes of every record (or part) it is asked to
    write, in ``log`` as ``(rank, name, bytes)``: what a write carried, not only what the
    store kept (it keeps a record's first writer)."""

    def __init__(self, store, rank, log):
        self._store, self._rank, self._log = store, rank, log

    def _note(self, name, parts):
        import ctypes

        data = (b"".join(ctypes.string_at(a, n) for a, n in parts)
                if isinstance(parts, list) else bytes(parts))
        self._log.append((self._rank, name, data))

    def put(self, name, parts):
        self._note(name, parts)
        return self._store.put(name, parts)

    def put_part(self, name, index, count, parts, assemble):
        self._note(f"{name}#part{index}", parts)
        return self._store.put_part(name, index, count, parts, assemble)

    def __getattr__(self, attr):
        return getattr(self._store, attr)


@pytest.mark.parametrize("kw", [dict(tp=2, shards=2), dict(dcp=2, interleave=BS)],
                         ids=["tp2-head-shards", "dcp2-i16"])
def test_a_load_failing_on_one_rank_keeps_every_rank_from_saving_over_it(tmp_path, monkeypatch,
                                                                        kw):
    """Rank 0's record of request 2's block 2 is refused, rank 1's loads (TP 2 over two KV
    head shards, or DCP 2 where each rank holds its own records of a virtual block). Both
    ranks compute request 2's next block over rank 0's unfilled block. In the same step
    request 3, a miss that shares nothing with it, computes and saves two blocks and
    finishes. Every write any rank is asked to make carries its record's right bytes (no
    rank writes what it computed over the failed block); request 3's records are all
    written (it finished in that step: its saves were not dropped with request 2's, nor
    planned again); request 2's are written after the recompute."""
    kw = dict(kw, monkeypatch=monkeypatch, budget=128)
    a = Engine(tmp_path / "store", **kw)
    sb, shards = a.sblock, a.shards
    a.sched.add_request(create_request(request_id=1, num_tokens=70, common_prefix_len=64,
                                       max_tokens=1, block_size=sb))
    a.run()
    b = create_request(request_id=2, num_tokens=64 + sb, common_prefix_len=64, max_tokens=2,
                       block_size=sb)
    c = create_request(request_id=3, num_tokens=2 * sb, max_tokens=1, block_size=sb)
    b_names = block_names(b.all_token_ids, BS)
    _damage(str(a.worker.store.path_of(head_shard_key(b_names[2], 0, shards))))

    e = Engine(tmp_path / "store", **kw)
    e.poison()
    log = []
    for r, w in enumerate(e.workers):
        w.store = _RecordingWrites(w.store, r, log)
    e.sched.add_request(b)
    e.sched.add_request(c)
    seen = {}

    def ids(so, meta):
        seen["b"] = list(e.sched.kv_cache_manager.get_block_ids("id-2")[0])

    so = e.step(before_forward=ids)
    assert so.num_scheduled_tokens == {"id-2": sb, "id-3": 2 * sb}, so.num_scheduled_tokens
    # Only rank 0's load failed (its block 2 and every later loaded block); vLLM was told
    # by the merged output.
    assert e.outputs[-1].invalid_block_ids == set(seen["b"][2 // e.dcp:4 // e.dcp])
    assert "id-3" not in e.sched.running  # finished in that step
    c_tokens = list(c.all_token_ids)
    c_keys = [head_shard_key(n, s, shards) for n in block_names(c_tokens, BS)[:2 * sb // BS]
              for s in range(shards)]
    for _ in range(20):  # request 3 is freed only once its held saves are written
        if any("id-3" in (o.finished_sending or ()) for o in e.outputs):
            break
        assert "id-3" in e.sched.requests
        e.step()
    else:
        raise AssertionError("request 3 was never reported done")
    assert all(_stored(e, k) is not None for k in c_keys), "reported done before written"
    e.run()
    assert_clean(e)
    # What every write carried, against the canonical record of its name.
    want = {}
    for req in (b, c):
        tokens = list(req.all_token_ids)
        for k, name in enumerate(block_names(tokens, BS)[:len(tokens) // BS]):
            for s in range(shards):
                want[head_shard_key(name, s, shards)] = (tokens, k, s)
    assert log
    for rank, key, data in log:
        assert key in want, f"rank {rank} wrote an unplanned record {key}"
        tokens, k, s = want[key]
        assert data == e.expected_record(tokens, k, shard=s), (
            f"rank {rank} wrote record {k} (shard {s}) computed over the failed load")
    # Every record of request 3 (saved in the failed step) and of request 2 is there.
    for key, (tokens, k, s) in want.items():
        assert _stored(e, key) == e.expected_record(tokens, k, shard=s), key
    st = e.stats()
    assert st.get("saves_dropped") == 2 and st.get("load_errors") == 1, st
    assert e.connector.planner_stats()["saves_rejected"] == 1


def _sched_output(new=(), cached=(), tokens=None):
    """What build_connector_meta reads of vLLM's ``SchedulerOutput``: ``new`` requests
    ``(id, block ids)``, ``cached`` request ids (no new blocks), tokens a request."""
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              new_block_ids=[None] * len(cached)),
        num_scheduled_tokens=dict(tokens or {}))


def test_steps_in_flight_when_a_failure_is_reported_are_settled_by_it(tmp_path):
    """vLLM's asynchronous scheduling plans a step before it has the last one's output.
    Steps 1 and 2 are planned, then step 1's output reports request 2's block 2 failed:
    request 2's saves of both steps (step 2 computed over the same block) are rejected,
    request 3's (no failed block) kept, and request 2's saves are planned again from its
    first. A step whose report never comes (step 3: the next report names step 4) has its
    saves rejected: nothing is known of its loads."""
    p = CpHiCacheConnector(vllm_config(tmp_path / "store"), KVConnectorRole.SCHEDULER,
                           kv_cache_config())
    b = create_request(request_id=2, num_tokens=160, block_size=BS)
    c = create_request(request_id=3, num_tokens=160, block_size=BS)
    for r in (b, c):
        assert p.get_num_new_matched_tokens(r, 0) == (0, False)
    m1 = p.build_connector_meta(_sched_output(
        new=[("id-2", list(range(10))), ("id-3", list(range(10, 20)))],
        tokens={"id-2": 64, "id-3": 64}))
    b.num_computed_tokens = c.num_computed_tokens = 64  # vLLM advances them after planning
    m2 = p.build_connector_meta(_sched_output(cached=["id-2", "id-3"],
                                              tokens={"id-2": 64, "id-3": 64}))
    assert (m1.step, m2.step) == (1, 2)
    assert [b for _, b in m2.saves["id-2"]] == [4, 5, 6, 7]
    p.update_connector_output(KVConnectorOutput(
        invalid_block_ids={2}, kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={1: 1})))
    p.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={2: 1})))
    b.num_computed_tokens, c.num_computed_tokens = 32, 128  # vLLM recomputes b from block 2
    m3 = p.build_connector_meta(_sched_output(cached=["id-3"], tokens={"id-3": 32}))
    assert m3.settled == {1: {"id-2"}, 2: {"id-2"}}, m3.settled
    assert p._reqs["id-2"].saved_upto == 0 and p._reqs["id-3"].saved_upto == 10
    m4 = p.build_connector_meta(_sched_output(cached=["id-2"], tokens={"id-2": 32}))
    assert [b for _, b in m4.saves["id-2"]] == [0, 1, 2, 3]  # planned again
    p.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={4: 1})))
    m5 = p.build_connector_meta(_sched_output())
    assert m5.settled == {3: {"id-3"}, 4: set()}, m5.settled
    assert p._reqs["id-3"].saved_upto == 8
    ps = p.planner_stats()
    assert ps["saves_rejected"] == 3 and ps["saves_settled"] == 3, ps

    # At TP 2 a step is settled once both workers have reported it, in one output or two
    # (the second worker's failed blocks may come with its own report).
    cfg = vllm_config(tmp_path / "store")
    cfg.parallel_config.tensor_parallel_size = 2
    p = CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    b = create_request(request_id=4, num_tokens=64, block_size=BS)
    p.get_num_new_matched_tokens(b, 0)
    p.build_connector_meta(_sched_output(new=[("id-4", list(range(4)))], tokens={"id-4": 64}))
    p.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={1: 1})))
    assert p.build_connector_meta(_sched_output()).settled == {}
    p.update_connector_output(KVConnectorOutput(
        invalid_block_ids={1}, kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={1: 1})))
    assert p.build_connector_meta(_sched_output()).settled == {1: {"id-4"}}
    merged = CpHiCacheWorkerMeta(steps={5: 1}).aggregate(CpHiCacheWorkerMeta(steps={5: 1}))
    assert merged.steps == {5: 2}


ASYNC_SCHED = [dict(), dict(load_async=True),
               dict(host_bytes=16 * len(LAYERS) * 2 * BS * SLOT_BYTES)]
ASYNC_SCHED_RUNS = [(extra, tp) for tp in (1, 2) for extra in ASYNC_SCHED]


@pytest.mark.parametrize("extra,tp", ASYNC_SCHED_RUNS,
                         ids=[f"tp{tp}-{m}" for tp in (1, 2)
                              for m in ("sync-loads", "load-async", "host")])
def test_vllm_async_scheduler_end_to_end(tmp_path, monkeypatch, extra, tp):
    """vLLM's ``AsyncScheduler`` (``async_scheduling``), each step planned before the last
    one's output is seen, with the connector over the store (synchronous loads, loads that
    span steps, and the host tier): request 1 is a miss, computed and saved; then, vLLM's
    prefix cache reset and every block poisoned, request 2 shares its prefix and gets it
    loaded (from the host tier where it is on), while request 3, a miss, is computed in
    the same steps. Every block of every scheduled request is checked after every step,
    the records hold the forward's bytes, and once all have finished nothing is left
    behind: no request tracked, no free delayed, no step unsettled, no save held. At TP 2
    over two head shards every worker does it with its own heads (and its own pool)."""
    e = Engine(tmp_path / "store", verify=True, async_scheduling=True, extra=extra, tp=tp,
               shards=tp, monkeypatch=monkeypatch)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    assert type(e.sched) is AsyncScheduler
    a = create_request(request_id=1, num_tokens=72, common_prefix_len=64, max_tokens=3,
                       block_size=BS)
    e.sched.add_request(a)
    e.step()
    e.step()
    # Step 2 was planned before step 1's output was seen: it carries no verdict on step 1's
    # saves (under vLLM's synchronous scheduling it would).
    assert e.metas[0].saves and e.metas[1].settled == {}, e.metas[1]
    e.run()
    assert_clean(e)
    def stored_right(req, k):
        name = block_names(req.all_token_ids, BS)[k]
        return all(_stored(e, head_shard_key(name, s, tp)) == e.expected_record(
            list(req.all_token_ids), k, s) for s in range(tp))

    assert all(stored_right(a, k) for k in range(4))
    assert e.stats().get("records_saved") == 4 * tp and not e.stats().get("save_errors")
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    b = create_request(request_id=2, num_tokens=80, common_prefix_len=64, max_tokens=3,
                       block_size=BS)
    c = create_request(request_id=3, num_tokens=40, max_tokens=3, block_size=BS)
    e.sched.add_request(b)
    e.sched.add_request(c)
    e.run()
    assert_clean(e)
    st = e.stats()
    host = bool(extra.get("host_bytes"))
    assert st.get("host_hits", 0) == (4 * tp if host else 0), st
    assert st.get("records_loaded", 0) == (0 if host else 4 * tp), st
    assert not st.get("load_errors") and not st.get("save_errors"), st
    assert not st.get("saves_dropped"), st
    if extra.get("load_async"):
        assert [o.finished_recving for o in e.outputs if o.finished_recving] == [{"id-2"}]
    # Request 2's fifth block and request 3's two were computed here and saved.
    for req, k in ((b, 4), (c, 0), (c, 1)):
        assert stored_right(req, k), (req.request_id, k)
    if host:
        assert_host_consistent(e)


@pytest.mark.parametrize("extra", ASYNC_SCHED[:2], ids=["sync-loads", "load-async"])
def test_vllm_async_scheduler_recomputes_a_failed_load(tmp_path, extra):
    """Under vLLM's ``AsyncScheduler`` request 2's block 2 record is damaged: its load
    fails, is reported after the next step was planned, and is recomputed; every block is
    checked after every step (but the synchronous load's own step, whose forward ran over
    the failed block), every record ends with the forward's bytes, and nothing is left
    behind."""
    _save_prefix(tmp_path / "store")
    b = _prefix_hit()
    names = block_names(b.all_token_ids, BS)
    e = Engine(tmp_path / "store", verify=True, async_scheduling=True, extra=extra)
    _damage(str(e.worker.store.path_of(names[2])))
    e.poison()
    e.sched.add_request(b)
    if not extra:
        e.verify = False  # the forward of the failed load's step ran over its block
        e.step()
        e.verify = True
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("load_errors") == 1 and st.get("records_loaded") == 2, st
    tokens = list(b.all_token_ids)
    for k in range(5):
        assert _stored(e, names[k]) == e.expected_record(tokens, k), k


def test_a_failed_load_reported_after_its_request_was_preempted_still_caps_it(tmp_path):
    """vLLM's asynchronous scheduling plans step 2 (preempting request 2, whose block ids
    are then gone) before step 1's output reports request 2's loaded block 2 failed. The
    planner still maps the failure back to the request (through step 1's loads): block 2
    is not offered to it again, and its saves restart there (before, the resumed request
    was offered the failed block again, and its saves restarted only at block 4: records
    2 and 3 were never saved again by it)."""
    _save_prefix(tmp_path / "store")
    p = CpHiCacheConnector(vllm_config(tmp_path / "store"), KVConnectorRole.SCHEDULER,
                           kv_cache_config())
    b = _prefix_hit()
    ids = list(range(10, 15))
    assert p.get_num_new_matched_tokens(b, 0) == (64, False)
    p.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: (ids,)), 64)
    b.num_computed_tokens = 64
    m1 = p.build_connector_meta(_sched_output(new=[("id-2", ids)], tokens={"id-2": 16}))
    assert [blk for _, blk in m1.loads["id-2"]] == ids[:4]
    assert [blk for _, blk in m1.saves["id-2"]] == [14]
    so = _sched_output()
    so.preempted_req_ids = {"id-2"}
    p.build_connector_meta(so)  # step 2, planned before step 1's output
    b.num_computed_tokens = 0
    p.update_connector_output(KVConnectorOutput(
        invalid_block_ids={12, 13}, kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={1: 1})))
    assert p._reqs["id-2"].saved_upto == 2 and p._reqs["id-2"].load_cap == 2
    assert p.get_num_new_matched_tokens(b, 0) == (32, False)  # blocks 0 and 1 only
    m3 = p.build_connector_meta(_sched_output())
    assert m3.settled == {1: {"id-2"}}, m3.settled


def test_under_the_fail_policy_a_failed_load_ends_the_request_with_an_error(tmp_path):
    """With vLLM's default ``kv_load_failure_policy="fail"`` a refused record ends its
    request with an error (its output is never served) and leaves nothing behind."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    e = Engine(tmp_path / "store")
    a = create_request(request_id=1, num_tokens=70, common_prefix_len=64, max_tokens=2,
                       block_size=BS)
    e.sched.add_request(a)
    e.run()
    _damage(str(e.worker.store.path_of(block_names(a.all_token_ids, BS)[2])))
    e = Engine(tmp_path / "store", policy="fail")
    b = create_request(request_id=2, num_tokens=80, common_prefix_len=64, max_tokens=2,
                       block_size=BS)
    e.sched.add_request(b)
    e.step()
    assert len(e.outputs[-1].invalid_block_ids) == 2
    assert b.status == RequestStatus.FINISHED_ERROR
    assert b.get_finished_reason() == FinishReason.ERROR
    e.run()
    assert_clean(e)


# (dcp, interleave, load errors): with interleave 1 every rank holds a share of each
# record's tokens, so every rank fails its read; with whole blocks only rank 0 holds it.
FAILED_LOAD_RUNS = [(2, 1, 2), (2, BS, 1), (4, 1, 4)]


@pytest.mark.parametrize("dcp,interleave,errors", FAILED_LOAD_RUNS,
                         ids=[f"dcp{d}i{i}" for d, i, _ in FAILED_LOAD_RUNS])
def test_a_failed_load_under_dcp_is_recomputed_on_every_rank(tmp_path, monkeypatch, dcp,
                                                              interleave, errors):
    """Under DCP a damaged record of virtual block 1 fails its load on the ranks that read
    it; the block is reported once, vLLM recomputes from it, and every rank's blocks end
    with the KV their tokens give (checked after every step)."""
    vblock = BS * dcp
    prefix = 2 * vblock
    # The whole prompt in one step (the stand-in runner samples a token every step).
    a = Engine(tmp_path / "store", dcp=dcp, interleave=interleave, monkeypatch=monkeypatch,
               budget=256)
    req = create_request(request_id=1, num_tokens=prefix + 6, common_prefix_len=prefix,
                         max_tokens=1, block_size=a.sblock)
    a.sched.add_request(req)
    a.run()
    names = block_names(req.all_token_ids, BS)
    _damage(str(a.worker.store.path_of(names[dcp])))  # virtual block 1's first record

    b = Engine(tmp_path / "store", dcp=dcp, interleave=interleave, verify=True,
               monkeypatch=monkeypatch)
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=prefix + 16,
                                       common_prefix_len=prefix, max_tokens=2,
                                       block_size=b.sblock))
    seen = {}

    def ids(so, meta):
        if meta.loads:
            seen["ids"] = list(b.sched.kv_cache_manager.get_block_ids("id-2")[0][:2])

    b.verify = False  # the failed block is recomputed in the next step, not this one
    so = b.step(ids)
    assert so.num_scheduled_tokens == {"id-2": 16}
    assert b.outputs[-1].invalid_block_ids == {seen["ids"][1]}
    b.verify = True
    so = b.step()
    # From virtual block 1's first token, within the step's token budget.
    want = min(prefix + 16 - vblock, b.sched.max_num_scheduled_tokens)
    assert so.num_scheduled_tokens == {"id-2": want}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    assert b.stats().get("load_errors") == errors


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
    blocks are reused at once (its saves copied them out within their step); resumed, it gets its blocks back
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


# (dcp, interleave) of the run that writes the store, then of the run that reads it after a
# restart: records are canonical, so any DCP degree and interleave reads any other's.
DCP_RUNS = [
    ((2, BS), (2, BS)),
    ((2, 1), (2, 1)),
    ((2, BS), (1, 1)),
    ((1, 1), (2, 1)),
    ((2, 1), (1, 1)),
    ((4, 1), (2, 1)),
    ((4, 1), (2, BS)),
    ((2, 1), (4, 4)),
    ((4, 1), (1, 1)),
    ((4, BS), (4, BS)),
]


@pytest.mark.parametrize("write,read", DCP_RUNS,
                         ids=[f"dcp{w[0]}i{w[1]}-to-dcp{r[0]}i{r[1]}" for w, r in DCP_RUNS])
def test_dcp_store_is_read_under_any_degree_byte_for_byte(tmp_path, monkeypatch, write, read):
    """Request 1 runs at one DCP degree and interleave size (each rank computes and saves
    only its interleaved tokens: whole records, or parts assembled into them); after a
    restart at another, request 2 shares its 128-token prefix and gets it from the
    connector, each rank loading only its tokens into the slots vLLM's block table gives
    them. Every computed block of every rank is checked after every step."""
    a = Engine(tmp_path / "store", dcp=write[0], interleave=write[1], verify=True,
               monkeypatch=monkeypatch)
    a.sched.add_request(create_request(request_id=1, num_tokens=136, common_prefix_len=128,
                                       max_tokens=2, block_size=a.sblock))
    a.run()
    assert_clean(a)
    assert a.stats().get("records_saved", 0) >= 128 // BS and not a.stats().get("save_errors")

    b = Engine(tmp_path / "store", dcp=read[0], interleave=read[1], verify=True,
               monkeypatch=monkeypatch)
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=144, common_prefix_len=128,
                                       max_tokens=2, block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 144 - 128}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == read[0] * 128 // b.sblock, st
    assert not st.get("load_errors"), st


def test_loading_into_another_ranks_slots_is_caught(tmp_path, monkeypatch):
    """The seed's bug in vLLM's form: DCP workers that load each other's interleaved
    tokens (ranks swapped) fill their blocks with KV of the wrong tokens; the check of every
    block against the KV its slots' tokens give catches it on the first load."""
    a = Engine(tmp_path / "store", dcp=2, interleave=1, monkeypatch=monkeypatch)
    a.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=1, block_size=a.sblock))
    a.run()
    b = Engine(tmp_path / "store", dcp=2, interleave=1, verify=True, ranks=[1, 0],
               monkeypatch=monkeypatch)
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=1, block_size=b.sblock))
    with pytest.raises(AssertionError, match="holds other KV on rank 0"):
        b.step()


# The KV tensor shape the store is written from, then the one it is read into after a
# restart (records hold [heads, tokens, K|V] per layer whatever the shape), at DCP 1 and at
# DCP 2 with an interleave of 1 (tokens placed through the layout's byte indices).
LAYOUT_RUNS = [("blocks_first", "kv_first"), ("kv_first", "bhnc"), ("bhnc", "bnhc"),
               ("bnhc", "hbnc"), ("hbnc", "blocks_first"), ("mla", "mla")]
IN_PLACE = {"bhnc", "hbnc", "mla"}  # a block's record in <= 8 runs a layer (K|V apart: gathered)


@pytest.mark.parametrize("dcp", [1, 2], ids=["dcp1", "dcp2i1"])
@pytest.mark.parametrize("write,read", LAYOUT_RUNS, ids=[f"{w}-to-{r}" for w, r in LAYOUT_RUNS])
def test_kv_layouts_round_trip_byte_for_byte(tmp_path, monkeypatch, write, read, dcp):
    """GQA/MHA KV (K and V of 2 heads a token) and MLA's latent KV: a shared prefix saved
    from one tensor shape and layout is loaded into another after a restart, every rank's
    every computed block checked against the KV its tokens give after every step; the
    record holds the canonical bytes."""
    mla = write == "mla"
    kw = dict(dcp=dcp, interleave=1, verify=True, monkeypatch=monkeypatch, mla=mla)
    a = Engine(tmp_path / "store", layout=write, **kw)
    assert a.worker._in_place == (write in IN_PLACE)
    req = create_request(request_id=1, num_tokens=72, common_prefix_len=64, max_tokens=2,
                         block_size=a.sblock)
    a.sched.add_request(req)
    a.run()
    assert_clean(a)
    names = block_names(req.all_token_ids, BS)
    out = torch.empty(a.worker.page_bytes, dtype=torch.uint8)
    assert a.worker.store.get(names[1], [(out.data_ptr(), out.numel())])
    assert bytes(out.numpy()) == a.expected_record(list(req.all_token_ids), 1)

    b = Engine(tmp_path / "store", layout=read, **kw)
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == dcp * 64 // b.sblock and not st.get("load_errors"), st


def test_kernel_blocks_and_kv_apart_map_to_the_canonical_record():
    """The byte map of a layer (``register_kv_caches``) for kernel blocks (2 kernel blocks
    of BS / 2 tokens a block, ``[2B, H, N/2, C]``) and for K and V apart (``[2, B, N, H,
    D]``): a block's gathered bytes are ``[heads, tokens, K then V]``, and scattering them
    into another block copies it."""
    from cp_hicache.vllm import _LayerBlocks

    nb, h, d = 6, HEADS, HEAD_SIZE
    page = h * BS * 2 * d * 2
    kernel = torch.randn((nb * 2, h, BS // 2, 2 * d), dtype=torch.float16)
    g = _LayerBlocks.of("k", kernel, nb, BS, page)
    want = kernel.view(nb, 2, h, BS // 2, 2 * d)[3].permute(1, 0, 2, 3).reshape(h, BS, -1)
    assert bytes(g.gather(3, None).numpy()) == bytes(want.contiguous().view(torch.uint8).numpy())
    assert g.runs is not None and len(g.runs) == 2 * h  # in place: a run a kernel block a head
    kv = torch.randn((2, nb, BS, h, d), dtype=torch.float16)
    g = _LayerBlocks.of("kv", kv, nb, BS, page)
    want = kv[:, 4].permute(2, 1, 0, 3).contiguous()  # [H, N, K/V, D]
    assert bytes(g.gather(4, None).numpy()) == bytes(want.view(torch.uint8).numpy())
    assert g.runs is None  # scattered: gathered, not read in place
    g.scatter(1, g.gather(4, None), None)
    assert torch.equal(kv[:, 1], kv[:, 4])
    with pytest.raises(ValueError, match="ambiguous"):
        _LayerBlocks.of("x", torch.zeros((2, 2, BS, h, d), dtype=torch.float16), 2, BS, page)


# (tp, dcp, interleave, head shards, mla): TP above DCP. GQA/MHA KV heads are split over the
# TP ranks as vLLM splits them (the model has heads x shards KV heads; where TP exceeds
# them, neighbouring ranks hold copies), a DCP group within one shard's ranks; MLA's latent
# KV is the same on every TP rank.
TP_RUNS = [
    (2, 1, 1, 2, False),   # two head shards of 2 heads
    (4, 1, 1, 2, False),   # 2 KV heads over TP 4: ranks 1 and 3 hold copies
    (4, 2, 1, 2, False),   # TP 4, DCP 2: a DCP group per KV head
    (4, 2, BS, 2, False),
    (2, 1, 1, 1, True),    # MLA at TP 2: rank 1's KV is a copy
    (4, 2, 1, 1, True),    # MLA at TP 4, DCP 2: the second DCP group's is a copy
]


@pytest.mark.parametrize("tp,dcp,interleave,shards,mla", TP_RUNS,
                         ids=[f"tp{t}dcp{d}i{i}{'mla' if m else f'h{h}'}"
                              for t, d, i, h, m in TP_RUNS])
def test_tp_above_dcp_records_per_head_shard(tmp_path, monkeypatch, tp, dcp, interleave,
                                            shards, mla):
    """Each TP rank saves and loads only its own head shard's records (keys name the
    shard; MLA's are shard-less), only the first DCP group of each shard writes, and after a
    restart every rank's blocks hold their own heads' KV (checked after every step)."""
    heads = HEADS if shards == tp else 1  # vLLM: max(1, KV heads // TP) a rank
    kw = dict(tp=tp, dcp=dcp, interleave=interleave, shards=shards, heads=heads, mla=mla,
              verify=True, monkeypatch=monkeypatch)
    a = Engine(tmp_path / "store", **kw)
    assert [w.head_shard for w in a.workers] == [a.shard(w) for w in range(tp)]
    req = create_request(request_id=1, num_tokens=72, common_prefix_len=64, max_tokens=2,
                         block_size=a.sblock)
    a.sched.add_request(req)
    a.run()
    assert_clean(a)
    names = block_names(req.all_token_ids, BS)[:4]
    store = a.worker.store
    if shards > 1:
        for h in range(shards):
            assert store.present_run([head_shard_key(n, h, shards) for n in names]) == 4
        assert store.present_run(names) == 0  # no shard-less record
        out = torch.empty(a.worker.page_bytes, dtype=torch.uint8)
        assert store.get(head_shard_key(names[2], 1, shards), [(out.data_ptr(), out.numel())])
        assert bytes(out.numpy()) == a.expected_record(list(req.all_token_ids), 2, shard=1)
    else:
        assert store.present_run(names) == 4
    # Written once per shard (records, or DCP parts of them): copies write nothing.
    direct = dcp == 1 or interleave == BS
    assert a.stats().get("records_saved") == 4 * shards, a.stats()
    assert a.stats().get("parts_saved", 0) == (0 if direct else 4 * shards * dcp), a.stats()

    b = Engine(tmp_path / "store", **kw)
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == tp * 64 // b.sblock and not st.get("load_errors"), st


def test_a_block_is_a_hit_only_with_every_head_shard(tmp_path, monkeypatch):
    """At TP 2 over two head shards, record 2's shard 1 gone: the planner offers the two
    blocks before it, not four (a partial hit would fail on one rank and be recomputed)."""
    kw = dict(tp=2, shards=2, verify=True, monkeypatch=monkeypatch)
    a = Engine(tmp_path / "store", **kw)
    req = create_request(request_id=1, num_tokens=72, common_prefix_len=64, max_tokens=1,
                         block_size=BS)
    a.sched.add_request(req)
    a.run()
    names = block_names(req.all_token_ids, BS)
    os.remove(a.worker.store.path_of(head_shard_key(names[2], 1, 2)))
    b = Engine(tmp_path / "store", **kw)
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=1, block_size=BS))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 80 - 32}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    assert not b.stats().get("load_errors")


def test_loading_another_tp_ranks_heads_is_caught(tmp_path, monkeypatch):
    """Workers that take each other's TP rank (so each other's head shard) fill their
    blocks with the other heads' KV; the check of every block catches it."""
    a = Engine(tmp_path / "store", tp=2, shards=2, monkeypatch=monkeypatch)
    a.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=1, block_size=BS))
    a.run()
    b = Engine(tmp_path / "store", tp=2, shards=2, verify=True, tp_ranks=[1, 0],
               monkeypatch=monkeypatch)
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=1, block_size=BS))
    with pytest.raises(AssertionError, match="holds other KV on rank 0"):
        b.step()


#: The KV heads of the model the re-sharding tests run (vLLM splits them over ``min(TP, 4)``
#: shards; at TP 8, neighbouring ranks hold copies).
MODEL_KV_HEADS = 4


def _split_kw(tp: int, monkeypatch, verify: bool = True):
    """The engine of a ``MODEL_KV_HEADS``-KV-head GQA model at TP ``tp``: its heads split
    over the TP ranks as vLLM splits them (at TP 1, one shard of every head, not declared
    the same on every rank: a model whose KV other TP degrees split)."""
    shards = min(tp, MODEL_KV_HEADS)
    return dict(tp=tp, shards=shards, heads=MODEL_KV_HEADS // shards, replicated=False,
                verify=verify, monkeypatch=monkeypatch)


def _write_at(path, tp, monkeypatch, num_tokens=72, prefix=64):
    """Runs one request at TP ``tp`` into the store ``path``; its token ids and the
    engine."""
    a = Engine(path, **_split_kw(tp, monkeypatch))
    req = create_request(request_id=1, num_tokens=num_tokens, common_prefix_len=prefix,
                         max_tokens=2, block_size=BS)
    a.sched.add_request(req)
    a.run()
    assert_clean(a)
    assert not a.stats().get("save_errors")
    return list(req.all_token_ids), a


# (TP degree writing the store, TP degree reading it) over a 4-KV-head model.
RESHARD_RUNS = [(2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (1, 2), (2, 8)]


@pytest.mark.parametrize("write,read", RESHARD_RUNS,
                         ids=[f"tp{w}-to-tp{r}" for w, r in RESHARD_RUNS])
def test_a_store_written_at_one_head_split_is_read_at_another(tmp_path, monkeypatch, write,
                                                              read):
    """Request 1 runs at one TP degree (records per head shard of that split); after a
    restart at another, request 2 shares its 64-token prefix and gets it from the
    connector: each rank reads the records of the writers' split that hold its heads (one
    record holding more heads than it has, or several records each holding some) and
    fills its blocks, poisoned before, with its heads' KV byte for byte (every rank's
    every block checked after every step). The reader writes none of them again."""
    tokens, _ = _write_at(tmp_path / "store", write, monkeypatch)
    b = Engine(tmp_path / "store", **_split_kw(read, monkeypatch))
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    assert set(so.kv_connector_metadata.load_splits["id-2"].values()) == {min(write, 4)}
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == read * 4 and not st.get("load_errors"), st
    # Writers write their own split: the loaded blocks are not written at the reader's.
    own = b.worker.head_shards
    names = block_names(tokens, BS)[:4]
    assert b.worker.store.present_run(
        [head_shard_key(n, s, own) for n in names for s in range(own)]) == 0
    assert st.get("records_saved") == min(read, 4), st  # block 4 only, once per shard


RESHARD_TIERS = [(read, mode) for read in (1, 4) for mode in ("async", "host", "async-host")]
RESHARD_TIERS.append((8, "async-host"))  # TP 8: copy ranks (two a shard) load and hold it


@pytest.mark.parametrize("read,mode", RESHARD_TIERS,
                         ids=[f"tp2-to-tp{r}-{m}" for r, m in RESHARD_TIERS])
def test_re_sharding_with_loads_that_span_steps_and_with_the_host_tier(tmp_path, monkeypatch,
                                                                       read, mode):
    """A store written at TP 2 over a 4-KV-head model, read at TP 1 and TP 4 with loads
    that span steps (``load_async``), with the host tier, and with both (and at TP 8, where
    two ranks hold each shard, with both): every rank reads
    the writers' records holding its heads into its poisoned blocks, byte for byte (every
    rank's every block checked after every step). With the host tier the re-sharded
    blocks go into every worker's pool (its own heads of them), and the next request of
    the prefix is a host hit on every worker, byte for byte, reading nothing from the
    store."""
    tokens, _ = _write_at(tmp_path / "store", 2, monkeypatch)
    host = "host" in mode
    extra = {"host_bytes": 16 * PAGE if host else 0, "load_async": "async" in mode}
    b = Engine(tmp_path / "store", extra=extra, **_split_kw(read, monkeypatch))
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = b.step()
    meta = b.metas[0]
    assert so.num_scheduled_tokens == ({} if extra["load_async"] else {"id-2": 16}), so
    assert set(meta.load_splits["id-2"].values()) == {2}, meta.load_splits
    assert len(meta.host_fills.get("id-2", ())) == (4 if host else 0), meta.host_fills
    _run_checked(b) if host else b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == read * 4 and not st.get("load_errors"), st
    assert st.get("records_saved") == min(read, 4), st  # block 4 only, once per shard
    if not host:
        return
    assert st.get("host_admissions") == read * 5 and not st.get("host_failures"), st
    assert b.sched.reset_prefix_cache()
    b.outputs.clear()
    b.poison()
    reads = []
    for w in b.workers:
        w.store = _RecordingReads(w.store, reads)
        w._split_stores = {s: _RecordingReads(st_, reads) for s, st_ in w._split_stores.items()}
    b.sched.add_request(create_request(request_id=3, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = b.step()
    assert b.metas[-1].load_splits == {} and len(b.metas[-1].host_loads["id-3"]) == 4
    _run_checked(b)
    assert_clean(b)
    st = b.stats()
    assert reads == [] and st.get("host_hits") == read * 4, st
    assert not st.get("records_loaded") and not st.get("load_errors"), st


def _split_dir_bytes(path) -> dict:
    """Bytes of the records (and held parts) on disk in each head split's directory of the
    store in ``path``: directory name -> bytes."""
    out = {}
    for d in sorted(os.listdir(path)):
        total = 0
        for sub in ("records", "parts"):
            for root, _, files in os.walk(os.path.join(path, d, sub)):
                total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        out[d] = total
    return out


def test_an_old_split_that_cannot_be_trimmed_leaves_the_new_one_half(tmp_path, monkeypatch):
    """After a TP change, an old head split's directory that cannot be trimmed (a store
    this process may only read: here its opens ignore the smaller budget) is not counted
    against the new split beyond half: the new split keeps half of ``capacity_bytes``,
    not a store of one record."""
    import cp_hicache.vllm as cv

    store = tmp_path / "store"
    cap = 16 * (PAGE + 64)
    extra = {"capacity_bytes": cap}
    a = Engine(store, extra=extra, **_split_kw(2, monkeypatch))
    for rid in (3, 5):
        a.sched.add_request(create_request(request_id=rid, num_tokens=72, max_tokens=2,
                                           block_size=BS))
        a.run()
    assert_clean(a)
    assert sum(_split_dir_bytes(store).values()) == cap
    real = cv._native.PageStore

    def untrimmable(path, fingerprint, page_bytes, capacity):
        if os.path.basename(path) == os.path.basename(a.worker.store_path):
            capacity = cv._NO_EVICTION
        return real(path, fingerprint, page_bytes, capacity)

    monkeypatch.setattr(cv._native, "PageStore", untrimmable)
    b = Engine(store, extra=extra, **_split_kw(4, monkeypatch))
    assert _split_dir_bytes(store)[os.path.basename(a.worker.store_path)] == cap
    assert b.connector.split_capacity == cap - cap // 2
    assert all(w.split_capacity == cap - cap // 2 for w in b.workers)


def test_capacity_bytes_is_one_budget_the_deployments_split_gets_whole(tmp_path,
                                                                       monkeypatch):
    """``capacity_bytes`` is one budget for the store. A single TP degree's head split
    gets all of it (before, each of a 4-KV-head model's 3 splits kept to a third: a TP 2
    deployment's store stopped at a third of its budget): 16 records of a budget of 16
    are all kept. After a TP change (TP 2, then TP 4) the old split's directory, holding
    the whole budget, is trimmed at open to half, its least recently used records first
    (here the older request's), and the new split gets what is left: after the TP 4
    deployment writes more than that, the directories together hold at most the budget,
    and the TP 2 records kept are still re-sharded at TP 4 byte for byte. A TP 1
    deployment then trims both other splits, each to its proportional share of half. A
    budget that holds no record of the deployment's split is refused, naming the key."""
    store = tmp_path / "store"
    rec2 = PAGE + 64  # a record at TP 2 (2 of the 4 heads) with its header
    cap = 16 * rec2
    extra = {"capacity_bytes": cap}
    a = Engine(store, extra=extra, **_split_kw(2, monkeypatch))
    assert a.connector.split_capacity == cap
    assert all(w.split_capacity == cap for w in a.workers)
    reqs = {}
    for rid in (3, 5):  # 4 blocks of 2 shards each, no prefix shared
        reqs[rid] = create_request(request_id=rid, num_tokens=72, max_tokens=2,
                                   block_size=BS)
        a.sched.add_request(reqs[rid])
        a.run()
    assert_clean(a)
    assert not a.stats().get("save_errors"), a.stats()
    sizes = _split_dir_bytes(store)
    assert list(sizes.values()) == [cap], sizes  # all 16 kept, none evicted
    assert a.worker.store.stats()["evictions"] == 0
    old_dir = os.path.basename(a.worker.store_path)
    # Request 3's records are the least recently used.
    long_ago = time.time() - 3600
    names = {rid: block_names(list(r.all_token_ids), BS)[:4] for rid, r in reqs.items()}
    for n in names[3]:
        for s in range(2):
            os.utime(a.worker.store.path_of(head_shard_key(n, s, 2)), (long_ago, long_ago))
    b = Engine(store, extra=extra, **_split_kw(4, monkeypatch))
    sizes = _split_dir_bytes(store)
    # Trimmed to half: request 5's 8 records (the TP 4 directory is there, empty).
    assert sizes[old_dir] == cap // 2 and sum(sizes.values()) == cap // 2, sizes
    assert b.connector.split_capacity == cap - cap // 2
    assert all(w.split_capacity == cap - cap // 2 for w in b.workers)
    old = b.worker._split_stores[2]
    assert old.present_run([head_shard_key(n, s, 2) for n in names[3][:1]
                            for s in range(2)]) == 0
    # Re-sharding reads what is left, byte for byte (the blocks are checked every step).
    b.poison()
    b.sched.add_request(create_request(request_id=5, num_tokens=80, max_tokens=2,
                                       block_size=BS))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-5": 16}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == 4 * 4 and not st.get("load_errors"), st
    # TP 4 writes more than its share (8 blocks of 4 shards, 32 records): its own
    # directory evicts, and the store keeps to the budget.
    b.sched.add_request(create_request(request_id=7, num_tokens=136, max_tokens=2,
                                       block_size=BS))
    b.run()
    assert_clean(b)
    assert not b.stats().get("save_errors")
    sizes = _split_dir_bytes(store)
    assert len(sizes) == 2 and sizes[old_dir] <= cap // 2, sizes
    assert sum(sizes.values()) <= cap, sizes
    assert sum(w.store.stats()["evictions"] for w in b.workers) > 0
    # A TP 1 deployment next: the two other splits hold more than half, so each is
    # trimmed to its proportional share of half (whole records: at most that).
    before = _split_dir_bytes(store)
    c = Engine(store, extra=extra, **_split_kw(1, monkeypatch))
    after = _split_dir_bytes(store)
    for d, n in before.items():
        assert after[d] <= n * (cap // 2) // sum(before.values()), (before, after)
    assert c.connector.split_capacity == cap - sum(after.values()) >= cap - cap // 2
    with pytest.raises(ValueError, match=r"capacity_bytes'\] = 1000 holds no record"):
        Engine(store, extra={"capacity_bytes": 1000}, **_split_kw(2, monkeypatch))


# ((TP, DCP, interleave) writing, (TP, DCP, interleave) reading) over a 4-KV-head model: a DCP
# group within one head shard's ranks (TP 8: 4 shards of 2 ranks each).
RESHARD_DCP_RUNS = [((2, 1, 1), (8, 2, 1)), ((8, 2, BS), (2, 1, 1)), ((8, 2, 1), (1, 1, 1))]


@pytest.mark.parametrize("write,read", RESHARD_DCP_RUNS,
                         ids=[f"tp{w[0]}dcp{w[1]}i{w[2]}-to-tp{r[0]}dcp{r[1]}i{r[2]}"
                              for w, r in RESHARD_DCP_RUNS])
def test_head_splits_are_re_sharded_under_dcp(tmp_path, monkeypatch, write, read):
    """Re-sharding under DCP: each rank reads the writers' records holding its heads and
    takes its interleaved tokens out of them (or, writing, saves its tokens of its own
    shard as parts); every rank's every block is checked after every step."""
    def kw(tp, dcp, interleave):
        return dict(_split_kw(tp, monkeypatch), dcp=dcp, interleave=interleave)

    a = Engine(tmp_path / "store", **kw(*write))
    a.sched.add_request(create_request(request_id=1, num_tokens=136, common_prefix_len=128,
                                       max_tokens=2, block_size=a.sblock))
    a.run()
    assert_clean(a)
    assert not a.stats().get("save_errors")
    b = Engine(tmp_path / "store", **kw(*read))
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=144, common_prefix_len=128,
                                       max_tokens=2, block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    assert set(so.kv_connector_metadata.load_splits["id-2"].values()) == {min(write[0], 4)}
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == read[0] * 128 // b.sblock, st
    assert not st.get("load_errors"), st


def test_a_store_written_at_several_head_splits_is_read_block_by_block(tmp_path,
                                                                        monkeypatch):
    """Blocks 0 and 1 of a prefix are written at TP 2; a TP 4 run reads them (re-sharded)
    and writes blocks 2 and 3 at its own split; a TP 1 run then gets all four, each from
    the split holding it, byte for byte into poisoned blocks."""
    _write_at(tmp_path / "store", 2, monkeypatch, num_tokens=40, prefix=32)
    b = Engine(tmp_path / "store", **_split_kw(4, monkeypatch))
    b.sched.add_request(create_request(request_id=3, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-3": 72 - 32}, so.num_scheduled_tokens
    (bb,) = b.sched.kv_cache_manager.get_block_ids("id-3")
    assert so.kv_connector_metadata.load_splits == {"id-3": {bb[0]: 2, bb[1]: 2}}
    b.run()
    assert_clean(b)
    assert b.stats().get("records_saved") == 2 * 4, b.stats()  # blocks 2 and 3, 4 shards

    c = Engine(tmp_path / "store", **_split_kw(1, monkeypatch))
    c.poison()
    c.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = c.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    (cb,) = c.sched.kv_cache_manager.get_block_ids("id-2")
    assert so.kv_connector_metadata.load_splits == {
        "id-2": {cb[0]: 2, cb[1]: 2, cb[2]: 4, cb[3]: 4}}
    c.run()
    assert_clean(c)
    st = c.stats()
    assert st.get("records_loaded") == 4 and not st.get("load_errors"), st


def test_a_block_missing_a_record_of_the_writers_split_is_not_offered(tmp_path,
                                                                      monkeypatch):
    """Written at TP 4 (4 shards), read at TP 2: rank 1's heads of record 2 are in two
    writer records; one of them gone, the planner offers the two blocks before it (rank 1
    could not assemble its heads), and nothing fails to load."""
    tokens, a = _write_at(tmp_path / "store", 4, monkeypatch)
    names = block_names(tokens, BS)
    os.remove(a.worker.store.path_of(head_shard_key(names[2], 3, 4)))
    b = Engine(tmp_path / "store", **_split_kw(2, monkeypatch))
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 80 - 32}, so.num_scheduled_tokens
    b.run()
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == 2 * 2 and not st.get("load_errors"), st


def test_a_record_of_the_writers_split_that_fails_to_load_is_recomputed_never_served(
        tmp_path, monkeypatch):
    """Written at TP 4, read at TP 2: writer shard 3's record of block 2 (heads 3 of rank
    1's 2 and 3) is damaged. The planner offers 4 blocks; rank 1's load of block 2 is
    refused by the store's checksum, blocks 2 and 3 are reported and recomputed on every
    rank, and every block of every rank ends with its heads' KV, never the damaged bytes."""
    tokens, a = _write_at(tmp_path / "store", 4, monkeypatch)
    names = block_names(tokens, BS)
    _damage(str(a.worker.store.path_of(head_shard_key(names[2], 3, 4))))
    b = Engine(tmp_path / "store", **_split_kw(2, monkeypatch, verify=False))
    b.poison()
    req = create_request(request_id=2, num_tokens=80, common_prefix_len=64, max_tokens=2,
                         block_size=BS)
    b.sched.add_request(req)
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    (bb,) = b.sched.kv_cache_manager.get_block_ids("id-2")
    assert b.outputs[-1].invalid_block_ids == set(bb[2:4])
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 48}, so.num_scheduled_tokens
    for i in range(5):
        for r in range(2):
            assert b.block(bb[i], r) == b.expected_block(list(req.all_token_ids), i, r), (i, r)
    b.run()
    assert_clean(b)
    assert b.stats().get("load_errors") == 1


def test_refuses_head_splits_vllm_does_not_make(tmp_path):
    # A DCP group of 2 over TP 4 with 4 KV heads (one a rank): the group would span shards.
    cfg = vllm_config(tmp_path / "store")
    cfg.parallel_config.tensor_parallel_size = 4
    cfg.parallel_config.decode_context_parallel_size = 2
    cfg.model_config.model_arch_config.total_num_kv_heads = 4
    with pytest.raises(ValueError, match="would span two shards"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER,
                           kv_cache_config(heads=1, replicated=False))
    # A spec of 2 heads a rank at TP 2 for a model of 12 KV heads (vLLM would give 6).
    cfg = vllm_config(tmp_path / "store")
    cfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="the head split is not vLLM's"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER,
                           kv_cache_config(heads=2, replicated=False))


def test_refuses_what_is_not_built(tmp_path):
    cfg = vllm_config(tmp_path / "store")
    cfg.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ValueError, match="tensor_parallel_size = 1 is not a multiple of "
                                         "decode_context_parallel_size = 2"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    cfg = vllm_config(tmp_path / "store")
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="pipeline_parallel_size = 2 is not built"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())
    # Neither a store nor a host tier.
    cfg = create_vllm_config(block_size=BS, kv_connector="CpHiCacheConnector",
                             kv_connector_module_path="cp_hicache.vllm", kv_role="kv_both",
                             kv_connector_extra_config={"host_bytes": 0})
    with pytest.raises(ValueError, match=r"needs kv_connector_extra_config\['path'\].*"
                                         r"\['host_bytes'\] > 0\): it has neither"):
        CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_unknown_config_keys_are_refused_naming_the_key_and_the_known_ones(tmp_path):
    """A misspelled ``path`` with the default host tier used to give a host-only deployment
    quietly (nothing outlived the process); every key the connector does not know is
    refused, by the scheduler and by every worker alike (vLLM builds both from the same
    config), naming the key and the known keys."""
    for extra in ({"pth": str(tmp_path / "store")},
                  {"path": str(tmp_path / "store"), "capacity": 1 << 30, "load_asycn": True}):
        cfg = create_vllm_config(block_size=BS, kv_connector="CpHiCacheConnector",
                                 kv_connector_module_path="cp_hicache.vllm",
                                 kv_role="kv_both", kv_connector_extra_config=extra)
        bad = sorted(set(extra) - {"path"})
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError) as err:
                CpHiCacheConnector(cfg, role, kv_cache_config())
            msg = str(err.value)
            assert all(repr(k) in msg for k in bad), msg
            assert "known keys are path, host_bytes, capacity_bytes, load_buffer_bytes, " \
                   "save_buffer_bytes, load_async, write_policy" in msg, msg
    assert not (tmp_path / "store").exists()  # refused before anything was made


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local", "full_with_window"])
def test_refuses_windowed_attention(tmp_path, kind):
    """vLLM gives the blocks out of a sliding window (or an attention chunk) the null block
    id 0: a load would fill it and a save copy it under a real record's name."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    common = dict(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                  dtype=torch.float16)
    if kind == "sliding_window":
        spec = SlidingWindowSpec(sliding_window=64, **common)
    elif kind == "chunked_local":
        spec = ChunkedLocalAttentionSpec(attention_chunk_size=64, **common)
    else:
        spec = FullAttentionSpec(sliding_window=64, max_tp_shards=1, **common)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    with pytest.raises(ValueError, match="is windowed"):
        CpHiCacheConnector(vllm_config(tmp_path / "store"), KVConnectorRole.SCHEDULER, kcc)


def test_is_a_best_effort_cache_and_ignores_stray_reports(tmp_path):
    """A dropped save is a later miss (``requires_kv_delivery`` False); a report of saves
    done for a request whose freeing was not delayed is logged, not raised (it would end
    the engine); registering the KV tensors again stops the old threads."""
    e = Engine(tmp_path / "store")
    assert e.connector.requires_kv_delivery is False
    e.connector.update_connector_output(KVConnectorOutput(finished_sending={"nobody"}))
    old = (e.worker._loader, e.worker._writer)
    e.worker.register_kv_caches(e.kv)
    assert all(ex._shutdown for ex in old)
    assert (e.worker._loader, e.worker._writer) != old


# ------------------------------------------------------------------------------------------
# Layer-wise loads and asynchronous saves
# ------------------------------------------------------------------------------------------


def _save_prefix(path) -> None:
    """Fills a store with request 1's four 16-token blocks (a 64-token prefix)."""
    e = Engine(path)
    e.sched.add_request(create_request(request_id=1, num_tokens=70, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    e.run()
    assert_clean(e)


def _prefix_hit():
    """Request 2: 80 tokens sharing request 1's prefix (64 of them hit the store)."""
    return create_request(request_id=2, num_tokens=80, common_prefix_len=64, max_tokens=2,
                          block_size=BS)


def _layer(block: bytes, li: int) -> bytes:
    """Layer ``li``'s bytes of a block as ``Engine.block`` gives it."""
    n = len(block) // len(LAYERS)
    return block[li * n:(li + 1) * n]


class _RecordingReads:
    """The worker's store, noting each record read in ``events``."""

    def __init__(self, store, events):
        self._store, self._events = store, events

    def get(self, name, parts):
        self._events.append(("read", name))
        return self._store.get(name, parts)

    def __getattr__(self, attr):
        return getattr(self._store, attr)


def test_wait_for_layer_load_waits_for_its_layer_and_records_are_checked_first(tmp_path):
    """start_load_kv returns at once; the loader thread reads (and checks) every record of
    the step before it fills any block, then fills layer by layer: wait_for_layer_load(0)
    returns with layer 0 of every loaded block filled while layer 1 is not yet (its wait
    blocks until the loader fills it), and the blocks end byte for byte as saved."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store")
    e.poison()
    w = e.worker
    events = []
    w.store = _RecordingReads(w.store, events)
    gate = threading.Event()

    def hook(li):
        events.append(("layer", li))
        if li == 1:
            assert gate.wait(30)

    w._load_layer_hook = hook
    b = _prefix_hit()
    e.sched.add_request(b)
    tokens = list(b.all_token_ids)
    seen = {}

    def before_forward(so, meta):
        if not meta.loads:
            return
        (bb,) = e.sched.kv_cache_manager.get_block_ids("id-2")
        ids = bb[:4]
        w.wait_for_layer_load(LAYERS[0])
        poison = b"\xa5" * len(_layer(e.block(ids[0]), 1))
        for i, x in enumerate(ids):
            assert _layer(e.block(x), 0) == _layer(e.expected_block(tokens, i), 0)
            assert _layer(e.block(x), 1) == poison, "layer 1 filled before its turn"
        waiter = threading.Thread(target=w.wait_for_layer_load, args=(LAYERS[1],))
        waiter.start()
        waiter.join(0.3)
        seen["blocked"] = waiter.is_alive()
        assert all(_layer(e.block(x), 1) == poison for x in ids)
        gate.set()
        waiter.join(30)
        assert not waiter.is_alive()
        for i, x in enumerate(ids):
            assert e.block(x) == e.expected_block(tokens, i)
        seen["ok"] = True

    try:
        so = e.step(before_forward=before_forward)
    finally:
        gate.set()
    assert seen.get("ok") and seen["blocked"], seen
    assert so.num_scheduled_tokens == {"id-2": 16}
    first_fill = events.index(("layer", 0))
    reads = [i for i, ev in enumerate(events) if ev[0] == "read"]
    assert len(reads) == 4 and max(reads) < first_fill, events
    assert events[first_fill:] == [("layer", 0), ("layer", 1)], events
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("records_loaded") == 4 and not st.get("load_errors"), st


def test_wait_for_save_copies_no_block_the_loader_is_still_filling(tmp_path):
    """A forward that hands no layer over (nor waits for one): ``wait_for_save`` copies the
    step's blocks to save itself, among them blocks the step loads (request 3 shares
    request 2's loaded blocks through vLLM's prefix cache and saves them); it joins the
    step's load first, so no layer is copied while the loader is still filling it."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store", layerwise=False)
    e.poison()
    w = e.worker
    w._load_layer_hook = lambda li: time.sleep(0.3) if li == 1 else None
    copied = []
    orig = w._take_layer

    def take_layer(sb, li):
        task = w._load
        copied.append((sb.block_id, li, task is None or task.done.is_set()))
        return orig(sb, li)

    w._take_layer = take_layer
    e.sched.add_request(_prefix_hit())
    e.sched.add_request(create_request(request_id=3, num_tokens=96, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = e.sched.schedule()
    meta = so.kv_connector_metadata
    loaded = {blk for _, blk in meta.loads["id-2"]}
    assert loaded & {blk for _, blk in meta.saves["id-3"]}, "no loaded block is saved"
    for r in e.runners:
        r.pre_forward(so)
        r.finish_forward()
        r.post_forward(so.finished_req_ids)
    assert copied and all(done for _, _, done in copied), copied


def test_layer_wise_hooks_need_piecewise_cuda_graphs():
    """A full CUDA graph would skip wait_for_layer_load and save_kv_layer on replay: the
    connector asks vLLM for piecewise graphs."""
    assert CpHiCacheConnector.requires_piecewise_for_cudagraph({}) is True


def test_a_block_failing_after_a_layer_was_served_is_reported_whole(tmp_path):
    """Layer 0 of block 2 is filled and waited for, then filling its layer 1 fails: block
    2 is reported whole by get_block_ids_with_load_errors in the same step, vLLM recomputes
    from it, and every block ends with the KV its tokens give."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store")
    e.poison()
    w = e.worker
    layer1 = w._layers[1]
    orig, seen_blocks = layer1.fill, []

    def failing_fill(block, src, slots):
        if block not in seen_blocks:
            seen_blocks.append(block)
        if len(seen_blocks) == 3 and block == seen_blocks[2]:
            raise OSError("injected: the copy of layer 1 failed")
        return orig(block, src, slots)

    layer1.fill = failing_fill
    b = _prefix_hit()
    e.sched.add_request(b)
    tokens = list(b.all_token_ids)
    served = {}

    def before_forward(so, meta):
        if meta.loads:
            (bb,) = e.sched.kv_cache_manager.get_block_ids("id-2")
            w.wait_for_layer_load(LAYERS[0])
            served["layer0"] = _layer(e.block(bb[2]), 0)
            served["ids"] = list(bb[:4])

    so = e.step(before_forward=before_forward)
    assert so.num_scheduled_tokens == {"id-2": 16}
    # Layer 0 of block 2 was served (waited for) before the block failed ...
    assert served["layer0"] == _layer(e.expected_block(tokens, 2), 0)
    # ... and the whole block is reported in that step.
    assert e.outputs[-1].invalid_block_ids == {served["ids"][2]}
    layer1.fill = orig
    so = e.step()
    assert so.num_scheduled_tokens == {"id-2": 48}, so.num_scheduled_tokens
    (bb,) = e.sched.kv_cache_manager.get_block_ids("id-2")
    for i in range(5):
        assert e.block(bb[i]) == e.expected_block(tokens, i)
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("load_errors") == 1 and st.get("records_loaded") == 3, st


@pytest.mark.parametrize("layout,dcp", [("blocks_first", 1), ("hbnc", 1), ("kv_first", 2)],
                         ids=["in-place", "gathered", "dcp2-parts"])
def test_layerwise_saves_write_the_records_the_whole_step_path_writes(tmp_path, monkeypatch,
                                                                      layout, dcp):
    """Records saved layer by layer (save_kv_layer after each layer's forward) and records
    saved with no save_kv_layer call (wait_for_save copies every layer) are byte for byte
    the same, and the canonical record of their tokens."""
    records = {}
    for layerwise in (True, False):
        path = tmp_path / f"store-{layerwise}"
        e = Engine(path, dcp=dcp, layout=layout, layerwise=layerwise,
                   monkeypatch=monkeypatch if dcp > 1 else None)
        req = create_request(request_id=1, num_tokens=70, max_tokens=2, block_size=BS)
        e.sched.add_request(req)
        e.run()
        assert_clean(e)
        tokens = list(req.all_token_ids)
        names = block_names(tokens, BS)[:64 // BS]
        got = []
        for k, name in enumerate(names):
            out = torch.empty(e.worker.page_bytes, dtype=torch.uint8)
            assert e.worker.store.get(name, [(out.data_ptr(), out.numel())]), (layerwise, k)
            got.append(bytes(out.numpy()))
            assert got[-1] == e.expected_record(tokens, k), (layerwise, k)
        records[layerwise] = got
        assert not e.stats().get("save_errors")
    assert records[True] == records[False]


class _GatedWrites:
    """The worker's store, whose writes wait for ``gate``."""

    def __init__(self, store, gate):
        self._store, self._gate = store, gate

    def put(self, *a, **k):
        assert self._gate.wait(60)
        return self._store.put(*a, **k)

    def put_part(self, *a, **k):
        assert self._gate.wait(60)
        return self._store.put_part(*a, **k)

    def __getattr__(self, attr):
        return getattr(self._store, attr)


def test_saves_are_asynchronous_and_reported_only_once_written(tmp_path):
    """The writes wait on a gate: every step (wait_for_save included) returns meanwhile;
    the finished request's blocks stay allocated (request_finished delayed their freeing)
    and get_finished does not report it; vLLM reuses the blocks after each layer's save
    (here: garbage over every layer once save_kv_layer copied it), yet the records hold
    the forward's KV. Once the gate opens, the request is reported done and freed."""
    e = Engine(tmp_path / "store")
    w = e.worker
    gate = threading.Event()
    w.store = _GatedWrites(w.store, gate)
    orig_save = w.save_kv_layer

    def save_then_clobber(name, kv_layer, attn_metadata, **kw):
        orig_save(name, kv_layer, attn_metadata, **kw)
        kv_layer.view(torch.uint8).fill_(0x5A)  # vLLM may reuse the blocks now

    w.save_kv_layer = save_then_clobber
    req = create_request(request_id=1, num_tokens=64, max_tokens=2, block_size=BS)
    e.sched.add_request(req)
    names = block_names(req.all_token_ids, BS)[:4]
    try:
        for _ in range(6):
            t0 = time.monotonic()
            e.step()
            assert time.monotonic() - t0 < 20, "a step waited for the writes"
        assert "id-1" in e.sched.requests  # finished, its blocks kept for its writes
        ps = e.connector.planner_stats()
        assert ps["delayed"] == 1 and ps["finished_sending"] == 0, ps
        assert not any(o.finished_sending for o in e.outputs)
        assert w.store.present_run(names) == 0
    finally:
        gate.set()
    e.run()
    assert_clean(e)
    assert e.connector.planner_stats()["finished_sending"] == 1
    assert w.store.present_run(names) == 4
    tokens = list(req.all_token_ids)
    for k, name in enumerate(names):
        out = torch.empty(w.page_bytes, dtype=torch.uint8)
        assert w.store.get(name, [(out.data_ptr(), out.numel())])
        assert bytes(out.numpy()) == e.expected_record(tokens, k)


def test_a_failing_writer_is_counted_and_its_request_still_ends(tmp_path):
    """A store write that raises is a save error (a later miss); a writer task that raises
    outside it is counted too (``writer_failures``); neither is lost, and the request is
    still reported done and freed."""
    e = Engine(tmp_path / "store")
    w = e.worker

    class FailingPut:
        def __init__(self, store):
            self._store = store

        def put(self, *a, **k):
            raise OSError("injected: no space left on device")

        def __getattr__(self, attr):
            return getattr(self._store, attr)

    w.store = FailingPut(w.store)
    e.sched.add_request(create_request(request_id=1, num_tokens=40, max_tokens=2,
                                       block_size=BS))
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("save_errors") == 2 and not st.get("records_saved"), st

    e = Engine(tmp_path / "store2")

    def broken_write(rid, jobs):
        raise RuntimeError("injected: a bug in the writer")

    e.worker._write = broken_write
    e.sched.add_request(create_request(request_id=1, num_tokens=40, max_tokens=2,
                                       block_size=BS))
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("writer_failures") == 1 and st.get("save_errors") == 1, st


def test_a_step_that_never_completed_its_saves_is_counted_not_written(tmp_path):
    """A step whose ``wait_for_save`` never came (its blocks may be reused since): when the
    next step's saves begin, its half-copied blocks are dropped and counted, never held or
    written."""
    e = Engine(tmp_path / "store")
    e.sched.add_request(create_request(request_id=1, num_tokens=32, max_tokens=1,
                                       block_size=BS))
    so = e.sched.schedule()
    w = e.worker
    e.runners[0].pre_forward(so)
    w.save_kv_layer(LAYERS[0], e.kv[LAYERS[0]], None)  # layer 0 of the step's 2 blocks
    w.bind_connector_metadata(CpHiCacheMetadata(step=so.kv_connector_metadata.step + 1))
    w.wait_for_save()
    assert w.get_kv_connector_stats().data.get("saves_dropped") == 2
    assert not w._held and not w._writes


def test_shutdown_drains_the_writes_and_leaves_no_thread(tmp_path):
    """shutdown waits for the writes in flight, then stops the loader and the writer: no
    thread of the connector is left, and it may be called again."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store")
    w = e.worker
    gate = threading.Event()
    w.store = _GatedWrites(w.store, gate)
    b = _prefix_hit()
    e.sched.add_request(b)
    e.step()  # loads 4 blocks, computes and saves block 4
    e.step()
    threads = list(w._writer._threads) + list(w._loader._threads)
    assert threads and all(t.is_alive() for t in threads)
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    try:
        w.shutdown()
    finally:
        gate.set()
        opener.join()
    assert not any(t.is_alive() for t in threads)
    assert w.store.present_run(block_names(b.all_token_ids, BS)[:5]) == 5
    w.shutdown()  # idempotent
    w.wait_for_layer_load(LAYERS[0])  # nothing to wait for
    assert w.get_block_ids_with_load_errors() == set()


# ------------------------------------------------------------------------------------------
# Loads that span steps (load_kv_async)
# ------------------------------------------------------------------------------------------


def test_loads_that_span_steps_hold_the_request_until_its_blocks_are_in(tmp_path):
    """With ``load_async`` the planner answers vLLM's lookup with an asynchronous load: the
    request waits (``WAITING_FOR_REMOTE_KVS``) while the loader, held back here, reads and
    fills its blocks; steps run meanwhile without it and nothing waits for the loads. Once
    they end, the worker reports it in ``finished_recving``; vLLM schedules it with the 64
    loaded tokens computed (its first saves start at block 4), and every block holds its
    tokens' KV byte for byte (checked after every step)."""
    from vllm.v1.request import RequestStatus

    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store", verify=True, extra={"load_async": True})
    e.poison()
    gate = threading.Event()
    e.worker._load_layer_hook = lambda li: gate.wait(30)
    b = _prefix_hit()
    e.sched.add_request(b)
    try:
        for _ in range(3):
            t0 = time.monotonic()
            so = e.step()
            assert time.monotonic() - t0 < 20, "a step waited for the loads"
            assert not so.num_scheduled_tokens, so.num_scheduled_tokens
        assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert [blk for _, blk in e.metas[0].loads["id-2"]] == list(
            e.sched.kv_cache_manager.get_block_ids("id-2")[0][:4])
        assert not any(o.finished_recving for o in e.outputs)
    finally:
        gate.set()
    e.run()
    assert_clean(e)
    assert [o.finished_recving for o in e.outputs if o.finished_recving] == [{"id-2"}]
    first_saves = next(m.saves["id-2"] for m in e.metas if "id-2" in m.saves)
    assert [names for names, _ in first_saves] == [[block_names(b.all_token_ids, BS)[4]]]
    st = e.stats()
    assert st.get("records_loaded") == 4 and not st.get("load_errors"), st


def test_a_load_spanning_steps_that_fails_is_reported_with_its_request_and_recomputed(
        tmp_path):
    """With ``load_async``, block 2 of the hit refused: the request is reported received
    with blocks 2 and 3 invalid in the same step; vLLM schedules it from block 2, and every
    block and record ends with its tokens' KV."""
    _save_prefix(tmp_path / "store")
    b = _prefix_hit()
    names = block_names(b.all_token_ids, BS)
    e = Engine(tmp_path / "store", verify=True, extra={"load_async": True})
    _damage(str(e.worker.store.path_of(names[2])))
    e.poison()
    e.sched.add_request(b)
    e.run()
    assert_clean(e)
    (out,) = [o for o in e.outputs if o.finished_recving]
    assert out.finished_recving == {"id-2"} and len(out.invalid_block_ids) == 2, out
    first_saves = next(m.saves["id-2"] for m in e.metas if "id-2" in m.saves)
    assert [ns for ns, _ in first_saves] == [[n] for n in names[2:5]]  # recomputed from 2
    tokens = list(b.all_token_ids)
    for k in range(5):
        assert _stored(e, names[k]) == e.expected_record(tokens, k), k
    assert e.stats().get("load_errors") == 1


def test_a_block_whose_load_failed_is_not_offered_again_to_its_request(tmp_path):
    """With ``load_async``, block 0's record is there but cannot be read (an I/O error).
    The failed load leaves the request with nothing computed, so vLLM looks it up again;
    the planner does not offer that block to the request again (it would fail again, for
    ever): the request is computed from token 0 (verified every step), and the records
    after it end right."""
    _save_prefix(tmp_path / "store")
    b = _prefix_hit()
    names = block_names(b.all_token_ids, BS)
    e = Engine(tmp_path / "store", verify=True, extra={"load_async": True})
    _io_error(e, names[0], "reading")
    e.poison()
    e.sched.add_request(b)
    e.run(timeout_s=15)
    assert_clean(e)
    assert e.stats().get("load_errors") == 1
    assert [o.finished_recving for o in e.outputs if o.finished_recving] == [{"id-2"}]
    tokens = list(b.all_token_ids)
    for k in range(1, 5):  # record 0 still cannot be read
        assert _stored(e, names[k]) == e.expected_record(tokens, k), k


@pytest.mark.parametrize("kw", [dict(tp=2, shards=2), dict(dcp=2, interleave=1)],
                         ids=["tp2-head-shards", "dcp2-i1"])
def test_loads_that_span_steps_under_tp_and_dcp(tmp_path, monkeypatch, kw):
    """With ``load_async`` at TP 2 over head shards and at DCP 2 (interleave 1): each rank
    loads its own records into its slots, the request is received once every worker has
    said so, and every rank's blocks hold their KV byte for byte (checked every step)."""
    kw = dict(kw, monkeypatch=monkeypatch, verify=True)
    a = Engine(tmp_path / "store", **kw)
    a.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=1, block_size=a.sblock))
    a.run()
    e = Engine(tmp_path / "store", extra={"load_async": True}, **kw)
    e.poison()
    e.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=e.sblock))
    e.run()
    assert_clean(e)
    assert [o.finished_recving for o in e.outputs if o.finished_recving] == [{"id-2"}]
    st = e.stats()
    assert st.get("records_loaded") == 2 * 64 // e.sblock and not st.get("load_errors"), st


def test_an_abort_while_its_load_spans_steps_frees_its_blocks_once_the_load_ends(tmp_path):
    """A request aborted while its asynchronous load runs keeps its blocks (the loader is
    still filling them) until the worker reports the load ended; then nothing is left."""
    from vllm.v1.request import RequestStatus

    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store", extra={"load_async": True})
    gate = threading.Event()
    e.worker._load_layer_hook = lambda li: gate.wait(30)
    e.sched.add_request(_prefix_hit())
    try:
        e.step()
        e.sched.finish_requests(["id-2"], RequestStatus.FINISHED_ABORTED)
        e.step()
        assert "id-2" in e.sched.requests  # its blocks wait for the load
    finally:
        gate.set()
    e.run()
    assert_clean(e)
    assert [o.finished_recving for o in e.outputs if o.finished_recving] == [{"id-2"}]


def test_an_abort_while_a_resumed_request_loads_frees_its_blocks_once_and_after_the_load(
        tmp_path):
    """A request that saved blocks, preempted (vLLM's ``reset_prefix_cache`` preempts every
    running one), resumed with an asynchronous load of its own records and aborted while
    the loader (held back here) still fills its blocks: vLLM itself keeps the blocks until
    the load is reported ended (``finished_recving``) and frees them then, so the connector
    must not delay their freeing too nor report the request's saves done
    (``finished_sending``): that would free the blocks under the loader, and free them twice
    (vLLM's scheduler asserts)."""
    from vllm.v1.request import RequestStatus

    e = Engine(tmp_path / "store", extra={"load_async": True})
    a = create_request(request_id=1, num_tokens=70, max_tokens=20, block_size=BS)
    e.sched.add_request(a)
    for _ in range(3):
        e.step()
    e.worker._writer.submit(lambda: None).result()  # its 4 records are written
    assert e.sched.reset_prefix_cache(reset_running_requests=True)
    gate = threading.Event()
    e.worker._load_layer_hook = lambda li: gate.wait(30)
    try:
        e.step()
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        e.sched.finish_requests(["id-1"], RequestStatus.FINISHED_ABORTED)
        for _ in range(3):
            e.step()
            assert "id-1" in e.sched.requests, "its blocks were freed under the loader"
            assert not any(o.finished_sending for o in e.outputs[-1:])
    finally:
        gate.set()
    e.run(timeout_s=15)
    assert_clean(e)
    assert [o.finished_recving for o in e.outputs if o.finished_recving] == [{"id-1"}]


# ------------------------------------------------------------------------------------------
# Bounds on host memory
# ------------------------------------------------------------------------------------------


def test_the_writers_queue_is_bounded_and_nothing_is_lost(tmp_path):
    """``save_buffer_bytes`` of two blocks, slow writes, a request completing 8 blocks in
    one step: the bytes handed to the writer and not yet written (counted from outside, at
    every hand-over and end of a writer task) never exceed two blocks; the save path waits
    for room instead (``save_waits``), and every record is written byte for byte."""
    page = len(LAYERS) * 2 * BS * SLOT_BYTES
    e = Engine(tmp_path / "store", budget=128, extra={"save_buffer_bytes": 2 * page})
    w = e.worker
    assert w.save_buffer_bytes == 2 * page == 2 * w.page_bytes

    class SlowPut:
        def __init__(self, store):
            self._store = store

        def put(self, *a, **k):
            time.sleep(0.01)
            return self._store.put(*a, **k)

        def __getattr__(self, attr):
            return getattr(self._store, attr)

    w.store = SlowPut(w.store)
    queued = {"now": 0, "peak": 0}
    lock = threading.Lock()
    submit = w._writer.submit

    def counting_submit(fn, rid, work, *a, **k):
        n = sum(buf.nbytes for _, buf, _ in work)
        with lock:
            queued["now"] += n
            queued["peak"] = max(queued["peak"], queued["now"])
        f = submit(fn, rid, work, *a, **k)

        def done(_f, n=n):
            with lock:
                queued["now"] -= n

        f.add_done_callback(done)
        return f

    w._writer.submit = counting_submit
    req = create_request(request_id=1, num_tokens=128, max_tokens=1, block_size=BS)
    e.sched.add_request(req)
    so = e.step()
    assert so.num_scheduled_tokens == {"id-1": 128}
    e.run()
    assert_clean(e)
    assert queued["peak"] == 2 * page, queued  # filled to the bound, never past it
    st = e.stats()
    assert st.get("records_saved") == 8 and st.get("save_waits"), st
    assert not st.get("save_errors") and not st.get("saves_dropped"), st
    tokens = list(req.all_token_ids)
    for k, name in enumerate(block_names(tokens, BS)):
        assert _stored(e, name) == e.expected_record(tokens, k), k


def test_the_loaders_reads_are_bounded_and_every_block_is_loaded(tmp_path):
    """``load_buffer_bytes`` of two records and a four-block hit: the loader never holds
    more than two records read and not yet filled into their blocks (reads and fills
    counted from outside), reads in batches of two, and every block ends byte for byte as
    saved (checked after every step)."""
    _save_prefix(tmp_path / "store")
    page = len(LAYERS) * 2 * BS * SLOT_BYTES
    e = Engine(tmp_path / "store", verify=True, extra={"load_buffer_bytes": 2 * page})
    e.poison()
    w = e.worker
    events = []
    w.store = _RecordingReads(w.store, events)
    last = w._layers[-1]
    orig = last.fill

    def fill(block, src, slots):
        orig(block, src, slots)
        events.append(("filled", block))

    last.fill = fill
    e.sched.add_request(_prefix_hit())
    so = e.step()
    assert so.num_scheduled_tokens == {"id-2": 16}
    held = peak = 0
    for ev, _ in events:
        held += 1 if ev == "read" else -1
        peak = max(peak, held)
    assert peak == 2 and held == 0, events
    assert [ev for ev, _ in events] == ["read", "read", "filled", "filled"] * 2, events
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("records_loaded") == 4 and not st.get("load_errors"), st


def test_host_memory_bounds_below_one_block_are_refused(tmp_path):
    page = len(LAYERS) * 2 * BS * SLOT_BYTES
    for key in ("load_buffer_bytes", "save_buffer_bytes"):
        with pytest.raises(ValueError, match=rf"{key}'\] = {page - 1}: less than one block"):
            CpHiCacheConnector(vllm_config(tmp_path / "store", **{key: page - 1}),
                               KVConnectorRole.SCHEDULER, kv_cache_config())
    for path in (tmp_path / "store", None):
        with pytest.raises(ValueError, match=rf"host_bytes'\] = {page - 1}: less than one"):
            CpHiCacheConnector(vllm_config(path, host_bytes=page - 1),
                               KVConnectorRole.SCHEDULER, kv_cache_config())
    with pytest.raises(ValueError, match=r"host_bytes'\] = -1 is negative"):
        CpHiCacheConnector(vllm_config(tmp_path / "store", host_bytes=-1),
                           KVConnectorRole.SCHEDULER, kv_cache_config())
    # Host only: no store anywhere.
    c = CpHiCacheConnector(vllm_config(None, host_bytes=page), KVConnectorRole.SCHEDULER,
                           kv_cache_config())
    assert c.store is None and c.host_slots == 1 and c.store_stats() == {}


# ------------------------------------------------------------------------------------------
# The host tier (host_bytes): pools per worker, accounted for by the planner
# ------------------------------------------------------------------------------------------

PAGE = len(LAYERS) * 2 * BS * SLOT_BYTES  # one block of one worker (HEADS heads)


def assert_host_consistent(e: Engine) -> None:
    """Every block the planner's host index says the workers hold is in that slot on every
    worker (but slots of admissions decided and not yet shipped, and those a load that
    spans steps is still filling)."""
    c = e.connector
    pending = {a[2] for adm in c._host_admits.values() for a in adm}
    pending |= {slot for slot, _ in c._host.pinned.values()}
    for key, slot in c.host_index().items():
        if slot in pending:
            continue
        for w, worker in enumerate(e.workers):
            assert worker._host_tags[slot] == key, (
                f"worker {w}'s host slot {slot} holds {worker._host_tags[slot]}, the "
                f"planner says {key}")


def _run_checked(e: Engine, timeout_s: float = 60.0) -> None:
    """``Engine.run``, the host tier checked consistent after every step."""
    deadline = time.monotonic() + timeout_s
    while e.sched.requests:
        assert time.monotonic() < deadline, list(e.sched.requests)
        so = e.step()
        assert_host_consistent(e)
        if not so.num_scheduled_tokens:
            time.sleep(0.01)
    e.step()
    assert_host_consistent(e)


def _host_prefix_then_hit(e: Engine, before_hit=None):
    """Request 1 computes a 64-token prefix (4 scheduler blocks' worth at DCP 1); then,
    vLLM's own prefix cache reset and every block poisoned, request 2 shares it. Returns
    the stats of request 2's part and request 2's scheduled tokens in its first step."""
    a = create_request(request_id=1, num_tokens=72, common_prefix_len=64, max_tokens=2,
                       block_size=e.sblock)
    e.sched.add_request(a)
    _run_checked(e)
    assert_clean(e)
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    if before_hit is not None:
        before_hit(e)
    e.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=e.sblock))
    so = e.step()
    assert_host_consistent(e)
    _run_checked(e)
    assert_clean(e)
    return e.stats(), so.num_scheduled_tokens


@pytest.mark.parametrize("layout", ["blocks_first", "kv_first", "hbnc", "mla"])
def test_host_tier_alone_serves_a_prefix_byte_for_byte(tmp_path, layout):
    """No store (no ``path``): request 1's saved blocks go into the workers' host pools,
    and request 2's prefix comes from them, every block checked after every step: GQA's
    K and V apart (gathered) or together, a block in pieces (``hbnc``: copied run by
    run), MLA."""
    e = Engine(None, verify=True, layout=layout, mla=layout == "mla",
               extra={"host_bytes": 16 * PAGE})
    assert e.connector.store is None and e.worker.store is None
    st, first = _host_prefix_then_hit(e)
    assert first == {"id-2": 16}, first  # 64 tokens from the host tier
    assert st.get("host_hits") == 4 and not st.get("records_loaded"), st
    assert not st.get("load_errors") and not st.get("records_saved"), st
    assert e.connector.planner_stats()["host_hits"] == 4
    # Request 1's four blocks and request 2's fifth were admitted.
    assert len(e.connector.host_index()) == 5


def test_a_host_hit_reads_nothing_from_the_store(tmp_path):
    """With a store and a host tier: request 2's prefix is served from the host pool with
    no store read (every read noted), even with the store's records removed."""
    e = Engine(tmp_path / "store", verify=True, extra={"host_bytes": 16 * PAGE})
    reads = []

    def no_store(e):
        names = block_names([1] * 64, BS)
        for n in names:
            os.remove(e.worker.store.path_of(n))
        e.worker.store = _RecordingReads(e.worker.store, reads)

    st, first = _host_prefix_then_hit(e, no_store)
    assert first == {"id-2": 16}, first
    assert reads == [], reads
    assert st.get("host_hits") == 4 and not st.get("records_loaded"), st
    assert not st.get("load_errors"), st
    assert st.get("records_saved") == 1, st  # only request 2's new block


@pytest.mark.parametrize("store", [True, False], ids=["with-store", "host-only"])
def test_host_eviction_keeps_planner_and_workers_consistent(tmp_path, store):
    """A host tier of 3 blocks: request 1's 4 saved blocks evict its first, request 3's
    evict the rest. After every step the planner's index and every worker's slots agree.
    Request 4, sharing request 1's prefix, then gets the blocks the host still holds from
    it and the evicted ones from the store (or, host-only, recomputes them), byte for
    byte: never a slot's other block."""
    e = Engine(tmp_path / "store" if store else None, verify=True,
               extra={"host_bytes": 3 * PAGE + PAGE // 2})
    assert e.connector.host_slots == 3 and e.worker._host_pool.shape[0] == 3
    e.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    a = block_names([1] * 64, BS)
    assert list(e.connector.host_index()) == a[1:4]
    st = e.stats()
    assert st.get("host_admissions") == 4 and st.get("host_evictions") == 1, st
    # Request 3 (other tokens) saves 2 blocks: a[1] and a[2] go.
    e.sched.add_request(create_request(request_id=3, num_tokens=40, max_tokens=2,
                                       block_size=BS))
    _run_checked(e)
    assert list(e.connector.host_index())[0] == a[3]
    assert e.connector.planner_stats()["host_evicted"] == 3
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=4, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    slot_a3 = e.connector.host_index()[a[3]]
    so = e.step()
    assert_host_consistent(e)
    if store:
        # Blocks 0..2 from the store, block 3 from the host. The three read go into the
        # host tier, evicting the other three blocks, a[3] last: its slot takes block 2
        # once the step's loads (block 3's from that slot) have ended.
        assert so.num_scheduled_tokens == {"id-4": 16}, so.num_scheduled_tokens
        meta = e.metas[-1]
        ids = [b for _, b in meta.loads["id-4"]]
        assert meta.host_loads == {"id-4": {ids[3]: slot_a3}}
        assert meta.host_fills["id-4"][ids[2]][0] == slot_a3
        # (block 0 then goes for the block the step saved, once settled)
        index = e.connector.host_index()
        assert a[3] not in index and {a[1], a[2]} <= index.keys(), index
    else:
        # The run must start at block 0, which no tier holds: computed.
        assert so.num_scheduled_tokens == {"id-4": 64}, so.num_scheduled_tokens
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert not st.get("load_errors"), st
    assert st.get("host_hits", 0) == (1 if store else 0), st
    assert st.get("records_loaded", 0) == (3 if store else 0), st


def _in_store(e: Engine, names) -> list:
    """Which of the records ``names`` (DCP 1, no head shards) the engine's store holds."""
    return [n for n in names if e.worker.store.exists(n)]


def _settled_stats(e: Engine) -> dict:
    """``e.stats()`` once every worker's writes (flushes included, which no request waits
    for) have ended, with the counters the workers have not reported in a step yet."""
    total = e.stats()
    for w in e.workers:
        if w._writer is not None:
            w._writer.submit(lambda: None).result()  # one thread: every earlier write ended
        left = w.get_kv_connector_stats()
        for k, v in (left.data.items() if left is not None else ()):
            total[k] = total.get(k, 0) + v
    return total


def test_write_back_saves_to_the_host_tier_and_flushes_on_eviction(tmp_path):
    """``write_policy`` ``write_back`` with a host tier of 3 blocks: request 1's 4 saved
    blocks go to the host tier only, and the first, evicted by the fourth, is the only one
    written to the store (a flush: the worker writes the slot's bytes out before the
    admission replaces them). Request 3's 2 blocks evict two more, flushed byte for byte.
    Request 4, sharing request 1's prefix, gets blocks 0..2 from the store and block 3,
    which only the host tier holds, from the host tier, byte for byte. After shutdown
    (which flushes what only the host tier holds), a restart reads every block from the
    store."""
    e = Engine(tmp_path / "store", verify=True,
               extra={"host_bytes": 3 * PAGE + PAGE // 2, "write_policy": "write_back"})
    a = block_names([1] * 64, BS)
    e.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    assert_clean(e)
    assert list(e.connector.host_index()) == a[1:4]
    st = _settled_stats(e)
    assert _in_store(e, a) == a[:1]
    assert st.get("host_admissions") == 4 and st.get("host_flushes") == 1, st
    assert st.get("records_saved") == 1 and not st.get("flush_errors"), st
    ps = e.connector.planner_stats()
    assert ps["host_flushes"] == 1 and ps["host_dirty"] == 3, ps
    tokens1 = [1] * 64 + list(range(8))
    assert _stored(e, a[0]) == e.expected_record(tokens1, 0)
    e.sched.add_request(create_request(request_id=3, num_tokens=40, max_tokens=2,
                                       block_size=BS))
    _run_checked(e)
    assert_clean(e)
    _settled_stats(e)
    assert _in_store(e, a) == a[:3]
    for k in range(3):
        assert _stored(e, a[k]) == e.expected_record(tokens1, k), k
    assert e.connector.planner_stats()["host_flushes"] == 3
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=4, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = e.step()
    assert so.num_scheduled_tokens == {"id-4": 16}, so.num_scheduled_tokens
    meta = e.metas[-1]
    ids = [b for _, b in meta.loads["id-4"]]
    assert list(meta.host_loads["id-4"]) == [ids[3]], meta.host_loads
    _run_checked(e)
    assert_clean(e)
    st = _settled_stats(e)
    assert st.get("host_hits") == 1 and st.get("records_loaded") == 3, st
    assert not st.get("load_errors"), st
    # The blocks read from the store went into the host tier, evicting a[3] last (after
    # the step's load from its slot): flushed then, byte for byte.
    assert _stored(e, a[3]) == e.expected_record(tokens1, 3)
    # Request 4's fifth block is only in the host tier until shutdown flushes it.
    tokens4 = [1] * 64 + [4 * i for i in range(16)]
    b4 = block_names(tokens4, BS)[4]
    assert e.connector.host_index().get(b4) is not None and not e.worker.store.exists(b4)
    for w in e.workers:
        w.shutdown()
    assert _stored(e, b4) == e.expected_record(tokens4, 4)
    b = Engine(tmp_path / "store", verify=True,
               extra={"host_bytes": 3 * PAGE + PAGE // 2, "write_policy": "write_back"})
    b.poison()
    b.sched.add_request(create_request(request_id=4, num_tokens=96, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-4": 16}, so.num_scheduled_tokens
    _run_checked(b)
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == 5 and not st.get("host_hits"), st
    assert not st.get("load_errors"), st


@pytest.mark.parametrize("mode", ["load-async", "async-scheduler"])
def test_write_back_flushes_slots_that_loads_from_the_store_refill(tmp_path, mode):
    """``write_back`` with a 3-block host tier, with loads that span steps and under vLLM's
    ``AsyncScheduler``: request 1's and request 3's blocks are only in the host tier
    (but those evicted by later saves); request 4's hit reads request 1's evicted blocks
    from the store, and their admissions evict the three blocks the host tier held, only
    there, each flushed by every worker before the load's copy replaces it (on the loader
    thread, steps later with ``load_async``). Every block is checked after every step, and
    every flushed record holds the forward's bytes."""
    extra = {"host_bytes": 3 * PAGE + PAGE // 2, "write_policy": "write_back",
             "load_async": mode == "load-async"}
    e = Engine(tmp_path / "store", verify=True, extra=extra,
               async_scheduling=mode == "async-scheduler")
    reqs = [create_request(request_id=1, num_tokens=72, common_prefix_len=64, max_tokens=2,
                           block_size=BS),
            create_request(request_id=3, num_tokens=40, max_tokens=2, block_size=BS)]
    for r in reqs:
        e.sched.add_request(r)
        e.run()
        assert_clean(e)
    a = block_names(list(reqs[0].all_token_ids), BS)
    c = block_names(list(reqs[1].all_token_ids), BS)
    held = list(e.connector.host_index())
    assert held == [a[3], c[0], c[1]], held
    assert not any(e.worker.store.exists(n) for n in held)
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=4, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    e.run()
    assert_clean(e)
    st = _settled_stats(e)
    assert st.get("host_hits") == 1 and st.get("records_loaded") == 3, st
    assert not st.get("load_errors") and not st.get("flush_errors"), st
    # a[0], then a[1] and a[2] (saves), then a[3], c[0] and c[1] (the loads' admissions).
    assert e.connector.planner_stats()["host_flushes"] == 6
    for names, req in ((a, reqs[0]), (c, reqs[1])):
        for k in range(2 if names is c else 4):
            assert _stored(e, names[k]) == e.expected_record(list(req.all_token_ids), k), k


WRITE_BACK_PARALLEL = [dict(), dict(tp=2, shards=2), dict(dcp=2, interleave=1)]


@pytest.mark.parametrize("kw", WRITE_BACK_PARALLEL, ids=["dcp1", "tp2h2", "dcp2i1"])
def test_write_back_flushes_what_only_the_host_tier_holds_at_shutdown(tmp_path, monkeypatch,
                                                                     kw):
    """``write_back`` with a host tier that evicts nothing: nothing is written to the
    store while the engine runs; ``shutdown`` flushes every block only the host tier
    holds (every worker its own bytes: its head shard's, its DCP rank's tokens, written
    as parts), and a restart reads the whole prefix from the store, every rank's blocks
    byte for byte."""
    extra = {"host_bytes": 16 * PAGE, "write_policy": "write_back"}
    e = Engine(tmp_path / "store", verify=True, extra=extra, monkeypatch=monkeypatch, **kw)
    e.sched.add_request(create_request(request_id=1, num_tokens=72 * e.dcp,
                                       common_prefix_len=64 * e.dcp, max_tokens=2,
                                       block_size=e.sblock))
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert not st.get("records_saved") and not st.get("parts_saved"), st
    assert not st.get("host_flushes"), st
    for w in e.workers:
        assert w.store.stats()["records_written"] == 0
    for w in e.workers:
        w.shutdown()
    flushed = sum(w._stats.get("host_flushes", 0) for w in e.workers)
    # 4 blocks, each worker its record of each (under DCP with a small interleave, its
    # part of each of the block's records).
    assert flushed == 4 * e.tp * (e.dcp if e.interleave < BS else 1), flushed
    b = Engine(tmp_path / "store", verify=True, extra=extra, monkeypatch=monkeypatch, **kw)
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80 * e.dcp,
                                       common_prefix_len=64 * e.dcp, max_tokens=2,
                                       block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16 * e.dcp}, so.num_scheduled_tokens
    _run_checked(b)
    assert_clean(b)
    st = b.stats()
    assert not st.get("load_errors") and not st.get("host_hits"), st
    assert st.get("records_loaded") == 4 * e.tp, st


class _FailingPuts:
    """A store whose writes raise (a full or failing disk); everything else passes."""

    def __init__(self, store):
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def put(self, name, parts):
        raise OSError("no space left on device")


def test_a_failed_write_back_flush_is_counted_and_never_a_wrong_record(tmp_path):
    """``write_back``: a flush whose write fails leaves its block out of the store
    (``flush_errors``, ``save_errors``); the next request of the prefix computes it, and
    the store holds no record of it (nor any wrong one)."""
    extra = {"host_bytes": 3 * PAGE + PAGE // 2, "write_policy": "write_back"}
    e = Engine(tmp_path / "store", verify=True, extra=extra)
    store = e.worker.store
    e.worker.store = _FailingPuts(store)
    e.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    assert_clean(e)
    st = _settled_stats(e)
    assert st.get("flush_errors") == 1 and st.get("save_errors") == 1, st
    assert not st.get("host_flushes") and not st.get("records_saved"), st
    a = block_names([1] * 64, BS)
    assert not any(store.exists(n) for n in a)
    e.worker.store = store
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = e.step()
    # Block 0 is in no tier: the run starts there, and is computed.
    assert so.num_scheduled_tokens == {"id-2": 64}, so.num_scheduled_tokens
    _run_checked(e)
    assert_clean(e)
    assert not e.stats().get("load_errors")


def test_write_policy_values_are_checked(tmp_path):
    """An unknown ``write_policy`` is refused, listing the known ones; ``write_back``
    without a host tier or without a store is refused, saying which is missing; on the
    scheduler and on the workers alike."""
    cases = [({"path": str(tmp_path / "s"), "write_policy": "write_around"},
              r"write_policy'\] = 'write_around' is not known; the write policies are "
              r"write_through, write_back"),
             ({"path": str(tmp_path / "s"), "host_bytes": 0, "write_policy": "write_back"},
              r"needs both a host tier .* no host tier \(host_bytes is 0\)"),
             ({"host_bytes": 16 * PAGE, "write_policy": "write_back"},
              r"needs both .* this config has no store \(path\)")]
    for extra, match in cases:
        cfg = create_vllm_config(block_size=BS, kv_connector="CpHiCacheConnector",
                                 kv_connector_module_path="cp_hicache.vllm",
                                 kv_role="kv_both", kv_connector_extra_config=extra)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            with pytest.raises(ValueError, match=match):
                CpHiCacheConnector(cfg, role, kv_cache_config())
    # write_through, the default, spelled out.
    e = Engine(tmp_path / "store", extra={"write_policy": "write_through"})
    assert not e.connector.write_back


HOST_PARALLEL = [dict(tp=2, shards=2), dict(dcp=2, interleave=1), dict(dcp=2, interleave=BS),
                 dict(tp=2, mla=True), dict(tp=4, dcp=2, interleave=1, shards=2, heads=1),
                 dict(dcp=4, interleave=1)]


@pytest.mark.parametrize("kw", HOST_PARALLEL,
                         ids=["tp2h2", "dcp2i1", "dcp2i16", "tp2mla", "tp4dcp2i1h2", "dcp4i1"])
def test_host_tier_under_tp_and_dcp(tmp_path, monkeypatch, kw):
    """Head shards, DCP ranks (whole-block and token interleave) and TP copies (MLA): every
    worker's pool holds its own bytes of each block in the planner's slot, and a prefix hit
    from the host tier fills every rank's blocks with its own KV (checked after every step),
    with no store."""
    e = Engine(None, verify=True, monkeypatch=monkeypatch,
               extra={"host_bytes": 16 * PAGE}, **kw)
    st, first = _host_prefix_then_hit(e)
    blocks = 64 // e.sblock
    assert first == {"id-2": 80 - 64}, first
    assert st.get("host_hits") == e.tp * blocks, st
    assert not st.get("load_errors") and not st.get("records_loaded"), st
    # Every worker holds the same blocks in the same slots.
    tags = [w._host_tags for w in e.workers]
    assert all(t == tags[0] for t in tags), tags


def test_host_loads_that_span_steps_hold_no_copy_of_their_slots(tmp_path, monkeypatch):
    """With ``load_async`` a load from the host tier fills its blocks from the slots when it
    starts, in the step that plans it (a later admission may reuse a slot while the load
    runs; the request is out of the batch, so no forward reads its blocks): the load the
    loader thread runs then holds no copy of a slot (before, each block's bytes were
    cloned and held until the loader filled them: host memory past ``host_bytes`` and
    ``load_buffer_bytes``, growing with the loads queued behind a slow store read). The
    prefix is served byte for byte, with no store (blocks a load that spans steps reads
    from a store are admitted into slots the planner pins until the load is received:
    ``test_blocks_a_load_spanning_steps_reads_from_the_store_go_into_the_host_tier``)."""
    e = Engine(None, verify=True, extra={"host_bytes": 16 * PAGE, "load_async": True})
    held, started = [], []
    real = e.worker._run_load

    def noting(task, loads):
        held.extend(v for v in task.host.values() if isinstance(v, torch.Tensor))
        started.append(sorted(task.host))
        real(task, loads)

    monkeypatch.setattr(e.worker, "_run_load", noting)
    st, _ = _host_prefix_then_hit(e)
    assert len(started) == 1 and len(started[0]) == 4, started
    assert held == [], f"{len(held)} copies of host slots held by the load"
    assert st.get("host_hits") == 4 and not st.get("load_errors"), st


RESTART_RUNS = [dict(), dict(tp=2, shards=2), dict(dcp=2, interleave=1),
                dict(dcp=2, interleave=BS)]


@pytest.mark.parametrize("kw", RESTART_RUNS, ids=["dcp1", "tp2h2", "dcp2i1", "dcp2i16"])
def test_a_restart_has_an_empty_host_tier_and_reads_the_store(tmp_path, monkeypatch, kw):
    """A new engine (new connectors) over the same store: its host tier is empty, so the
    prefix is read from the store, and the blocks read go into the host tier (each worker
    copies its filled block: its head shard's, its DCP rank's tokens): the next request
    sharing the prefix is served from it, with no store read on any worker, every rank's
    blocks checked after every step."""
    kw = dict(kw, monkeypatch=monkeypatch, extra={"host_bytes": 16 * PAGE})
    a = Engine(tmp_path / "store", **kw)
    a.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=a.sblock))
    _run_checked(a)
    blocks = 64 // a.sblock
    assert len(a.connector.host_index()) == blocks
    b = Engine(tmp_path / "store", verify=True, **kw)
    assert b.connector.host_index() == {}
    assert all(t is None for w in b.workers for t in w._host_tags)
    b.poison()
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    assert b.metas[-1].host_loads == {} and len(b.metas[-1].host_fills["id-2"]) == blocks
    _run_checked(b)
    assert_clean(b)
    st = b.stats()
    assert st.get("records_loaded") == b.tp * blocks and not st.get("host_hits"), st
    # The blocks read are in the host tier now (and, at DCP 1, request 2's fifth, saved).
    assert st.get("host_admissions") == b.tp * (blocks + (b.dcp == 1)), st
    keys = block_names([1] * 64, BS)[b.dcp - 1::b.dcp]
    assert b.connector.host_index().keys() >= set(keys)
    assert b.sched.reset_prefix_cache()
    b.outputs.clear()
    b.poison()
    reads = []
    for w in b.workers:
        w.store = _RecordingReads(w.store, reads)
    b.sched.add_request(create_request(request_id=3, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=b.sblock))
    so = b.step()
    assert so.num_scheduled_tokens == {"id-3": 16}, so.num_scheduled_tokens
    _run_checked(b)
    assert_clean(b)
    st = b.stats()
    assert reads == [] and st.get("host_hits") == b.tp * blocks, st
    assert not st.get("records_loaded") and not st.get("load_errors"), st


def _gate_loads(e: Engine) -> threading.Event:
    """Holds every worker's loader before its first fill until the event is set."""
    gate = threading.Event()
    for w in e.workers:
        w._load_layer_hook = lambda li: gate.wait(30)
    return gate


@pytest.mark.parametrize("kw", RESTART_RUNS, ids=["dcp1", "tp2h2", "dcp2i1", "dcp2i16"])
def test_blocks_a_load_spanning_steps_reads_from_the_store_go_into_the_host_tier(
        tmp_path, monkeypatch, kw):
    """With ``load_async`` the blocks a load reads from the store are admitted to the host
    tier too (before, only synchronous loads' were: the next request of the prefix read
    the store again). Their slots are filled when the load ends, steps after the one that
    planned it: until it is reported received the planner neither offers them nor evicts
    them (pinned). Then the next request sharing the prefix is a host hit on every worker
    that reads nothing from the store, every rank's blocks checked after every step."""
    write = dict(kw, monkeypatch=monkeypatch, extra={"host_bytes": 16 * PAGE})
    a = Engine(tmp_path / "store", **write)
    a.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=a.sblock))
    _run_checked(a)
    b = Engine(tmp_path / "store", verify=True, monkeypatch=monkeypatch,
               extra={"host_bytes": 16 * PAGE, "load_async": True}, **kw)
    blocks = 64 // b.sblock
    keys = block_names([1] * 64, BS)[b.dcp - 1::b.dcp]
    b.poison()
    gate = _gate_loads(b)
    b.sched.add_request(create_request(request_id=2, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=b.sblock))
    try:
        for _ in range(2):
            so = b.step()
            assert not so.num_scheduled_tokens, so.num_scheduled_tokens
            assert_host_consistent(b)
        meta = b.metas[0]
        assert meta.host_loads == {} and len(meta.host_fills["id-2"]) == blocks, meta
        # Admitted, but pinned while the load runs: not offered from the host tier.
        assert b.connector.host_index().keys() == set(keys)
        assert all(b.connector._host.servable(k) is None for k in keys)
    finally:
        gate.set()
    _run_checked(b)
    assert_clean(b)
    assert b.connector._host.pinned == {}
    assert all(b.connector._host.servable(k) is not None for k in keys)
    st = b.stats()
    assert st.get("records_loaded") == b.tp * blocks and not st.get("load_errors"), st
    assert st.get("host_admissions") == b.tp * (blocks + (b.dcp == 1)), st
    assert not st.get("host_failures"), st
    assert b.sched.reset_prefix_cache()
    b.outputs.clear()
    b.poison()
    reads = []
    for w in b.workers:
        w.store = _RecordingReads(w.store, reads)
    b.sched.add_request(create_request(request_id=3, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=b.sblock))
    _run_checked(b)
    assert_clean(b)
    st = b.stats()
    assert reads == [] and st.get("host_hits") == b.tp * blocks, st
    assert not st.get("records_loaded") and not st.get("load_errors"), st


def test_a_failed_load_spanning_steps_admits_none_of_its_failed_blocks(tmp_path):
    """With ``load_async`` and the host tier, block 2's record is damaged: the load fills
    blocks 0 and 1 and their slots; blocks 2 and 3 fail, so their slots hold nothing and
    the worker reports those admissions, which leave the index (their slots free once the
    load is received). The recomputed blocks are admitted from their saves; the index and
    the worker agree after every step, and the next request of the prefix is a host hit
    on all four blocks, byte for byte."""
    _save_prefix(tmp_path / "store")
    b = _prefix_hit()
    names = block_names(b.all_token_ids, BS)
    e = Engine(tmp_path / "store", verify=True,
               extra={"host_bytes": 16 * PAGE, "load_async": True})
    _damage(str(e.worker.store.path_of(names[2])))
    e.poison()
    e.sched.add_request(b)
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert st.get("load_errors") == 1 and st.get("host_failures") == 2, st
    assert e.connector._host.pinned == {}
    assert set(e.connector.host_index()) == set(names[:5])
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=3, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert st.get("host_hits") == 4 and not st.get("load_errors"), st


def test_slots_a_load_spanning_steps_fills_are_not_evicted_while_it_runs(tmp_path):
    """A host tier of 4 slots, all admitted to request 2's load from the store, which spans
    steps (held back here). Meanwhile request 5 computes and saves two blocks: their
    admissions find every slot pinned and are not made (they would have evicted blocks
    whose slots the load fills later: the planner's index and the workers' slots would
    disagree). Once the load is received the slots hold request 2's prefix, consistent on
    every step, and request 3 sharing it is served from them."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store", verify=True,
               extra={"host_bytes": 4 * PAGE, "load_async": True})
    keys = block_names([1] * 64, BS)
    e.poison()
    gate = _gate_loads(e)
    e.sched.add_request(_prefix_hit())
    try:
        e.step()
        e.sched.add_request(create_request(request_id=5, num_tokens=40, max_tokens=1,
                                           block_size=BS))
        for _ in range(4):
            e.step()
            assert_host_consistent(e)
        assert list(e.connector.host_index()) == keys[:4]
        assert not any(m.host_admits for m in e.metas), [m.host_admits for m in e.metas]
    finally:
        gate.set()
    _run_checked(e)
    assert_clean(e)
    assert e.connector._host.pinned == {}
    # Request 2's fifth block, saved once it ran, took the least recently used slot.
    assert e.connector.host_index().keys() >= set(keys[1:4])
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=3, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    so = e.step()
    assert not so.num_scheduled_tokens  # an asynchronous load, from the host tier
    assert set(e.metas[-1].host_loads["id-3"].values()) <= set(range(4))
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert not st.get("load_errors") and st.get("host_hits", 0) >= 3, st


@pytest.mark.parametrize("store", [True, False], ids=["with-store", "host-only"])
def test_a_failed_host_admission_is_not_offered_and_a_failed_host_load_is_recomputed(
        tmp_path, monkeypatch, store):
    """TP 2 over head shards. Worker 1 fails to copy block 2 into its pool: it reports it,
    and the planner stops offering that block from the host tier (the store serves it, or
    it is recomputed). Then worker 0's slot of block 1 is made to hold nothing the planner
    knows of (as a lost copy would): the load from it fails on that rank, is reported and
    recomputed, and the block is dropped from the index: never served."""
    e = Engine(tmp_path / "store" if store else None, verify=True, monkeypatch=monkeypatch,
               tp=2, shards=2, extra={"host_bytes": 16 * PAGE})
    names = block_names([1] * 64, BS)
    w1 = e.workers[1]
    real_put = w1._host_put

    def failing_put(slot, sb):
        if sb.items[0][0] == head_shard_key(names[2], 1, 2):
            raise OSError("no room")
        real_put(slot, sb)

    monkeypatch.setattr(w1, "_host_put", failing_put)
    e.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    assert_clean(e)
    assert names[2] not in e.connector.host_index()
    assert e.connector.planner_stats()["host_dropped"] == 1
    assert e.stats().get("host_failures") == 1, e.stats()
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    # Worker 0 loses block 1's copy behind the planner's back.
    e.workers[0]._host_tags[e.connector.host_index()[names[1]]] = None
    e.sched.add_request(_prefix_hit())
    e.verify = False  # rank 0's block 1 is not loaded in this step: recomputed after it
    so = e.step()
    e.verify = True
    assert e.outputs[-1].invalid_block_ids, "the failed host load was not reported"
    if store:
        # Blocks 0, 1 and 3 from the host, 2 from the store; block 1 fails on rank 0.
        assert so.num_scheduled_tokens == {"id-2": 16}, so.num_scheduled_tokens
    else:
        assert so.num_scheduled_tokens == {"id-2": 80 - 32}, so.num_scheduled_tokens
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert st.get("load_errors") == 1, st  # rank 0's block 1; its later blocks not loaded
    # Dropped from the index by the failure (block 2's admission and block 1's load),
    # admitted again from the recomputed saves: consistent on every worker.
    assert e.connector.planner_stats()["host_dropped"] >= 2
    assert names[1] in e.connector.host_index()
    assert_host_consistent(e)


def test_a_load_planned_with_a_failing_admission_is_recomputed_never_served(tmp_path,
                                                                          monkeypatch):
    """TP 2 over head shards, no store, vLLM's prefix cache off. Request 1's four blocks are
    settled after step 1, and their admissions ship in step 2's metadata; request 2, looked
    up in that same step, is offered them from the host tier. Worker 1 fails to copy block
    2 into its slot: its load of block 2 from that slot (in the same step, before its
    report reached the planner) is a load error, recomputed, never the slot's old bytes."""
    e = Engine(None, monkeypatch=monkeypatch, tp=2, shards=2,
               extra={"host_bytes": 16 * PAGE}, prefix_caching=False)
    names = block_names([1] * 64, BS)
    w1 = e.workers[1]
    real_put = w1._host_put

    def failing_put(slot, sb):
        if sb.items[0][0] == head_shard_key(names[2], 1, 2):
            raise OSError("no room")
        real_put(slot, sb)

    monkeypatch.setattr(w1, "_host_put", failing_put)
    e.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=1, block_size=BS))
    e.step()  # blocks 0..3 computed and saved; settled once the step's reports are in
    assert list(e.connector.host_index()) == names[:4]
    e.sched.add_request(_prefix_hit())
    seen = {}

    def ids(so, meta):
        seen["b"] = list(e.sched.kv_cache_manager.get_block_ids("id-2")[0])

    so = e.step(before_forward=ids)
    assert so.num_scheduled_tokens.get("id-2") == 16, so.num_scheduled_tokens
    assert e.metas[-1].host_admits and set(e.metas[-1].host_loads) == {"id-2"}
    # Worker 1's blocks 2 and 3 (block 3: after a failed one) were not served.
    assert e.outputs[-1].invalid_block_ids == set(seen["b"][2:4])
    assert names[2] not in e.connector.host_index()
    e.verify = True
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    # Block 2 fails to go in twice: request 1's copy, and request 2's recomputed one.
    assert st.get("load_errors") == 1 and st.get("host_failures") == 2, st
    assert names[2] not in e.connector.host_index()


def test_the_host_index_pins_slots_being_filled_and_numbers_its_admissions():
    """The planner's host index alone: a pinned admission (a load that spans steps fills
    its slot) is neither offered nor evicted; with every slot pinned nothing is admitted;
    a report naming an older admission of a key drops nothing; a pinned entry dropped
    (its copy failed on some worker) keeps its slot taken until the load is received (a
    worker may still be filling it), and only then is the slot free again."""
    from cp_hicache.vllm import _HostIndex

    h = _HostIndex(2)
    assert h.admit("a", pin=True) == (0, "", 1)
    assert h.admit("b") == (1, "", 2)
    assert h.servable("a") is None and h.get("a") == 0 and h.servable("b") == 1
    assert h.admit("c") == (1, "b", 3)  # b, not the pinned a (least recently used)
    assert h.admit("d", pin=True) == (1, "c", 4)
    assert h.admit("e") is None  # every slot is being filled
    assert not h.drop("d", 3) and h.get("d") == 1  # an older admission's report
    assert h.drop("a", 1) and h.get("a") is None
    assert h.admit("e") is None  # a's slot stays taken while its load runs
    h.unpin(1)
    assert h.admit("e") == (0, "", 5)
    h.unpin(4)
    assert h.servable("d") == 1 and h.pinned == {}
    assert h.admit("f") == (1, "d", 6)  # d is evictable again


def test_a_late_admission_failure_drops_no_newer_admission_of_the_same_block(tmp_path,
                                                                              monkeypatch):
    """A host tier of one slot, no store, vLLM's prefix cache off. Request 1's block K is
    admitted after step 1 and the worker fails to copy it in step 2; its report arrives a
    step late, as under vLLM's asynchronous scheduling (held back here). Meanwhile step 2's
    saves are settled: request 3's block evicts K, and request 4's block, K again, is
    admitted anew into the slot, which the worker fills in step 3. The late report names
    the failed admission, not the block: the newer entry stays (before, it dropped K from
    the index while every worker held it: the slot's block was lost, never offered)."""
    e = Engine(None, verify=True, prefix_caching=False, extra={"host_bytes": PAGE})
    k = block_names([1] * 16, BS)[0]
    w = e.worker
    real_put, fails = w._host_put, []

    def failing_put(slot, sb):
        if sb.items[0][0] == k and not fails:
            fails.append(slot)
            raise OSError("no room")
        real_put(slot, sb)

    monkeypatch.setattr(w, "_host_put", failing_put)
    real_meta, late = w.build_connector_worker_meta, []

    def late_report():
        m = real_meta()
        held = set(late.pop()) if late else set()
        if m is not None and m.host_failed:
            late.append(m.host_failed)
            m.host_failed = set()
        if held:
            m = m or CpHiCacheWorkerMeta()
            m.host_failed |= held
        return m

    monkeypatch.setattr(w, "build_connector_worker_meta", late_report)
    e.sched.add_request(create_request(request_id=1, num_tokens=16, common_prefix_len=16,
                                       max_tokens=1, block_size=BS))
    e.step()
    assert e.connector.host_index() == {k: 0}
    for rid, prefix in ((3, 0), (4, 16)):
        e.sched.add_request(create_request(request_id=rid, num_tokens=16,
                                           common_prefix_len=prefix, max_tokens=1,
                                           block_size=BS))
    e.step()  # the admission of K fails here; its report is held back
    assert fails == [0] and late, late
    assert e.connector.host_index() == {k: 0}  # admitted again (request 4's K)
    e.step()  # the worker makes it; the late report comes in
    assert not late
    assert w._host_tags[0] == k
    assert e.connector.host_index() == {k: 0}, e.connector.host_index()
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert st.get("host_failures") == 1 and st.get("host_admissions") == 2, st
    assert e.connector.planner_stats()["host_dropped"] == 0
    # Request 5 shares K: served from the slot.
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=5, num_tokens=32, common_prefix_len=16,
                                       max_tokens=1, block_size=BS))
    so = e.step()
    assert so.num_scheduled_tokens == {"id-5": 16}, so.num_scheduled_tokens
    _run_checked(e)
    assert_clean(e)
    assert e.stats().get("host_hits") == 1 and not e.stats().get("load_errors")


def test_a_block_admitted_by_a_load_is_not_offered_from_the_host_in_the_same_step(tmp_path):
    """After a restart, two requests sharing a stored prefix are looked up in the same step
    (vLLM's prefix cache off). The first's loads admit the prefix to the host tier, but its
    slots are filled only once the step's loads end: the second is offered the prefix from
    the store too, not from slots that do not hold it yet (a load error and a recompute)."""
    _save_prefix(tmp_path / "store")
    e = Engine(tmp_path / "store", verify=True, budget=128, prefix_caching=False,
               extra={"host_bytes": 16 * PAGE})
    e.poison()
    for rid in (2, 3):
        e.sched.add_request(create_request(request_id=rid, num_tokens=80,
                                           common_prefix_len=64, max_tokens=2,
                                           block_size=BS))
    so = e.step()
    assert so.num_scheduled_tokens == {"id-2": 16, "id-3": 16}, so.num_scheduled_tokens
    meta = e.metas[-1]
    assert meta.host_loads == {} and len(meta.host_fills["id-2"]) == 4, meta
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert st.get("records_loaded") == 8 and not st.get("load_errors"), st


def test_a_failed_host_load_spanning_steps_leaves_the_host_index(tmp_path, monkeypatch):
    """With ``load_async``, the worker's slot of block 1 is made to hold nothing the
    planner knows of (as a lost copy would). Request 2's load from it fails, is reported
    with the request received (after the step that planned it was settled) and recomputed;
    the block leaves the host index as a failed synchronous host load does (before, the
    planner kept it: the recomputed block's admission only touched it, the worker's slot
    stayed empty, and every later hit failed and was recomputed again)."""
    e = Engine(None, verify=True, extra={"host_bytes": 16 * PAGE, "load_async": True})
    names = block_names([1] * 64, BS)
    e.sched.add_request(create_request(request_id=1, num_tokens=72, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    assert_clean(e)
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.worker._host_tags[e.connector.host_index()[names[1]]] = None
    # The load ends only after the step that planned it has been reported and settled.
    gate = threading.Event()
    real = e.worker._run_load

    def gated(task, loads):
        gate.wait(30)
        real(task, loads)

    monkeypatch.setattr(e.worker, "_run_load", gated)
    e.sched.add_request(_prefix_hit())
    so = e.step()
    assert not so.num_scheduled_tokens and e.metas[-1].host_loads, e.metas[-1]
    e.step()
    assert e.connector.planner_stats()["unsettled"] == 0
    gate.set()
    e.run()
    assert_clean(e)
    st = e.stats()
    assert st.get("load_errors") == 1 and st.get("host_hits") == 1, st
    # Blocks 1 to 3 (1 failed, the others after it) are dropped by the failure, and
    # admitted again from request 2's recomputed blocks.
    assert e.connector.planner_stats()["host_dropped"] == 3
    assert names[1] in e.connector.host_index()
    assert_host_consistent(e)
    # Request 3 shares the prefix: served from the host tier, nothing fails.
    assert e.sched.reset_prefix_cache()
    e.outputs.clear()
    e.poison()
    e.sched.add_request(create_request(request_id=3, num_tokens=80, common_prefix_len=64,
                                       max_tokens=2, block_size=BS))
    _run_checked(e)
    assert_clean(e)
    st = e.stats()
    assert not st.get("load_errors") and st.get("host_hits") == 4, st
