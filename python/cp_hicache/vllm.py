"""vLLM's KV connector over cp-hicache's host tier and page store: ``CpHiCacheConnector``.

Loaded out of tree by vLLM's own connector factory, no fork::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "CpHiCacheConnector",
        "kv_connector_module_path": "cp_hicache.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"path": "/shared/kv-store",
                                      "capacity_bytes": 1099511627776,
                                      "host_bytes": 8589934592}}'

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
- **Executors, on the workers.** A worker moves records between the store and
  the blocks of vLLM's KV tensors (:meth:`register_kv_caches`): a record is a block's
  bytes in every layer, in the order of vLLM's KV cache groups.
- **The host tier, decided by the planner.** Each worker allocates a pool of
  ``host_bytes // page_bytes`` block slots once (pinned where CUDA is there). The planner
  keeps the one index of them (:class:`_HostIndex`: block key -> slot, least recently used
  first): every worker holds the same blocks in the same slots, each its own bytes of them
  (its head shard's, its DCP rank's tokens). A lookup offers the run over host and store;
  the metadata names the loads a slot serves (``host_loads``: no store read) and, with a
  step's verdict, the admissions of its kept saves with their slots (``host_admits``: an
  admission evicts the slot's block). Workers never decide: they check each slot's block
  key on a load (a mismatch fails the load: reported, recomputed) and report the
  admissions they could not make (``CpHiCacheWorkerMeta.host_failed``), which the planner
  drops from its index. No group round.
- **Layer-wise loads.** :meth:`start_load_kv` hands the step's loads to the worker's loader
  thread and returns. The loader reads the planned records into host memory first (each
  checked whole by the store: checksums and the fingerprint; at most
  ``load_buffer_bytes`` at once, in batches past it), then fills the blocks layer by layer,
  in layer order; :meth:`wait_for_layer_load` blocks the forward until its layer is in
  every loaded block. A record that is missing, torn, changed or of another
  deployment is not copied, and its block and every later block of the request are
  reported by :meth:`get_block_ids_with_load_errors`, which waits for the step's loads to
  end: a block any layer of which could not be filled is reported whole in that step, even
  where its earlier layers were already waited for, so vLLM discards what the step computed
  over it and recomputes it: a failed load is never served. With ``load_async`` loads span
  steps instead (vLLM's ``load_kv_async``): the request waits out of the batch, and
  :meth:`get_finished` reports it received once its blocks are in (or failed).
  **A failed load taints saves, on every rank:** the forward computed the step's blocks
  over the failed block as if it were loaded, on every rank (attention mixes the ranks'
  KV), and only the planner sees every rank's failures. So a worker holds each step's
  saves until the planner, having the step's report from every worker
  (:class:`CpHiCacheWorkerMeta`, with the failed blocks merged by vLLM), settles the step
  in a later step's metadata (``CpHiCacheMetadata.settled``): the saves of requests whose
  blocks include a failed one are dropped on every rank (and planned again where the
  request still runs), the others written.
- **Asynchronous, layer-wise saves.** :meth:`save_kv_layer`, called by each attention
  layer after its forward, copies that layer's bytes of the step's blocks to save into host
  buffers (:meth:`wait_for_save` copies the layers a forward did not hand over, and waits
  for no write); once the planner has settled the step, the blocks go to the writer
  thread, whose queue holds at most ``save_buffer_bytes`` (handing over more waits for
  room). :meth:`request_finished` keeps a finished request's blocks from being freed until
  the workers report its saves written or dropped (``finished_sending`` from
  :meth:`get_finished`); the writer's failures are counted (``save_errors``), never lost.
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
  each rank's block is one record, loaded and saved whole; with a smaller ``I`` each rank
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
  writes it; the copies load it and write nothing. Records are re-sharded on read: each
  head split of a model has its own store (``path/vllm-<digest>``, its fingerprint naming
  the split), and a rank reads the records of any split holding its heads, taking their
  bytes out or putting several side by side (:meth:`CpHiCacheConnector._read_split`); the
  planner offers a block when every shard of some split holds it.
- **KV tensors.** A record holds each layer's block as ``[heads, tokens, bytes per token]``
  (vLLM 0.34's ``[B, H, N, C]`` view: a head's K then V, or MLA's latent entry), whatever
  the shape and strides of the tensors: GQA's ``[2, B, N, H, D]`` (K and V apart) and
  every vLLM KV cache layout give the same record (:meth:`register_kv_caches`).

Not built yet, refused at construction with a ``ValueError`` naming the setting: pipeline
or prefill-context parallelism, head splits vLLM does not make (a DCP group across two head
shards, a spec whose heads do not match the model's over TP), KV cache groups of more than
one kind (hybrid models), windowed attention (sliding window, chunked local: vLLM gives
the blocks out of the window the null block, which would be loaded into and saved from).
Requests with multimodal inputs, LoRA adapters or prompt embeddings are neither looked up
nor saved (their KV is not a function of the token ids alone). Loads and saves are
staged through host memory by threads of the worker (no CUDA stream yet). Device (GPU)
tensors are refused by :meth:`register_kv_caches`. The host tier admits saved blocks
and blocks read from the store (``host_fills``); those a load that spans steps reads go
into their slots when it ends, and the planner pins them (neither offered nor evicted)
until the load is reported received.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
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
    "CpHiCacheWorkerMeta",
    "block_names",
    "extend_block_names",
]

logger = logging.getLogger(__name__)

#: The keys of ``kv_connector_extra_config`` the connector knows; any other is refused.
CONFIG_KEYS = ("path", "host_bytes", "capacity_bytes", "load_buffer_bytes",
               "save_buffer_bytes", "load_async", "write_policy")

#: The values of ``kv_connector_extra_config['write_policy']``: ``write_through`` (the
#: default: a computed block is saved to the host tier and the store) and ``write_back``
#: (to the host tier only; written to the store when the host tier evicts it, and at
#: ``shutdown``).
WRITE_POLICIES = ("write_through", "write_back")

#: The writer task name of a write-back flush (a host slot's block written to the store
#: when the host tier evicts it): no request waits for it.
_FLUSH = "\0host-flush"

#: The default capacity of the store, in bytes.
DEFAULT_CAPACITY = 16 << 30

#: Bytes of a record's header in a directory store (``src/storage/record.rs``): a record
#: of ``page_bytes`` takes ``page_bytes + RECORD_HEADER_BYTES`` of the store's budget.
RECORD_HEADER_BYTES = 64

#: The budget another head split's directory is opened with only to count its bytes: no
#: record is evicted (a store evicts at open down to its budget).
_NO_EVICTION = 1 << 62

#: The default host tier a worker (``host_bytes``): 4 GiB of pinned memory, allocated once
#: when the worker registers its KV tensors. A node of 8 workers pins 32 GiB, a small share
#: of a GPU server's memory, and a worker holds 2048 blocks of 2 MiB (a 16-token block of
#: an 8B GQA model at TP 1: 32k tokens; more at higher TP, where a worker's block holds
#: fewer heads). The least recently used blocks go first; 0 turns the tier off.
DEFAULT_HOST_BYTES = 4 << 30

#: The default bound on a worker's host memory for records read and not yet filled into
#: their blocks (``load_buffer_bytes``), and for copied blocks handed to the writer and not
#: yet written (``save_buffer_bytes``).
DEFAULT_LOAD_BUFFER = 256 << 20
DEFAULT_SAVE_BUFFER = 256 << 20

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


class _HostIndex:
    """The planner's accounting of the host tier of every worker: which scheduler blocks
    (each named by its last record's name, a chain over every token up to the block's end)
    every worker holds, in which slot of its pool, least recently used first. Every worker
    holds the same blocks in the same slots (its own bytes of each: its head shard's, its
    DCP rank's tokens), so one index serves all; the workers only execute what it decides
    (admissions, each replacing the slot's previous block: its eviction)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.lru: "OrderedDict[str, int]" = OrderedDict()  # block key -> slot, LRU first
        self.free: List[int] = list(range(slots - 1, -1, -1))
        #: Each entry's admission number (its generation): a report about an admission (a
        #: worker could not make it, a load from it failed) drops the entry only while it
        #: is still that admission's, never a newer admission of the same key.
        self.gens: Dict[str, int] = {}
        self._gen = 0
        #: Admissions being filled by loads that span steps (``load_async``), admission
        #: number -> ``(slot, block key)``: neither offered (the slots are filled when the
        #: load ends) nor evicted until the load is reported received; a slot whose entry
        #: was dropped meanwhile stays taken until then (a worker may still be filling it).
        self.pinned: Dict[int, Tuple[int, str]] = {}
        #: ``write_back``: the blocks held only here, not yet in the store (an eviction of
        #: one is a flush: the workers write the slot's bytes to the store before they
        #: reuse it), and how many such evictions there were.
        self.dirty: Set[str] = set()
        self.flushes = 0

    def get(self, key: str) -> Optional[int]:
        """The slot holding (or, pinned, being filled with) ``key``; None if none."""
        return self.lru.get(key)

    def servable(self, key: str) -> Optional[int]:
        """The slot a load may read ``key`` from: None where no slot holds it, or its slot
        is still being filled by a load that spans steps."""
        slot = self.lru.get(key)
        return None if slot is None or self.gens[key] in self.pinned else slot

    def gen(self, key: str) -> int:
        return self.gens.get(key, 0)

    def touch(self, key: str) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)

    def admit(self, key: str, pin: bool = False) -> Optional[Tuple[int, str, int]]:
        """A slot for ``key`` (most recently used): a free one, else the least recently
        used unpinned block's, which it evicts. Returns the slot, the evicted key ("" if
        none) and the admission's number; None where every slot is pinned. ``pin``: the
        slot is filled by a load that spans steps (until :meth:`unpin`)."""
        evicted = ""
        if self.free:
            slot = self.free.pop()
        else:
            evicted = next((k for k in self.lru if self.gens[k] not in self.pinned), "")
            if not evicted:
                return None
            slot = self.lru.pop(evicted)
            del self.gens[evicted]
            if evicted in self.dirty:
                self.dirty.discard(evicted)
                self.flushes += 1
        self._gen += 1
        self.lru[key] = slot
        self.gens[key] = self._gen
        if pin:
            self.pinned[self._gen] = (slot, key)
        return slot, evicted, self._gen

    def unpin(self, gen: int) -> None:
        """The load filling admission ``gen`` has ended on every worker: its entry (if not
        dropped meanwhile) may be offered and evicted; a dropped one's slot is free now."""
        slot, key = self.pinned.pop(gen, (None, ""))
        if slot is not None and self.gens.get(key) != gen:
            self.free.append(slot)

    def drop(self, key: str, gen: Optional[int] = None) -> bool:
        """Drops ``key``'s entry (only admission ``gen``'s, where given: a later admission
        of the same key stays). Its slot is free again, but while pinned (a worker may
        still be filling it: freed by :meth:`unpin`)."""
        if key not in self.lru or (gen is not None and self.gens[key] != gen):
            return False
        slot = self.lru.pop(key)
        self.dirty.discard(key)
        if self.gens.pop(key) not in self.pinned:
            self.free.append(slot)
        return True


def _kv_same_on_every_rank(spec: Any) -> bool:
    """Whether a KV cache spec's KV is the same on every TP rank: MLA's latent KV
    (``MLAAttentionSpec``), or a spec that declares ``max_tp_shards`` 1."""
    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
    except ImportError:  # pragma: no cover - depends on vLLM's version
        MLAAttentionSpec = ()
    return isinstance(spec, MLAAttentionSpec) or getattr(spec, "max_tp_shards", None) == 1


@dataclass
class CpHiCacheMetadata(KVConnectorMetadata):
    """One step's plan, built once by the scheduler-side connector and executed by every
    worker: blocks to load before the forward, blocks to save after it, and the requests
    preempted since the last step (their writes are waited for before their blocks are
    reused)."""

    loads: Dict[str, List[Job]] = field(default_factory=dict)
    saves: Dict[str, List[Job]] = field(default_factory=dict)
    preempted: Set[str] = field(default_factory=set)
    #: This step's number (1, 2, ...: the planner counts the steps it plans). The workers
    #: hold this step's saves until a later step's ``settled`` names it, and report the
    #: steps they ran back to the planner (:class:`CpHiCacheWorkerMeta`).
    step: int = 0
    #: The planner's verdicts on earlier steps' saves, given once it has seen every
    #: worker's report of that step (so every rank's failed loads): step -> the requests
    #: whose saves of that step are dropped (computed over a block that failed to load on
    #: some rank); the step's other saves are written.
    settled: Dict[int, Set[str]] = field(default_factory=dict)
    #: Requests that finished without the planner delaying the freeing of their blocks
    #: (aborted while their asynchronous load ran: vLLM itself frees their blocks once the
    #: load is reported ended): the workers report no ``finished_sending`` for them (vLLM
    #: would free the blocks a second time), their saves are written or dropped all the same.
    unreported: Set[str] = field(default_factory=set)
    #: Host tier: the loads of this step served from the workers' host pools, per request:
    #: block id -> slot (the block's records are not read from the store).
    host_loads: Dict[str, Dict[int, int]] = field(default_factory=dict)
    #: Host tier: the planner's admissions of settled saves, per step (applied with that
    #: step's verdict in ``settled``): ``(request, block id, slot, block key, evicted key,
    #: admission)``: the worker copies its held copy of the block into the slot, which
    #: held the evicted block ("" for a free slot) until then. ``admission`` numbers the
    #: planner's admissions: a worker that cannot make one reports it by that number.
    host_admits: Dict[int, List[Tuple[str, int, int, str, str, int]]] = field(
        default_factory=dict)
    #: ``write_back``: per step (applied with that step's verdict), the saves ``(request,
    #: block id)`` the workers keep in the host tier only (admitted in ``host_admits``, or
    #: held there already), not written to the store: each worker writes a slot's block to
    #: the store when an admission replaces it (a flush) or at ``shutdown``. A kept save not
    #: named (no slot for it) is written to the store at once, as under ``write_through``.
    host_only: Dict[int, Set[Tuple[str, int]]] = field(default_factory=dict)
    #: Host tier: blocks this step loads from the store that the workers then copy into
    #: their pools, per request: block id -> ``(slot, block key, evicted key, admission)``;
    #: made once the step's loads have ended (after every load of the step, from any slot;
    #: with ``load_async``, when the load that spans steps ends), from the filled block,
    #: or failed (the slot then holds nothing servable: reported).
    host_fills: Dict[str, Dict[int, Tuple[int, str, str, int]]] = field(default_factory=dict)
    #: Re-sharding: the loads of this step whose records were written at another head
    #: split, per request: block id -> the writers' number of KV head shards (each worker
    #: reads the records of that split holding its heads and takes them out). A block not
    #: named is read from this deployment's own split.
    load_splits: Dict[str, Dict[int, int]] = field(default_factory=dict)


@dataclass
class CpHiCacheWorkerMeta(KVConnectorWorkerMetadata):
    """A worker's report to the planner (vLLM's worker-to-scheduler metadata, merged over
    the workers of the step by vLLM's ``KVOutputAggregator``): the steps it ran since its
    last report, each with the number of workers reporting it (1 from a worker, summed when
    merged). It comes with the worker's ``invalid_block_ids`` of those steps, so once every
    worker has reported a step the planner has seen every rank's failed loads of it."""

    steps: Dict[int, int] = field(default_factory=dict)
    #: Host tier: ``(block key, admission)`` of the admissions this worker could not make
    #: (its copy of the block was not held, or the copy failed): the planner stops
    #: offering them (the entry of that admission only: a later admission of the same key,
    #: made since, stays).
    host_failed: Set[Tuple[str, int]] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "CpHiCacheWorkerMeta":
        for t, n in (getattr(other, "steps", None) or {}).items():
            self.steps[t] = self.steps.get(t, 0) + n
        self.host_failed |= set(getattr(other, "host_failed", None) or ())
        return self


@dataclass
class CpHiCacheStats(KVConnectorStats):
    """The worker's counters since the last report, summed over workers by vLLM:
    ``records_loaded`` (this rank's blocks filled from the store: a record each, or under
    DCP with a small interleave this rank's tokens of several), ``records_saved`` (records
    written, or there already: a record written in parts counted once, by the rank whose
    part completed it; ``parts_saved`` counts the parts), ``load_errors`` (blocks whose
    record was refused or missing at load time: recomputed), ``save_errors`` (writes that
    failed: a later miss, nothing wrong served; ``writer_failures`` of them are writer
    tasks that raised outside the store), ``saves_read_only`` (not written: the store is
    read-only to this process), ``bytes_loaded``, ``bytes_saved``; ``saves_dropped``
    (blocks not saved: the planner rejected them, computed over a block that failed to
    load on some rank, or shutdown came before their verdict); ``save_waits`` (hand-overs
    to the writer that waited for room in its queue); ``loader_failures`` (the loader
    thread failed a step's loads outright: a bug, its blocks reported as load errors).
    Host tier: ``host_hits`` (blocks filled from the worker's host pool, not counted in
    ``records_loaded``), ``host_admissions`` (blocks copied into the pool) and
    ``host_evictions`` (blocks an admission replaced), all per worker and summed;
    ``host_failures`` (admissions this worker could not make: reported to the planner).
    ``write_back``: ``host_flushes`` (records, or DCP parts, a flush wrote to the store: a
    host slot's block replaced by an admission, or at ``shutdown``; also counted in
    ``records_saved``) and ``flush_errors`` (flushes that failed: that block is not in the
    store; also counted in ``save_errors``)."""

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
    #: The first of its blocks whose load failed: never offered to this request again (a
    #: record that is there but cannot be read would fail again, for ever).
    load_cap: Optional[int] = None
    #: The first block of the loads planned last (``update_state_after_alloc``).
    planned_first: Optional[int] = None
    #: Of the planned run, the blocks the host tier holds: block -> slot.
    planned_host: Dict[int, int] = field(default_factory=dict)
    #: Of the planned run, the blocks read from records of another head split: block ->
    #: the writers' number of KV head shards.
    planned_splits: Dict[int, int] = field(default_factory=dict)


@dataclass
class _StepPlan:
    """The saves of a step the planner has planned and not yet settled: per request, the
    first block it saves and its block ids (the list the request had then: a preemption
    gives it a new one); and the blocks reported failed by any step while this one was in
    flight (its own, and earlier steps' reported after it was planned)."""

    saves: Dict[str, Tuple[int, List[int]]] = field(default_factory=dict)
    bad: Set[int] = field(default_factory=set)
    #: The step's saves as host-tier admissions to make once it is settled: per request,
    #: ``(block key, block id)`` of each block saved.
    admits: Dict[str, List[Tuple[str, int]]] = field(default_factory=dict)
    #: The step's loads from the host tier: block id -> ``(block key, admission)``
    #: (dropped from the host index if the load fails on some worker, unless admitted
    #: again since).
    host_loads: Dict[int, Tuple[str, int]] = field(default_factory=dict)
    #: The step's synchronous loads: per request, ``(its block, block id)``. A failed one
    #: is reported after the step, when vLLM's asynchronous scheduling may have preempted
    #: the request since (its block ids are gone then): mapped back through these.
    loads: Dict[str, List[Tuple[int, int]]] = field(default_factory=dict)


class _LoadTask:
    """One step's loads on the loader thread: an event per layer (set once every loaded
    block holds that layer, or has failed), the blocks that failed, and the end."""

    def __init__(self, layers: int) -> None:
        self.events = [threading.Event() for _ in range(layers)]
        self.done = threading.Event()
        self.errors: Set[int] = set()
        self.failed_reqs: Set[str] = set()  # requests with a block in ``errors``
        #: Blocks served from the host tier: block id -> slot, or (loads that span steps)
        #: the slot's bytes copied when the load started (None: the slot did not hold it).
        self.host: Dict[int, Any] = {}
        #: Blocks loaded from the store to copy into host slots once every load of the
        #: step (or, spanning steps, the load) has ended: block id -> ``(slot, block key,
        #: evicted key, admission)``.
        self.fills: Dict[int, Tuple[int, str, str, int]] = {}
        #: Blocks read from the records of another head split: block id -> its shards.
        self.splits: Dict[int, int] = {}

    def fail_all(self, loads: Dict[str, List[Job]]) -> Set[int]:
        """Marks every block of ``loads`` not yet failed as failed (and every request);
        returns those newly failed."""
        lost = {b for jobs in loads.values() for _, b in jobs} - self.errors
        self.errors |= lost
        self.failed_reqs |= set(loads)
        return lost

    def finish(self) -> None:
        for ev in self.events:
            ev.set()
        self.done.set()


class _SaveBlock:
    """A block to save this step: what it writes (``items``: ``(key, slots, bytes per
    layer, part)``), a host buffer per item its layers are copied into, which layers are
    in, and whether it went to the writer."""

    def __init__(self, rid: str, block_id: int, items: List[Any], layers: int,
                 write: bool = True, own: bool = True) -> None:
        self.rid, self.block_id, self.items = rid, block_id, items
        self.bufs = [np.empty(lsz * layers, dtype=np.uint8) for _, _, lsz, _ in items]
        self.have = [False] * layers
        self.submitted = False
        #: Whether this rank writes it to the store (a copy rank's block, or any block
        #: without a store, is held for the host tier only).
        self.write = write
        #: Whether this rank's copy is the one that counts (not a copy rank's): what
        #: ``saves_dropped`` counts.
        self.own = own


#: A block of a load that spans steps filled from its host slot when the load started.
_HOST_FILLED = ()

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

    def fill(self, block: int, src: Any, slots: Optional[List[int]]) -> None:
        """Puts ``src`` (uint8 ``[heads, tokens, width]``: a record's layer, or its tokens
        for ``slots``) into the block (its slots ``slots``, or all)."""
        if slots is None and self.runs is not None:
            flat = src.reshape(-1)
            at, pos = self.base + block * self.stride, 0
            for off, n in self.runs:
                self.storage[at + off:at + off + n] = flat[pos:pos + n]
                pos += n
        else:
            self.scatter(block, src, slots)

    def take(self, block: int, slots: Optional[List[int]], out: Any) -> None:
        """Copies the block's bytes (of its slots ``slots``, or all), ``[heads, tokens,
        width]``, into ``out`` (a flat uint8 tensor of that many bytes)."""
        if slots is None and self.runs is not None:
            at, pos = self.base + block * self.stride, 0
            for off, n in self.runs:
                out[pos:pos + n] = self.storage[at + off:at + off + n]
                pos += n
        else:
            out[:] = self.gather(block, slots).reshape(-1)

    def gather(self, block: int, slots: Optional[List[int]]) -> Any:
        idx = self.index if slots is None else self.index[:, slots, :]
        return self.storage[self.base + block * self.stride + idx]

    def scatter(self, block: int, src: Any, slots: Optional[List[int]]) -> None:
        idx = self.index if slots is None else self.index[:, slots, :]
        self.storage[self.base + block * self.stride + idx] = src


def _spec_words(spec: Any, heads: Optional[int] = None) -> str:
    """A KV cache spec's words for the fingerprint (its kind, shape and dtype); with
    ``heads``, those of the same spec holding ``heads`` KV heads a rank (another head
    split of the same model: its page holds that many heads' bytes)."""
    words = [type(spec).__name__]
    for attr in ("block_size", "num_kv_heads", "head_size", "dtype", "page_size_bytes"):
        if hasattr(spec, attr):
            value = getattr(spec, attr)
            if heads is not None and attr == "num_kv_heads":
                value = heads
            elif heads is not None and attr == "page_size_bytes":
                value = value // int(spec.num_kv_heads) * heads
            words.append(f"{attr}={value}")
    return ",".join(words)


class CpHiCacheConnector(KVConnectorBase_V1):
    """vLLM ``KVConnectorBase_V1`` over a ``cp_hicache`` page store (see the module
    documentation). Configured through ``kv_connector_extra_config``:

    - ``path`` (required without a host tier): the store's directory, shared by every worker
      and by later runs. Left out: a host-only deployment.
    - ``host_bytes`` (default 4 GiB, :data:`DEFAULT_HOST_BYTES`): each worker's host tier,
      in slots of one block of its KV; 0 turns it off. At least one block's bytes.
    - ``capacity_bytes`` (default 16 GiB): the store's byte budget; least recently used
      records go first. Under ``path`` each head split of a GQA/MHA model's KV has a
      directory of its own (re-sharding): this deployment's split may use what the others
      do not hold when it opens, and they are trimmed to half of it first where they
      hold more (``_size_splits``), so the store as a whole keeps to it at open.
    - ``load_buffer_bytes`` (default 256 MiB): the most bytes of records a worker's loader
      holds read and not yet filled into their blocks. A step's loads beyond it are read
      and filled in batches, in order; at least one block's reads.
    - ``save_buffer_bytes`` (default 256 MiB): the most bytes of copied blocks a worker
      queues for its writer thread. Handing over more blocks waits (in the engine's
      thread) until writes have freed room: back-pressure, nothing is dropped. At least a
      block's bytes.
    - ``load_async`` (default False): loads span steps (vLLM's ``load_kv_async``): a hit's
      request waits (``WAITING_FOR_REMOTE_KVS``) while its records are read and filled,
      the forward never waits for them, and the worker reports the request in
      ``finished_recving`` once its blocks are in (with its failed blocks, if any, in the
      same step's ``invalid_block_ids``). Otherwise loads are synchronous, layer by layer
      ahead of the forward.
    - ``write_policy`` (default ``write_through``, :data:`WRITE_POLICIES`):
      ``write_through`` saves a computed block to the host tier and the store;
      ``write_back`` to the host tier only, writing it to the store when the host tier
      evicts it (each worker copies the slot's bytes out for its writer thread before the
      admission that replaces it) and at ``shutdown``. ``write_back`` needs both a host
      tier and ``path``.

    Any other key is refused (a ``ValueError`` naming it and the known keys,
    :data:`CONFIG_KEYS`): a misspelled ``path`` would otherwise quietly give a host-only
    deployment.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(str(k) for k in extra if k not in CONFIG_KEYS)
        if unknown:
            # A misspelled key would silently fall back to its default: a typo in ``path``
            # with the default host tier would quietly make a host-only deployment.
            raise ValueError(
                "CpHiCacheConnector: unknown kv_connector_extra_config key"
                f"{'s' if len(unknown) > 1 else ''} {', '.join(repr(k) for k in unknown)}; "
                f"the known keys are {', '.join(CONFIG_KEYS)}"
            )
        path = extra.get("path") or None
        host_bytes = int(extra.get("host_bytes", DEFAULT_HOST_BYTES))
        if host_bytes < 0:
            raise ValueError(f"kv_connector_extra_config['host_bytes'] = {host_bytes} is "
                             "negative (0 turns the host tier off)")
        if not path and host_bytes == 0:
            raise ValueError(
                "CpHiCacheConnector needs kv_connector_extra_config['path'] (the store's "
                "directory, shared by every worker: a shared file system on a cluster) or a "
                "host tier (kv_connector_extra_config['host_bytes'] > 0): it has neither"
            )
        capacity = int(extra.get("capacity_bytes", DEFAULT_CAPACITY))
        policy = extra.get("write_policy", "write_through")
        if policy not in WRITE_POLICIES:
            raise ValueError(
                f"kv_connector_extra_config['write_policy'] = {policy!r} is not known; "
                f"the write policies are {', '.join(WRITE_POLICIES)}"
            )
        #: ``write_back``: a computed block is saved to the host tier only, and written to
        #: the store when the host tier evicts it (and at ``shutdown``).
        self.write_back = policy == "write_back"
        if self.write_back and (not path or host_bytes == 0):
            raise ValueError(
                "kv_connector_extra_config['write_policy'] = 'write_back' writes blocks to "
                "the store when the host tier evicts them: it needs both a host tier "
                "(host_bytes > 0) and a store (path); this config has "
                + ("neither" if not path and host_bytes == 0
                   else "no store (path)" if not path else "no host tier (host_bytes is 0)")
            )
        #: Whether loads span steps (vLLM's ``load_kv_async``) instead of running ahead of
        #: the forward of the step that plans them.
        self.load_async = bool(extra.get("load_async", False))
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
        self._check_window(spec)
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
        self._spec = spec
        self._model = getattr(getattr(vllm_config, "model_config", None), "model", None)
        #: The model's KV heads where they are split over the TP ranks (so a record of any
        #: other head split of the same model is read here, re-sharded: ``_read_split``);
        #: 0 where the KV is the same on every rank (MLA) or the split is not known.
        self.kv_heads = self._total_kv_heads(vllm_config, spec, self.head_shards)
        self.fingerprint = self._split_fingerprint(self.head_shards)
        #: The storage tier: a page store in ``path`` (None: a host-only deployment).
        self.path = self.store_path = self.store = None
        self.capacity_bytes = capacity
        #: The budget of this deployment's own head split's directory (the only one it
        #: writes): ``capacity_bytes`` less what the other splits' directories hold when it
        #: opens, those trimmed first where that would leave it less than half
        #: (``_size_splits``). All of ``capacity_bytes`` without a store, or where the model
        #: has one split (MLA, a spec declaring its KV the same on every rank).
        self.split_capacity = capacity
        #: The stores of the other head splits of this model (``_split_store``): shards ->
        #: the store, opened at construction where its directory is there, else once it is.
        self._split_stores: Dict[int, Any] = {}
        self._split_lock = threading.Lock()
        if path:
            self.path = str(path)
            self.store_path = self._split_path(self.head_shards)
            if capacity < self.page_bytes + RECORD_HEADER_BYTES:
                raise ValueError(
                    f"kv_connector_extra_config['capacity_bytes'] = {capacity} holds no "
                    f"record of this deployment's head split ({self.page_bytes} bytes and a "
                    f"{RECORD_HEADER_BYTES}-byte header)"
                )
            self.split_capacity = self._size_splits(capacity)
            self.store = _native.PageStore(self.store_path, self.fingerprint, self.page_bytes,
                                           self.split_capacity)
        #: The host tier: ``host_slots`` slots of one block of this worker's bytes each
        #: (``page_bytes``: the same on every worker, whatever its head shard or DCP rank),
        #: at most ``host_bytes`` a worker; 0 slots: off.
        self.host_bytes = host_bytes
        self.host_slots = host_bytes // self.page_bytes
        if host_bytes and not self.host_slots:
            raise ValueError(
                f"kv_connector_extra_config['host_bytes'] = {host_bytes}: less than one "
                f"block's {self.page_bytes} bytes (0 turns the host tier off)"
            )
        #: The planner's accounting of every worker's host tier (scheduler side only).
        self._host: Optional[_HostIndex] = (
            _HostIndex(self.host_slots)
            if self.host_slots and role == KVConnectorRole.SCHEDULER else None)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", None)
        if role == KVConnectorRole.SCHEDULER and policy != "recompute":
            logger.warning(
                "cp_hicache: kv_load_failure_policy is %r: a record that fails to load ends "
                "its request with an error; \"recompute\" recomputes its blocks instead", policy)
        # Scheduler side.
        self._reqs: Dict[str, _ReqState] = {}
        self._pending_loads: Dict[str, List[Job]] = {}
        self._delayed: Set[str] = set()
        #: Requests whose asynchronous load (``load_async``) runs: started, not yet reported
        #: received; and those finished meanwhile, to name in the next metadata
        #: (``CpHiCacheMetadata.unreported``).
        self._loading: Set[str] = set()
        self._unreported: Set[str] = set()
        #: The steps planned so far; the saves of those not yet settled (every worker's
        #: report of the step not seen yet); the verdicts to send in the next metadata.
        self._step = 0
        self._inflight: Dict[int, _StepPlan] = {}
        self._reports: Dict[int, int] = {}  # step -> workers that reported it so far
        self._settled: Dict[int, Set[str]] = {}
        self._planner_stats = {"lookups": 0, "hit_tokens": 0, "finished_sending": 0,
                               "invalid_blocks": 0, "saves_settled": 0, "saves_rejected": 0,
                               "host_hits": 0, "host_admitted": 0, "host_evicted": 0,
                               "host_dropped": 0}
        #: Host-tier admissions decided since the last metadata (step -> admissions).
        self._host_admits: Dict[int, List[Tuple[str, int, int, str, str, int]]] = {}
        #: ``write_back``: the saves kept in the host tier only, per step (``host_only``).
        self._host_only: Dict[int, Set[Tuple[str, int]]] = {}
        #: Host-tier loads planned since the last metadata: request -> block id -> slot
        #: (and -> ``(block key, admission)``); and store loads to admit to the host tier
        #: once loaded (``host_fills``).
        self._pending_host: Dict[str, Dict[int, int]] = {}
        self._pending_host_keys: Dict[str, Dict[int, Tuple[str, int]]] = {}
        self._pending_fills: Dict[str, Dict[int, Tuple[int, str, str, int]]] = {}
        self._filling: Set[str] = set()  # the block keys of ``_pending_fills``
        #: Host-tier loads that span steps (``load_async``), until their requests are
        #: reported received: request -> block id -> ``(block key, admission)`` (their
        #: failures come after the step that planned them may have been settled).
        self._async_host: Dict[str, Dict[int, Tuple[str, int]]] = {}
        #: Admissions of blocks read by loads that span steps (``load_async``), pinned in
        #: the host index until their requests are reported received: request -> their
        #: admission numbers.
        self._async_fills: Dict[str, List[int]] = {}
        #: Loads planned since the last metadata from another head split's records:
        #: request -> block id -> the writers' shards (``load_splits``).
        self._pending_splits: Dict[str, Dict[int, int]] = {}
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
        # Host memory bounds: a block's reads are every record its slots take tokens from
        # (one, but for DCP with a small interleave); its save is one record's bytes.
        self._block_read_bytes = len({k for k, _ in self._slots}) * self.page_bytes
        self.load_buffer_bytes = self._bound(extra, "load_buffer_bytes", DEFAULT_LOAD_BUFFER,
                                             self._block_read_bytes)
        self.save_buffer_bytes = self._bound(extra, "save_buffer_bytes", DEFAULT_SAVE_BUFFER,
                                             self.page_bytes)
        #: Bytes of copied blocks handed to the writer and not yet written (at most
        #: ``save_buffer_bytes``), and the condition the save path waits on for room.
        self._queued_bytes = 0
        self._queue_cv = threading.Condition()
        # Per layer: where each byte of a record's layer is in vLLM's tensor.
        self._layers: Optional[List[_LayerBlocks]] = None
        self._in_place = False
        self._num_blocks = 0
        self._layer_index: Dict[str, int] = {n: i for i, n in enumerate(self.layer_names)}
        self._writer: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._loader: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._load: Optional[_LoadTask] = None  # the step's loads, until collected
        #: Loads that span steps (``load_async``): each task and the requests it loads,
        #: until reported in ``finished_recving``.
        self._async_loads: List[Tuple[_LoadTask, Set[str]]] = []
        #: Called by the loader thread with a layer's index before it fills that layer (a
        #: test's instrument; None in service).
        self._load_layer_hook: Optional[Any] = None
        self._saves_meta: Any = None  # the metadata _saves was made for
        self._started_meta: Any = None  # the metadata whose loads were started
        self._saves: List[_SaveBlock] = []
        self._saves_done = False
        #: Steps whose saves are copied and wait for the planner's verdict (step -> blocks),
        #: the verdicts received for steps not held yet, the last step whose saves were
        #: completed, and the steps run since the last report to the planner.
        self._held: Dict[int, List[_SaveBlock]] = {}
        self._verdicts: Dict[int, Set[str]] = {}
        self._last_saved_step = 0
        self._ran: Set[int] = set()
        self._writes: Dict[str, List[concurrent.futures.Future]] = {}
        self._saving_reqs: Set[str] = set()
        self._finished_waiting: Set[str] = set()
        self._load_errors: Set[int] = set()
        #: The host tier's pool (``host_slots`` blocks of ``page_bytes``, allocated once by
        #: register_kv_caches: pinned where CUDA is there), the block key each slot holds
        #: (None: nothing servable), the planner's admissions received for steps not yet
        #: released, and the admissions that failed, to report.
        self._host_pool: Any = None
        self._host_tags: List[Optional[str]] = [None] * self.host_slots
        self._admits: Dict[int, List[Tuple[str, int, int, str, str, int]]] = {}
        self._host_failed: Set[Tuple[str, int]] = set()
        #: ``write_back``: the saves the planner keeps in the host tier only, per step
        #: (``host_only``), and the slots holding such a block, not yet in the store: slot
        #: -> ``(block key, what it writes: a save's items)``. A slot so marked is written
        #: to the store (flushed) before anything replaces it, and at ``shutdown``.
        self._only: Dict[int, Set[Tuple[str, int]]] = {}
        self._host_dirty: Dict[int, Tuple[str, List[Any]]] = {}
        self._stats: Dict[str, int] = {}
        self._stats_lock = threading.Lock()

    @staticmethod
    def _bound(extra: Dict[str, Any], key: str, default: int, least: int) -> int:
        """A host memory bound from ``kv_connector_extra_config[key]``: at least ``least``
        bytes (one block's), so that every step can make progress."""
        n = int(extra.get(key, max(default, least)))
        if n < least:
            raise ValueError(
                f"kv_connector_extra_config['{key}'] = {n}: less than one block's {least} "
                "bytes (a worker must hold at least one block's records)"
            )
        return n

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; a save dropped (a request preempted while its writes
        are pending) is a later miss, so vLLM need not recompute the request for it."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """True: the forward must call :meth:`wait_for_layer_load` and :meth:`save_kv_layer`
        in every attention layer, which a full CUDA graph would skip on replay (vLLM then
        runs piecewise CUDA graphs, attention outside them)."""
        return True

    #: KV cache specs of attention over a window of the tokens: vLLM gives the blocks out of
    #: the window the null block (id 0), so a load would fill it and a save copy it under a
    #: real record's name.
    _WINDOWED_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec",
                       "ChunkedLocalAttentionSpec", "CircularBufferSpec")

    @classmethod
    def _check_window(cls, spec: Any) -> None:
        kinds = {c.__name__ for c in type(spec).__mro__}
        window = (getattr(spec, "sliding_window", None)
                  or getattr(spec, "attention_chunk_size", None))
        if kinds & set(cls._WINDOWED_SPECS) or window:
            raise ValueError(
                f"CpHiCacheConnector: the KV cache spec {type(spec).__name__} is windowed "
                f"(sliding window or chunked local attention: {window}): not built (vLLM "
                "gives out-of-window blocks the null block, which would be loaded into and "
                "saved from)"
            )

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
        if _kv_same_on_every_rank(spec):
            return 1
        declared = getattr(spec, "max_tp_shards", None)
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

    @staticmethod
    def _total_kv_heads(vllm_config: Any, spec: Any, shards: int) -> int:
        """The model's KV heads where vLLM splits them over the TP ranks as
        ``_head_shards`` says (``shards`` shards of ``spec.num_kv_heads`` heads); 0 for
        MLA, a spec declaring its KV the same on every rank, or a model config without
        head counts: then records are never re-sharded."""
        if _kv_same_on_every_rank(spec):
            return 0
        per_rank = int(getattr(spec, "num_kv_heads", 0) or 0)
        mc = getattr(vllm_config, "model_config", None)
        try:
            total = int(mc.get_total_num_kv_heads())
        except Exception:  # no head counts: no re-sharding
            return 0
        return total if per_rank > 0 and per_rank * shards == total else 0

    def _split_fingerprint(self, shards: int) -> str:
        """The fingerprint of this model's records at a head split of ``shards`` KV head
        shards: the model, block size, KV cache spec (kind, heads a shard, head size,
        dtype), layers, a record's bytes, and the number of shards. Each head split's
        records are in a store of their own (a store's records are all one size); every
        other word is the model's, so no other model's or format's records are read."""
        spec_words = _spec_words(self._spec) if shards == self.head_shards else \
            _spec_words(self._spec, self.kv_heads // shards)
        page_bytes = self._split_page_bytes(shards)
        return ";".join([
            "vllm-kv-connector v2",
            f"model={self._model}",
            f"block_size={self.block_size}",
            f"spec={spec_words}",
            f"layers={len(self.layer_names)}",
            f"page_bytes={page_bytes}",
        ] + ([f"kv_head_shards={shards}"] if shards > 1 else []))

    def _split_page_bytes(self, shards: int) -> int:
        """Bytes of a record of one head shard of ``shards``."""
        if shards == self.head_shards:
            return self.page_bytes
        return self.page_bytes // (self.kv_heads // self.head_shards) * (self.kv_heads // shards)

    def _split_path(self, shards: int) -> str:
        digest = hashlib.sha256(self._split_fingerprint(shards).encode()).hexdigest()[:16]
        return os.path.join(self.path, f"vllm-{digest}")

    def _model_splits(self) -> List[int]:
        """The head splits of the model's KV: this deployment's own first, then (GQA with
        a known split: ``kv_heads``) every other split of the model's KV heads, from the
        finest down."""
        own = self.head_shards
        if not self.kv_heads:
            return [own]
        return [own] + [s for s in range(self.kv_heads, 0, -1)
                        if self.kv_heads % s == 0 and s != own]

    def _size_splits(self, capacity: int) -> int:
        """Shares ``capacity`` (``capacity_bytes``) between this deployment's own head
        split and the other splits' directories there now, at open, and returns its own
        split's budget. The other splits are opened (kept in ``_split_stores`` for
        re-sharding reads) and their bytes counted. Where they hold more than half of
        ``capacity``, each is trimmed (opened again with a smaller budget: the store evicts
        its least recently used records down to it at open) to its proportional share of
        half (at least one of its records: a store's budget holds one). The own split gets
        what they then hold less than ``capacity`` (at least one record; at least half of
        it where they could not be trimmed, a store this process may only read). So a single TP
        degree's split gets the whole budget, and after a TP change the old split's
        records stay to be re-sharded while yielding room to the new one. Another
        deployment writing another split at the same time is not seen: each sees the
        budget as it was when it opened."""
        held: Dict[int, Tuple[Any, int]] = {}
        for shards in self._model_splits()[1:]:
            where = self._split_path(shards)
            if not os.path.isdir(where):
                continue
            store = _native.PageStore(where, self._split_fingerprint(shards),
                                      self._split_page_bytes(shards), _NO_EVICTION)
            held[shards] = (store, int(store.stats()["usage_bytes"]))
        others = sum(n for _, n in held.values())
        half = capacity // 2
        if others > capacity - half:
            for shards, (store, n) in list(held.items()):
                if not n:
                    continue
                target = max(n * half // others,
                             self._split_page_bytes(shards) + RECORD_HEADER_BYTES)
                if target >= n:
                    continue
                store = _native.PageStore(self._split_path(shards),
                                          self._split_fingerprint(shards),
                                          self._split_page_bytes(shards), target)
                held[shards] = (store, int(store.stats()["usage_bytes"]))
            logger.info("cp_hicache: the other head splits' directories held %d bytes of "
                        "capacity_bytes %d; trimmed to %d", others, capacity,
                        sum(n for _, n in held.values()))
            others = sum(n for _, n in held.values())
        for shards, (store, _) in held.items():
            self._split_stores[shards] = store
        own = capacity - others
        if others > half:
            # Not trimmed (a store this process may only read): the own split still gets
            # half, rather than a store of one record.
            logger.warning("cp_hicache: the other head splits' directories still hold %d "
                           "bytes (not trimmed: read-only?); this split keeps %d bytes of "
                           "capacity_bytes %d", others, capacity - half, capacity)
            own = capacity - half
        return max(own, self.page_bytes + RECORD_HEADER_BYTES)

    def _read_splits(self) -> List[int]:
        """The head splits whose records this deployment reads (``_model_splits``; only
        its own without a store)."""
        return self._model_splits() if self.store is not None else [self.head_shards]

    def _split_store(self, shards: int) -> Optional[Any]:
        """The store of the records written at ``shards`` KV head shards (this
        deployment's own, or another split's once its directory is there: opened then,
        never created here); None where there is none."""
        if shards == self.head_shards:
            return self.store
        store = self._split_stores.get(shards)
        if store is not None or self.path is None:
            return store
        where = self._split_path(shards)
        if not os.path.isdir(where):
            return None
        with self._split_lock:
            store = self._split_stores.get(shards)
            if store is None:
                # Its directory appeared since this deployment opened (another deployment
                # writes it now): opened for reading with the whole budget (a reader never
                # writes; its open trims nothing that deployment's own budget keeps).
                store = _native.PageStore(where, self._split_fingerprint(shards),
                                          self._split_page_bytes(shards),
                                          max(self.capacity_bytes,
                                              self._split_page_bytes(shards)
                                              + RECORD_HEADER_BYTES))
                self._split_stores[shards] = store
        return store

    def _present_blocks(self, shards: int, names: List[str]) -> int:
        """How many whole scheduler blocks of the records ``names`` (from a block's first)
        the store of head split ``shards`` holds in a run: every head shard's record of
        each, so that every worker of this deployment finds the records it needs."""
        store = self._split_store(shards)
        if store is None:
            return 0
        wanted = names
        if shards > 1:
            wanted = [head_shard_key(n, s, shards) for n in names for s in range(shards)]
        return store.present_run(wanted) // (self.dcp * shards)

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
        synchronous to vLLM (``False``): they end within the step that plans them, layer by
        layer ahead of the forward (:meth:`wait_for_layer_load`); with ``load_async`` they
        span steps (``True``): vLLM holds the request back until the workers report its
        blocks in (``finished_recving``)."""
        st = self._state(request)
        st.planned = None
        self._planner_stats["lookups"] += 1
        sb, d = self.sched_block, self.dcp
        if not self._cacheable(request) or num_computed_tokens % sb:
            return 0, False
        limit = (request.num_tokens - 1) // sb  # scheduler blocks
        if st.load_cap is not None:
            limit = min(limit, st.load_cap)
        first = num_computed_tokens // sb
        if limit <= first:
            return 0, False
        names = self._names(st, limit * d)
        host = self._host
        st.planned_host = {}
        st.planned_splits = {}
        splits = self._read_splits()
        # The run over host and store: each block from the host tier where it holds it
        # (every worker holds its bytes of the block), else from the store.
        # A block admitted from a load of this same step is not in any slot until the
        # step's loads have ended: read from the store like the load admitting it.
        # So is a block a load that spans steps admits, until that load is received.
        in_host = ([None if names[(k + 1) * d - 1] in self._filling
                    else host.servable(names[(k + 1) * d - 1]) for k in range(first, limit)]
                   if host is not None else [None] * (limit - first))
        k = first
        while k < limit:
            slot = in_host[k - first]
            if slot is not None:
                st.planned_host[k] = slot
                k += 1
                continue
            if self.store is None:
                break
            end = k + 1  # the store's part: up to the next block the host holds
            while end < limit and in_host[end - first] is None:
                end += 1
            # Block by block over the head splits: the longest run of whole blocks any
            # split holds from here (this deployment's own first), then on from its end.
            while k < end:
                got, split = 0, splits[0]
                for s in splits:
                    n = self._present_blocks(s, names[k * d:end * d])
                    if n > got:
                        got, split = n, s
                    if got == end - k:
                        break
                if got == 0:
                    break
                if split != self.head_shards:
                    st.planned_splits.update({b: split for b in range(k, k + got)})
                k += got
            if k < end:
                break
        run = k - first
        if run == 0:
            return 0, False
        st.planned = (first, run)
        self._planner_stats["hit_tokens"] += run * sb
        return run * sb, self.load_async

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
        st.planned_first = first
        (block_ids,) = blocks.get_block_ids()
        if len(block_ids) < first + n:
            raise RuntimeError(
                f"request {request.request_id}: {len(block_ids)} blocks allocated, the load "
                f"needs blocks {first}..{first + n}"
            )
        self._pending_loads[request.request_id] = [
            (self._block_names(st, first + k), int(block_ids[first + k])) for k in range(n)
        ]
        host = {int(block_ids[k]): slot for k, slot in st.planned_host.items()
                if k < first + n}
        st.planned_host = {}
        splits = {int(block_ids[k]): s for k, s in st.planned_splits.items()
                  if k < first + n}
        st.planned_splits = {}
        if splits:
            self._pending_splits[request.request_id] = splits
        if host:
            self._pending_host[request.request_id] = host
            keys = self._pending_host_keys.setdefault(request.request_id, {})
            self._planner_stats["host_hits"] += len(host)
            for k in range(first, first + n):
                if int(block_ids[k]) in host:
                    key = st.names[(k + 1) * self.dcp - 1]
                    self._host.touch(key)
                    keys[int(block_ids[k])] = (key, self._host.gen(key))
        if self._host is not None:
            # The blocks read from the store go into the host tier too, once loaded. A load
            # that spans steps fills their slots when it ends, steps later: its admissions
            # are pinned (neither offered nor evicted) until it is reported received.
            fills = {}
            for k in range(first, first + n):
                b = int(block_ids[k])
                key = st.names[(k + 1) * self.dcp - 1]
                if b in host or self._host.get(key) is not None:
                    continue
                got = self._host.admit(key, pin=self.load_async)
                if got is None:  # every slot is being filled by loads that span steps
                    continue
                slot, evicted, gen = got
                fills[b] = (slot, key, evicted, gen)
                if self.load_async:
                    self._async_fills.setdefault(request.request_id, []).append(gen)
                else:
                    self._filling.add(key)
                self._planner_stats["host_admitted"] += 1
                if evicted:
                    self._planner_stats["host_evicted"] += 1
            if fills:
                self._pending_fills[request.request_id] = fills
        if self.load_async:
            # Not scheduled until its loads are in: a failed one is mapped back to the
            # request through these (its saves then start at the failed block).
            st.block_ids = [int(b) for b in block_ids]
            self._loading.add(request.request_id)
        # Those blocks are in the store already: no need to save them again.
        st.saved_upto = max(st.saved_upto, first + n)

    def build_connector_meta(self, scheduler_output: Any) -> CpHiCacheMetadata:
        """The step's plan: the loads planned since the last step, the full blocks this
        step's forward completes (to save), the requests preempted since the last step."""
        self._step += 1
        meta = CpHiCacheMetadata(loads=self._pending_loads, step=self._step,
                                 settled=self._settled, unreported=self._unreported,
                                 host_loads=self._pending_host,
                                 host_admits=self._host_admits,
                                 host_only=self._host_only,
                                 host_fills=self._pending_fills,
                                 load_splits=self._pending_splits)
        self._pending_loads, self._settled, self._unreported = {}, {}, set()
        self._pending_splits = {}
        self._pending_host, self._host_admits, self._pending_fills = {}, {}, {}
        self._host_only = {}
        host_keys, self._pending_host_keys = self._pending_host_keys, {}
        self._filling = set()
        plan = _StepPlan()
        for rid, host in meta.host_loads.items():
            keys = host_keys.get(rid, {})
            plan.host_loads.update({b: keys[b] for b in host if b in keys})
            if self.load_async:
                self._async_host[rid] = {b: keys[b] for b in host if b in keys}
        if not self.load_async:
            for rid, fills in meta.host_fills.items():
                # A block that fails to load leaves the host index (as one loaded from it).
                # (One a load that spans steps fills is reported by the workers, whose
                # copies fail with it: ``host_failed``.)
                plan.host_loads.update({b: (key, gen)
                                        for b, (_, key, _, gen) in fills.items()})
        if not self.load_async:
            for rid, jobs in meta.loads.items():
                st = self._reqs.get(rid)
                if st is not None and st.planned_first is not None:
                    plan.loads[rid] = [(st.planned_first + k, b)
                                       for k, (_, b) in enumerate(jobs)]
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
            plan.saves[rid] = (st.saved_upto, st.block_ids)
            if self._host is not None:
                plan.admits[rid] = [(ns[-1], b) for ns, b in jobs]
            st.saved_upto = full
            meta.saves[rid] = jobs
            st.has_saves = True
        if plan.saves or plan.loads or plan.host_loads:
            self._inflight[meta.step] = plan
        return meta

    def request_finished(self, request: Any, block_ids: List[int]
                         ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Frees the planner's state of the request; keeps vLLM from freeing its blocks
        (``True``) when saves were planned for it, until the workers report its writes done
        (``finished_sending`` from :meth:`get_finished`). A request whose asynchronous load
        still runs (aborted meanwhile) is not delayed: vLLM keeps its blocks until the load
        is reported ended and frees them then; a delay here too would have them freed twice
        (or under the loader, were the writes reported done first), so the workers are told
        to report nothing for it (``CpHiCacheMetadata.unreported``)."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        self._pending_loads.pop(rid, None)
        self._pending_host.pop(rid, None)
        self._pending_host_keys.pop(rid, None)
        unshipped = self._pending_fills.pop(rid, None) or {}
        for b, (_, key, _, gen) in unshipped.items():
            self._host.drop(key, gen)  # planned, never shipped: its slot goes back
            self._host.unpin(gen)
        if unshipped and rid in self._async_fills:
            gone = {gen for _, _, _, gen in unshipped.values()}
            self._async_fills[rid] = [g for g in self._async_fills[rid] if g not in gone]
            if not self._async_fills[rid]:
                del self._async_fills[rid]
        delay = st is not None and st.has_saves
        if delay and rid in self._loading:
            delay = False
            self._unreported.add(rid)
        if delay:
            self._delayed.add(rid)
        return delay, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Takes the workers' reports: requests whose writes are done (their blocks are
        freed by vLLM now), blocks that failed to load on any rank (vLLM recomputes them),
        and the steps the workers ran (:class:`CpHiCacheWorkerMeta`), whose saves it then
        settles (:meth:`_settle`)."""
        for rid in connector_output.finished_sending or ():
            if rid not in self._delayed:
                # Raising here would end the engine; a report of no consequence.
                logger.warning("cp_hicache: a worker reported request %s's saves done, but "
                               "its freeing was not delayed", rid)
                continue
            self._delayed.discard(rid)
            self._planner_stats["finished_sending"] += 1
        self._loading.difference_update(connector_output.finished_recving or ())
        invalid = set(connector_output.invalid_block_ids or ())
        self._planner_stats["invalid_blocks"] += len(invalid)
        if invalid:
            # vLLM recomputes from a request's first invalid block: save the recomputed
            # blocks again (the store removed the refused record), and offer the request
            # no block from there again (vLLM may look a request up again when its load
            # failed at the first block).
            failed: Dict[str, int] = {}  # request -> its first failed block
            for rid, st in self._reqs.items():
                for k, b in enumerate(st.block_ids[:st.saved_upto]):
                    if b in invalid:
                        failed[rid] = k
                        break
            # A request preempted since its failed load (its block ids are gone).
            for plan in self._inflight.values():
                for rid, loaded in plan.loads.items():
                    for k, b in loaded:
                        if b in invalid and rid in self._reqs:
                            failed[rid] = min(failed.get(rid, k), k)
                            break
            for rid, k in failed.items():
                st = self._reqs[rid]
                st.saved_upto = min(st.saved_upto, k)
                st.load_cap = k if st.load_cap is None else min(st.load_cap, k)
            # A block the host tier failed to serve on some worker: not offered from it again.
            if self._host is not None:
                loaded = [plan.host_loads for plan in self._inflight.values()]
                loaded += self._async_host.values()  # reported once received
                for host_loads in loaded:
                    for b, (key, gen) in host_loads.items():
                        if b in invalid and self._host.drop(key, gen):
                            self._planner_stats["host_dropped"] += 1
            # Every step in flight was planned before this report: its forward may have
            # read these blocks (vLLM's asynchronous scheduling plans the next step before
            # it sees this one's output).
            for plan in self._inflight.values():
                plan.bad |= invalid
        meta = connector_output.kv_connector_worker_meta
        if self._host is not None:
            # Admissions some worker could not make: no longer offered from the host tier
            # (the entry of that admission only: the key may have been evicted and admitted
            # again since, under vLLM's asynchronous scheduling, and that entry stays).
            for key, gen in getattr(meta, "host_failed", None) or ():
                if self._host.drop(key, gen):
                    self._planner_stats["host_dropped"] += 1
        for rid in connector_output.finished_recving or ():
            self._async_host.pop(rid, None)  # its failed blocks came with it
            # Its blocks read from the store are in their slots on every worker (or were
            # reported failed above, with it): offered, and evictable, from now on.
            for gen in self._async_fills.pop(rid, ()):
                self._host.unpin(gen)
        for t, n in (getattr(meta, "steps", None) or {}).items():
            self._reports[t] = self._reports.get(t, 0) + n
        # vLLM's executor runs every step on every worker (TP ranks; PP is refused).
        whole = [t for t, n in self._reports.items() if n >= self.tp]
        if whole:
            self._settle(max(whole))

    def _settle(self, last: int) -> None:
        """Gives the verdict on the saves of every step up to ``last`` (the latest step every
        worker has reported, with its failed loads): a request's saves of a step are
        dropped where its blocks include one that failed on any rank while the step was in
        flight (its KV was computed over that block), or where not every worker reported
        the step (nothing is known of its loads); the others are written. The workers learn
        the verdicts from the next step's metadata (``settled``). A dropped request still
        running has its saves planned again from the step's first block."""
        whole = {t for t, n in self._reports.items() if t <= last and n >= self.tp}
        self._reports = {t: n for t, n in self._reports.items() if t > last}
        for t in sorted(t for t in self._inflight if t <= last):
            plan = self._inflight.pop(t)
            dropped = set()
            for rid, (first, block_ids) in plan.saves.items():
                if t not in whole or not plan.bad.isdisjoint(block_ids):
                    dropped.add(rid)
                    st = self._reqs.get(rid)
                    if st is not None:
                        st.saved_upto = min(st.saved_upto, first)
            if plan.saves:  # a step of loads only has no verdict to send
                self._settled[t] = dropped
            if self._host is not None:
                self._admit(t, plan, dropped)
            self._planner_stats["saves_settled"] += len(plan.saves) - len(dropped)
            self._planner_stats["saves_rejected"] += len(dropped)

    def _admit(self, step: int, plan: _StepPlan, dropped: Set[str]) -> None:
        """The host tier's admissions of a settled step's saves (those not dropped): each
        block not held yet gets a slot (evicting the least recently used block where none
        is free), sent to the workers with the step's verdict; a block held already is
        only made most recently used. The workers copy their held copies of the blocks in
        (:meth:`_release`), or report the ones they could not (``host_failed``)."""
        host = self._host
        out = []
        only: Set[Tuple[str, int]] = set()
        for rid, blocks in plan.admits.items():
            if rid in dropped:
                continue
            for key, b in blocks:
                if host.get(key) is not None:
                    host.touch(key)
                    # Held there already: dirty, its slot's flush writes it; clean (a fill
                    # from the store, perhaps another head split's records, whose read may
                    # yet fail), written now (a record the store holds is answered present).
                    if self.write_back and key in host.dirty:
                        only.add((rid, b))
                    continue
                got = host.admit(key)
                if got is None:  # every slot is being filled by loads that span steps
                    continue  # (under write_back: written to the store at once)
                slot, evicted, gen = got
                out.append((rid, b, slot, key, evicted, gen))
                if self.write_back:
                    host.dirty.add(key)
                    only.add((rid, b))
                self._planner_stats["host_admitted"] += 1
                if evicted:
                    self._planner_stats["host_evicted"] += 1
        if out:
            self._host_admits[step] = out
        if only:
            self._host_only[step] = only

    def host_index(self) -> Dict[str, int]:
        """The planner's host index: block key -> slot, least recently used first (empty
        with the host tier off)."""
        return dict(self._host.lru) if self._host is not None else {}

    def planner_stats(self) -> Dict[str, int]:
        """The scheduler side's counters: lookups, tokens offered, requests whose saves
        were reported done, blocks reported invalid, a request's saves of a step settled
        (to be written) or rejected (dropped: computed over a failed load); and ``tracked``
        requests, ``delayed`` frees and ``unsettled`` steps (planned saves without a
        verdict, or verdicts not yet sent; all 0 once every request has finished and been
        freed)."""
        return dict(self._planner_stats,
                    host_flushes=self._host.flushes if self._host is not None else 0,
                    host_dirty=len(self._host.dirty) if self._host is not None else 0,
                    tracked=len(self._reqs) + len(self._loading) + len(self._async_fills),
                    delayed=len(self._delayed),
                    unsettled=len(self._inflight) + len(self._settled))

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
        if self._loader is not None or self._writer is not None:
            # Registered again (vLLM re-creates its KV tensors): the old threads are drained
            # and stopped, none left behind.
            self._load_errors |= self._join_load()
            for ex in (self._loader, self._writer):
                if ex is not None:
                    ex.shutdown(wait=True)
        if self.host_slots and self._host_pool is None:
            # Once per worker: fixed-size block slots, pinned where a CUDA device is there
            # (its copies to and from device blocks then run asynchronously).
            pin = bool(torch.cuda.is_available())
            self._host_pool = torch.empty((self.host_slots, self.page_bytes),
                                          dtype=torch.uint8, pin_memory=pin)
        self._kv_caches_kept = kv_caches  # the addresses stay valid while vLLM's tensors live
        self._layers = layers
        self._in_place = all(g.runs is not None for g in layers)
        self._num_blocks = num_blocks
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cp-hicache-save")
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cp-hicache-load")

    def _check_block(self, block_id: int) -> None:
        if self._layers is None:
            raise RuntimeError("CpHiCacheConnector: register_kv_caches was not called")
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside 0..{self._num_blocks}")

    def _key(self, name: str) -> str:
        """The store name of this worker's head shard of record ``name``."""
        return head_shard_key(name, self.head_shard, self.head_shards)

    def _count(self, **kv: int) -> None:
        with self._stats_lock:
            for k, v in kv.items():
                self._stats[k] = self._stats.get(k, 0) + v

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to wait for: a save copies its blocks' bytes out of vLLM's tensors within
        the step that computed them (:meth:`save_kv_layer`, :meth:`wait_for_save`), and a
        step's loads are joined before the step ends (:meth:`get_block_ids_with_load_errors`),
        so a preempted request's blocks are free for vLLM to reuse at once."""
        return

    def _host_source(self, names: List[str], slot: int) -> Optional[Any]:
        """This worker's bytes of the scheduler block named ``names`` in host slot ``slot``,
        ``[layers, heads, tokens, width]`` as its block holds them; None where the slot does
        not hold that block (its admission failed here: reported, recomputed)."""
        if (self._host_pool is None or not 0 <= slot < self.host_slots
                or self._host_tags[slot] != names[-1]):
            return None
        g = self._layers[0]
        return self._host_pool[slot].view(len(self._layers), g.heads, self.block_size, g.width)

    def _host_fill_now(self, names: List[str], block_id: int, slot: int) -> bool:
        """Fills block ``block_id`` from host slot ``slot`` at once (a load that spans
        steps: a later admission may reuse the slot); False where the slot does not hold
        that block here or the copy failed (a load error: reported, recomputed)."""
        try:
            self._check_block(block_id)
            src = self._host_source(names, slot)
            if src is None:
                return False
            for li, g in enumerate(self._layers):
                g.fill(block_id, src[li], None)
            return True
        except Exception as e:
            logger.warning("cp_hicache: filling block %d from host slot %d failed: %s",
                           block_id, slot, e)
            return False

    def _host_put(self, slot: int, sb: "_SaveBlock") -> None:
        """Copies a held block's bytes (every layer copied) into host slot ``slot``, as the
        block holds them: the record, or under DCP with a small interleave this rank's
        tokens of several records, slot by slot."""
        dst = self._host_pool[slot].numpy()
        if len(sb.items) == 1 and sb.items[0][1] is None:
            dst[:] = sb.bufs[0]
            return
        g = self._layers[0]
        n = len(self._layers)
        view = dst.reshape(n, g.heads, self.block_size, g.width)
        for (_, slots, _, _), buf in zip(sb.items, sb.bufs):
            view[:, :, slots, :] = buf.reshape(n, g.heads, len(slots), g.width)

    def _read_split(self, name: str, shards: int, rec: Any) -> bool:
        """Re-sharding: fills ``rec`` (this rank's record of ``name``, ``page_bytes``) from
        the records of ``name`` written at another head split of ``shards`` shards: each
        writer shard holding some of this rank's heads is read whole and checked by its
        store, and its bytes of those heads taken out of every layer (a record's layer is
        ``[heads, tokens, width]``: a head's bytes are contiguous). False when one is
        missing or refused."""
        store = self._split_store(shards)
        if store is None or not self.kv_heads:
            return False
        layers = len(self.layer_names)
        mine = self.kv_heads // self.head_shards  # heads a shard here
        theirs = self.kv_heads // shards  # heads a writer's shard
        lo, hi = self.head_shard * mine, (self.head_shard + 1) * mine
        head_bytes = self.layer_page_bytes // mine  # one head's bytes of a layer
        out = rec.reshape(layers, mine, head_bytes)
        src = np.empty(layers * theirs * head_bytes, dtype=np.uint8)
        view = src.reshape(layers, theirs, head_bytes)
        for w in range(lo // theirs, (hi - 1) // theirs + 1):
            key = head_shard_key(name, w, shards)
            if not store.get(key, [(int(src.ctypes.data), src.nbytes)]):
                return False
            a, b = max(lo, w * theirs), min(hi, (w + 1) * theirs)
            out[:, a - lo:b - lo, :] = view[:, a - w * theirs:b - w * theirs, :]
        return True

    def _read_block(self, names: List[str], block_id: int, split: Optional[int] = None
                    ) -> Optional[List[Tuple[Any, Optional[List[int]], Optional[List[int]]]]]:
        """Reads this rank's records of scheduler block ``block_id`` (of its head shard) into
        host buffers, each checked whole by the store (checksums, fingerprint) before
        anything of it reaches a block: ``(record [layers, heads, tokens, width], slots,
        tokens)`` per record (slots and tokens None: the whole record, in order, into the
        whole block); None when one is missing or refused. ``split``: the records were
        written at that many KV head shards, not this deployment's (``_read_split``)."""
        import torch

        self._check_block(block_id)
        g = self._layers[0]
        shape = (len(self._layers), g.heads, self.block_size, g.width)

        def read(name: str) -> Optional[Any]:
            if self.store is None:  # host only: a block the host tier does not serve
                return None
            rec = np.empty(self.page_bytes, dtype=np.uint8)
            if split is not None and split != self.head_shards:
                if not self._read_split(name, split, rec):
                    return None
            elif not self.store.get(self._key(name), [(int(rec.ctypes.data), rec.nbytes)]):
                return None
            return torch.from_numpy(rec).view(shape)

        if self._direct():
            rec = read(names[self.dcp_rank % len(names)])
            return None if rec is None else [(rec, None, None)]
        by_record: Dict[int, Tuple[List[int], List[int]]] = {}
        for s, (k, tok) in enumerate(self._slots):
            slots, toks = by_record.setdefault(k, ([], []))
            slots.append(s)
            toks.append(tok)
        out = []
        for k, (slots, toks) in sorted(by_record.items()):
            rec = read(names[k])
            if rec is None:
                return None
            out.append((rec, slots, toks))
        return out

    def _run_load(self, task: "_LoadTask", loads: Dict[str, List[Job]]) -> None:
        """The loader thread's work for one step: reads and checks the planned records
        (a refused one fails its block and every later block of its request), then fills
        their blocks, in batches of at most ``load_buffer_bytes`` of records, in the plan's
        order. Every batch but the last is filled whole; the last is filled layer by layer,
        in layer order, setting each layer's event once every block of the step holds that
        layer (or has failed): with one batch (the step's reads within the bound) every
        record is read and checked before any block is filled. Whatever goes wrong ends as
        load errors, never as an exception in the engine's thread: every event is set and
        the task marked done on every path."""
        filled: Set[int] = set()  # blocks filled in every layer
        host = task.host
        try:
            batch: List[Tuple[str, int, List[Any]]] = []
            held = 0
            for rid, jobs in loads.items():
                failed = False
                for names, block_id in jobs:
                    if failed:
                        task.errors.add(block_id)
                        continue
                    if batch and held + self._block_read_bytes > self.load_buffer_bytes:
                        self._fill(task, batch, filled, last=False)
                        batch, held = [], 0
                    if block_id in host:  # from the host pool: no store read
                        src = host[block_id]
                        if isinstance(src, int):
                            self._check_block(block_id)
                            src = self._host_source(names, src)
                        items = (None if src is None else [] if src is _HOST_FILLED
                                 else [(src, None, None)])
                        if items is None:
                            logger.warning("cp_hicache: block %d of %s is not in host slot "
                                           "%s here", block_id, rid, host[block_id])
                    else:
                        try:
                            items = self._read_block(names, block_id,
                                                     task.splits.get(block_id))
                        except (_native.UsageError, OSError, ValueError) as e:
                            logger.warning("cp_hicache: loading block %d of %s failed: %s",
                                           block_id, rid, e)
                            items = None
                    if items is None:
                        failed = True
                        task.errors.add(block_id)
                        task.failed_reqs.add(rid)
                        self._count(load_errors=1)
                    else:
                        batch.append((rid, block_id, items))
                        if block_id not in host:
                            held += self._block_read_bytes
                if failed:
                    logger.warning("cp_hicache: request %s: a planned record could not be "
                                   "loaded; vLLM recomputes from its block", rid)
            self._fill(task, batch, filled, last=True)
            hits = len(filled & host.keys())
            stored = len(filled) - hits
            self._count(records_loaded=stored, bytes_loaded=stored * self.page_bytes,
                        host_hits=hits)
        except BaseException as e:  # a bug: fail every block not filled, loudly
            logger.error("cp_hicache: the loader failed: %r", e)
            # Every block of the step's loads not filled in every layer: those staged and
            # those not read yet (this request's later blocks, later requests'), whose
            # layers' events are set below as if loaded.
            left = {rid: [j for j in jobs if j[1] not in filled]
                    for rid, jobs in loads.items()}
            lost = task.fail_all({rid: jobs for rid, jobs in left.items() if jobs})
            self._count(load_errors=len(lost), loader_failures=1)
        finally:
            # The task finishes whatever the fills do (a writer's error while flushing a
            # slot they replace included): _join_load waits for it.
            try:
                if task.fills:
                    self._host_fill(task, filled)
            finally:
                task.finish()

    def _host_fill(self, task: "_LoadTask", filled: Set[int]) -> None:
        """Copies the step's blocks loaded from the store that the planner admitted to the
        host tier (``host_fills``) into their slots, from the filled blocks, after every
        load of the step (one from a slot a fill replaces included) has ended. A block not
        loaded here (failed, or after a failed one) leaves its slot holding nothing
        servable, reported to the planner (``host_failed``)."""
        import torch

        for b, (slot, key, evicted, gen) in task.fills.items():
            ok = False
            self._flush_slot(slot)
            if (b in filled and b not in task.errors and self._host_pool is not None
                    and 0 <= slot < self.host_slots):
                try:
                    lsz = self.layer_page_bytes
                    row = self._host_pool[slot]
                    for li, g in enumerate(self._layers):
                        g.take(b, None, row[li * lsz:(li + 1) * lsz])
                    ok = True
                except Exception as e:  # the slot holds nothing servable: reported
                    logger.warning("cp_hicache: copying loaded block %d into host slot %d "
                                   "failed: %s", b, slot, e)
            self._host_settle(slot, key, evicted, gen, ok)

    def _host_settle(self, slot: int, key: str, evicted: str, gen: int, ok: bool) -> None:
        """Records admission ``gen`` into slot ``slot``: the slot holds ``key`` (``ok``) or
        nothing servable (then reported to the planner); counts it."""
        with self._stats_lock:
            if 0 <= slot < self.host_slots:
                if evicted and self._host_tags[slot] == evicted:
                    self._stats["host_evictions"] = self._stats.get("host_evictions", 0) + 1
                self._host_tags[slot] = key if ok else None
            name = "host_admissions" if ok else "host_failures"
            self._stats[name] = self._stats.get(name, 0) + 1
            if not ok:
                self._host_failed.add((key, gen))

    def _fill(self, task: "_LoadTask", batch: List[Tuple[str, int, List[Any]]],
              filled: Set[int], last: bool) -> None:
        """Fills the blocks of a batch of checked records, layer by layer, adding those
        filled in every layer to ``filled``; with ``last`` sets each layer's event once the
        layer is in (every earlier batch is filled whole by then). A block whose copy fails
        is an error (reported whole, recomputed)."""
        for li, g in enumerate(self._layers):
            hook = self._load_layer_hook
            if hook is not None:
                hook(li)
            for rid, block_id, items in batch:
                if block_id in task.errors:
                    continue
                try:
                    for rec, slots, toks in items:
                        src = rec[li]
                        g.fill(block_id, src if toks is None else src[:, toks, :], slots)
                except Exception as e:  # the block is incomplete: reported, recomputed
                    logger.warning("cp_hicache: filling layer %d of block %d failed: %s",
                                   li, block_id, e)
                    task.errors.add(block_id)
                    task.failed_reqs.add(rid)
                    self._count(load_errors=1)
            if last:
                task.events[li].set()
        filled |= {b for _, b, _ in batch if b not in task.errors}

    def _join_load(self) -> Set[int]:
        """Waits for the step's load (if any) and returns its failed blocks."""
        task, self._load = self._load, None
        if task is None:
            return set()
        task.done.wait()
        return task.errors

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Starts the step's planned loads on the loader thread and returns: the records
        are read and checked there, then the blocks filled layer by layer
        (:meth:`wait_for_layer_load` waits for a layer). A record that is missing or refused,
        and every later block of its request, is not served: the blocks go to
        :meth:`get_block_ids_with_load_errors` and vLLM recomputes them. With ``load_async``
        (vLLM calls this after the forward then) nothing of the step waits for the loads:
        :meth:`get_finished` reports their requests received once they end, and their
        failed blocks go out in the same step."""
        meta = self._get_connector_metadata()
        self._load_errors |= self._join_load()  # a step whose errors were not collected
        if not meta.loads or self._started_meta is meta:
            return
        self._started_meta = meta
        if self._loader is None:
            raise RuntimeError(
                "CpHiCacheConnector: loads planned on a worker that was shut down"
                if self._layers is not None
                else "CpHiCacheConnector: register_kv_caches was not called"
            )
        task = _LoadTask(len(self._layers))
        loads = {rid: list(jobs) for rid, jobs in meta.loads.items()}
        for rid, host in (getattr(meta, "host_loads", None) or {}).items():
            if self.load_async:
                # The load outlives the step: a later step's admission may reuse the slot,
                # so its blocks are filled from the slots now (checked now), holding no
                # copy of them; the loader only accounts for them (its request is out of
                # the batch: no forward reads its blocks meanwhile).
                names = {b: ns for ns, b in loads.get(rid, ())}
                task.host.update({b: (_HOST_FILLED if b in names
                                      and self._host_fill_now(names[b], b, slot) else None)
                                  for b, slot in host.items()})
            else:
                task.host.update({int(b): int(slot) for b, slot in host.items()})
        for fills in (getattr(meta, "host_fills", None) or {}).values():
            task.fills.update({int(b): f for b, f in fills.items()})
        for splits in (getattr(meta, "load_splits", None) or {}).values():
            task.splits.update({int(b): int(s) for b, s in splits.items()})
        try:
            self._loader.submit(self._run_load, task, loads)
        except Exception as e:  # no load runs: every block is a load error, no wait hangs
            logger.error("cp_hicache: the step's loads could not be started: %r", e)
            lost = task.fail_all(loads)
            self._count(load_errors=len(lost), loader_failures=1)
            if task.fills:
                self._host_fill(task, set())  # none made: reported
            task.finish()
        if self.load_async:
            # Nothing of this step waits for it: reported by get_finished once done.
            self._async_loads.append((task, set(loads)))
        else:
            self._load = task

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Blocks until the step's loads have filled layer ``layer_name`` of every loaded
        block (or failed it: then the block is reported by
        :meth:`get_block_ids_with_load_errors` and its tokens recomputed). Raises nothing;
        returns at once when the step loads nothing or the layer is not the connector's."""
        task = self._load
        li = self._layer_index.get(layer_name)
        if task is None or li is None:
            return
        task.events[li].wait()

    def _step_saves(self, meta: Any) -> List["_SaveBlock"]:
        """The step's blocks to save (made once per step's metadata): for each, the record
        (or, under DCP with a small interleave, this rank's part of each record) it writes,
        with a host buffer its layers are copied into as the forward computes them."""
        if self._saves_meta is meta:
            return self._saves
        if self._saves and not self._saves_done:
            # The last step's wait_for_save never came: its blocks may have been reused
            # since, so its copies cannot be completed. Dropped, counted and logged.
            logger.warning("cp_hicache: %d block(s) of step %s not saved: the step ended "
                           "without wait_for_save", len(self._saves),
                           getattr(self._saves_meta, "step", None))
            self._count(saves_dropped=sum(sb.own for sb in self._saves))
        self._saves_meta, self._saves, self._saves_done = meta, [], False
        if meta.saves and self._writer is None:
            raise RuntimeError(
                "CpHiCacheConnector: saves planned on a worker that was shut down"
                if self._layers is not None
                else "CpHiCacheConnector: register_kv_caches was not called"
            )
        layers = len(self._layers or ())
        for rid, jobs in meta.saves.items():
            self._saving_reqs.add(rid)  # reported by get_finished once its writes are done
            write = not self.copy and self.store is not None
            if self.copy and not self.host_slots:
                # This rank's KV is a copy of another DCP group's (TP ranks beyond the
                # heads, or MLA's replicated latent KV): that group writes it (with the
                # host tier on, the copy is held all the same: its pool holds the block).
                continue
            g = self._layers[0]
            for names, b in jobs:
                self._check_block(b)
                items = []
                if self._direct():
                    key = self._key(names[self.dcp_rank % len(names)])
                    items.append((key, None, self.layer_page_bytes, None))
                else:
                    # Each rank holds part of each record: it writes its tokens of each
                    # record it holds tokens of, packed [layers][heads][its tokens][width].
                    for k, name in enumerate(names):
                        slots = [s for s, (rec, _) in enumerate(self._slots) if rec == k]
                        if not slots:
                            continue
                        owners = self._owners(k)
                        items.append((self._key(name), slots, g.heads * len(slots) * g.width,
                                      (owners.index(self.dcp_rank), len(owners), k)))
                self._saves.append(_SaveBlock(rid, b, items, layers, write, not self.copy))
        return self._saves

    def _take_layer(self, sb: "_SaveBlock", li: int) -> None:
        """Copies layer ``li`` of a block to save into its host buffers."""
        import torch

        g = self._layers[li]
        for (_, slots, lsz, _), buf in zip(sb.items, sb.bufs):
            g.take(sb.block_id, slots, torch.from_numpy(buf[li * lsz:(li + 1) * lsz]))
        sb.have[li] = True

    def _submit(self, blocks: List["_SaveBlock"]) -> None:
        """Hands blocks whose every layer is copied to the writer thread: a task per
        request and at most ``save_buffer_bytes`` of blocks, each waiting (in the calling
        thread: the engine's) until the writer's queue has room for it."""
        by_req: Dict[str, List[_SaveBlock]] = {}
        for sb in blocks:
            by_req.setdefault(sb.rid, []).append(sb)
        for rid, sbs in by_req.items():
            chunk: List[_SaveBlock] = []
            size = 0
            for sb in sbs:
                n = sum(buf.nbytes for buf in sb.bufs)
                if chunk and size + n > self.save_buffer_bytes:
                    self._enqueue(rid, chunk, size)
                    chunk, size = [], 0
                chunk.append(sb)
                size += n
            if chunk:
                self._enqueue(rid, chunk, size)

    def _enqueue(self, rid: str, chunk: List["_SaveBlock"], size: int) -> None:
        """Queues one writer task of ``size`` bytes, first waiting until the bytes queued
        and not yet written leave room for it (``save_waits`` counts the waits)."""
        with self._queue_cv:
            if self._queued_bytes and self._queued_bytes + size > self.save_buffer_bytes:
                self._count(save_waits=1)
                while self._queued_bytes and self._queued_bytes + size > self.save_buffer_bytes:
                    self._queue_cv.wait()
            self._queued_bytes += size
        work = []
        for sb in chunk:
            sb.submitted = True
            work.extend((key, buf, part) for (key, _, _, part), buf in zip(sb.items, sb.bufs))
        try:
            f = self._writer.submit(self._write, rid, work)
        except Exception as e:  # no write runs: counted and logged, the room given back
            logger.error("cp_hicache: a write could not be queued: %r", e)
            self._count(save_errors=len(work), writer_failures=1)
            self._dequeue(size)
            return
        f.add_done_callback(lambda f, size=size: self._dequeue(size))
        f.add_done_callback(self._write_done)
        if rid != _FLUSH:  # no request waits for a flush (and it may come from the loader)
            self._writes.setdefault(rid, []).append(f)

    def _dequeue(self, size: int) -> None:
        """A writer task ended (written or not): its bytes leave the queue."""
        with self._queue_cv:
            self._queued_bytes -= size
            self._queue_cv.notify_all()

    def _write_done(self, f: concurrent.futures.Future) -> None:
        """A writer task that raised (``_write`` counts its records' failures itself; this
        is anything else): counted and logged, never lost."""
        if not f.cancelled() and f.exception() is not None:
            logger.error("cp_hicache: a writer task failed: %r", f.exception())
            self._count(save_errors=1, writer_failures=1)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Called by each attention layer after its forward: copies that layer's bytes of
        the step's blocks to save (this rank's tokens of them) out of vLLM's tensor into
        host buffers, since vLLM may reuse a block once the step is over (they are written
        once the planner has settled the step: :meth:`wait_for_save`). Layers that are not
        the connector's (a draft model's) are ignored."""
        li = self._layer_index.get(layer_name)
        meta = getattr(self, "_connector_metadata", None)
        if li is None or meta is None or self._layers is None:
            return
        for sb in self._step_saves(meta):
            if not sb.have[li]:
                self._take_layer(sb, li)

    def wait_for_save(self) -> None:
        """Completes the step's saves without waiting for any write: a block some layer of
        which :meth:`save_kv_layer` did not copy (a forward that does not call it) has those
        layers copied now (after the step's loads have ended: a layer the forward did not
        hand over may be one the loader is still filling). The step's copied blocks are then
        held until the planner's verdict on the step comes in a later step's metadata
        (:meth:`bind_connector_metadata`): only the planner sees every rank's failed loads,
        and a rank whose own loads succeeded computed over another rank's failed block all
        the same. vLLM keeps a finished request's blocks until its writes are reported done
        (:meth:`request_finished`, :meth:`get_finished`). Under DCP with an interleave of a
        whole block each rank writes the records its block holds; with a smaller one every
        rank holds part of each record and writes it as a part (``PageStore.put_part``): the
        last part to come assembles and writes the record, the same bytes a DCP-1 block
        holds."""
        meta = self._get_connector_metadata()
        saves = self._step_saves(meta)
        if self._saves_done:
            return
        self._saves_done = True
        if saves and any(not all(sb.have) for sb in saves):
            task = self._load
            if task is not None:
                task.done.wait()
            for sb in saves:
                for li, have in enumerate(sb.have):
                    if not have:
                        self._take_layer(sb, li)
        step = int(getattr(meta, "step", 0) or 0)
        if saves:
            self._held.setdefault(step, []).extend(saves)
        self._last_saved_step = max(self._last_saved_step, step)
        self._saves = []  # held (or written) from here on
        self._release()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Binds the step's metadata (vLLM calls it before the step's loads) and, on a
        worker, takes the planner's verdicts on earlier steps' saves (``settled``): the
        blocks of a step settled are written, but those of the requests the planner
        rejected (computed over a block that failed to load on some rank), which are
        dropped (``saves_dropped``)."""
        super().bind_connector_metadata(connector_metadata)
        if self._role != KVConnectorRole.WORKER:
            return
        step = int(getattr(connector_metadata, "step", 0) or 0)
        if step:
            self._ran.add(step)
        self._verdicts.update(getattr(connector_metadata, "settled", None) or {})
        self._admits.update(getattr(connector_metadata, "host_admits", None) or {})
        self._only.update(getattr(connector_metadata, "host_only", None) or {})
        for rid in getattr(connector_metadata, "unreported", None) or ():
            # vLLM frees its blocks itself (its load ended): nothing to report.
            self._saving_reqs.discard(rid)
            self._finished_waiting.discard(rid)
        self._release()

    def _release(self) -> None:
        """Applies the verdicts received to the steps held: writes the blocks settled,
        drops those rejected. A verdict on a step this worker does not hold (it saved
        nothing in it, or holds copies) is forgotten once the step's saves are done."""
        for t in sorted(self._held):
            dropped = self._verdicts.pop(t, None)
            if dropped is None:
                continue
            blocks = self._held.pop(t)
            keep = [sb for sb in blocks if sb.rid not in dropped]
            lost = sum(sb.own for sb in blocks) - sum(sb.own for sb in keep)
            if lost:
                logger.warning("cp_hicache: %d block(s) of step %d not saved: computed over "
                               "a block that failed to load", lost, t)
                self._count(saves_dropped=lost)
            admits = self._admits.pop(t, None)
            failed: Set[Tuple[str, int]] = set()
            if admits:
                failed = self._host_admit(admits, {(sb.rid, sb.block_id): sb for sb in keep})
            # Under write_back the blocks kept in the host tier only are written when it
            # evicts them; one whose admission failed here is written now instead.
            only = self._only.pop(t, set())
            keep = [sb for sb in keep if sb.write and ((sb.rid, sb.block_id) not in only
                                                       or (sb.rid, sb.block_id) in failed)]
            if keep:
                self._submit(keep)
        for t in [t for t in self._verdicts if t <= self._last_saved_step]:
            del self._verdicts[t]
        for t in [t for t in self._only if t <= self._last_saved_step]:
            del self._only[t]
        for t in [t for t in self._admits if t <= self._last_saved_step]:
            # Admissions of a step this worker holds no copies of (its saves were dropped
            # here: the step ended without wait_for_save): none can be made.
            self._host_admit(self._admits.pop(t), {})

    def _host_admit(self, admits: List[Tuple[str, int, int, str, str, int]],
                    blocks: Dict[Tuple[str, int], "_SaveBlock"]) -> Set[Tuple[str, int]]:
        """Makes the planner's admissions: each block's held copy goes into its slot,
        replacing (evicting) the slot's block. An admission that cannot be made (no whole
        copy of the block held here, or the copy failed) leaves the slot holding nothing
        servable and is reported to the planner (``host_failed``): its block is not
        offered from the host tier again, and a load already planned from it fails here
        (reported, recomputed), never served. Under ``write_back`` a slot holding a block
        not yet in the store is flushed first, and the admitted block's slot is marked so.
        Returns the ``(request, block id)`` of the admissions not made."""
        # No load of this step may read a slot while it is replaced.
        self._load_errors |= self._join_load()
        failed: Set[Tuple[str, int]] = set()
        for rid, b, slot, key, evicted, gen in admits:
            # Nor may a load that spans steps still fill it (the planner pins such slots
            # until the load is received, so this never waits; kept for the bytes' sake).
            for task, _ in self._async_loads:
                if any(f[0] == slot for f in task.fills.values()):
                    task.done.wait()
            sb = blocks.get((rid, b))
            ok = False
            self._flush_slot(slot)
            if (sb is not None and all(sb.have) and self._host_pool is not None
                    and 0 <= slot < self.host_slots):
                try:
                    self._host_put(slot, sb)
                    ok = True
                except Exception as e:  # the slot holds nothing servable: reported
                    logger.warning("cp_hicache: copying block %d of %s into host slot %d "
                                   "failed: %s", b, rid, slot, e)
            self._host_settle(slot, key, evicted, gen, ok)
            if not ok:
                failed.add((rid, b))
            elif self.write_back and sb.write:
                self._host_dirty[slot] = (key, sb.items)
        return failed

    def _flush_slot(self, slot: int) -> None:
        """``write_back``: before host slot ``slot`` is replaced (the planner's admission
        evicts its block) or at ``shutdown``, writes the block it holds, if not yet in the
        store, to the store: the slot's bytes are copied out now (so the slot may be
        reused at once) and written by the writer thread, as a save is (within
        ``save_buffer_bytes``). A flush that fails leaves that block out of the store
        (``flush_errors``), never a wrong record."""
        ent = self._host_dirty.pop(slot, None)
        if ent is None:
            return
        key, items = ent
        try:
            if self._writer is None or self._host_tags[slot] != key:
                raise RuntimeError(f"host slot {slot} no longer holds block {key}")
            sb = _SaveBlock(_FLUSH, -1, items, len(self._layers))
            src = self._host_pool[slot].numpy()
            if len(items) == 1 and items[0][1] is None:
                sb.bufs[0][:] = src
            else:
                g = self._layers[0]
                view = src.reshape(len(self._layers), g.heads, self.block_size, g.width)
                for (_, slots, _, _), buf in zip(items, sb.bufs):
                    buf[:] = view[:, :, slots, :].reshape(-1)
        except Exception as e:
            logger.warning("cp_hicache: flushing host slot %d to the store failed: %s",
                           slot, e)
            self._count(flush_errors=len(items))
            return
        self._enqueue(_FLUSH, [sb], sum(buf.nbytes for buf in sb.bufs))

    def build_connector_worker_meta(self) -> Optional[CpHiCacheWorkerMeta]:
        """The steps this worker ran since its last report (:class:`CpHiCacheWorkerMeta`),
        sent to the planner with the step's failed loads."""
        with self._stats_lock:
            failed, self._host_failed = self._host_failed, set()
        if not self._ran and not failed:
            return None
        ran, self._ran = self._ran, set()
        return CpHiCacheWorkerMeta(steps={t: 1 for t in sorted(ran)}, host_failed=failed)

    def _owners(self, record: int) -> List[int]:
        """The ranks holding tokens of record ``record`` of a scheduler block, in order."""
        i, d, bs = self.interleave, self.dcp, self.block_size
        return sorted({(o // i) % d for o in range(record * bs, (record + 1) * bs)})

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
                whole = True  # counted as a record (a part: counted once, by one rank)
                if part is None:
                    if isinstance(data, np.ndarray):
                        data = [(int(data.ctypes.data), int(data.nbytes))]
                    written = self.store.put(name, data)
                else:
                    index, count, record = part
                    got = self.store.put_part(
                        name, index, count, [(int(data.ctypes.data), int(data.nbytes))],
                        lambda ps, record=record: self._assemble(record, ps))
                    written = got != "read_only"
                    if written:
                        self._count(parts_saved=1)
                    # The rank that assembled it counts the record; one already there is
                    # counted by its first part's rank.
                    whole = got == "completed" or (got == "present" and index == 0)
                if not written:  # a store this process may only read (another user's,
                    self._count(saves_read_only=1)  # a read-only mount): never written
                elif whole:
                    self._count(records_saved=1, bytes_saved=self.page_bytes)
                if written and rid == _FLUSH:
                    self._count(host_flushes=1)
            except Exception as e:  # a failed write is a later miss, counted and logged
                logger.warning("cp_hicache: saving a block of %s failed: %s",
                               "a host slot (flush)" if rid == _FLUSH else rid, e)
                self._count(save_errors=1)
                if rid == _FLUSH:
                    self._count(flush_errors=1)

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Requests that finished and whose saves are all settled and written or dropped
        (``finished_sending``: vLLM frees their blocks now), and with ``load_async`` the
        requests whose loads have ended (``finished_recving``: filled, or failed, their
        failed blocks reported in the same step)."""
        self._finished_waiting |= set(finished_req_ids) & self._saving_reqs
        done = set()
        # Requests with saves not yet settled (held, or copied this step): not done.
        pending = {sb.rid for blocks in self._held.values() for sb in blocks}
        pending |= {sb.rid for sb in self._saves}
        for rid in list(self._finished_waiting):
            if rid not in pending and all(f.done() for f in self._writes.get(rid, ())):
                done.add(rid)
                self._finished_waiting.discard(rid)
                self._saving_reqs.discard(rid)
                self._writes.pop(rid, None)
        # Loads that span steps and have ended: their requests are received, and their
        # failed blocks go out with them (get_block_ids_with_load_errors comes next).
        recving: Set[str] = set()
        for task, rids in list(self._async_loads):
            if task.done.is_set():
                self._async_loads.remove((task, rids))
                recving |= rids
                self._load_errors |= task.errors
        # Writes of requests still running that are done need no tracking (a task that
        # raised was counted by _write_done).
        for rid, fs in list(self._writes.items()):
            fs[:] = [f for f in fs if not f.done()]
            if not fs and rid not in self._saving_reqs:
                del self._writes[rid]
        return (done or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks whose planned record could not be loaded since the last call (vLLM
        recomputes them). Waits for the step's loads to end first (they have, where the
        forward waited for every layer), so a step's failures are reported in that step,
        as vLLM asks of synchronous loads: a block any layer of which was not filled from a
        checked record is reported whole, even if earlier layers were served."""
        self._load_errors |= self._join_load()
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
        """What this process's store did (records written, read, refused by kind); empty
        without a store (a host-only deployment)."""
        return self.store.stats() if self.store is not None else {}

    def shutdown(self) -> None:
        """Drains: waits for the step's loads and every write in flight, then stops the
        loader and writer threads (none is left behind). Saves still waiting for the
        planner's verdict are dropped (counted as ``saves_dropped``, logged): whether
        another rank's load failed under them is not known. Idempotent."""
        self._load_errors |= self._join_load()
        for task, _ in self._async_loads:
            task.done.wait()
        held = sum(sb.own for blocks in self._held.values() for sb in blocks)
        if held:
            logger.warning("cp_hicache: shutdown: %d block(s) not saved: the planner's "
                           "verdict on their steps had not come", held)
            self._count(saves_dropped=held)
        self._held.clear()
        self._verdicts.clear()
        # write_back: what only the host tier holds goes to the store before the writer
        # stops (each worker its own bytes of every such slot).
        for slot in sorted(self._host_dirty):
            self._flush_slot(slot)
        for attr in ("_loader", "_writer"):
            ex = getattr(self, attr)
            if ex is not None:
                ex.shutdown(wait=True)
                setattr(self, attr, None)
