"""The cache's collective over a ``torch.distributed`` group."""

from __future__ import annotations

import struct
import time
from typing import Any, List, Optional, Tuple

#: How long a wait sleeps between polls of a round in flight: short against a gloo round
#: (about a millisecond on one machine), and what lets Python handle Ctrl-C while a peer is
#: late instead of only at the group's timeout.
_POLL_S = 0.0002


def _encode(what: str, payload: Optional[bytes], why: Optional[str]) -> bytes:
    """``(what, payload, why)`` as bytes: each part a little-endian i64 length (-1 for None)
    and its bytes. No pickle: a peer's bytes are data, never code."""
    out = bytearray()
    for part in (what.encode(), payload, None if why is None else why.encode()):
        out += struct.pack("<q", -1 if part is None else len(part))
        out += b"" if part is None else part
    return bytes(out)


def _decode(data: bytes) -> Tuple[str, Optional[bytes], Optional[str]]:
    parts: List[Optional[bytes]] = []
    at = 0
    for _ in range(3):
        (n,) = struct.unpack_from("<q", data, at)
        at += 8
        if n < 0:
            parts.append(None)
        else:
            if at + n > len(data):
                raise ValueError(f"a contribution of {len(data)} bytes ends inside a part")
            parts.append(data[at:at + n])
            at += n
    what, payload, why = parts
    if what is None:
        raise ValueError("a contribution without a step name")
    return what.decode(), payload, None if why is None else why.decode()


class TorchCollective:
    """Runs the cache's collective rounds on a ``torch.distributed`` process group.

    Each round gathers every rank's ``(what, payload, why)``: the step's name (so that ranks
    that diverged are caught instead of pairing the wrong calls), this rank's bytes and,
    when this rank's step failed, why. The Rust side checks the names, lengths and failures;
    this class only moves them, as two ``all_gather`` calls (the lengths, then the bytes)
    that it polls, so that Ctrl-C interrupts a wait for a late peer at once. Use a gloo
    group dedicated to the cache (a CPU control plane, as SGLang's ``cpu_group``, but not
    that one: the cache's rounds must not interleave with the engine's own collectives),
    created with a bounded ``timeout`` so that no rank waits for ever on a peer that is gone.

    Args:
        group: the ``ProcessGroup`` of the CP ranks; ``None`` for the default (world) group.
    """

    kind = "torch.distributed"

    def __init__(self, group: Optional[Any] = None) -> None:
        import torch
        import torch.distributed as dist  # only when a group is used

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        self._torch = torch
        self._dist = dist
        self._group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)

    def _gather(self, tensor: Any) -> List[Any]:
        out = [self._torch.empty_like(tensor) for _ in range(self.size)]
        work = self._dist.all_gather(out, tensor, group=self._group, async_op=True)
        while not work.is_completed():
            time.sleep(_POLL_S)
        work.wait()
        return out

    def exchange(
        self, what: str, payload: Optional[bytes], why: Optional[str]
    ) -> List[Tuple[str, Optional[bytes], Optional[str]]]:
        """Every rank's ``(what, payload, why)``, in rank order (this rank's included)."""
        torch = self._torch
        data = _encode(what, payload, why)
        sizes = [int(n) for n in self._gather(torch.tensor([len(data)], dtype=torch.int64))]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [_decode(t[:n].numpy().tobytes()) for t, n in zip(self._gather(buf), sizes)]
