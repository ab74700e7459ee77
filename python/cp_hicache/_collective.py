"""The cache's collective over a ``torch.distributed`` group."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple


class TorchCollective:
    """Runs the cache's collective rounds on a ``torch.distributed`` process group.

    Each round is one ``all_gather_object`` of ``(what, payload, why)``: the step's name (so
    that ranks that diverged are caught instead of pairing the wrong calls), this rank's bytes
    and, when this rank's step failed, why. The Rust side checks the names and failures; this
    class only moves them. Use a gloo group (a CPU control plane, as SGLang's ``cpu_group``),
    created with a bounded ``timeout`` so that no rank waits for ever on a peer that is gone.

    Args:
        group: the ``ProcessGroup`` of the CP ranks; ``None`` for the default (world) group.
    """

    kind = "torch.distributed"

    def __init__(self, group: Optional[Any] = None) -> None:
        import torch.distributed as dist  # only when a group is used

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call init_process_group first"
            )
        self._dist = dist
        self._group = group
        self.rank: int = dist.get_rank(group)
        self.size: int = dist.get_world_size(group)

    def exchange(
        self, what: str, payload: Optional[bytes], why: Optional[str]
    ) -> List[Tuple[str, Optional[bytes], Optional[str]]]:
        """Every rank's ``(what, payload, why)``, in rank order (this rank's included)."""
        out: List[Any] = [None] * self.size
        self._dist.all_gather_object(out, (what, payload, why), group=self._group)
        return out
