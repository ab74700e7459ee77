"""vLLM's KV connector over cp-hicache's page store: ``CpHiCacheConnector``.

Loaded out of tree by vLLM's own connector factory, no fork::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CpHiCacheConnector",
        "kv_connector_module_path": "cp_hicache.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": "/shared/kv-store",
                                      "capacity_bytes": 1099511627776}}'

What it does (issue 43; docs/ENGINES.md "vLLM" is the how-to):

- **One planner, on the scheduler.** vLLM's scheduler asks the scheduler-side connector how
  many tokens past its own prefix cache the store holds (:meth:`get_num_new_matched_tokens`):
  the planner names each whole block of the prompt by a hash chain over its tokens and asks
  the store how long a run of those records it holds (``PageStore.present_run``: file
  presence, nothing read). It records which of the request's blocks to load once vLLM has
  allocated them (:meth:`update_state_after_alloc`) and which full blocks to save as the
  forward computes them, and ships both to every worker in the step's metadata
  (:meth:`build_connector_meta`). vLLM hands the same metadata to every worker, so the plan
  is made once and every worker executes the same one: no group rounds (docs/DESIGN.md
  §12 says how this relates to ``RankCache``'s replicated decisions).
- **Executors, on the workers.** A worker reads and writes records straight from and into
  the blocks of vLLM's KV tensors (:meth:`register_kv_caches`): a record is a block's
  bytes in every layer, in the order of vLLM's KV cache groups. Loads run before the
  forward (:meth:`start_load_kv`); a record that is missing, torn, changed or of another
  deployment (checksums and the fingerprint, checked by the store) is not copied, and its
  block and every later block of the request are reported by
  :meth:`get_block_ids_with_load_errors`, so vLLM recomputes them: a failed load is never
  served. Saves run in a writer thread after the step (:meth:`wait_for_save`), reading the
  blocks in place; :meth:`request_finished` keeps a request's blocks from being freed until
  its writes are done (:meth:`get_finished`), and a preempted request's writes are waited
  for before its blocks can be reused (:meth:`handle_preemptions`).
- **Records are canonical.** A record holds ``block_size`` consecutive tokens of a
  prompt (every layer), as a DCP-1 block holds them. Its name is a chain over the tokens up
  to and including it (salted with the store's fingerprint: the model, dtype, block size,
  layers and their page bytes), not vLLM's per-process block hashes (seeded at random
  unless ``PYTHONHASHSEED`` is set), so a store written by one vLLM process serves a later
  one, at any DCP degree.
- **Decode context parallelism.** vLLM's scheduler works in virtual blocks of
  ``block_size * dcp`` tokens: each names ``dcp`` records, and every DCP rank uses the same
  block id for its block, which holds its interleaved tokens (token ``t`` of a virtual block
  on rank ``(t // I) % dcp``, ``I`` = ``cp_kv_cache_interleave_size``; vLLM's
  ``block_table.py``). A worker finds its rank in vLLM's DCP group. With ``I`` a whole block,
  each rank's block is one record, read and written in place; with a smaller ``I`` each rank
  reads the records its tokens come from and takes its tokens out, and writes its tokens of
  each record as a part (``PageStore.put_part``): the last part to come assembles the record.
  So a store written at DCP 4 is read at DCP 2 and at DCP 1, and the other way round.
- **Tensor parallelism.** GQA/MHA KV heads are split across the TP ranks as vLLM splits
  them (``min(tp, KV heads)`` shards; where TP exceeds the heads, neighbouring ranks hold
  copies, and a DCP group lies within one shard's ranks). A record then holds one head
  shard's bytes and its key names the shard (:func:`head_shard_key`), so two shards never
  share a key and each rank reads only its own; the planner counts a block as a hit only
  when every shard's record is there. MLA's latent KV is the same on every TP rank: its
  keys name no shard. Only the first DCP group of ranks holding a shard (or MLA's KV)
  writes it; the copies load it and write nothing.
- **KV tensors.** A record holds each layer's block as ``[heads, tokens, bytes per token]``
  (vLLM 0.34's ``[B, H, N, C]`` view: a head's K then V, or MLA's latent entry), whatever
  the shape and strides of the tensors: GQA's ``[2, B, N, H, D]`` (K and V apart) and
  every vLLM KV cache layout give the same record (:meth:`register_kv_caches`).

Not built yet, refused at construction with a ``ValueError`` naming the setting: pipeline
or prefill-context parallelism, head splits vLLM does not make (a DCP group across two head
shards, a spec whose heads do not match the model's over TP), KV cache groups of more than
one kind (hybrid models). A store written at one TP degree is not read at another with a
different head split (its records hold other heads: another fingerprint, a miss).
Requests with multimodal inputs, LoRA adapters or prompt embeddings are neither looked up
nor saved (their KV is not a function of the token ids alone). Loads and saves are
whole-block, not layer by layer: :meth:`wait_for_layer_load` and :meth:`save_kv_layer`
return at once. Device (GPU) tensors are refused by :meth:`register_kv_caches`. The host
tier (pinned pools per worker) is not built: every hit is read from the store.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cp_hicache.vllm is vLLM's KV connector: it needs vLLM (0.34) importable "
        "(scripts/vllm-env.sh builds a CPU environment with it)"
    ) from e

from . import _native

__all__ = [
    "CpHiCacheConnector",
    "CpHiCacheMetadata",
    "CpHiCacheStats",
    "block_names",
    "extend_block_names",
]

logger = logging.getLogger(__name__)

#: The default capacity of the store, in bytes.
DEFAULT_CAPACITY = 16 << 30

#: A block of vLLM's scheduler to load or save: the names of the records its tokens are in
#: (one per ``block_size`` tokens: ``dcp`` of them under decode context parallelism, where
#: the scheduler's blocks are virtual blocks of ``block_size * dcp`` tokens) and its block id,
#: the same on every rank.
Job = Tuple[List[str], int]


def dcp_rank_and_size() -> Tuple[int, int]:
    """This worker's decode-context-parallel rank and degree, from vLLM's DCP group
    (``get_dcp_group()``); ``(0, 1)`` where vLLM has not set one up (no DCP)."""
    from vllm.distributed import parallel_state

    group = getattr(parallel_state, "_DCP", None)
    if group is None:
        return 0, 1
    return int(group.rank_in_group), int(group.world_size)


def tp_rank_and_size() -> Tuple[int, int]:
    """This worker's tensor-parallel rank and degree, from vLLM's TP group; ``(0, 1)``
    where vLLM has not set one up."""
    from vllm.distributed import parallel_state

    group = getattr(parallel_state, "_TP", None)
    if group is None:
        return 0, 1
    return int(group.rank_in_group), int(group.world_size)


def head_shard_key(name: str, shard: int, shards: int) -> str:
    """The store name of TP head shard ``shard`` (of ``shards``) of record ``name``: the
    record's name itself where the KV is not split by heads (``shards == 1``: MLA's latent
    KV, replicated on every TP rank, or a model whose every rank holds every KV head)."""
    return name if shards == 1 else f"{name}~kvh{shard}of{shards}"


def block_names(tokens: Sequence[int], block_size: int, salt: str = "") -> List[str]:
    """The record names of the whole blocks of ``tokens``: block ``i``'s name hashes block
    ``i - 1``'s with block ``i``'s tokens (little-endian u32), so equal names mean equal
    prefixes. ``salt`` (vLLM's ``cache_salt``) starts the chain, so salted prompts never
    share records with unsalted ones. Independent of the process, the rank and the CP
    degree."""
    names: List[str] = []
    extend_block_names(names, tokens, block_size, salt)
    return names


def extend_block_names(names: List[str], tokens: Sequence[int], block_size: int,
                       salt: str = "") -> None:
    """Appends to ``names`` (the names of the first ``len(names)`` blocks of ``tokens``)
    the names of the whole blocks of ``tokens`` after them: a request's names grow with
    its tokens, each hashed once."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    if names:
        prev = bytes.fromhex(names[-1])
    else:
        prev = hashlib.sha256(b"cp-hicache vllm block v1\0" + salt.encode()).digest()[:16]
    first, end = len(names), len(tokens) // block_size
    if end <= first:
        return
    arr = np.asarray(tokens[first * block_size:end * block_size], dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in u32")
    raw = arr.astype("<u4").tobytes()
    step = 4 * block_size
    for i in range(end - first):
        prev = hashlib.sha256(prev + raw[i * step:(i + 1) * step]).digest()[:16]
        names.append(prev.hex())


@dataclass
class CpHiCacheMetadata(KVConnectorMetadata):
    """One step's plan, built once by the scheduler-side connector and executed by every
    worker: blocks to load before the forward, blocks to save after it, and the requests
    preempted since the last step (their writes are waited for before their blocks are
    reused)."""

    loads: Dict[str, List[Job]] = field(default_factory=dict)
    saves: Dict[str, List[Job]] = field(default_factory=dict)
    preempted: Set[str] = field(default_factory=set)


@dataclass
class CpHiCacheStats(KVConnectorStats):
    """The worker's counters since the last report, summed over workers by vLLM:
    ``records_loaded`` (this rank's blocks filled from the store: a record each, or under
    DCP with a small interleave this rank's tokens of several), ``records_saved`` (records
    or parts written, or there already), ``load_errors`` (blocks whose record was refused
    or missing at load time: recomputed), ``save_errors`` (writes that failed: a later
    miss, nothing wrong served), ``saves_read_only`` (not written: the store is read-only to
    this process), ``bytes_loaded``, ``bytes_saved``."""

    def aggregate(self, other: KVConnectorStats) -> "CpHiCacheStats":
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, Any]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reset(self) -> None:
        self.data = {}


@dataclass
class _ReqState:
    """The planner's view of one request."""

    request: Any
    names: List[str] = field(default_factory=list)  # of its first blocks, grown as needed
    block_ids: List[int] = field(default_factory=list)
    planned: Optional[Tuple[int, int]] = None  # (first block, blocks) to load
    saved_upto: int = 0  # blocks already saved, or known to be in the store
    has_saves: bool = False


#: Runs per layer up to which a block is read and written in place (more: gathered).
MAX_RUNS_IN_PLACE = 8


class _LayerBlocks:
    """Where a record's bytes of one layer are in vLLM's tensor for that layer: for each
    byte of the record's ``[heads, tokens, bytes per token]`` block, its offset from the
    block's start (``index``), the blocks' stride, and the contiguous runs those offsets
    make (``runs``, or None when there are more than ``MAX_RUNS_IN_PLACE``)."""

    def __init__(self, storage: Any, base: int, stride: int, index: Any, num_blocks: int):
        self.storage = storage  # the tensor's bytes, a flat uint8 tensor
        self.base = base  # block 0's offset in ``storage``
        self.stride = stride
        self.index = index  # int64 [heads, tokens, width]
        self.heads, _, self.width = index.shape
        self.num_blocks = num_blocks
        flat = index.reshape(-1).numpy()
        cuts = np.flatnonzero(np.diff(flat) != 1) + 1
        starts = np.concatenate(([0], cuts))
        ends = np.concatenate((cuts, [flat.size]))
        self.runs = ([(int(flat[a]), int(b - a)) for a, b in zip(starts, ends)]
                     if starts.size <= MAX_RUNS_IN_PLACE else None)
        self.addr = int(storage.data_ptr()) + base

    @classmethod
    def of(cls, name: str, t: Any, num_blocks: int, block_size: int,
           page_bytes: int) -> "_LayerBlocks":
        """The layout of layer ``name``'s tensor ``t`` (see ``register_kv_caches``)."""
        import torch

        def refuse(why: str) -> ValueError:
            return ValueError(f"register_kv_caches: layer {name}'s KV tensor "
                              f"{tuple(t.shape)}: {why}")

        v = t
        if v.dim() == 5:
            kv_first = v.shape[0] == 2 and v.shape[1] % num_blocks == 0
            blocks_first = v.shape[1] == 2 and v.shape[0] % num_blocks == 0
            if kv_first and blocks_first:
                raise refuse("K/V first or blocks first is ambiguous with "
                             f"{num_blocks} blocks")
            if kv_first:
                v = v.movedim(0, 1)
            elif not blocks_first:
                raise refuse(f"neither [2, blocks, tokens, heads, head] nor [blocks, 2, "
                             f"tokens, heads, head] with {num_blocks} blocks")
            v = v.permute(0, 3, 2, 1, 4)  # [blocks, heads, tokens, K/V, head]
        elif v.dim() == 3:
            v = v.unsqueeze(1)  # [blocks, 1, tokens, entry]
        elif v.dim() != 4:
            raise refuse("not [blocks, heads, tokens, bytes], K and V apart or MLA's "
                         "[blocks, tokens, entry]")
        if v.shape[0] % num_blocks:
            raise refuse(f"{v.shape[0]} blocks, the KV cache config {num_blocks}")
        k = v.shape[0] // num_blocks
        # [blocks, heads, kernel blocks, tokens of a kernel block, ...]
        v = v.unflatten(0, (num_blocks, k)).movedim(1, 2)
        if k * v.shape[3] != block_size:
            raise refuse(f"{k} x {v.shape[3]} tokens a block, the spec {block_size}")
        es = t.element_size()
        shape, strides = v.shape[1:], v.stride()[1:]
        index = torch.zeros(tuple(shape) + (es,), dtype=torch.int64)
        for d, (n, st) in enumerate(zip(shape, strides)):
            view = [1] * (len(shape) + 1)
            view[d] = n
            index += torch.arange(n, dtype=torch.int64).view(view) * (st * es)
        index += torch.arange(es, dtype=torch.int64)
        index = index.reshape(shape[0], block_size, -1)
        if index.numel() != page_bytes:
            raise refuse(f"a block holds {index.numel()} bytes, the KV cache spec says "
                         f"{page_bytes}")
        if torch.unique(index).numel() != index.numel():
            raise refuse("its blocks' elements overlap")
        storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        base = (int(v.data_ptr()) - int(storage.data_ptr()))
        stride = v.stride(0) * es
        if base < 0 or base + (num_blocks - 1) * stride + int(index.max()) >= storage.numel():
            raise refuse("its blocks reach outside its storage")
        return cls(storage, base, stride, index, num_blocks)

    def parts(self, block: int) -> List[Tuple[int, int]]:
        at = self.addr + block * self.stride
        return [(at + off, n) for off, n in self.runs]

    def gather(self, block: int, slots: Optional[List[int]]) -> Any:
        idx = self.index if slots is None else self.index[:, slots, :]
        return self.storage[self.base + block * self.stride + idx]

    def scatter(self, block: int, src: Any, slots: Optional[List[int]]) -> None:
        idx = self.index if slots is None else self.index[:, slots, :]
        self.storage[self.base + block * self.stride + idx] = src


def _spec_words(spec: Any) -> str:
    """A KV cache spec's words for the fingerprint (its kind, shape and dtype)."""
    words = [type(spec).__name__]
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if hasattr(spec, attr):
            words.append(f"{attr}={getattr(spec, attr)}")
    return ",".join(words)


class CpHiCacheConnector(KVConnectorBase_V1):
    """vLLM ``KVConnectorBase_V1`` over a ``cp_hicache`` page store (see the module
    documentation). Configured through ``kv_connector_extra_config``:

    - ``path`` (required): the store's directory, shared by every worker and by later runs.
    - ``capacity_bytes`` (default 16 GiB): the store's byte budget; least recently used
      records go first.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        path = extra.get("path")
        if not path:
            raise ValueError(
                "CpHiCacheConnector needs kv_connector_extra_config['path']: the store's "
                "directory, shared by every worker (a shared file system on a cluster)"
            )
        capacity = int(extra.get("capacity_bytes", DEFAULT_CAPACITY))
        if capacity <= 0:
            raise ValueError(f"kv_connector_extra_config['capacity_bytes'] = {capacity} is not positive")
        pc = vllm_config.parallel_config
        #: The DCP degree and interleave size (vLLM's ``cp_kv_cache_interleave_size``).
        self.dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        self.interleave = int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1)
        self._check_parallel(vllm_config, self.dcp)
        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            raise ValueError("CpHiCacheConnector needs vLLM's KV cache config (kv_cache_groups)")
        groups = kv_cache_config.kv_cache_groups
        specs = {_spec_words(g.kv_cache_spec) for g in groups}
        if len(specs) != 1:
            raise ValueError(
                "CpHiCacheConnector stores one kind of KV cache; this model has KV cache "
                f"groups of {len(specs)} kinds ({'; '.join(sorted(specs))}): hybrid models "
                "are not built"
            )
        spec = groups[0].kv_cache_spec
        self.block_size = int(spec.block_size)
        if self.block_size != int(vllm_config.cache_config.block_size):
            raise ValueError(
                f"the KV cache spec's block size {self.block_size} is not the scheduler's "
                f"{vllm_config.cache_config.block_size}"
            )
        if self.dcp > 1 and (self.block_size % self.interleave
                             or not getattr(spec, "dcp_sharded", True)):
            raise ValueError(
                f"CpHiCacheConnector: cp_kv_cache_interleave_size {self.interleave} does not "
                f"divide the block size {self.block_size}, or the KV cache is not DCP-sharded"
            )
        #: Tokens per scheduler block: a virtual block of ``dcp`` ranks' blocks.
        self.sched_block = self.block_size * self.dcp
        #: The TP degree, and how many distinct KV head shards its ranks hold: records are
        #: per head shard (``head_shard_key``) when it is more than 1.
        self.tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.head_shards = self._head_shards(vllm_config, spec, self.tp, self.dcp)
        #: Layer names, in record order: every group's layers, in order.
        self.layer_names: List[str] = [n for g in groups for n in g.layer_names]
        self.layer_page_bytes = int(spec.page_size_bytes)
        self.page_bytes = self.layer_page_bytes * len(self.layer_names)
        model = getattr(getattr(vllm_config, "model_config", None), "model", None)
        self.fingerprint = ";".join([
            "vllm-kv-connector v2",
            f"model={model}",
            f"block_size={self.block_size}",
            f"spec={_spec_words(spec)}",
            f"layers={len(self.layer_names)}",
            f"page_bytes={self.page_bytes}",
        ] + ([f"kv_head_shards={self.head_shards}"] if self.head_shards > 1 else []))
        digest = hashlib.sha256(self.fingerprint.encode()).hexdigest()[:16]
        self.path = str(path)
        self.store_path = os.path.join(self.path, f"vllm-{digest}")
        self.store = _native.PageStore(self.store_path, self.fingerprint, self.page_bytes, capacity)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", None)
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            logger.warning(
                "cp_hicache: kv_load_failure_policy is %r: a record that fails to load ends "
                "its request with an error; \"recompute\" recomputes its blocks instead", policy)
        # Scheduler side.
        self._reqs: Dict[str, _ReqState] = {}
        self._pending_loads: Dict[str, List[Job]] = {}
        self._delayed: Set[str] = set()
        self._planner_stats = {"lookups": 0, "hit_tokens": 0, "finished_sending": 0,
                               "invalid_blocks": 0}
        # Worker side.
        self.dcp_rank = 0
        self.tp_rank = self.head_shard = self.copy = 0
        if role == KVConnectorRole.WORKER:
            rank, size = dcp_rank_and_size()
            if size != self.dcp:
                raise ValueError(
                    f"CpHiCacheConnector: vLLM's DCP group has {size} ranks, the config says "
                    f"decode_context_parallel_size = {self.dcp}"
                )
            self.dcp_rank = rank
            tp_rank, tp_size = tp_rank_and_size()
            if tp_size != self.tp:
                raise ValueError(
                    f"CpHiCacheConnector: vLLM's TP group has {tp_size} ranks, the config "
                    f"says tensor_parallel_size = {self.tp}"
                )
            self.tp_rank = tp_rank
            per_shard = self.tp // self.head_shards
            self.head_shard = tp_rank // per_shard
            # The TP ranks beyond the first DCP group of a shard hold copies of its KV:
            # they load it, but only the first group writes it.
            self.copy = (tp_rank % per_shard) // self.dcp
        self._slots: List[Tuple[int, int]] = self._local_slots(self.dcp_rank)
        # Per layer: where each byte of a record's layer is in vLLM's tensor.
        self._layers: Optional[List[_LayerBlocks]] = None
        self._in_place = False
        self._num_blocks = 0
        self._writer: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._writes: Dict[str, List[concurrent.futures.Future]] = {}
        self._saving_reqs: Set[str] = set()
        self._finished_waiting: Set[str] = set()
        self._load_errors: Set[int] = set()
        self._stats: Dict[str, int] = {}
        self._stats_lock = threading.Lock()

    @staticmethod
    def _check_parallel(vllm_config: Any, dcp: int) -> None:
        pc = getattr(vllm_config, "parallel_config", None)
        for name in ("pipeline_parallel_size", "prefill_context_parallel_size"):
            n = int(getattr(pc, name, 1) or 1)
            if n > 1:
                raise ValueError(
                    f"CpHiCacheConnector: {name} = {n} is not built yet (each PP stage or "
                    "PCP rank would hold other bytes of a block; records in shards are not "
                    "built)"
                )
        tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        if tp % dcp:
            raise ValueError(
                f"CpHiCacheConnector: tensor_parallel_size = {tp} is not a multiple of "
                f"decode_context_parallel_size = {dcp} (vLLM's DCP groups are TP ranks)"
            )

    @staticmethod
    def _head_shards(vllm_config: Any, spec: Any, tp: int, dcp: int) -> int:
        """How many distinct KV head shards the TP ranks hold (1: every rank holds the same
        heads). MLA's latent KV (``MLAAttentionSpec``, or a spec whose ``max_tp_shards`` is
        1) is the same on every TP rank. GQA/MHA KV heads are split across the TP ranks as
        vLLM's ``QKVParallelLinear`` splits them: ``min(tp, total KV heads)`` shards of
        ``spec.num_kv_heads`` heads, rank ``r`` holding shard ``r // (tp / shards)`` (its
        neighbours hold copies when TP exceeds the heads). A DCP group (``dcp``
        consecutive TP ranks) must lie within one shard's ranks: they split one shard's
        tokens."""
        try:
            from vllm.v1.kv_cache_interface import MLAAttentionSpec
        except ImportError:  # pragma: no cover - depends on vLLM's version
            MLAAttentionSpec = ()
        declared = getattr(spec, "max_tp_shards", None)
        if isinstance(spec, MLAAttentionSpec) or declared == 1:
            return 1
        per_rank = int(getattr(spec, "num_kv_heads", 0) or 0)
        if declared is not None:
            shards = min(tp, int(declared))
        else:
            mc = getattr(vllm_config, "model_config", None)
            total = None
            if mc is not None and hasattr(mc, "get_total_num_kv_heads"):
                try:
                    total = int(mc.get_total_num_kv_heads())
                except Exception:  # a model config without head counts: assume none split
                    total = None
            if total is None:
                return 1 if tp == 1 else tp
            shards = min(tp, total)
            if shards > 1 and per_rank and per_rank * shards != total:
                raise ValueError(
                    f"CpHiCacheConnector: the KV cache spec holds {per_rank} KV heads per "
                    f"rank, the model has {total} KV heads over tensor_parallel_size = {tp} "
                    f"({shards} shards): the head split is not vLLM's"
                )
        if shards < 1 or tp % shards:
            raise ValueError(
                f"CpHiCacheConnector: {shards} KV head shards over tensor_parallel_size = "
                f"{tp}: the TP ranks do not split the heads evenly"
            )
        if (tp // shards) % dcp:
            raise ValueError(
                f"CpHiCacheConnector: {tp // shards} TP ranks hold each of {shards} KV head "
                f"shards; a DCP group of {dcp} ranks would span two shards (vLLM needs "
                "tensor_parallel_size / KV heads to be a multiple of the DCP size)"
            )
        return shards

    # ======================================================================================
    # Scheduler side: the planner
    # ======================================================================================

    @staticmethod
    def _cacheable(request: Any) -> bool:
        """Whether a request's KV is a function of its token ids alone (no multimodal
        inputs, LoRA adapter or prompt embeddings), the only KV records can name."""
        return not (getattr(request, "mm_features", None)
                    or getattr(request, "lora_request", None) is not None
                    or getattr(request, "prompt_embeds", None) is not None)

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = _ReqState(request=request)
            self._reqs[request.request_id] = st
        return st

    def _names(self, st: _ReqState, upto_blocks: int) -> List[str]:
        """The names of the request's first ``upto_blocks`` blocks (extended as its tokens
        grow; computed once per token)."""
        if len(st.names) < upto_blocks:
            tokens = st.request.all_token_ids[:upto_blocks * self.block_size]
            salt = getattr(st.request, "cache_salt", None) or ""
            extend_block_names(st.names, tokens, self.block_size, salt)
        return st.names

    def _block_names(self, st: _ReqState, block: int) -> List[str]:
        """The record names of scheduler block ``block`` (computed already)."""
        return st.names[block * self.dcp:(block + 1) * self.dcp]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> Tuple[int, bool]:
        """How many tokens past ``num_computed_tokens`` (vLLM's own prefix-cache hit, block
        aligned) the store holds, in whole blocks, leaving the last prompt token to be
        computed. Only records on disk count (a write in flight is not one yet). Loads are
        synchronous (``False``): they run before the step's forward."""
        st = self._state(request)
        st.planned = None
        self._planner_stats["lookups"] += 1
        sb, d = self.sched_block, self.dcp
        if not self._cacheable(request) or num_computed_tokens % sb:
            return 0, False
        limit = (request.num_tokens - 1) // sb  # scheduler blocks
        first = num_computed_tokens // sb
        if limit <= first:
            return 0, False
        names = self._names(st, limit * d)
        h = self.head_shards
        wanted = names[first * d:limit * d]
        if h > 1:  # every head shard of every record of a block: one TP rank's each
            wanted = [head_shard_key(n, s, h) for n in wanted for s in range(h)]
        run = self.store.present_run(wanted) // (d * h)
        if run == 0:
            return 0, False
        st.planned = (first, run)
        self._planner_stats["hit_tokens"] += run * sb
        return run * sb, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Turns the planned hit into load jobs on the blocks vLLM allocated for it."""
        st = self._state(request)
        planned, st.planned = st.planned, None
        if num_external_tokens == 0:
            return
        if planned is None:
            raise RuntimeError(
                f"vLLM allocated {num_external_tokens} external tokens for request "
                f"{request.request_id} that get_num_new_matched_tokens did not offer"
            )
        first, run = planned
        sb = self.sched_block
        if num_external_tokens % sb or num_external_tokens > run * sb:
            raise RuntimeError(
                f"request {request.request_id}: {num_external_tokens} external tokens, "
                f"the plan offered {run} whole blocks of {sb}"
            )
        n = num_external_tokens // sb
        (block_ids,) = blocks.get_block_ids()
        if len(block_ids) < first + n:
            raise RuntimeError(
                f"request {request.request_id}: {len(block_ids)} blocks allocated, the load "
                f"needs blocks {first}..{first + n}"
            )
        self._pending_loads[request.request_id] = [
            (self._block_names(st, first + k), int(block_ids[first + k])) for k in range(n)
        ]
        # Those blocks are in the store already: no need to save them again.
        st.saved_upto = max(st.saved_upto, first + n)

    def build_connector_meta(self, scheduler_output: Any) -> CpHiCacheMetadata:
        """The step's plan: the loads planned since the last step, the full blocks this
        step's forward completes (to save), the requests preempted since the last step."""
        meta = CpHiCacheMetadata(loads=self._pending_loads)
        self._pending_loads = {}
        # Preempted requests lost their blocks (first: one may be resumed in the same step,
        # with its new blocks among the new requests').
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:
                st.block_ids = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                raise RuntimeError(
                    f"request {new.req_id} was scheduled without get_num_new_matched_tokens"
                )
            st.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            st = self._reqs.get(rid)
            if st is not None and new_ids is not None:
                st.block_ids.extend(new_ids[0])
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                raise RuntimeError(f"request {rid} was scheduled without the planner seeing it")
            req = st.request
            if not self._cacheable(req):
                continue
            # num_computed_tokens is still the step's start here (vLLM advances it after
            # building the metadata); tokens past num_tokens are speculative drafts.
            end = min(req.num_computed_tokens + n, req.num_tokens)
            full = min(end // self.sched_block, len(st.block_ids))
            if full <= st.saved_upto:
                continue
            self._names(st, full * self.dcp)
            jobs = [(self._block_names(st, k), int(st.block_ids[k]))
                    for k in range(st.saved_upto, full)]
            st.saved_upto = full
            meta.saves[rid] = jobs
            st.has_saves = True
        return meta

    def request_finished(self, request: Any, block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Frees the planner's state of the request; keeps vLLM from freeing its blocks
        (``True``) when saves were planned for it, until the workers report its writes done
        (``finished_sending`` from :meth:`get_finished`)."""
        st = self._reqs.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        delay = st is not None and st.has_saves
        if delay:
            self._delayed.add(request.request_id)
        return delay, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Takes the workers' reports: requests whose writes are done (their blocks are
        freed by vLLM now) and blocks that failed to load (vLLM recomputes them)."""
        for rid in connector_output.finished_sending or ():
            if rid not in self._delayed:
                raise RuntimeError(
                    f"a worker reported request {rid}'s saves done, but its freeing was "
                    "not delayed"
                )
            self._delayed.discard(rid)
            self._planner_stats["finished_sending"] += 1
        invalid = set(connector_output.invalid_block_ids or ())
        self._planner_stats["invalid_blocks"] += len(invalid)
        if invalid:
            # vLLM recomputes from a request's first invalid block: save the recomputed
            # blocks again (the store removed the refused record).
            for st in self._reqs.values():
                for k, b in enumerate(st.block_ids[:st.saved_upto]):
                    if b in invalid:
                        st.saved_upto = k
                        break

    def planner_stats(self) -> Dict[str, int]:
        """The scheduler side's counters: lookups, tokens offered, requests whose saves
        were reported done, blocks reported invalid; and ``tracked`` requests, ``delayed``
        frees (both 0 once every request has finished and been freed)."""
        return dict(self._planner_stats, tracked=len(self._reqs), delayed=len(self._delayed))

    # ======================================================================================
    # Worker side: the executor
    # ======================================================================================

    def _local_slots(self, rank: int) -> List[Tuple[int, int]]:
        """Where each slot of ``rank``'s block of a scheduler block comes from: ``(record
        within the scheduler block, token within the record)``, vLLM's DCP layout
        (``block_table.py``): slot ``s`` holds the virtual block's token ``(s // I) * I * dcp
        + rank * I + s % I``, with ``I`` the interleave size."""
        i, d, bs = self.interleave, self.dcp, self.block_size
        out = []
        for s in range(bs):
            o = (s // i) * i * d + rank * i + s % i
            out.append((o // bs, o % bs))
        return out

    def _direct(self) -> bool:
        """Whether this rank's block holds one record's tokens, in order (DCP 1, or an
        interleave of a whole block): records then go straight between the store and the
        block."""
        return self.dcp == 1 or self.interleave == self.block_size

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        """Takes vLLM's per-layer KV tensors (CPU tensors), in any of these shapes:

        - ``[B, H, N, C]``: vLLM 0.34's per-layer view of every KV cache layout (``H`` the
          rank's KV heads, 1 for MLA; ``N`` the block's tokens; ``C`` a head's K then V, or
          MLA's latent entry), whatever its strides (``LBHNC``, ``LBNHC``, ``LHBNC``, ...);
        - ``[2, B, N, H, D]`` (K and V apart: the GQA/MHA shape of FlashAttention-style
          backends) or ``[B, 2, N, H, D]``;
        - ``[B, N, C]`` (MLA's latent KV);

        ``B`` the KV cache config's blocks, or kernel blocks (``num_blocks * k`` blocks of
        ``N / k`` tokens). A record holds each layer's block as ``[H, N, C]`` (a head's K then
        V for every token), in layer order: the same bytes whatever the shape or strides of
        the tensors it came from, so every layout reads every other's records. Blocks whose
        bytes are a few contiguous runs in that order are read and written in place; others
        (and DCP's interleaved tokens) are gathered and scattered through byte indices."""
        import torch

        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"register_kv_caches: no KV tensor for layers {missing}")
        num_blocks = int(self._kv_cache_config.num_blocks)
        layers = []
        for name in self.layer_names:
            t = kv_caches[name]
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"register_kv_caches: layer {name} is not a torch tensor")
            if t.device.type != "cpu":
                raise ValueError(
                    f"register_kv_caches: layer {name} is on {t.device}; the first step reads "
                    "and writes CPU tensors only (the staging of device blocks is not built)"
                )
            layers.append(_LayerBlocks.of(name, t, num_blocks, self.block_size,
                                          self.layer_page_bytes))
        if len({(g.heads, g.width) for g in layers}) != 1:
            raise ValueError("register_kv_caches: the layers' blocks differ in heads or bytes "
                             "per token")
        self._kv_caches_kept = kv_caches  # the addresses stay valid while vLLM's tensors live
        self._layers = layers
        self._in_place = all(g.runs is not None for g in layers)
        self._num_blocks = num_blocks
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cp-hicache-save")

    def _check_block(self, block_id: int) -> None:
        if self._layers is None:
            raise RuntimeError("CpHiCacheConnector: register_kv_caches was not called")
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside 0..{self._num_blocks}")

    def _parts(self, block_id: int) -> Optional[List[Tuple[int, int]]]:
        """The block's record as ``(address, bytes)`` runs of vLLM's tensors, in record
        order; None when its bytes are too scattered to be read and written in place."""
        self._check_block(block_id)
        if not self._in_place:
            return None
        return [run for g in self._layers for run in g.parts(block_id)]

    def _gather(self, block_id: int, slots: Optional[List[int]] = None) -> Any:
        """The block's bytes (of its slots ``slots``, or all), ``[layers][heads][tokens]
        [bytes]``, copied out of vLLM's tensors (a uint8 tensor)."""
        import torch

        return torch.cat([g.gather(block_id, slots).reshape(-1) for g in self._layers])

    def _scatter(self, block_id: int, record: Any, slots: Optional[List[int]] = None,
                 toks: Optional[List[int]] = None) -> None:
        """Puts a record's tokens ``toks`` (or all) into the block's slots ``slots`` (or
        all, in order)."""
        per_layer = record.view(len(self._layers), -1)
        for g, layer in zip(self._layers, per_layer):
            src = layer.view(g.heads, self.block_size, g.width)
            g.scatter(block_id, src if toks is None else src[:, toks, :], slots)

    def _key(self, name: str) -> str:
        """The store name of this worker's head shard of record ``name``."""
        return head_shard_key(name, self.head_shard, self.head_shards)

    def _count(self, **kv: int) -> None:
        with self._stats_lock:
            for k, v in kv.items():
                self._stats[k] = self._stats.get(k, 0) + v

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Waits for the writes of requests preempted since the last step: vLLM freed their
        blocks, and this step may write other KV into them."""
        for rid in getattr(kv_connector_metadata, "preempted", ()) or ():
            for f in self._writes.get(rid, ()):
                f.exception()

    def _load_block(self, names: List[str], block_id: int) -> bool:
        """Reads this rank's tokens of scheduler block ``block_id`` (of its head shard) from
        their records; False when one is missing or refused (then nothing of that record
        was written)."""
        import torch

        if self._direct():
            key = self._key(names[self.dcp_rank % len(names)])
            parts = self._parts(block_id)
            if parts is not None:
                return self.store.get(key, parts)
            rec = np.empty(self.page_bytes, dtype=np.uint8)
            if not self.store.get(key, [(int(rec.ctypes.data), rec.nbytes)]):
                return False
            self._scatter(block_id, torch.from_numpy(rec))
            return True
        self._check_block(block_id)
        by_record: Dict[int, Tuple[List[int], List[int]]] = {}
        for s, (k, tok) in enumerate(self._slots):
            slots, toks = by_record.setdefault(k, ([], []))
            slots.append(s)
            toks.append(tok)
        ok = True
        for k, (slots, toks) in sorted(by_record.items()):
            rec = np.empty(self.page_bytes, dtype=np.uint8)
            if not self.store.get(self._key(names[k]), [(int(rec.ctypes.data), rec.nbytes)]):
                ok = False
                continue
            self._scatter(block_id, torch.from_numpy(rec), slots, toks)
        return ok

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Reads every planned record into its block, before the forward. A record that
        is missing or refused, and every later block of its request, is not served: the
        blocks go to :meth:`get_block_ids_with_load_errors` and vLLM recomputes them."""
        meta = self._get_connector_metadata()
        for rid, jobs in meta.loads.items():
            failed = False
            for names, block_id in jobs:
                if failed:
                    self._load_errors.add(block_id)
                    continue
                try:
                    ok = self._load_block(names, block_id)
                except (_native.UsageError, OSError) as e:  # an I/O error of the store
                    logger.warning("cp_hicache: loading block %d of %s failed: %s",
                                   block_id, rid, e)
                    ok = False
                if ok:
                    self._count(records_loaded=1, bytes_loaded=self.page_bytes)
                else:
                    failed = True
                    self._load_errors.add(block_id)
                    self._count(load_errors=1)
            if failed:
                logger.warning("cp_hicache: request %s: a planned record could not be "
                               "loaded; vLLM recomputes from its block", rid)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Returns at once: :meth:`start_load_kv` has loaded every layer (loads are not
        layer by layer yet)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Returns at once: saves take a block's every layer after the step
        (:meth:`wait_for_save`), not layer by layer yet."""
        return

    def wait_for_save(self) -> None:
        """Hands the step's planned saves to the writer thread, which writes each block's
        record from vLLM's tensors in place. vLLM keeps the blocks until the request's
        writes are reported done (:meth:`request_finished`, :meth:`get_finished`); a
        preemption waits for them (:meth:`handle_preemptions`). Under DCP with an interleave
        of a whole block each rank writes the records its block holds; with a smaller one
        every rank holds part of each record and writes it as a part
        (``PageStore.put_part``): the last part to come assembles and writes the record,
        the same bytes a DCP-1 block holds."""
        meta = self._get_connector_metadata()
        if self._writer is None and meta.saves:
            raise RuntimeError(
                "CpHiCacheConnector: saves planned on a worker that was shut down"
                if self._layers is not None
                else "CpHiCacheConnector: register_kv_caches was not called"
            )
        for rid, jobs in meta.saves.items():
            self._saving_reqs.add(rid)  # reported by get_finished once its writes are done
            if self.copy:
                # This rank's KV is a copy of another DCP group's (TP ranks beyond the
                # heads, or MLA's replicated latent KV): that group writes it.
                continue
            if self._direct():
                work = []
                for names, b in jobs:
                    key = self._key(names[self.dcp_rank % len(names)])
                    parts = self._parts(b)
                    # Scattered blocks are copied out now (the block may be reused once
                    # the step is over); contiguous ones are read in place by the writer.
                    work.append((key, parts if parts is not None
                                 else self._gather(b).numpy(), None))
            else:
                # Each rank holds part of each record: its part is copied out now (the
                # block may be reused once the step is over), written as a part after.
                work = [w for names, b in jobs for w in self._part_payloads(names, b)]
            self._writes.setdefault(rid, []).append(self._writer.submit(self._write, rid, work))

    def _owners(self, record: int) -> List[int]:
        """The ranks holding tokens of record ``record`` of a scheduler block, in order."""
        i, d, bs = self.interleave, self.dcp, self.block_size
        return sorted({(o // i) % d for o in range(record * bs, (record + 1) * bs)})

    def _part_payloads(self, names: List[str], block_id: int) -> List[Tuple[str, Any, Any]]:
        """This rank's part of each record of scheduler block ``block_id`` it holds tokens
        of: ``(name, payload, (part, parts, record))``, the payload its tokens of the record
        packed ``[layers][heads][its tokens][bytes per token]``."""
        self._check_block(block_id)
        out = []
        for k, name in enumerate(names):
            slots = [s for s, (rec, _) in enumerate(self._slots) if rec == k]
            if not slots:
                continue
            owners = self._owners(k)
            payload = self._gather(block_id, slots).numpy()
            out.append((self._key(name), payload, (owners.index(self.dcp_rank), len(owners), k)))
        return out

    def _assemble(self, record: int, payloads: List[bytes]) -> bytes:
        """A record's payload from its owners' parts (in owner order), each rank's tokens
        put back in their places: the record as a DCP-1 block holds it."""
        rows, width = self._layers[0].heads, self._layers[0].width
        layers = len(self.layer_names)
        rec = np.empty((layers, rows, self.block_size, width), dtype=np.uint8)
        for owner, payload in zip(self._owners(record), payloads):
            toks = [t for rec_k, t in self._local_slots(owner) if rec_k == record]
            part = np.frombuffer(payload, dtype=np.uint8)
            if part.size != layers * rows * len(toks) * width:
                raise ValueError(
                    f"a part of {part.size} bytes from rank {owner}, this layout's parts "
                    f"hold {layers * rows * len(toks) * width}"
                )
            rec[:, :, toks, :] = part.reshape(layers, rows, len(toks), width)
        return rec.tobytes()

    def _write(self, rid: str, jobs: List[Tuple[str, Any, Any]]) -> None:
        for name, data, part in jobs:
            try:
                if part is None:
                    if isinstance(data, np.ndarray):
                        data = [(int(data.ctypes.data), int(data.nbytes))]
                    written = self.store.put(name, data)
                else:
                    index, count, record = part
                    written = self.store.put_part(
                        name, index, count, [(int(data.ctypes.data), int(data.nbytes))],
                        lambda ps, record=record: self._assemble(record, ps)) != "read_only"
                if written:
                    self._count(records_saved=1, bytes_saved=self.page_bytes)
                else:  # a store this process may only read (another user's, a read-only
                    self._count(saves_read_only=1)  # mount): read, never written
            except Exception as e:  # a failed write is a later miss, counted and logged
                logger.warning("cp_hicache: saving a block of %s failed: %s", rid, e)
                self._count(save_errors=1)

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Requests that finished and whose writes are all done (``finished_sending``:
        vLLM frees their blocks now). Loads are synchronous: nothing is received."""
        self._finished_waiting |= set(finished_req_ids) & self._saving_reqs
        done = set()
        for rid in list(self._finished_waiting):
            if all(f.done() for f in self._writes.get(rid, ())):
                done.add(rid)
                self._finished_waiting.discard(rid)
                self._saving_reqs.discard(rid)
                self._writes.pop(rid, None)
        # Writes of requests still running that are done need no tracking.
        for rid, fs in self._writes.items():
            fs[:] = [f for f in fs if not f.done()]
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks whose planned record could not be loaded since the last call (vLLM
        recomputes them)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> Optional[CpHiCacheStats]:
        """The worker's counters since the last call (:class:`CpHiCacheStats`)."""
        with self._stats_lock:
            data, self._stats = self._stats, {}
        return CpHiCacheStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional[CpHiCacheStats]:
        return CpHiCacheStats(data=dict(data)) if data is not None else CpHiCacheStats()

    def store_stats(self) -> Dict[str, Any]:
        """What this process's store did (records written, read, refused by kind)."""
        return self.store.stats()

    def shutdown(self) -> None:
        """Waits for every write in flight, then stops the writer thread."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
