"""cp_hicache: a CP-aware hierarchical KV cache for inference engines.

Each CP rank of an engine (one process per GPU) hosts one :class:`RankCache`. The ranks agree
through the engine's own ``torch.distributed`` group (gloo, the CPU control plane), map each
other's KV pools, and every prefix hit is checked byte for byte against deterministically
synthesised KV.

An engine calls :func:`warm_up` once per process before serving, so no request waits for a
kernel compile::

    import cp_hicache
    dep = cp_hicache.Deployment(model="nsa", page_size=64, cp=8, layers=61)
    report = cp_hicache.warm_up(dep)   # kernels, cache_hits, milliseconds

``python -m cp_hicache.replay --ranks C ...`` replays a workload with one process per rank and
prints the report of ``cp-hicache replay``.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._collective import TorchCollective
from ._native import (
    CacheError,
    CacheFullError,
    Deployment,
    DivergedError,
    GroupError,
    Pool,
    RequestAbandoned,
    UsageError,
    WarmUpReport,
    __version__,
    warm_up,
)

__all__ = [
    "CacheError",
    "CacheFullError",
    "Deployment",
    "DivergedError",
    "GroupError",
    "Match",
    "Pool",
    "RankCache",
    "Request",
    "RequestAbandoned",
    "StepError",
    "TorchCollective",
    "UsageError",
    "WarmUpReport",
    "__version__",
    "warm_up",
]

Tokens = Union[Sequence[int], np.ndarray]


def _maybe_stream(stream: Any) -> Optional[int]:
    """The raw ``CUstream`` handle of an engine's stream object, or ``None``."""
    from .ops import _stream_handle

    return None if stream is None else _stream_handle(stream)


def _u32_bytes(values: Tokens, what: str) -> bytes:
    """Token or page ids as little-endian u32 bytes: a sequence of ints or a one-dimensional
    array of a signed or unsigned integer dtype, every value within u32. Anything else is a
    UsageError naming the argument and what it got (bytes and strings are not token lists,
    a masked array's mask would be ignored, booleans, floats and timedeltas are not ids)."""
    if isinstance(values, (bytes, bytearray, memoryview, str)):
        raise UsageError(
            f"{what} must be a sequence or array of integers, not {type(values).__name__}"
        )
    if isinstance(values, np.ma.MaskedArray):
        raise UsageError(f"{what} must not be a masked array: its mask would be ignored")
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise UsageError(f"{what} must be one-dimensional, not of shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise UsageError(f"{what} must be integers, not {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise UsageError(f"{what} must fit in u32 (0..=4294967295)")
    return np.ascontiguousarray(arr, dtype="<u4").tobytes()


class StepError(CacheError):
    """Some operations of a :meth:`RankCache.step` failed (the step itself went through:
    every other operation took effect). A failed operation failed its request on every rank:
    a failed ``extend`` or ``finish`` left its request as it was (retry it, or end it with
    ``ok=False``), a ``finish`` another rank said not ok abandoned the request everywhere,
    and a failed ``begin`` admitted nothing.

    ``requests`` is what the step returns otherwise: the admitted requests, ``None`` where
    a prompt was not admitted. ``failures`` lists ``(kind, index, exception)``: which list
    the operation was in (``"finish"``, ``"extend"``, ``"begin"``), its index there, and its
    exception (a :class:`CacheFullError`, a :class:`RequestAbandoned`, ...)."""

    def __init__(
        self, requests: List[Optional["Request"]], failures: List[Tuple[str, int, BaseException]]
    ) -> None:
        self.requests = requests
        self.failures = failures
        each = "; ".join(f"{kind} {i}: {e}" for kind, i, e in failures)
        super().__init__(f"{len(failures)} operation(s) of the step failed: {each}")


class Match(NamedTuple):
    """The longest cached prefix of a prompt (:meth:`RankCache.match_prefix`)."""

    matched_tokens: int
    """Tokens matched, device-resident and host-only together (whole pages)."""
    device_pages: np.ndarray
    """Logical page ids (u32) of the device-resident prefix, in order."""
    host_nodes: int
    """Host-only nodes after the device prefix: what a load-back would bring back."""


class Request:
    """A request between its steps (:meth:`RankCache.begin` ... :meth:`RankCache.finish`)."""

    def __init__(self, native: Any) -> None:
        self._native = native

    @property
    def pages(self) -> np.ndarray:
        """Logical page ids (u32) of the sequence so far: the cached prefix, then (after
        :meth:`RankCache.allocate`) the pages to compute into. Page ``i`` holds tokens
        ``i * page_size ...``; :meth:`RankCache.locate` says where each lives."""
        return np.frombuffer(self._native.pages, dtype="<u4").copy()

    @property
    def cached_pages(self) -> int:
        """Leading pages that came from the cache (device hits, then loaded pages)."""
        return self._native.cached_pages

    @property
    def tokens(self) -> np.ndarray:
        """The tokens so far (u32): the prompt (its first chunk, with ``begin(chunk=)``),
        then what :meth:`RankCache.extend` added."""
        return np.frombuffer(self._native.tokens, dtype="<u4").copy()

    @property
    def computed_from(self) -> int:
        """The first token whose KV the engine's next forward writes: the first uncached
        token after allocating, the first new token after :meth:`RankCache.extend`."""
        return self._native.computed_from

    @property
    def pages_in_tree(self) -> int:
        """Leading pages the cache's tree holds (the cached prefix, then pages that
        :meth:`RankCache.extend` inserted unfinished); an abandon leaves them cached."""
        return self._native.pages_in_tree

    @property
    def loading_layers(self) -> int:
        """Layers of the load-back in flight (0 when nothing is loaded back)."""
        return self._native.loading_layers

    def wait_layer(self, layer: int, stream: Optional[Any] = None) -> None:
        """Makes work enqueued from now on wait until layer ``layer`` of the load-back is in
        the pools (a device-side wait on a GPU; immediate on the CPU). Attention on a layer
        calls it first, as SGLang's ``layer_transfer_counter.wait_until(layer)``.

        Without ``stream`` the wait orders the cache's own stream. With ``stream``, the
        engine's CUDA stream (a ``torch.cuda.Stream`` or anything with ``.cuda_stream``, or
        its raw ``CUstream`` handle; 0 is the legacy default stream), it orders that stream:
        the engine's kernels enqueued there from now on wait for the layer on the device,
        while later layers still load, with no host synchronisation. It must be a live
        stream of the cache's device (its primary context, as torch's streams are): the
        driver dereferences the handle. On the CPU nothing needs ordering and the handle is
        not used."""
        from .ops import _stream_handle

        self._native.wait_layer(layer, None if stream is None else _stream_handle(stream))

    def wait_all(self) -> None:
        """Waits for every layer of the load-back."""
        self._native.wait_all()

    def stats(self) -> Dict[str, Any]:
        """The request's statistics so far (:meth:`RankCache.finish` returns the same keys).
        ``tokens`` counts the request's tokens so far, ``len(request.tokens)``: what
        :meth:`RankCache.begin` took, then every token :meth:`RankCache.extend` added
        (prefill chunks and decode tokens). ``prompt_tokens`` counts what ``begin`` took
        (with ``chunk=``, the cached prefix and the first chunk); ``extended_tokens`` what the
        ``extend`` calls added since, so ``tokens == prompt_tokens + extended_tokens``."""
        return self._native.stats()


class RankCache:
    """One CP rank's cache, as an engine process hosts it.

    Args:
        deployment: the model's buffers, page size, CP degree and layers.
        rank: this process's rank (checked against the group).
        group: a ``torch.distributed`` ``ProcessGroup`` of the CP ranks (gloo), or any object
            with ``rank``, ``size`` and ``exchange(what, payload, why)`` such as
            :class:`TorchCollective`; ``None`` for a single rank (``cp=1``). torch is imported
            only when a group is given.
        device_pages: logical device pages across the group (each rank holds
            ``ceil(pages / cp)``).
        host_pages: host pages of this rank.
        policy: ``"write_through"`` or ``"write_back"``.
        backend: ``"auto"``, ``"host"`` (CPU emulation) or ``"cuda"``.
        tuning: a tuning file of ``cp-hicache tune``.
        fault: a fault to inject (``"plain-alloc-on-load"``, ...), for tests.
        device_buffers: the engine's own device KV, one entry per buffer kind of the
            deployment (``deployment.buffers``), adopted as this rank's device pools instead of
            allocating them: a list of per-layer tensors (``[pages, ...]``, SGLang), one
            ``[layers, pages, ...]`` tensor, or :class:`cp_hicache.ops.PageMajor` of one
            ``[pages, layers, ...]`` tensor (vLLM). Each holds at least the rank's
            ``ceil(device_pages / cp)`` pages per layer, C-contiguous, CPU tensors on the host
            backend and CUDA ones on the CUDA backend. The cache loads into and verifies the
            engine's tensors, and keeps them alive while it lives. Ranks in separate
            processes cannot map each other's engine memory, so in a group each rank verifies
            by sending the pages it owns through the group (``peer_pools == "gathered"``;
            each request's ``bytes_gathered`` says how much moved).

    The CP layout (who owns each token) is the deployment's
    (``Deployment(layout=..., interleave_size=...)``); every rank must use the same one
    (compared at start-up).

    Every rank of the group must make the same calls in the same order, as an engine's
    ranks do for each scheduled batch. Each step's outcome round compares what every rank
    decided: ranks handed different prompts fail that step with :class:`DivergedError` and
    undo it. A rank that fails a step makes every rank roll it back (:class:`CacheError`); a
    request too large for the pools raises :class:`CacheFullError`; a broken group raises
    :class:`GroupError`. A rank that cannot start (bad arguments, a tuning file, its
    kernels) tells its peers in the group's first round, so their constructors raise
    :class:`GroupError` naming it at once. The settings (deployment, pool sizes, policy) are
    compared at start-up; ranks that differ all raise :class:`UsageError`.

    Use it as a context manager, or call :meth:`close`, so that the ranks leave together.
    """

    def __init__(
        self,
        deployment: Deployment,
        rank: int = 0,
        group: Any = None,
        *,
        device_pages: int,
        host_pages: int,
        policy: str = "write_through",
        backend: str = "auto",
        tuning: Optional[str] = None,
        fault: Optional[str] = None,
        device_buffers: Optional[Sequence[Any]] = None,
    ) -> None:
        collective = None
        if group is not None:
            collective = group if hasattr(group, "exchange") else TorchCollective(group)
        adopted = None
        if device_buffers is not None:
            from .ops import _tensors

            if not isinstance(device_buffers, (list, tuple)):
                raise UsageError("device_buffers: one entry per buffer kind of the deployment")
            names = deployment.buffers
            if len(device_buffers) != len(names):
                raise UsageError(
                    f"device_buffers: {len(device_buffers)} entries for the buffer kinds "
                    f"{', '.join(names)}"
                )
            cuda = backend == "cuda"
            adopted = [
                _tensors(t, f"device_buffers[{b}]", deployment.page_bytes(b), cuda)
                for t, b in zip(device_buffers, names)
            ]
        self._native = _native.RankCache(
            deployment,
            rank,
            collective,
            device_pages=device_pages,
            host_pages=host_pages,
            policy=policy,
            backend=backend,
            tuning=tuning,
            fault=fault,
            device_buffers=adopted,
            keep=list(device_buffers) if device_buffers is not None else None,
        )

    @property
    def adopts_device(self) -> bool:
        """Whether the device pools are the engine's tensors (``device_buffers=``)."""
        return self._native.adopts_device

    @property
    def rank(self) -> int:
        """This rank."""
        return self._native.rank

    @property
    def deployment(self) -> Deployment:
        """The deployment."""
        return self._native.deployment

    @property
    def group_kind(self) -> str:
        """The group's transport: ``"local"`` (one rank) or ``"torch.distributed"``."""
        return self._native.group_kind

    @property
    def layer_waits(self) -> bool:
        """Whether the engine's attention calls :meth:`Request.wait_layer` before it reads
        each layer of loaded pages (``False`` by default). ``True``: a load runs layer by
        layer on a stream of its own at the greatest priority (CUDA), so layer ``l + 1``
        copies while layer ``l`` is read. ``False``: a load is one transfer on the cache's
        stream, in order with its other work. Set it only where every reader of loaded pages
        waits per layer."""
        return self._native.layer_waits

    @layer_waits.setter
    def layer_waits(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise UsageError(f"layer_waits is True or False, not {on!r}")
        self._native.layer_waits = on

    @property
    def peer_pools(self) -> str:
        """How this rank reaches its peers' pools (``direct``, ``shared-memory``, ``ipc``, or
        ``gathered``: it does not, and verification moves pages through the group)."""
        return self._native.peer_pools

    def serve(self, tokens: Tokens) -> Dict[str, Any]:
        """Serves one prompt end to end on every rank: match, load back (owners preserved),
        compute the rest (synthesised KV), materialise and verify every token, insert, back
        up, release. Returns the request's statistics; ``mismatched_tokens`` is 0 unless a
        page came back wrong."""
        return self._native.serve(_u32_bytes(tokens, "tokens"))

    def match_prefix(self, tokens: Tokens) -> Match:
        """The longest cached prefix of ``tokens`` (SGLang: ``HiRadixCache.match_prefix``).
        It may split a node, so every rank calls it with the same tokens."""
        matched, pages, host_nodes = self._native.match_prefix(_u32_bytes(tokens, "tokens"))
        return Match(matched, np.frombuffer(pages, dtype="<u4").copy(), host_nodes)

    def evict(self, pages: int) -> int:
        """Evicts device nodes in LRU order until ``pages`` device pages were released (write
        policy permitting, backed up first); returns the node count (SGLang:
        ``HiRadixCache.evict``)."""
        if pages < 0:
            raise UsageError(f"pages must be >= 0, not {pages}")
        return self._native.evict(pages)

    def digest(self) -> str:
        """A digest (hex) of this rank's allocator and tree; equal on every rank."""
        return self._native.digest()

    def host_digest(self) -> str:
        """A digest (hex) of this rank's own host state (its host pool and which host pages
        each cached prefix's copy holds), which :meth:`digest` leaves out: it differs
        between ranks by design."""
        return self._native.host_digest()

    def all_digests(self) -> list:
        """Every rank's digest, in rank order (a collective call)."""
        return self._native.all_digests()

    def check_invariants(self) -> None:
        """Checks the allocator, tree and device-lane invariants (reads device memory back:
        for tests, not the serving path). Call it between requests: the pages of a request
        begun and not finished count as leaked."""
        self._native.check_invariants()

    def lane_free_counts(self) -> list:
        """Free device pages per owner lane."""
        return self._native.lane_free_counts()

    def last_verdict(self) -> Dict[str, Any]:
        """What the last request's verification found, over all ranks and per rank."""
        return self._native.last_verdict()

    def attach_storage(
        self,
        path: Any,
        *,
        capacity_bytes: int = 16 << 30,
        policy: str = "with-host",
        options: Optional[Dict[str, Any]] = None,
    ) -> None:
        """Attaches the storage tier: a page store in directory ``path`` (created if need
        be), shared by every rank and by later processes, holding at most
        ``capacity_bytes`` (least recently used records go first). Pages are written by
        their owner rank with every host backup (``policy="with-host"``) or when a host
        copy is evicted (``"on-host-evict"``). A prefix that misses in device and host
        memory is read back from it, under any CP degree or layout, and verified; a
        request's stats then count ``storage_hit_tokens`` and ``storage_records_read``.
        Records are keyed by the model, layers, page size and the prefix's tokens, never
        by the CP degree, rank or layout. A collective: every rank calls it.

        ``path`` may be ``mooncake://HOST:PORT`` (a Mooncake Store master: each rank opens a
        :class:`cp_hicache.mooncake.MooncakeStore` with ``options``, its keyword arguments,
        ``metadata_server`` first), or an object keeping a store's objects (such a
        ``MooncakeStore``, or anything with its ``put_object``, ``get_object``,
        ``objects_exist`` and ``remove_object``). The records are the same bytes and are
        checked the same way; the store's own capacity applies, not ``capacity_bytes``."""
        if isinstance(path, str) and path.startswith("mooncake://"):
            from .mooncake import open_store

            path = open_store(path, options)
        elif options:
            raise UsageError("options are for a mooncake:// store")
        if not hasattr(path, "get_object"):
            path = str(path)
        self._native.attach_storage(path, capacity_bytes=capacity_bytes, policy=policy)

    def prefetch(self, tokens: Tokens, skip_tokens: int = 0) -> int:
        """Starts reading ahead, in a thread of this rank's, the records it would read from
        the storage tier for ``tokens`` (a request still to come: SGLang's prefetch of a
        waiting request), past what the cache holds and past the first ``skip_tokens``
        (a prefix the requests before it will have cached). The request's read then takes
        them (``storage_records_prefetched``) and waits only for one still being read.
        Local to this rank (no round; each rank asks for its own records); returns how many
        it asked for, 0 without a store."""
        if skip_tokens < 0:
            raise UsageError(f"skip_tokens = {skip_tokens} is negative")
        return self._native.prefetch(_u32_bytes(tokens, "tokens"), skip_tokens)

    def inject_launch_failure(self, request: int) -> None:
        """Makes this rank's first launch of request number ``request`` fail (every rank
        then rolls it back): for testing the failure path. Requests are numbered over
        :meth:`serve` and :meth:`begin` calls; only a :meth:`serve` arms it."""
        self._native.inject_launch_failure(request)

    def set_verifying_ranks(self, n: int) -> None:
        """Materialise and verify on the first ``n`` ranks only (default: all)."""
        self._native.set_verifying_ranks(n)

    def begin(
        self,
        tokens: Tokens,
        allocate: bool = False,
        chunk: Optional[int] = None,
        stream: Any = None,
    ) -> Request:
        """Starts a request in steps: matches ``tokens`` and loads the host-only part of the
        match back (owners preserved, layer by layer). With ``allocate=True`` it also
        allocates the pages to compute, in the same group round (then a request costs two
        rounds: this and :meth:`finish`). With ``chunk=N`` as well (chunked prefill), the
        request takes only the cached prefix and the next ``N`` tokens; :meth:`extend` gives
        it the rest. When it returns, the loaded pages are readable by every peer, not only
        by this rank. SGLang: ``match_prefix`` + ``init_load_back``.

        The pages handed out may still have the cache's work queued on them (a freed page's
        poison, on a GPU a load that is not layer-wise): with ``stream`` (the engine's CUDA
        stream, as for :meth:`Request.wait_layer`) that stream waits for it on the device, so
        the forward's writes come after it; without, an engine on a GPU calls
        :meth:`synchronize` before writing them. Nothing to order on the CPU."""
        return Request(
            self._native.begin(
                _u32_bytes(tokens, "tokens"), allocate, chunk, _maybe_stream(stream)
            )
        )

    def extend(self, request: Request, tokens: Tokens, stream: Any = None) -> None:
        """Adds ``tokens`` to an open request: the next prefill chunk, or decode tokens.
        Its forward has written every token so far; in one group round the whole pages
        written so far go into the cache unfinished (locked by the request, backed up per
        the policy; SGLang's ``cache_unfinished_req``), the partial last page is kept, and
        pages for the tokens past it are allocated. Where another request inserted the same
        tokens first, the request takes the cache's pages: read :attr:`Request.pages` again.
        The next forward writes tokens from :attr:`Request.computed_from` on. A step that
        fails on any rank leaves the request as it was. With ``stream`` (the engine's CUDA
        stream, as for :meth:`Request.wait_layer`), the cache's work, the backups of the
        pages written included, first waits on the device for the engine's work there, so
        the engine need not synchronise its stream before the call, and the stream then
        waits for the cache's work on the pages allocated (as in :meth:`begin`)."""
        self._native.extend(request._native, _u32_bytes(tokens, "tokens"), _maybe_stream(stream))

    def step(
        self,
        begin: Sequence[Tokens] = (),
        extend: Sequence[Tuple[Request, Tokens]] = (),
        finish: Sequence[Union[Request, Tuple[Request, bool]]] = (),
        allocate: bool = True,
        chunk: Optional[int] = None,
        stream: Any = None,
    ) -> List[Request]:
        """One scheduler step, what an engine calls once per batch: ``finish`` (requests,
        or ``(request, ok)`` pairs as for :meth:`finish`), then ``extend`` (``(request,
        tokens)`` pairs as for :meth:`extend`), then ``begin`` (prompts, each as
        :meth:`begin` with ``allocate`` and ``chunk``). Returns the new requests, in the
        order of ``begin``.

        At most one group round, whatever the batch: every rank runs the step on its replica
        and one round compares the step's decision digest and carries every rank's
        failures. A step of decode tokens that land in kept partial pages (nothing inserted,
        nothing allocated) takes no round at all; the next round's digest covers it. Pages a
        step frees (finished requests') are freed after the round, when no peer reads them.

        One request's failure fails that request on every rank, not the step (at the cost of
        a rollback and another round): the others take effect, and the call raises
        :class:`StepError` listing the failures, with the admitted requests. An error for the
        whole step (:class:`DivergedError`, :class:`GroupError`) leaves every request as it
        was. With ``stream`` (the engine's CUDA stream), the cache's work first waits on the
        device for the engine's work there, and the stream then waits for the cache's work
        on the pages the step handed out (as in :meth:`begin`)."""
        fin = []
        for f in finish:
            if isinstance(f, Request):
                fin.append((f._native, True))
            else:
                req, ok = f
                fin.append((req._native, bool(ok)))
        ext = [(req._native, _u32_bytes(t, "extend tokens")) for req, t in extend]
        beg = [_u32_bytes(t, "begin tokens") for t in begin]
        begun, failures = self._native.step(
            beg, ext, fin, allocate, chunk, _maybe_stream(stream)
        )
        requests = [None if r is None else Request(r) for r in begun]
        if failures:
            raise StepError(requests, [(kind, i, e) for kind, i, e in failures])
        return requests

    def synthesise(self, request: Request) -> None:
        """Writes synthesised KV for this rank's share of the tokens from
        :attr:`Request.computed_from` on (only those: a kept partial page keeps what earlier
        steps wrote): the stand-in for a forward. No group round."""
        self._native.synthesise(request._native)

    def verify(self, request: Request) -> int:
        """Materialises the whole sequence from every owner's pool (the partial last page
        included) and verifies every token against the synthesised KV, on every rank.
        Returns the mismatched tokens."""
        return self._native.verify(request._native)

    def allocate(self, request: Request, stream: Any = None) -> None:
        """Allocates the pages of the tokens the cache does not hold, evicting when short.
        Their owners follow the deployment's layout: zigzag over the ranks under
        ``layout="zigzag"``, round by round from the first computed page under
        ``"round-robin"``, page ``i`` on rank ``i % cp`` under the interleaved layouts (whole
        granules of ``cp`` pages). SGLang: the KV pool allocator's ``alloc``. ``stream``
        orders the engine's writes to the new pages as in :meth:`begin`."""
        self._native.allocate(request._native, _maybe_stream(stream))

    def synthesise_and_verify(self, request: Request) -> int:
        """Writes synthesised KV into this rank's computed pages and verifies the whole
        sequence from every owner's pool (what :meth:`serve` does between its steps): a test
        harness. Returns the mismatched tokens."""
        return self._native.synthesise_and_verify(request._native)

    def finish(
        self, request: Request, ok: bool = True, stream: Any = None
    ) -> Optional[Dict[str, Any]]:
        """Ends a request on every rank, in one group round.

        With ``ok=True`` (this rank's forward wrote its pages, and its stream was
        synchronised, or handed in as ``stream``: the engine's CUDA stream, as for
        :meth:`Request.wait_layer`, on which the cache's work then waits on the device
        before the backups copy the pages): inserts the request's pages, backs them up per the write policy and
        releases its locks; returns its statistics. If another rank said ``ok=False``, every
        rank abandons the request instead and this raises :class:`RequestAbandoned` naming
        it. With ``ok=False`` (this rank's forward failed): every rank abandons the request;
        returns ``None``. Nothing is freed or poisoned before every rank has reached this
        call, so a slow peer can still read the request's pages until then. SGLang:
        ``cache_finished_req``, ``write_backup``, ``dec_lock_ref``."""
        return self._native.finish(request._native, ok, _maybe_stream(stream))

    def abandon(self, request: Request) -> None:
        """Gives a request up on every rank (``finish(request, ok=False)``): unlocks its
        prefix and frees the pages allocated for it, once every rank has ended it."""
        self._native.abandon(request._native)

    def close(self) -> None:
        """Leaves the group: a last round in which every rank says it is done with its
        peers' pools (every rank calls it). Later calls raise :class:`CacheError`. The pools
        are freed now, or, while pool objects or tensors taken from them are alive, when the
        last of them goes. Idempotent."""
        self._native.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._native.closed

    def __enter__(self) -> "RankCache":
        return self

    def __exit__(self, kind: Any, value: Any, trace: Any) -> None:
        # After an exception the peers may be in another round: leaving then would pair the
        # disconnect with it. The group is failing anyway; only a clean exit says goodbye.
        if kind is None:
            self.close()

    def locate(self, pages: Tokens) -> Tuple[np.ndarray, np.ndarray]:
        """Each logical page's owner rank and local page in its owner's pool."""
        owners, local = self._native.locate(_u32_bytes(pages, "pages"))
        return (
            np.frombuffer(owners, dtype="<u4").copy(),
            np.frombuffer(local, dtype="<u4").copy(),
        )

    def synchronize(self) -> None:
        """Waits until every copy and kernel the cache enqueued has run. On a GPU the cache
        works on its own stream: :meth:`Request.wait_layer` orders that stream, or the
        engine's when it is handed in (``wait_layer(l, stream=...)``, no host wait). An
        engine whose kernels run on another stream and does not hand it in calls this before
        reading pages the cache loaded, and synchronises its own stream before
        :meth:`finish` backs up the pages it wrote. Immediate on the CPU."""
        self._native.synchronize()

    def token_locations(self, request: Request) -> Tuple[np.ndarray, np.ndarray]:
        """Where each token of ``request`` so far lives (after :meth:`allocate`, or a
        ``begin(allocate=True)``; after every :meth:`extend`, the tokens it added too): its
        owner rank and its slot in the owner's pool, ``local_page * page_size + slot`` (u32
        arrays, one entry per token of :attr:`Request.tokens`), the token index into
        ``pool.view(layers, local_pages * page_size, token_bytes)``, as an engine's
        ``out_cache_loc``; a forward writes entries from :attr:`Request.computed_from` on.
        The deployment's layout places the tokens: under token-interleave a page holds only
        its owner's runs of tokens."""
        self._native._check_owns(request._native)
        pages = request.pages
        tokens = request.stats()["tokens"]
        owners, slots = self._native.place_tokens(_u32_bytes(pages, "pages"), tokens)
        return (
            np.frombuffer(owners, dtype="<u4").copy(),
            np.frombuffer(slots, dtype="<u4").copy(),
        )

    def pool(self, buffer: str, owner: Optional[int] = None) -> Pool:
        """A device pool of ``buffer``, one of :attr:`Deployment.buffers` (``"mla_kv"``;
        NSA: ``"nsa_kv"``, ``"nsa_idx"``), as a DLPack producer,
        ``uint8[layers, local_pages, page_bytes]``: ``torch.from_dlpack(pool)`` reads and
        writes it in place (NumPy's view is read-only). ``owner=None`` is this rank's own
        pool; ``owner=r`` this rank's mapping of rank ``r``'s, how CP attention reads every
        page from its owner."""
        return self._native.pool(buffer, owner)

    def pools(self) -> Dict[str, Pool]:
        """Every buffer kind's pool of this rank."""
        return {b: self.pool(b) for b in self.deployment.buffers}

    def __repr__(self) -> str:
        return repr(self._native)
