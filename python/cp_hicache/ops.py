"""The cache's kernels as ops on an engine's own tensors.

An engine that keeps its own KV cache (its pools, page tables and requests) can still take
cp-hicache's JIT'd kernels, the way FlashInfer and sgl-kernel serve engines::

    from cp_hicache import Deployment
    from cp_hicache.ops import Ops

    ops = Ops(Deployment(model="mla", page_size=16, cp=4, layers=2))  # compiles once
    ops.transfer("h2d", device=[kv_layers], host=[host_kv], src_pages=h, dst_pages=d)
    ops.materialise("mla_kv", pools=[rank0, rank1, rank2, rank3], seq_pages=p, out=dense)

A buffer kind's tensors are one cross-layer tensor (``[layers, pages, ...]``), a list with
one tensor per layer (``[pages, ...]``, SGLang), or, for device tensors, one page-major
tensor wrapped as :class:`PageMajor` (``[blocks, layers, ...]``, vLLM's cross-layer KV
cache), C-contiguous, any dtype whose items tile a page. The kernels reach device tensors
through page tables, so each order is one launch. Device tensors are indexed by local page;
a host pool follows the deployment's host layout (page-first ``[pages, layers, ...]`` for the
NSA deployments) and is one tensor or, layer-first, one per layer. Every argument is checked
before anything is launched; a bad one raises :class:`UsageError` naming it and the rule.

The host backend runs the kernels on CPU tensors (torch or numpy), in order. The CUDA
backend (``Ops(dep, backend="cuda")``) runs :meth:`Ops.transfer` and :meth:`Ops.materialise`
on CUDA tensors (and pinned host tensors the device can address) of the executor's device,
ordered on the caller's stream (``stream=`` a raw ``CUstream`` handle, or an object with a
``cuda_stream`` attribute such as ``torch.cuda.Stream``): the op waits on the device for the
work enqueued there so far, and the stream for the op. :meth:`Ops.select` and
:meth:`Ops.release` take CUDA lanes there, and ``select`` the caller's CUDA output tensors.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _native
from ._native import Deployment, UsageError

__all__ = ["Lanes", "Ops", "PageMajor"]

Tensor = Any  # a torch.Tensor or a numpy.ndarray
Tensors = Union[Tensor, Sequence[Tensor]]


def _region(t: Tensor, what: str, page_bytes: int, cuda: bool = False) -> Tuple[int, int]:
    """(address, bytes) of a tensor the kernels may read and write in place: a CPU one, or
    with ``cuda`` a CUDA one (or a pinned CPU one the device addresses)."""
    if isinstance(t, np.ndarray):
        if not t.flags["C_CONTIGUOUS"]:
            raise UsageError(f"{what}: the array is not C-contiguous")
        if not t.flags["WRITEABLE"]:
            raise UsageError(f"{what}: the array is read-only")
        addr, nbytes, itemsize = t.ctypes.data, t.nbytes, t.itemsize
    elif hasattr(t, "data_ptr") and hasattr(t, "is_contiguous"):
        pass
    else:
        raise UsageError(f"{what}: {type(t).__name__} is not a torch tensor or numpy array")
    if isinstance(t, np.ndarray):
        if cuda:
            raise UsageError(f"{what}: a numpy array on the CUDA backend (pinned torch tensors only)")
    else:
        if t.device.type == "cuda" and not cuda:
            raise UsageError(
                f"{what}: a CUDA tensor; the host backend takes CPU tensors "
                "(Ops(..., backend=\"cuda\") takes CUDA ones)"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise UsageError(f"{what}: a {t.device.type} tensor is neither CPU nor CUDA")
        if cuda and t.device.type == "cpu" and not t.is_pinned():
            raise UsageError(f"{what}: a CPU tensor on the CUDA backend must be pinned")
        if not t.is_contiguous():
            raise UsageError(f"{what}: the tensor is not contiguous")
        addr, nbytes, itemsize = t.data_ptr(), t.numel() * t.element_size(), t.element_size()
    if page_bytes % itemsize != 0:
        raise UsageError(
            f"{what}: {itemsize}-byte items do not tile a {page_bytes}-byte page (dtype)"
        )
    return int(addr), int(nbytes)


class PageMajor:
    """A device tensor laid out ``[pages, layers, ...]`` (vLLM's cross-layer KV cache,
    ``[num_blocks, num_layers, ...]``): layer ``l`` of page ``p`` at ``(p * layers + l)``
    pages from its start. Device tensors and pools only."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


def _tensors(
    t: Tensors, what: str, page_bytes: int, cuda: bool = False
) -> Tuple[str, List[Tuple[int, int]]]:
    if isinstance(t, PageMajor):
        return "page_major", [_region(t.tensor, what, page_bytes, cuda)]
    if isinstance(t, (list, tuple)):
        regions = [_region(x, f"{what} layer {i}", page_bytes, cuda) for i, x in enumerate(t)]
        return "per_layer", regions
    return "cross_layer", [_region(t, what, page_bytes, cuda)]


def _pages(p: Any, what: str) -> bytes:
    a = np.asarray(p)
    if a.ndim != 1:
        raise UsageError(f"{what}: page ids are one-dimensional, got shape {a.shape}")
    if a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= 2**32):
        raise UsageError(f"{what}: page ids are integers in 0..2**32")
    return a.astype("<u4").tobytes()


def _stream(stream: Optional[Any], cuda: bool) -> Optional[int]:
    """The raw stream handle of ``stream=`` (CUDA backend only)."""
    if stream is None:
        return None
    if not cuda:
        raise UsageError(
            "stream= is for CUDA tensors on the CUDA backend; the host backend runs in order"
        )
    return _stream_handle(stream)


def _stream_handle(stream: Any) -> int:
    """The raw ``CUstream`` handle of a stream object (``.cuda_stream``, as
    ``torch.cuda.Stream``) or of a handle given as an int, checked to fit a u64."""
    handle = getattr(stream, "cuda_stream", stream)
    if (
        isinstance(handle, bool)
        or not isinstance(handle, (int, np.integer))
        or not 0 <= int(handle) < 2**64
    ):
        raise UsageError(
            "stream=: a raw CUstream handle (an int from 0 to 2**64 - 1) or an object with "
            f".cuda_stream (torch.cuda.current_stream()), not {stream!r}"
        )
    return int(handle)


def _words(t: Tensor, what: str, cuda: bool = False) -> Tuple[int, int]:
    """(address, bytes) of a tensor of 32-bit words (CPU, or with ``cuda`` a CUDA one)."""
    size = t.itemsize if isinstance(t, np.ndarray) else getattr(t, "element_size", lambda: 0)()
    if size != 4:
        raise UsageError(f"{what}: 32-bit words (uint32 or int32), not {getattr(t, 'dtype', type(t))}")
    return _region(t, what, 4, cuda)


class Lanes:
    """An engine's owner lanes, held in its own tensors: lane ``r`` holds the free pages of
    rank ``r`` (pages ``p`` with ``p % cp == r``) as a stack, ``stacks[r, :tops[r]]``, top
    last; ``status`` holds the allocator kernels' status words (refused launches, per-lane
    deficits or overflows, bad owners or pages). Any 32-bit CPU tensors will do on the host
    backend; on the CUDA backend, CUDA tensors (or pinned CPU ones)."""

    def __init__(self, stacks: Tensor, tops: Tensor, status: Tensor) -> None:
        self.stacks, self.tops, self.status = stacks, tops, status

    @classmethod
    def of(cls, free_pages: Any, cp: int, lane_cap: int) -> "Lanes":
        """Lanes (numpy) holding ``free_pages``, each pushed onto lane ``page % cp`` in
        order."""
        stacks = np.zeros((cp, lane_cap), dtype=np.uint32)
        tops = np.zeros(cp, dtype=np.uint32)
        for p in np.asarray(free_pages, dtype=np.int64):
            r = int(p) % cp
            if p <= 0 or p // cp >= lane_cap or tops[r] >= lane_cap:
                raise UsageError(f"page {p} does not fit lanes of {lane_cap} pages per rank")
            stacks[r, tops[r]] = p
            tops[r] += 1
        return cls(stacks, tops, np.zeros(cp + 2, dtype=np.uint32))

    def _arg(self, cuda: bool = False) -> Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]:
        return (
            _words(self.stacks, "lanes.stacks", cuda),
            _words(self.tops, "lanes.tops", cuda),
            _words(self.status, "lanes.status", cuda),
        )


class Ops:
    """A deployment's transfer and materialise kernels, compiled (through the JIT cache) and
    loaded once at construction, launched on the caller's tensors."""

    def __init__(self, deployment: Deployment, backend: str = "host") -> None:
        if backend not in ("host", "cuda"):
            raise UsageError(f"backend={backend!r}: \"host\" or \"cuda\"")
        self._native = _native.Ops(deployment, backend)
        self._cuda = self._native.backend == "cuda"
        self.deployment = deployment

    @property
    def buffers(self) -> List[str]:
        """The buffer kinds, in the order :meth:`transfer` takes them."""
        return list(self._native.buffers)

    def page_bytes(self, buffer: str) -> int:
        """Bytes of one page of ``buffer``."""
        return self._native.page_bytes(buffer)

    def _side(self, tensors: Sequence[Tensors], what: str) -> List[Tuple[str, List[Tuple[int, int]]]]:
        if not isinstance(tensors, (list, tuple)):
            raise UsageError(f"{what}: one entry per buffer kind ({', '.join(self.buffers)})")
        if len(tensors) != len(self.buffers):
            raise UsageError(
                f"{what}: {len(tensors)} entries for the buffer kinds {', '.join(self.buffers)}"
            )
        return [
            _tensors(t, f"{what}[{b}]", self.page_bytes(b), self._cuda)
            for t, b in zip(tensors, self.buffers)
        ]

    def transfer(
        self,
        direction: str,
        device: Sequence[Tensors],
        host: Sequence[Tensors],
        src_pages: Any,
        dst_pages: Any,
        layers: Optional[range] = None,
        stream: Optional[Any] = None,
    ) -> int:
        """Copies page ``src_pages[i]`` to page ``dst_pages[i]`` of every buffer kind, for
        the layers in ``layers`` (all by default): ``"h2d"`` host → device or ``"d2h"``
        device → host, one launch moving every buffer kind (one per layer when the host side
        is per-layer). ``device`` and ``host`` hold one entry per buffer kind (:attr:`buffers`;
        NSA's ``nsa_kv`` and ``nsa_idx`` move together). Destinations must be distinct. Returns
        the bytes moved. SGLang: the host pool's ``load_to_device_per_layer`` /
        ``backup_from_device_all_layer``."""
        handle = _stream(stream, self._cuda)
        if layers is None:
            layers = range(self.deployment.layers)
        if not isinstance(layers, range) or layers.step != 1:
            raise UsageError("layers: a range of consecutive layers")
        dev = self._side(device, "device")
        hst = self._side(host, "host")
        return self._native.transfer(
            direction, dev, hst, _pages(src_pages, "src_pages"), _pages(dst_pages, "dst_pages"),
            layers.start, layers.stop, handle,
        )

    def materialise(
        self,
        buffer: str,
        pools: Sequence[Tensors],
        seq_pages: Any,
        out: Tensors,
        stream: Optional[Any] = None,
    ) -> None:
        """Gathers sequence page ``i`` (page ``p = seq_pages[i]``, owned by rank ``p % cp`` at
        its local page ``p // cp``) of ``buffer`` from ``pools[p % cp]`` into page ``i`` of
        ``out`` (``[layers, len(seq_pages), ...]``, or per layer), for every layer: what
        attention over the CP group reads. ``pools`` holds every rank's device tensors of
        ``buffer``, in rank order."""
        handle = _stream(stream, self._cuda)
        pb = self.page_bytes(buffer)
        if not isinstance(pools, (list, tuple)):
            raise UsageError("pools: one entry per rank")
        ps = [_tensors(t, f"pools[{r}]", pb, self._cuda) for r, t in enumerate(pools)]
        self._native.materialise(
            buffer, ps, _pages(seq_pages, "seq_pages"), _tensors(out, "out", pb, self._cuda),
            handle,
        )

    def select(
        self,
        lanes: Lanes,
        owners: Any,
        out_pages: Optional[Tensor] = None,
        out_locs: Optional[Tensor] = None,
        stream: Optional[Any] = None,
    ) -> Tuple[Any, Any]:
        """Pops one page per entry of ``owners`` from lane ``owners[i]`` (the seed's
        ``alloc_pages_with_owners``: a page loaded back gets its recorded owner). Returns
        ``(pages, locs)``: ``uint32[n]`` pages and ``int64[n * page_size]`` token slots
        (``locs[i * page_size + j] == pages[i] * page_size + j``).

        - ``out_pages`` and ``out_locs`` given: the kernel writes both into them.
        - ``out_pages`` alone: the kernel writes the pages only and ``locs`` is ``None``; an
          engine that derives its slots from the pages (SGLang's ``out_cache_loc``) spares
          the kernel's one block ``8 * page_size`` bytes per page.
        - neither (host backend only): new numpy arrays, the slots computed on the host from
          the pages.

        On the CUDA backend ``out_pages`` (and ``out_locs``, if given) must be CUDA tensors,
        as the lanes are; ``out_locs`` without ``out_pages`` is refused. All or nothing: when
        a lane is short, no lane changes, the pages written are 0, and
        :class:`CacheFullError` says which lanes are short by how much (the status words are
        read back: a host synchronisation). ``stream`` as in :meth:`transfer`."""
        handle = _stream(stream, self._cuda)
        o = np.asarray(owners)
        if o.ndim != 1 or (o.size and (o.min() < 0 or o.max() >= 256)):
            raise UsageError("owners: one rank per page, integers in 0..256")
        o = o.astype(np.uint8)
        n, ps = len(o), self.deployment.page_size
        if out_pages is None and out_locs is not None:
            raise UsageError(
                "out_locs: given without out_pages; pass out_pages too (or out_pages alone, "
                "and derive the slots from the pages)"
            )
        host_locs = out_pages is None
        if host_locs:
            if self._cuda:
                raise UsageError(
                    "select on the CUDA backend writes into out_pages (and out_locs, if "
                    "given): CUDA tensors of uint32[n] and int64[n * page_size]"
                )
            out_pages = np.zeros(n, dtype=np.uint32)
        pages_arg = _region(out_pages, "out_pages", 4, self._cuda)
        locs_arg = None if out_locs is None else _region(out_locs, "out_locs", 8, self._cuda)
        self._native.select(lanes._arg(self._cuda), o.tobytes(), pages_arg, locs_arg, handle)
        if host_locs:
            # Raised above when refused, so these are the pages granted.
            pages = out_pages.astype(np.int64)
            out_locs = (pages[:, None] * ps + np.arange(ps, dtype=np.int64)).reshape(-1)
        return out_pages, out_locs

    def release(self, lanes: Lanes, pages: Any, stream: Optional[Any] = None) -> None:
        """Pushes each page back onto lane ``page % cp``, in order. All or nothing: an invalid
        page raises :class:`UsageError`, a lane without room :class:`CacheFullError`, and no
        lane changes. ``stream`` as in :meth:`transfer`."""
        handle = _stream(stream, self._cuda)
        self._native.release(lanes._arg(self._cuda), _pages(pages, "pages"), handle)
