"""SGLang's HiCache L3 storage backend over cp-hicache's page store: ``CpHiCacheStorage``.

Loaded by SGLang's own factory with ``--hicache-storage-backend dynamic`` and::

    --hicache-storage-backend-extra-config '{"backend_name": "cp_hicache",
        "module_path": "cp_hicache.sglang", "class_name": "CpHiCacheStorage",
        "interface_v1": 1, "path": "/shared/kv-store", "capacity_bytes": 1099511627776}'

``capacity_bytes`` bounds this deployment's records, shared evenly among its shards (MHA
head shards, PP stages), each in a directory of its own under ``path``. ``attention_dp``
(default false) says whether attention DP is on where SGLang's parallel context is not
published in this process.

``"path": "mooncake://HOST:PORT"`` (a Mooncake Store master) keeps the records in Mooncake
Store instead, the same bytes, checked the same way; ``"mooncake": {...}`` gives the
client's options (``cp_hicache.mooncake.MooncakeStore``: ``metadata_server``,
``segment_bytes``, ...), and Mooncake's capacity applies, not ``capacity_bytes``.

``interface_v1`` makes SGLang's controller call the zero-copy ``batch_get_v1`` /
``batch_set_v1``, which read and write the host pool's page buffers in place
(``get_page_buffer_meta``).

What it does differently from SGLang's file and Mooncake backends under context parallelism:

- **Keys are canonical.** A record is named by SGLang's chained page hash alone, salted with
  a fingerprint of the pages' format (model, dtype, layers, page size, host layout; for MHA
  the attention-TP head shard, and the PP stage, which holds other layers). The
  attention-CP rank and size are left out: SGLang's attention-CP ranks all hold the whole
  page (prefill CP all-gathers the KV, and the indexer keys, before writing them), so every
  CP rank reads the same record, and a store written under one CP degree serves another.
  No rank-scoped copy that only some ranks wrote (a MIN-reduced hit count of 0), and no
  copy per rank. Each shard's records live in a directory of their own under ``path``.
- **One writer per record.** SGLang calls ``batch_set_v1`` only on its storage writers
  (``is_storage_writer``: every rank for MHA; for MLA, TP rank 0 of each attention-DP
  group). Where every attention-CP rank is a writer of the same bytes (MHA, or MLA under
  attention DP), page ``key`` is written by CP rank ``int(sha256(key)) % attn_cp_size`` only,
  and the others report it backed up. Where one rank is the writer (MLA without attention
  DP: CP rank 0), it writes every page. Writers of replicated pages in different
  attention-DP groups may write the same record; the store keeps it whole (each record is
  written aside, then renamed over; a record already there is not written again).
- **Not built, refused at construction:** decode context parallel (``dcp_size > 1``: each
  rank holds a token-interleaved part of every page; SGLang too refuses a ``dynamic``
  backend there) and heads split across heterogeneous TP (``should_split_heads``).
- **Every read is checked.** A torn, changed or foreign record is refused, removed and
  counted (``get_stats()``), and served as a miss.

- **``indexer`` pages go with their ``kv`` page, in one record.** SGLang backs a page's
  KV-derived sidecar (DSA's ``indexer`` pool) up through ``batch_set_v2`` just before the
  page's KV through ``batch_set_v1``, and reads them back in the same order. The backend
  holds the ``indexer`` bytes until the ``kv`` page comes and writes one record with both,
  so no reader ever finds one without the other; a ``kv`` page whose ``indexer`` part never
  came is not written (``False``). Reading the record fills the ``kv`` page and holds its
  ``indexer`` part for the ``batch_get_v2`` that follows.

Other sidecar pools (Mamba or SWA states) are refused when registered: they are not built.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from typing import Any, List, Optional

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cp_hicache.sglang is SGLang's storage backend: it needs sglang's "
        "sglang.srt.mem_cache.hicache_storage module importable"
    ) from e

from . import _native

__all__ = ["CpHiCacheStorage"]

#: The default capacity of the store, in bytes.
DEFAULT_CAPACITY = 16 << 30

#: The most ``indexer`` bytes held for ``kv`` pages not written yet (a backup that
#: stopped part-way leaves some).
DEFAULT_INDEXER_STASH = 1 << 30


class CpHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a ``cp_hicache`` page store in a directory shared by
    every rank's process and by later runs (see the module documentation)."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        path = extra.get("path")
        if not path:
            raise ValueError(
                "CpHiCacheStorage needs extra_config['path']: the store's directory, shared "
                "by every rank (a shared file system on a cluster), or mooncake://HOST:PORT "
                "(a Mooncake Store master; its client options in extra_config['mooncake'])"
            )
        capacity = int(extra.get("capacity_bytes", DEFAULT_CAPACITY))
        if capacity <= 0:
            raise ValueError(f"extra_config['capacity_bytes'] = {capacity} is not positive")
        if int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
            raise ValueError(
                "CpHiCacheStorage does not store decode-context-parallel pages "
                f"(dcp_size={storage_config.dcp_size}): each rank holds a token-interleaved "
                "part of every page, and records in parts are not built"
            )
        if getattr(storage_config, "should_split_heads", False):
            raise ValueError(
                "CpHiCacheStorage does not split heads across heterogeneous TP "
                "(tp_lcm_size): give every TP size its own store"
            )
        self.extra = extra
        self._topology: Optional[tuple] = None
        self.config = storage_config
        self.path = str(path)
        self.capacity_bytes = capacity
        self.store: Optional[_native.PageStore] = None
        self.mem_pool_host: Any = None
        self.registered_pools: dict = {}
        # ``indexer`` bytes by page key: written with the page's ``kv`` (backups), or read
        # with it and waiting for ``batch_get_v2`` (loads).
        self._indexer_bytes = 0
        self._indexer_to_write: dict = {}
        self._indexer_read: dict = {}
        self.indexer_stash_bytes = int(extra.get("indexer_stash_bytes", DEFAULT_INDEXER_STASH))

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host pool whose ``kv`` pages this backend reads and writes."""
        super().register_mem_pool_host(mem_pool_host)
        self.store = None

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Takes a sidecar host pool: only the ``indexer`` pool (its pages go into the
        records of their ``kv`` pages); any other is refused."""
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == "kv":
            self.registered_pools["kv"] = host_pool
            return
        if name != "indexer":
            raise ValueError(
                f"CpHiCacheStorage stores kv pages and their indexer pages; the {name!r} "
                "pool is not built"
            )
        self.registered_pools["indexer"] = host_pool
        self.store = None

    def on_host_pools_registered(self) -> None:
        """Opens the store once every pool is known (a record holds a page of each)."""
        self._store()

    @staticmethod
    def _page_bytes(pool: Any) -> int:
        ptrs, sizes = pool.get_page_buffer_meta(_indices(range(int(pool.page_size))))
        if len(ptrs) != len(sizes) or not sizes:
            raise ValueError("a host pool's get_page_buffer_meta gave no page buffers")
        return int(sum(sizes))

    def _open(self) -> "_native.PageStore":
        kv = self.mem_pool_host
        kv_bytes = self._page_bytes(kv)
        indexer = self.registered_pools.get("indexer")
        self._indexer_bytes = 0 if indexer is None else self._page_bytes(indexer)
        fingerprint = self._fingerprint(kv, kv_bytes)
        if indexer is not None:
            fingerprint += f";indexer_page_bytes={self._indexer_bytes}"
        # A directory per shard (its records are other bytes under the same keys), each
        # with its share of the capacity.
        digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
        shards = int(getattr(self.config, "pp_size", 1) or 1)
        if not self._replicated():
            shards *= self.topology()[1]
        if self.path.startswith("mooncake://"):
            # One Mooncake Store for every shard: the fingerprint salts each page's key.
            from .mooncake import open_store

            self.store_path = self.path
            return _native.PageStore.over(
                open_store(self.path, self.extra.get("mooncake")), fingerprint,
                kv_bytes + self._indexer_bytes,
            )
        self.store_path = os.path.join(self.path, f"sglang-{digest}")
        return _native.PageStore(
            self.store_path, fingerprint, kv_bytes + self._indexer_bytes,
            max(self.capacity_bytes // shards, 1),
        )

    def _replicated(self) -> bool:
        """Whether every TP rank holds the same page (MLA, DSA: SGLang's ``is_mla_model``)."""
        return bool(getattr(self.config, "is_mla_model", False))

    def topology(self) -> tuple:
        """``(attn_tp_rank, attn_tp_size, attention_dp)``: the head shard this rank holds and
        whether attention DP is on (then the config's TP rank and size are attention TP's).

        Read from SGLang's published parallel context where this process has one; else from
        ``extra_config['attention_dp']`` (default off) and the config, whose TP group is then
        ``attn_cp_size`` attention-TP groups."""
        if self._topology is None:
            self._topology = self._read_topology()
        return self._topology

    def _read_topology(self) -> tuple:
        rc = sys.modules.get("sglang.srt.runtime_context")
        try:
            p = rc.get_parallel()
            return int(p.attn_tp_rank), int(p.attn_tp_size), int(p.attn_dp_size) > 1
        except Exception:  # not an SGLang process, or its context is not published
            pass
        c = self.config
        if bool(self.extra.get("attention_dp", False)):
            return int(c.tp_rank), int(c.tp_size), True
        cp = int(getattr(c, "attn_cp_size", 1) or 1)
        if c.tp_size % cp:
            raise ValueError(
                f"tp_size {c.tp_size} is not a multiple of attn_cp_size {cp}: set "
                "extra_config['attention_dp'] if attention DP is on"
            )
        attn_tp = c.tp_size // cp
        return int(c.tp_rank) % attn_tp, attn_tp, False

    def _fingerprint(self, pool: Any, page_bytes: int) -> str:
        c = self.config
        words = [
            "sglang",
            f"model={getattr(c, 'model_name', None)}",
            f"mla={self._replicated()}",
            f"layout={getattr(pool, 'layout', None)}",
            f"dtype={getattr(pool, 'dtype', None)}",
            f"layers={getattr(pool, 'layer_num', None)}",
            f"page_size={pool.page_size}",
            f"page_bytes={page_bytes}",
        ]
        if not self._replicated():
            # Heads are split across attention-TP ranks: each shard's page holds other
            # bytes. Attention-CP ranks of one shard hold the same ones.
            rank, size, _ = self.topology()
            words.append(f"heads={rank}/{size}")
        if getattr(c, "pp_size", 1) > 1:
            words.append(f"pp={c.pp_rank}/{c.pp_size}")
        return ";".join(words)

    def _store(self) -> "_native.PageStore":
        if self.store is None:
            if self.mem_pool_host is None:
                raise RuntimeError(
                    "CpHiCacheStorage: no host pool registered yet (register_mem_pool_host)"
                )
            self.store = self._open()
        return self.store

    # -- who writes ----------------------------------------------------------------------

    def is_writer(self) -> bool:
        """SGLang's storage writer election (``HiCacheStorageConfig.is_storage_writer``)."""
        w = getattr(self.config, "is_storage_writer", True)
        return bool(w() if callable(w) else w)

    def writes(self, key: str) -> bool:
        """Whether this rank is page ``key``'s one writer (see the module documentation)."""
        c = self.config
        if not self.is_writer():
            return False
        size = int(getattr(c, "attn_cp_size", 1) or 1)
        # Every CP peer is a writer of the same bytes for MHA, and for MLA only where the
        # config's TP rank is attention TP's (attention DP on): only then split.
        if size <= 1 or (self._replicated() and not self.topology()[2]):
            return True
        owner = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % size
        return owner == int(getattr(c, "attn_cp_rank", 0))

    # -- the zero-copy interface (interface_v1) --------------------------------------------

    def _pages(self, keys: List[str], host_indices: Any, pool: Any = None) -> List[list]:
        pool = self.mem_pool_host if pool is None else pool
        n = len(keys)
        if n == 0:
            return []
        if len(host_indices) != n * pool.page_size:
            raise ValueError(
                f"{len(host_indices)} host indices for {n} pages of {pool.page_size} tokens"
            )
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        per = len(ptrs) // n
        if per * n != len(ptrs) or len(sizes) != len(ptrs):
            raise ValueError(
                f"get_page_buffer_meta gave {len(ptrs)} buffers for {n} pages"
            )
        return [
            [(int(p), int(s)) for p, s in zip(ptrs[i * per:(i + 1) * per],
                                              sizes[i * per:(i + 1) * per])]
            for i in range(n)
        ]

    def batch_set_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Any = None) -> List[bool]:
        """Writes the pages this rank is the writer of from the host pool, in place (with
        their ``indexer`` part, which ``batch_set_v2`` handed over first); the others are
        reported backed up (their writer writes them)."""
        store = self._store()
        out: List[bool] = []
        # The pages to write, in one put_many (one batch of the engine's for Mooncake).
        names: List[str] = []
        pages: List[Any] = []
        at: List[int] = []
        for k, parts in zip(keys, self._pages(keys, host_indices)):
            indexer = self._indexer_to_write.pop(k, None)
            if not self.writes(k):
                out.append(True)
            elif self._indexer_bytes and indexer is None:
                out.append(False)  # never a kv page without its indexer page
            else:
                at.append(len(out))
                out.append(False)
                names.append(k)
                pages.append(parts if indexer is None else parts + [_buffer_part(indexer)])
        if names:
            for i, ok in zip(at, store.put_many(names, pages)):
                out[i] = ok
        return out

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Any = None) -> List[bool]:
        """Reads pages into the host pool in place, up to the first miss (the controller
        keeps the leading run); each page's ``indexer`` part waits for ``batch_get_v2``."""
        import numpy as np

        store = self._store()
        # The batch_get_v2 that follows each batch_get_v1 takes what it read; what an
        # earlier batch left (its batch_get_v2 never came) goes.
        self._indexer_read.clear()
        names = list(keys)
        pages = self._pages(keys, host_indices)
        indexers = []
        for i in range(len(names)):
            indexer = np.empty(self._indexer_bytes, dtype=np.uint8) if self._indexer_bytes else None
            indexers.append(indexer)
            if indexer is not None:
                pages[i] = pages[i] + [_buffer_part(indexer)]
        # One get_many (one batch of the engine's for Mooncake); what follows a miss is
        # not kept.
        out: List[bool] = []
        for k, ok, indexer in zip(names, store.get_many(names, pages) if names else [], indexers):
            ok = ok and not (out and not out[-1])
            if ok and indexer is not None:
                self._indexer_read[k] = indexer
            out.append(ok)
        return out

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        """Takes each page's ``indexer`` bytes, to be written in one record with the page's
        ``kv`` by the ``batch_set_v1`` that follows."""
        import numpy as np

        out = {}
        for t in transfers:
            name, pool, keys = self._transfer(t)
            got = []
            for k, parts in zip(keys, self._pages(keys, t.host_indices, pool)):
                if sum(n for _, n in parts) != self._indexer_bytes:
                    got.append(False)
                    continue
                buf = np.empty(self._indexer_bytes, dtype=np.uint8)
                at = 0
                for addr, n in parts:
                    buf[at:at + n] = np.ctypeslib.as_array(
                        (ctypes.c_uint8 * n).from_address(addr))
                    at += n
                self._indexer_to_write.pop(k, None)
                self._indexer_to_write[k] = buf
                got.append(True)
            out[name] = got
        # A backup that stopped before its kv pages leaves their indexer bytes here: the
        # oldest go past the bound (their kv pages, should they come, are then not
        # written). What is kept is the page's own bytes, never a stale host location.
        while len(self._indexer_to_write) * max(self._indexer_bytes, 1) > self.indexer_stash_bytes:
            self._indexer_to_write.pop(next(iter(self._indexer_to_write)))
        return out

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> dict:
        """Fills the ``indexer`` pages that ``batch_get_v1`` read with their ``kv``."""
        out = {}
        for t in transfers:
            name, pool, keys = self._transfer(t)
            got = []
            for k, parts in zip(keys, self._pages(keys, t.host_indices, pool)):
                buf = self._indexer_read.pop(k, None)
                if buf is None or (got and not got[-1]):
                    got.append(False)
                    continue
                if sum(n for _, n in parts) != buf.nbytes:
                    raise ValueError(
                        f"the indexer pool's page buffers hold {sum(n for _, n in parts)} "
                        f"bytes, its pages in the store {buf.nbytes}"
                    )
                at = 0
                for addr, n in parts:
                    ctypes.memmove(addr, buf[at:at + n].ctypes.data, n)
                    at += n
                got.append(True)
            out[name] = got
        return out

    def batch_exists_v2(self, keys: List[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """The run of pages whose records exist; a record holds the ``indexer`` page too."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        hit = self.batch_exists(keys, extra_info)
        for t in pool_transfers or []:
            self._transfer(t)
        extra = {self._name(t): hit for t in pool_transfers or []} if hit else {}
        return PoolTransferResult(hit, extra, list(range(1, hit + 1)))

    @staticmethod
    def _name(t: Any) -> str:
        return str(getattr(t.name, "value", t.name))

    def _transfer(self, t: Any) -> tuple:
        name = self._name(t)
        pool = self.registered_pools.get(name)
        if name != "indexer" or pool is None:
            raise ValueError(f"CpHiCacheStorage: no {name!r} pool is registered with it")
        return name, pool, list(t.keys or [])

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, have a record."""
        return self._store().present_run(list(keys))

    # -- the abstract interface (one flat page tensor per key) ---------------------------

    def exists(self, key: str) -> bool:
        return self._store().exists(key)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        if target_location is None:
            raise ValueError("CpHiCacheStorage.get reads into target_location (a flat page)")
        ok = self._store().get(key, [_tensor_part(target_location)])
        return target_location if ok else None

    def batch_get(self, keys: List[str], target_locations: Any = None,
                  target_sizes: Any = None) -> List[Any]:
        out = []
        for k, t in zip(keys, target_locations):
            got = self.get(k, t)
            out.append(got)
            if got is None:
                break
        return out + [None] * (len(keys) - len(out))

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        if value is None:
            raise ValueError("CpHiCacheStorage.set writes value (a flat page)")
        if not self.writes(key):
            return True
        return self._store().put(key, [_tensor_part(value.contiguous())])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values))

    def get_stats(self) -> Optional[dict]:
        return None if self.store is None else self.store.stats()


def _indices(seq: Any) -> Any:
    """Token indices as the host pool expects them (a torch tensor where torch is there)."""
    try:
        import torch

        return torch.tensor(list(seq), dtype=torch.int64)
    except ImportError:  # pragma: no cover
        return list(seq)


def _buffer_part(a: Any) -> tuple:
    """A numpy byte buffer's ``(address, bytes)``."""
    return (int(a.ctypes.data), int(a.nbytes))


def _tensor_part(t: Any) -> tuple:
    """A contiguous CPU tensor's ``(address, bytes)``."""
    if not t.is_contiguous():
        raise ValueError("a page tensor must be contiguous")
    if t.device.type != "cpu":
        raise ValueError(f"a page tensor must be in host memory, not on {t.device}")
    return (t.data_ptr(), t.numel() * t.element_size())
