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

Batches move without Python copies: the page store hands
:meth:`MooncakeStore.put_objects_from` and :meth:`MooncakeStore.get_objects_into` the
addresses of its records, one ``batch_put_from``/``batch_get_into`` each (the TCP transport
reads and writes any memory of this process; other transports go through ``put``/``get``
of bytes, since their buffers would have to be registered: ``zero_copy``).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Dict, List, Optional, Sequence
from urllib.parse import parse_qsl, urlparse

from ._native import UsageError

SCHEME = "mooncake"

# Mooncake's error code for an object that is not there (a get, a remove).
_OBJECT_NOT_FOUND = -704
# Not one of Mooncake's codes: an object a batch call left unanswered.
_SHORT = object()
# Names per batch_is_exist when usage() checks what this client put.
_USAGE_BATCH = 4096


def parse_url(url: str) -> str:
    """The master's ``HOST:PORT`` in ``mooncake://HOST:PORT[?OPTION=VALUE&...]``."""
    return _parse(url)[0]


def _parse(url: str) -> "tuple[str, Dict[str, Any]]":
    u = urlparse(url)
    if u.scheme != SCHEME or not u.hostname or not u.port or u.path not in ("", "/"):
        raise UsageError(
            f"{url!r}: a Mooncake store is named mooncake://HOST:PORT (the master), with "
            "its client's options as ?OPTION=VALUE&..."
        )
    options: Dict[str, Any] = {}
    for k, v in parse_qsl(u.query, keep_blank_values=True, strict_parsing=bool(u.query)):
        if k not in _OPTIONS:
            raise UsageError(f"{url!r}: no option {k!r} (the options: {', '.join(_OPTIONS)})")
        try:
            options[k] = _OPTIONS[k](v)
        except ValueError as e:
            raise UsageError(f"{url!r}: option {k}={v!r}: {e}") from None
    return f"{u.hostname}:{u.port}", options


# The options a URL may give (MooncakeStore's keyword arguments), and their types.
_OPTIONS = {
    "metadata_server": str,
    "local_host": str,
    "segment_bytes": int,
    "buffer_bytes": int,
    "protocol": str,
    "device": str,
}


class MooncakeError(RuntimeError):
    """A Mooncake Store call failed (the master gone, the segment full)."""


class _Unanswered(MooncakeError):
    """A read failed and the master did not answer the object's size either."""


class MooncakeStore:
    """A client of the Mooncake Store whose master is ``master`` (``HOST:PORT`` or
    ``mooncake://HOST:PORT``), contributing ``segment_bytes`` of this process's memory to
    the cluster, with a ``buffer_bytes`` local transfer buffer.

    ``metadata_server`` is the transfer engine's metadata URL (the master's HTTP metadata
    server: ``http://HOST:PORT/metadata``); ``local_host`` the address this client is
    reached at; ``protocol`` ``"tcp"`` (or ``"rdma"`` with ``device``). ``zero_copy``:
    whether batches move by address (``batch_put_from``/``batch_get_into`` at the page
    store's own buffers, which the TCP transport reads and writes wherever they are); by
    default for ``"tcp"`` only: another transport would need them registered, so its
    objects go through ``put``/``get`` of bytes, one call each.
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
        zero_copy: Optional[bool] = None,
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
        self.protocol = protocol
        self.zero_copy = protocol == "tcp" if zero_copy is None else bool(zero_copy)
        # Whether put_objects_from moves an object's buffers as they are (the page store
        # then puts a record as its header and the page in place, no copy): by address,
        # batch_put_from_multi_buffers gathers them; the bytes path joins them (a copy).
        self.gathers_puts = self.zero_copy
        self._lock = threading.Lock()
        # Bytes of each object this client put and has not seen go (for usage()).
        self._put_sizes: Dict[str, int] = {}
        self._closed = False

    def __repr__(self) -> str:
        return f"MooncakeStore(mooncake://{self.master})"

    def _error(self, what: str, rc: int) -> MooncakeError:
        return MooncakeError(f"Mooncake Store: {what} failed ({rc}), master {self.master}")

    def _check(self, what: str, rc: int) -> None:
        if rc < 0:
            raise self._error(what, rc)

    def put_object(self, name: str, data: bytes) -> bool:
        """Stores ``data`` as ``name`` unless it is there; True when written."""
        if self.objects_exist([name])[0]:
            return False
        self._check(f"put {name}", self._store.put(name, data))
        self._wrote([name], [len(data)])
        return True

    def put_objects_from(
        self,
        names: Sequence[str],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> "List[bool | MooncakeError]":
        """Stores object ``names[i]``, unless it is there, as the bytes of the buffers of
        this process's memory at ``addrs[i]`` (``sizes[i]`` bytes each, in order), in one
        ``batch_is_exist`` and one ``batch_put_from`` (one buffer per object) or
        ``batch_put_from_multi_buffers``; whether each was written, or the error of an object
        whose put failed (the others' answers stand). The memory must stay unchanged for
        the call."""
        there = self.objects_exist(list(names))
        out: List[Any] = [not t for t in there]
        todo = [i for i, t in enumerate(there) if not t]
        if todo:
            keys = [names[i] for i in todo]
            if self.zero_copy and all(len(addrs[i]) == 1 for i in todo):
                rcs = self._store.batch_put_from(
                    keys, [addrs[i][0] for i in todo], [sizes[i][0] for i in todo]
                )
            elif self.zero_copy:
                rcs = self._store.batch_put_from_multi_buffers(
                    keys, [list(addrs[i]) for i in todo], [list(sizes[i]) for i in todo]
                )
            else:
                rcs = [
                    self._store.put(
                        names[i],
                        b"".join(ctypes.string_at(a, n) for a, n in zip(addrs[i], sizes[i])),
                    )
                    for i in todo
                ]
            rcs = list(rcs)
            if len(rcs) != len(todo):
                # Which objects a short (or long) answer leaves out is unknown: none
                # counts as written.
                why = f"{len(rcs)} answers for {len(todo)} objects"
                rcs = [_SHORT] * len(todo)
            written = []
            for i, k, rc in zip(todo, keys, rcs):
                if rc is _SHORT:
                    out[i] = MooncakeError(
                        f"Mooncake Store: put {k} unanswered ({why}), master {self.master}"
                    )
                elif rc < 0:
                    # This object's put failed; the batch's others stand.
                    out[i] = self._error(f"put {k}", rc)
                else:
                    written.append(i)
            self._wrote([names[i] for i in written], [sum(sizes[i]) for i in written])
        return out

    def get_object(self, name: str) -> Optional[bytes]:
        """Object ``name``'s bytes, None when there is none; raises :class:`MooncakeError`
        when it is there but was not read."""
        return self._get(name, ask=True)

    def _get(self, name: str, ask: bool) -> Optional[bytes]:
        """``get_object``; ``ask``: whether an empty reply may be explained by the object's
        size (else it is a failed read: the master already left one unanswered)."""
        data = self._store.get(name)
        if data:
            return bytes(data)
        # Mooncake's get answers b"" both for a key it does not hold and for a read that
        # failed (the master or the segment's holder unreachable), and it holds no empty
        # object (a put of 0 bytes is refused): the object's size says which. One that is
        # there but came back empty is a failed read, not a miss (a miss would hide the
        # failure and have the record written again over a store that has it) nor a
        # refusal (nothing was read to refuse, and a refusal removes the object).
        size = self._store.get_size(name) if ask else -1
        if size == _OBJECT_NOT_FOUND:
            self._gone([name])
            return None
        what = f"get {name} (an empty reply"
        if size < 0:
            raise _Unanswered(self._error(f"{what}, and its size unanswered)", size).args[0])
        raise self._error(f"{what} of an object of {size} bytes)", -1)

    def get_objects_into(
        self,
        names: Sequence[str],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
    ) -> "List[Optional[int] | MooncakeError]":
        """Reads object ``names[i]`` into the buffers of this process's memory at
        ``addrs[i]`` (``sizes[i]`` bytes each, in order), in one ``batch_get_into`` (one
        buffer per object) or ``batch_get_into_multi_buffers``: for each, its length (read
        when it fits in the buffers, its bytes first; a longer object is not read), or
        None when there is none, or the error of an object whose read failed (the others'
        answers stand)."""
        if not names:
            return []
        if not self.zero_copy:
            out = []
            # As below: once the master left an object's size unanswered, the batch's
            # other empty replies are failed reads without asking.
            ask = True
            for n, a, s in zip(names, addrs, sizes):
                try:
                    out.append(self._get_bytes_into(n, a, s, ask))
                except MooncakeError as e:
                    ask = ask and not isinstance(e, _Unanswered)
                    out.append(e)
            return out
        single = all(len(a) == 1 for a in addrs)
        if single:
            rcs = self._store.batch_get_into(
                list(names), [a[0] for a in addrs], [s[0] for s in sizes]
            )
        else:
            rcs = self._store.batch_get_into_multi_buffers(
                list(names), [list(a) for a in addrs], [list(s) for s in sizes]
            )
        rcs = list(rcs)
        if len(rcs) != len(names):
            # Which objects were read is unknown: none is used.
            return [
                MooncakeError(
                    f"Mooncake Store: get {n} unanswered ({len(rcs)} answers for "
                    f"{len(names)} objects), master {self.master}"
                )
                for n in names
            ]
        out: "List[Optional[int] | MooncakeError]" = []
        # Once the master did not answer an object's length, the batch's other failed
        # objects are not asked for theirs: each would wait out the same timeout (about 4 s
        # with the master down, ten of them a minute).
        unanswered = False
        for n, rc, a, s in zip(names, rcs, addrs, sizes):
            if rc > 0:
                out.append(rc)
                continue
            if rc == _OBJECT_NOT_FOUND:
                self._gone([n])
                out.append(None)
                continue
            # Mooncake refuses buffers smaller than the object (-600), and several buffers
            # of another total (a failed transfer): its length says which.
            size = -1 if unanswered else self._store.get_size(n)
            unanswered = unanswered or (size < 0 and size != _OBJECT_NOT_FOUND)
            if size == _OBJECT_NOT_FOUND:
                self._gone([n])
                out.append(None)
            elif size > sum(s):
                out.append(size)  # longer than the buffers: not read
            elif size >= 0 and not single:
                try:
                    out.append(self._get_bytes_into(n, a, s))
                except MooncakeError as e:
                    out.append(e)
            else:
                # This object's read failed; the batch's others stand.
                out.append(self._error(f"get {n}", rc if rc < 0 else -1))
        return out

    def _get_bytes_into(
        self, name: str, addrs: Sequence[int], sizes: Sequence[int], ask: bool = True
    ) -> Optional[int]:
        """``get_objects_into`` of one object through ``get`` (bytes)."""
        data = self._get(name, ask)
        if data is not None and len(data) <= sum(sizes):
            view = memoryview(data)
            at = 0
            for p, k in zip(addrs, sizes):
                k = min(k, len(data) - at)
                if k > 0:
                    ctypes.memmove(p, bytes(view[at : at + k]), k)
                at += k
        return None if data is None else len(data)

    def objects_exist(self, names: List[str]) -> List[bool]:
        """Whether each of ``names`` is there (``batch_is_exist``)."""
        if not names:
            return []
        got = list(self._store.batch_is_exist(list(names)))
        if len(got) != len(names):
            raise MooncakeError(
                f"Mooncake Store: is_exist answered {len(got)} of {len(names)} names, "
                f"master {self.master}"
            )
        for n, r in zip(names, got):
            self._check(f"is_exist {n}", r)
        return [r == 1 for r in got]

    def remove_object(self, name: str) -> bool:
        """Removes ``name``: True when this call removed it, False when it was not there
        (the master removes an object once: of two clients removing it at once, one is
        answered True)."""
        rc = self._store.remove(name, True)
        if rc != _OBJECT_NOT_FOUND:
            self._check(f"remove {name}", rc)
        self._gone([name])
        return rc != _OBJECT_NOT_FOUND

    def remove_objects(self, names: Sequence[str]) -> "List[bool | MooncakeError]":
        """:meth:`remove_object` of each of ``names`` in one ``batch_remove``: whether this
        call removed each (of two clients removing one object at once, one is answered
        True), or the error of an object whose removal failed (the others' answers
        stand)."""
        if not names:
            return []
        rcs = list(self._store.batch_remove(list(names), True))
        if len(rcs) != len(names):
            raise MooncakeError(
                f"Mooncake Store: batch_remove answered {len(rcs)} of {len(names)} names, "
                f"master {self.master}"
            )
        out: "List[bool | MooncakeError]" = []
        for n, rc in zip(names, rcs):
            if rc == _OBJECT_NOT_FOUND:
                out.append(False)
            elif rc < 0:
                out.append(self._error(f"remove {n}", rc))
            else:
                out.append(True)
        self._gone(list(names))
        return out

    def usage(self) -> int:
        """Bytes of the objects this client put that the cluster still holds (one
        ``batch_is_exist`` per 4,096 of them; those gone, evicted or removed by another
        client or with their segment, are forgotten). Other clients' objects are theirs
        to count: Mooncake's client reports no cluster-wide total. With the master
        unreachable, the last count (nothing forgotten), not an error: a statistic."""
        with self._lock:
            names = list(self._put_sizes)
        gone = []
        try:
            for at in range(0, len(names), _USAGE_BATCH):
                chunk = names[at : at + _USAGE_BATCH]
                gone += [n for n, e in zip(chunk, self.objects_exist(chunk)) if not e]
        except MooncakeError:
            gone = []
        self._gone(gone)
        with self._lock:
            return sum(self._put_sizes.values())

    def _wrote(self, names: Sequence[str], sizes: Sequence[int]) -> None:
        with self._lock:
            self._put_sizes.update(zip(names, sizes))

    def _gone(self, names: Sequence[str]) -> None:
        with self._lock:
            for n in names:
                self._put_sizes.pop(n, None)

    def damage(self, name: str, data: bytes) -> None:
        """Replaces object ``name`` by ``data`` (for tests that damage a record)."""
        self._check(f"upsert {name}", self._store.upsert(name, data))

    def close(self) -> None:
        """Leaves the cluster (this client's segment goes with it)."""
        if not self._closed:
            self._closed = True
            self._store.close()


def open_store(url: str, options: Optional[Dict[str, Any]] = None) -> MooncakeStore:
    """The :class:`MooncakeStore` of ``mooncake://HOST:PORT[?OPTION=VALUE&...]`` with
    ``options`` (its keyword arguments; they override the URL's, and ``metadata_server``
    defaults to ``http://HOST:8080/metadata``). ``python -m cp_hicache.replay --storage``
    takes such a URL, e.g.
    ``mooncake://127.0.0.1:50051?metadata_server=http://127.0.0.1:8080/metadata&segment_bytes=0``."""
    master, opts = _parse(url)
    opts.update(options or {})
    opts.setdefault("metadata_server", f"http://{master.rsplit(':', 1)[0]}:8080/metadata")
    return MooncakeStore(master, **opts)
