"""The storage tier over Mooncake Store (issue 44): :class:`MooncakeStore` keeps a page
store's objects in a Mooncake cluster, so ranks on several machines, and later processes,
share one store.

It only moves whole objects by name; the rank writes and checks the records themselves
(the bytes a directory store writes: header, checksum, canonical key), so a record damaged
in Mooncake is refused and counted as one damaged on disk. Pass it (or its URL,
``mooncake://HOST:PORT``, the master's RPC address) to :meth:`cp_hicache.RankCache.attach_storage`::

    rc.attach_storage("mooncake://127.0.0.1:50051",
                      options={"metadata_server": "http://127.0.0.1:8080/metadata"})

One writer per record: Mooncake's ``put`` of a key that is there keeps the first object;
presence is ``batch_is_exist``. Leases, eviction and capacity are Mooncake's.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

from ._native import UsageError

SCHEME = "mooncake"

# Mooncake's error code for an object that is not there (a get, a remove).
_OBJECT_NOT_FOUND = -704


def parse_url(url: str) -> str:
    """The master's ``HOST:PORT`` in ``mooncake://HOST:PORT``."""
    u = urlparse(url)
    if u.scheme != SCHEME or not u.hostname or not u.port or u.path not in ("", "/"):
        raise UsageError(f"{url!r}: a Mooncake store is named mooncake://HOST:PORT (the master)")
    return f"{u.hostname}:{u.port}"


class MooncakeError(RuntimeError):
    """A Mooncake Store call failed (the master gone, the segment full)."""


class MooncakeStore:
    """A client of the Mooncake Store whose master is ``master`` (``HOST:PORT`` or
    ``mooncake://HOST:PORT``), contributing ``segment_bytes`` of this process's memory to
    the cluster, with a ``buffer_bytes`` local transfer buffer.

    ``metadata_server`` is the transfer engine's metadata URL (the master's HTTP metadata
    server: ``http://HOST:PORT/metadata``); ``local_host`` the address this client is
    reached at; ``protocol`` ``"tcp"`` (or ``"rdma"`` with ``device``).
    """

    def __init__(
        self,
        master: str,
        *,
        metadata_server: str,
        local_host: str = "127.0.0.1",
        segment_bytes: int = 256 << 20,
        buffer_bytes: int = 64 << 20,
        protocol: str = "tcp",
        device: str = "",
    ) -> None:
        if master.startswith(SCHEME + "://"):
            master = parse_url(master)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise UsageError(
                "the Mooncake store needs the `mooncake-transfer-engine-non-cuda` wheel "
                f"(scripts/mooncake-env.sh installs it): {e}"
            ) from e
        self.master = master
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            local_host, metadata_server, segment_bytes, buffer_bytes, protocol, device, master
        )
        if rc != 0:
            raise MooncakeError(
                f"Mooncake Store: setup failed ({rc}) with the master at {master} and the "
                f"metadata server {metadata_server}"
            )
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"MooncakeStore(mooncake://{self.master})"

    def _check(self, what: str, rc: int) -> None:
        if rc < 0:
            raise MooncakeError(f"Mooncake Store: {what} failed ({rc}), master {self.master}")

    def put_object(self, name: str, data: bytes) -> bool:
        """Stores ``data`` as ``name`` unless it is there; True when written."""
        if self.objects_exist([name])[0]:
            return False
        self._check(f"put {name}", self._store.put(name, data))
        return True

    def get_object(self, name: str) -> Optional[bytes]:
        """Object ``name``'s bytes, None when there is none."""
        data = self._store.get(name)
        # Mooncake's get answers b"" for a key it does not hold; a record is never empty.
        return bytes(data) if data else None

    def objects_exist(self, names: List[str]) -> List[bool]:
        """Whether each of ``names`` is there (``batch_is_exist``)."""
        if not names:
            return []
        got = self._store.batch_is_exist(list(names))
        for n, r in zip(names, got):
            self._check(f"is_exist {n}", r)
        return [r == 1 for r in got]

    def remove_object(self, name: str) -> None:
        """Removes ``name`` (nothing when it is not there)."""
        rc = self._store.remove(name, True)
        if rc != _OBJECT_NOT_FOUND:
            self._check(f"remove {name}", rc)

    def damage(self, name: str, data: bytes) -> None:
        """Replaces object ``name`` by ``data`` (for tests that damage a record)."""
        self._check(f"upsert {name}", self._store.upsert(name, data))

    def close(self) -> None:
        """Leaves the cluster (this client's segment goes with it)."""
        if not self._closed:
            self._closed = True
            self._store.close()


def open_store(url: str, options: Optional[Dict[str, Any]] = None) -> MooncakeStore:
    """The :class:`MooncakeStore` of ``mooncake://HOST:PORT`` with ``options`` (its keyword
    arguments; ``metadata_server`` defaults to ``http://HOST:8080/metadata``)."""
    opts = dict(options or {})
    master = parse_url(url)
    opts.setdefault("metadata_server", f"http://{master.rsplit(':', 1)[0]}:8080/metadata")
    return MooncakeStore(master, **opts)
