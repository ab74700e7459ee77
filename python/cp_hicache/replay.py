"""``python -m cp_hicache.replay --ranks C [options of cp-hicache replay]``.

Replays a workload with each CP rank in a process of its own, as an engine runs them: the
ranks agree through ``torch.distributed`` (gloo on 127.0.0.1), map each other's pools (shared
memory), and each verifies every request. Rank 0 prints the report of ``cp-hicache replay``;
``--json`` writes the same fields, with ``group.kind`` ``"torch.distributed"``.

A rank process that dies (a crash, a kill) ends the run with exit status 1 and a message naming
the rank; the survivors' collective calls fail at once (the dead rank's sockets close) or, at
the latest, after ``--group-timeout`` seconds. Exit status: 0 verified without mismatch, 1 a
mismatch or failure, 2 bad arguments or input.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import List, Optional

from . import _native
from ._collective import TorchCollective

#: Seconds the launcher waits for the other ranks to end once one has died, beyond which it
#: terminates them (they normally fail within a second: the dead rank's sockets close).
GRACE_SECONDS = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, timeout: float, argv: List[str]) -> None:
    """One rank process: join the gloo group, replay, exit with the replay's status."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
        )
    except Exception as e:  # noqa: BLE001 - any failure to join ends this rank
        print(f"error: rank {rank}: cannot join the gloo group: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"rank {rank} (pid {os.getpid()}) joined the group", file=sys.stderr, flush=True)
    code, message = _native.replay_rank(argv, TorchCollective())
    if message:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Leave without tearing the group down: a peer that already failed would make a
    # destroy_process_group wait.
    os._exit(code)


def _describe(rank: int, code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} exited with status {code}"


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the launcher; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    status, text, ranks, timeout = _native.check_replay(argv)
    if status is not None:
        (sys.stdout if status == 0 else sys.stderr).write(text)
        return status
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, ranks, port, timeout, argv), name=f"cp-rank-{r}"
        )
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    died: Optional[int] = None
    died_at = 0.0
    try:
        while any(p.is_alive() for p in procs):
            if died is None:
                for r, p in enumerate(procs):
                    # A rank that ends before its peers with a failure, or by a signal, is
                    # the cause; the others follow.
                    if p.exitcode is not None and p.exitcode < 0:
                        died, died_at = r, time.monotonic()
                        break
            elif time.monotonic() - died_at > GRACE_SECONDS:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                break
            time.sleep(0.05)
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        print("interrupted: every rank was stopped", file=sys.stderr)
        return 130
    codes = [p.exitcode for p in procs]
    if died is None:
        died = next((r for r, c in enumerate(codes) if c is not None and c < 0), None)
    if died is not None:
        print(
            f"error: {_describe(died, codes[died])} during the replay; the run is incomplete "
            f"(exit statuses by rank: {codes})",
            file=sys.stderr,
        )
        return 1
    if all(c == codes[0] for c in codes):
        return int(codes[0])
    print(f"error: the ranks ended differently (exit statuses by rank: {codes})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
