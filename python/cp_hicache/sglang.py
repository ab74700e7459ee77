"""SGLang's HiCache L3 storage backend over cp-hicache's page store: ``CpHiCacheStorage``.

Loaded by SGLang's own factory with ``--hicache-storage-backend dynamic`` and::

    --hicache-storage-backend-extra-config '{"backend_name": "cp_hicache",
        "module_path": "cp_hicache.sglang", "class_name": "CpHiCacheStorage",
        "interface_v1": 1, "path": "/shared/kv-store", "capacity_bytes": 1099511627776}'

``interface_v1`` makes SGLang's controller call the zero-copy ``batch_get_v1`` /
``batch_set_v1``, which read and write the host pool's page buffers in place
(``get_page_buffer_meta``).

What it does differently from SGLang's file and Mooncake backends under context parallelism:

- **Keys are canonical.** A record is named by SGLang's chained page hash alone, salted with
  a fingerprint of the pages' format (model, dtype, layers, page size, host layout; the TP
  rank only where heads are split across it, and the PP stage, which holds other layers).
  The attention-CP rank and size are left out, so every CP rank reads the same record, and a
  store written under one CP degree serves another: no rank-scoped copy that only some ranks
  wrote (a MIN-reduced hit count of 0), and no copy per rank.
- **One writer per record.** Among the attention-CP ranks, page ``key`` is written by rank
  ``int(sha256(key)) % attn_cp_size`` only; the others report it backed up. Under MLA only
  SGLang's storage writer of the TP group writes (``is_storage_writer``). No two ranks ever
  write one record, and records become visible whole (written aside, then renamed).
- **Every read is checked.** A torn, changed or foreign record is refused, removed and
  counted (``get_stats()``), and served as a miss.

Not built yet: the v2 pool transfers (``batch_get_v2``/``batch_set_v2``, the ``indexer``
pool committed with ``kv``); until then a deployment with sidecar pools keeps them out of
this store.
"""

from __future__ import annotations

import hashlib
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


class CpHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over a ``cp_hicache`` page store in a directory shared by
    every rank's process and by later runs (see the module documentation)."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        path = extra.get("path")
        if not path:
            raise ValueError(
                "CpHiCacheStorage needs extra_config['path']: the store's directory, shared "
                "by every rank (a shared file system on a cluster)"
            )
        capacity = int(extra.get("capacity_bytes", DEFAULT_CAPACITY))
        if capacity <= 0:
            raise ValueError(f"extra_config['capacity_bytes'] = {capacity} is not positive")
        self.config = storage_config
        self.path = str(path)
        self.capacity_bytes = capacity
        self.store: Optional[_native.PageStore] = None
        self.mem_pool_host: Any = None
        self.registered_pools: dict = {}

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Takes the host pool whose pages this backend reads and writes, and opens the
        store for its page format."""
        super().register_mem_pool_host(mem_pool_host)
        page_size = int(mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(_indices(range(page_size)))
        if len(ptrs) != len(sizes) or not sizes:
            raise ValueError("the host pool's get_page_buffer_meta gave no page buffers")
        page_bytes = int(sum(sizes))
        self._parts_per_page = len(ptrs)
        self.store = _native.PageStore(
            self.path, self._fingerprint(mem_pool_host, page_bytes), page_bytes,
            self.capacity_bytes,
        )

    def _fingerprint(self, pool: Any, page_bytes: int) -> str:
        c = self.config
        words = [
            "sglang",
            f"model={getattr(c, 'model_name', None)}",
            f"mla={bool(getattr(c, 'is_mla_model', False))}",
            f"layout={getattr(pool, 'layout', None)}",
            f"dtype={getattr(pool, 'dtype', None)}",
            f"layers={getattr(pool, 'layer_num', None)}",
            f"page_size={pool.page_size}",
            f"page_bytes={page_bytes}",
        ]
        if not getattr(c, "is_mla_model", False):
            # Heads are split across TP ranks: each rank's page holds other bytes.
            words.append(f"tp={c.tp_rank}/{c.tp_size}")
        if getattr(c, "pp_size", 1) > 1:
            words.append(f"pp={c.pp_rank}/{c.pp_size}")
        return ";".join(words)

    def _store(self) -> "_native.PageStore":
        if self.store is None:
            raise RuntimeError(
                "CpHiCacheStorage: no host pool registered yet (register_mem_pool_host)"
            )
        return self.store

    # -- who writes ----------------------------------------------------------------------

    def writes(self, key: str) -> bool:
        """Whether this rank is page ``key``'s one writer."""
        c = self.config
        if not getattr(c, "is_storage_writer", True):
            return False
        size = int(getattr(c, "attn_cp_size", 1) or 1)
        if size <= 1:
            return True
        owner = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % size
        return owner == int(getattr(c, "attn_cp_rank", 0))

    # -- the zero-copy interface (interface_v1) --------------------------------------------

    def _pages(self, keys: List[str], host_indices: Any) -> List[list]:
        pool = self.mem_pool_host
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
        """Writes the pages this rank is the writer of from the host pool, in place; the
        others are reported backed up (their writer writes them)."""
        store = self._store()
        return [
            store.put(k, parts) if self.writes(k) else True
            for k, parts in zip(keys, self._pages(keys, host_indices))
        ]

    def batch_get_v1(self, keys: List[str], host_indices: Any,
                     extra_info: Any = None) -> List[bool]:
        """Reads pages into the host pool in place, up to the first miss (the controller
        keeps the leading run)."""
        store = self._store()
        out: List[bool] = []
        for k, parts in zip(keys, self._pages(keys, host_indices)):
            ok = bool(out[-1]) if out else True
            out.append(ok and store.get(k, parts))
        return out

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


def _tensor_part(t: Any) -> tuple:
    """A contiguous CPU tensor's ``(address, bytes)``."""
    if not t.is_contiguous():
        raise ValueError("a page tensor must be contiguous")
    if t.device.type != "cpu":
        raise ValueError(f"a page tensor must be in host memory, not on {t.device}")
    return (t.data_ptr(), t.numel() * t.element_size())
