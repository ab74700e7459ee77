"""What the cache costs a scheduler's decode step, over CP ranks as gloo processes.

Each rank admits B requests (200-token prompts) in one ``step``, then decodes one token per
request per step for ``--steps`` steps, two ways: a ``step(extend=[...])`` per decode step (the
batch), and one ``extend`` per request (the single-request calls, as before ``step``). Each
is timed per decode step against one bare ``all_gather`` of a small tensor on the same gloo
group, in the same run. No forward runs (no KV is written): what is timed is the cache's own
work and its group rounds.

    python python/examples/step_cost.py --ranks 4 --batches 1 16 64
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cp_hicache


def timed(f, n: int) -> float:
    """Milliseconds per call of ``f`` over ``n`` calls, the ranks lined up first."""
    dist.barrier()
    t = time.perf_counter()
    for i in range(n):
        f(i)
    return (time.perf_counter() - t) * 1000 / n


def rank_main(rank: int, size: int, port: int, batches, steps: int, page: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=300))
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))
    dep = cp_hicache.Deployment(model="mla", page_size=page, cp=size, layers=1)
    cp_hicache.warm_up(dep, backend="host")
    pages_per_req = (200 + 2 * steps) // page + 2
    most = max(batches)
    rc = cp_hicache.RankCache(
        dep, rank, group, device_pages=(most * pages_per_req * 2 // size + 8) * size,
        host_pages=most * pages_per_req * 2, backend="host",
    )
    small = torch.zeros(8, dtype=torch.uint8)
    slots = [torch.empty_like(small) for _ in range(size)]
    rows = []
    for b in batches:
        base = 1_000_000 * b
        prompts = [np.arange(base + 1000 * i, base + 1000 * i + 200, dtype=np.uint32)
                   for i in range(b)]
        gather_ms = timed(lambda i: dist.all_gather(slots, small, group=group), steps)
        reqs = rc.step(begin=prompts)
        batched_ms = timed(lambda i: rc.step(extend=[(r, [7 + i]) for r in reqs]), steps)
        single_ms = timed(lambda i: [rc.extend(r, [70_000 + i]) for r in reqs], steps)
        rc.step(finish=reqs)
        rows.append((b, gather_ms, batched_ms, single_ms))
    if rank == 0:
        out.put(rows)
    rc.close()
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="CP ranks, one process each")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64],
                    help="requests per decode step")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per way")
    ap.add_argument("--page-size", type=int, default=64, help="tokens per page")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main,
                         args=(r, args.ranks, port, args.batches, args.steps, args.page_size, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    print(f"{args.ranks} gloo processes, page {args.page_size}, {args.steps} decode steps "
          f"of one token per request")
    print("| requests | all_gather ms | step() ms/step | x all_gather | extend() per request "
          "ms/step | x all_gather |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b, g, bat, single in rows:
        print(f"| {b} | {g:.3f} | {bat:.3f} | {bat / g:.2f} | {single:.3f} | {single / g:.2f} |")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
