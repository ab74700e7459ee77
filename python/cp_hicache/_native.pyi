"""Type stubs of the extension module ``cp_hicache._native`` (the Rust side)."""

from os import PathLike
from typing import Any, Dict, List, Optional, Tuple, Union

__version__: str

class CacheError(RuntimeError):
    """A failure of the cache, an executor or the JIT (the message is the Rust error's)."""

class GroupError(CacheError):
    """The CP group broke (a rank gone, a timeout, diverged ranks): nothing more can be served."""

class UsageError(ValueError):
    """Bad arguments or settings (what the command line refuses with exit status 2)."""

class CacheFullError(CacheError):
    """A request needs more pages at once than the pools can give it (it was undone)."""

class DivergedError(CacheError):
    """The ranks decided a step differently: it was undone on every rank."""

class RequestAbandoned(CacheError):
    """Another rank ended the request with ok=False: every rank abandoned it."""

class Deployment:
    """What an engine deploys: the model's KV buffers, page size, CP degree and layers."""

    def __init__(
        self,
        model: str = "nsa",
        page_size: int = 64,
        cp: int = 8,
        layers: int = 61,
        transfer: Optional[str] = None,
        layout: str = "zigzag",
        interleave_size: Optional[int] = None,
        kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        tp_rank: Optional[int] = None,
        tp_size: Optional[int] = None,
    ) -> None:
        """``model``: ``"nsa"``, ``"mla"`` or ``"gqa"`` (a GQA/MHA model's bf16 K and V of
        one TP shard: ``kv_heads`` heads of ``head_dim`` per rank, 8 and 128 when not given;
        only GQA takes them).

        ``tp_rank`` of ``tp_size``: which TP head shard a GQA deployment holds (0 of 1 when
        not given: unsplit). Shards of one model have the same shape but other heads, so a
        split shard (``tp_size > 1``) has a storage fingerprint and synthesised KV of its
        own: it reads and writes only its own records. NSA and MLA keep the same latent KV
        on every TP rank and refuse ``tp_size > 1`` (:class:`UsageError`), as do a
        ``tp_rank`` not below ``tp_size``, ``tp_size`` 0 and a ``tp_rank`` without
        ``tp_size``.

        ``layout``: ``"zigzag"``, ``"round-robin"``, ``"page-interleave"`` (SGLang's
        logical pages) or ``"token-interleave"`` (vLLM decode CP: token ``t`` on rank
        ``(t // interleave_size) % cp``; ``interleave_size`` 1 when not given)."""
    @property
    def name(self) -> str:
        """The deployment's name, as ``cp-hicache compile`` prints it (``nsa_ps64_cp8``)."""
    @property
    def model(self) -> str:
        """``"nsa"``, ``"mla"`` or ``"gqa"``."""
    @property
    def kv_heads(self) -> Optional[int]:
        """KV heads per rank of a GQA model; ``None`` for the others."""
    @property
    def head_dim(self) -> Optional[int]:
        """Elements per head of a GQA model; ``None`` for the others."""
    @property
    def tp_rank(self) -> int:
        """The TP head shard this deployment holds, ``0..tp_size`` (0 unsplit)."""
    @property
    def tp_size(self) -> int:
        """The TP head shards the model's KV heads are split into (1: unsplit)."""
    @property
    def page_size(self) -> int:
        """Tokens per page."""
    @property
    def cp(self) -> int:
        """The CP degree."""
    @property
    def layers(self) -> int:
        """Layers per KV buffer."""
    @property
    def buffers(self) -> List[str]:
        """The KV buffer kinds, one pool each: ``["mla_kv"]``, ``["nsa_kv", "nsa_idx"]``
        for NSA, ``["gqa8x128_kv"]`` for GQA with 8 KV heads of 128."""
    @property
    def layout(self) -> str:
        """The CP layout's name."""
    @property
    def interleave_size(self) -> Optional[int]:
        """Tokens per run of token-interleave; ``None`` for the page layouts."""

class WarmUpReport:
    """What :func:`warm_up` did."""

    deployment: str
    backend: str
    kernels: int
    cache_hits: int
    milliseconds: float
    cache_dir: str
    tuning_file: Optional[str]

def warm_up(
    deployment: Deployment,
    tuning: Optional[Union[str, PathLike]] = None,
    backend: str = "auto",
) -> WarmUpReport:
    """Compiles (or loads from the JIT cache) every kernel of ``deployment`` and loads it into
    this process's executor, once per engine process before serving."""

class Pool:
    """One rank's device pool of one buffer kind, a DLPack producer of
    ``uint8[layers, local_pages, page_bytes]`` viewing the pool in place."""

    @property
    def buffer(self) -> str: ...
    @property
    def shape(self) -> Tuple[int, int, int]: ...
    @property
    def data_ptr(self) -> int: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...

class PageStore:
    """A page store in a directory shared by processes (``cp_hicache.sglang`` and
    ``cp_hicache.vllm`` use it): records named by the engine's own names, salted with the
    fingerprint, read and written from ``[(address, bytes), ...]`` buffers in place."""

    def __init__(
        self, path: Union[str, PathLike], fingerprint: str, page_bytes: int, capacity_bytes: int
    ) -> None: ...
    @property
    def page_bytes(self) -> int: ...
    def put(self, name: str, parts: List[Tuple[int, int]]) -> bool: ...
    def put_part(
        self,
        name: str,
        part: int,
        parts: int,
        payload: List[Tuple[int, int]],
        assemble: Any,
    ) -> str:
        """Part ``part`` of ``parts`` of the record; the writer of the last part calls
        ``assemble(list of the parts' payloads)`` for the record's payload. ``"held"``,
        ``"completed"``, ``"present"`` or ``"read_only"`` (nothing written)."""
    def get(self, name: str, parts: List[Tuple[int, int]]) -> bool: ...
    def put_many(self, names: List[str], parts: List[List[Tuple[int, int]]]) -> List[bool]: ...
    def get_many(self, names: List[str], parts: List[List[Tuple[int, int]]]) -> List[bool]: ...
    def exists(self, name: str) -> bool: ...
    def present_run(self, names: List[str]) -> int: ...
    def stats(self) -> Dict[str, int]: ...
    def path_of(self, name: str) -> str: ...

class Ops:
    """A deployment's transfer and materialise kernels on the caller's tensors."""

    def __init__(self, deployment: Deployment, backend: str = "host") -> None: ...
    @property
    def backend(self) -> str: ...
    @property
    def buffers(self) -> List[str]: ...
    def page_bytes(self, buffer: str) -> int: ...
    def transfer(
        self,
        direction: str,
        device: List[Tuple[bool, List[Tuple[int, int]]]],
        host: List[Tuple[bool, List[Tuple[int, int]]]],
        src_pages: bytes,
        dst_pages: bytes,
        first_layer: int,
        layer_end: int,
    ) -> int: ...
    def materialise(
        self,
        buffer: str,
        pools: List[Tuple[bool, List[Tuple[int, int]]]],
        seq_pages: bytes,
        dense: Tuple[bool, List[Tuple[int, int]]],
    ) -> None: ...
    def select(
        self,
        lanes: Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]],
        owners: bytes,
        out_pages: Tuple[int, int],
        out_locs: Tuple[int, int],
        stream: Optional[int] = None,
    ) -> None: ...
    def release(
        self,
        lanes: Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]],
        pages: bytes,
        stream: Optional[int] = None,
    ) -> None: ...

class RankCache:
    """One CP rank's cache (see ``cp_hicache.RankCache``, which wraps this class)."""

    def __init__(
        self,
        deployment: Deployment,
        rank: int = 0,
        collective: Any = None,
        *,
        device_pages: int,
        host_pages: int,
        policy: str = "write_through",
        backend: str = "auto",
        tuning: Optional[Union[str, PathLike]] = None,
        fault: Optional[str] = None,
    ) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def deployment(self) -> Deployment: ...
    @property
    def group_kind(self) -> str: ...
    @property
    def peer_pools(self) -> str: ...
    @property
    def layer_waits(self) -> bool: ...
    @layer_waits.setter
    def layer_waits(self, on: bool) -> None: ...
    def serve(self, tokens: bytes) -> Dict[str, Any]: ...
    def match_prefix(self, tokens: bytes) -> Tuple[int, bytes, int]: ...
    def evict(self, pages: int) -> int: ...
    def digest(self) -> str: ...
    def host_digest(self) -> str: ...
    def _check_owns(self, req: Request) -> None: ...
    def all_digests(self) -> List[str]: ...
    def check_invariants(self) -> None: ...
    def lane_free_counts(self) -> List[int]: ...
    def last_verdict(self) -> Dict[str, Any]: ...
    def prefetch(self, tokens: bytes, skip_tokens: int = 0) -> int: ...
    def attach_storage(
        self, path: str, *, capacity_bytes: int = ..., policy: str = ...
    ) -> None: ...
    def inject_launch_failure(self, request: int) -> None: ...
    def set_verifying_ranks(self, n: int) -> None: ...
    def pool(self, buffer: str, owner: Optional[int] = None) -> Pool: ...
    def locate(self, pages: bytes) -> Tuple[bytes, bytes]: ...
    def place_tokens(self, pages: bytes, n_tokens: int) -> Tuple[bytes, bytes]: ...
    def begin(
        self,
        tokens: bytes,
        allocate: bool = False,
        chunk: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> Request: ...
    def allocate(self, req: Request, stream: Optional[int] = None) -> None: ...
    def extend(self, req: Request, tokens: bytes, stream: Optional[int] = None) -> None: ...
    def step(
        self,
        begin: List[bytes],
        extend: List[Tuple[Request, bytes]],
        finish: List[Tuple[Request, bool]],
        allocate: bool = True,
        chunk: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> Tuple[List[Optional[Request]], List[Tuple[str, int, BaseException]]]: ...
    def synthesise(self, req: Request) -> None: ...
    def verify(self, req: Request) -> int: ...
    def synthesise_and_verify(self, req: Request) -> int: ...
    def finish(
        self, req: Request, ok: bool = True, stream: Optional[int] = None
    ) -> Optional[Dict[str, Any]]: ...
    def abandon(self, req: Request) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def synchronize(self) -> None: ...

class Request:
    """A request between its steps."""

    @property
    def pages(self) -> bytes: ...
    @property
    def tokens(self) -> bytes: ...
    @property
    def computed_from(self) -> int: ...
    @property
    def pages_in_tree(self) -> int: ...
    @property
    def cached_pages(self) -> int: ...
    @property
    def loading_layers(self) -> int: ...
    def wait_layer(self, layer: int, stream: Optional[int] = None) -> None: ...
    def wait_all(self) -> None: ...
    def stats(self) -> Dict[str, Any]: ...

def check_replay(argv: List[str]) -> Tuple[Optional[int], str, int, float]:
    """Checks ``python -m cp_hicache.replay`` arguments: ``(None, "", ranks, timeout)`` to go
    on, else ``(status, text, ...)`` to print and exit with."""

def replay_rank(argv: List[str], collective: Any) -> Tuple[int, Optional[str]]:
    """Runs one rank of the multi-process replay; returns its exit status and error message."""
