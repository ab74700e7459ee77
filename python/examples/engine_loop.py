"""The calls an engine makes per request, with cp_hicache as its KV cache.

Each CP rank is a process (as in SGLang, vLLM, TensorRT-LLM), joined in a gloo group. Per
process: warm the kernels up once, build the rank's cache, take its KV pools as torch tensors.
Per request, on every rank:

1. ``begin(tokens, allocate=True)``  match the prompt, load its host-only part back (owners
                    preserved), and allocate pages for the tokens to compute (zigzag over the
                    owners): one group round. When it returns, every loaded page is readable
                    by every peer.
2. the forward      per layer: wait for that layer's load; each rank writes the KV of the new
                    pages it owns; the engine's own collective (here a barrier) ends the
                    layer's writes; then "attention" reads *every* page of the request from its
                    owner's pool (cached pages, and the pages peers computed in this very
                    request), checking it holds what the model wrote.
3. ``finish(req, ok=...)``  insert the pages, back them up, release: one group round. Nothing
                    is freed before every rank has reached it, so a slow rank still reading
                    is safe. A rank whose forward failed says ``ok=False`` and every rank
                    abandons the request.

``--slow-rank R`` makes rank R's attention start late, so its peers reach ``finish`` while it
still reads their pages (the partial last page of a request is freed there). Between rounds
the engine evicts everything from the device (memory pressure), so the second round's prefixes
come back from host memory: the bytes the engine wrote must survive the round trip, in pages
with the same owners. The "model" is a stand-in: a page's KV is bytes derived from its tokens
and layer.

    python python/examples/engine_loop.py --ranks 4 --slow-rank 1
"""

from __future__ import annotations

import argparse
import hashlib
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


def page_kv(tokens: np.ndarray, page: int, layer: int, page_size: int, nbytes: int) -> torch.Tensor:
    """The stand-in model's KV of page ``page`` at ``layer``: it depends on every token up to
    the page's end, as real KV does on the prefix."""
    prefix = tokens[: (page + 1) * page_size].tobytes()
    seed = hashlib.sha256(prefix + layer.to_bytes(4, "little")).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))


def prompts(rounds: int) -> list:
    """Conversations sharing a system prompt: every request's prefix is cached."""
    system = np.arange(1000, 1000 + 96, dtype=np.uint32)
    out = []
    for user in range(3):
        turn = system
        for t in range(2):
            turn = np.concatenate([turn, np.arange(50 * user + 10 * t, 50 * user + 10 * t + 40, dtype=np.uint32)])
            out.append(turn)
    return out * rounds


def rank_main(rank: int, size: int, port: int, backend: str, fault, slow_rank, slow_ms) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=120))
    # The cache's own group: a dedicated gloo group, not one the engine's own collectives use,
    # so that the cache's rounds never interleave with the engine's.
    cache_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=size, layers=4)

    # Once per process, before serving: no request waits for a compiler.
    warm = cp_hicache.warm_up(dep, backend=backend)
    rc = cp_hicache.RankCache(
        dep, rank, cache_group, device_pages=64 * size + 1, host_pages=256, backend=backend,
        fault=fault,
    )
    buffer = dep.buffers[0]
    # Every owner's pool as this rank reaches it (its own, and its mappings of its peers').
    pools = [torch.from_dlpack(rc.pool(buffer, owner=r)) for r in range(size)]
    page_bytes = pools[0].shape[2]
    if rank == 0:
        print(f"warm-up: {warm.kernels} kernels, {warm.cache_hits} from the cache, "
              f"{warm.milliseconds:.0f} ms; pools {tuple(pools[0].shape)} x {size} owners")

    wrong = checked = cached_checked = 0
    rounds = []
    for i, tokens in enumerate(prompts(rounds=2)):
        if i == len(prompts(1)):
            rc.evict(1 << 30)  # memory pressure: every prefix goes to host memory
        req = rc.begin(tokens, allocate=True)      # 1. match + load-back + allocate
        # The forward writes the new pages after the cache's work on them (a freed page's
        # poison): an engine on a GPU hands its stream in, begin(..., stream=s); this one
        # writes from the CPU, so it waits (immediate on the CPU backend).
        rc.synchronize()
        pages = req.pages
        owners, local = rc.locate(pages)
        for layer in range(dep.layers):            # 2. the forward, layer by layer
            req.wait_layer(layer) if req.loading_layers else None
            for p in range(req.cached_pages, len(pages)):
                if owners[p] == rank:              # each rank writes the pages it owns
                    pools[rank][layer, local[p]] = page_kv(tokens, p, layer, dep.page_size, page_bytes)
            dist.barrier()                         # the engine's own collective: KV written
            if rank == slow_rank:
                time.sleep(slow_ms / 1000)         # a straggler: its peers run ahead
            for p in range(len(pages)):            # attention reads every page from its owner
                want = page_kv(tokens, p, layer, dep.page_size, page_bytes)
                got = pools[owners[p]][layer, local[p]]
                checked += 1
                cached_checked += int(p < req.cached_pages)
                wrong += int(not torch.equal(got, want))
        stats = rc.finish(req, ok=True)            # 3. insert + back up + release
        rounds.append(stats["group_rounds"])
        if rank == 0:
            print(f"request {i:2}: {len(tokens):4} tokens, device hit {stats['device_hit_tokens']:4}, "
                  f"loaded {stats['host_hit_tokens']:4}, computed {stats['computed_tokens']:4}")
    total = torch.tensor([wrong, checked, cached_checked])
    dist.all_reduce(total)
    if rank == 0:
        print(f"read back by attention: {int(total[1])} page-layers ({int(total[2])} cached), "
              f"{int(total[0])} wrong")
        print(f"cache rounds per request: {max(rounds)}")
    rc.close()
    dist.barrier()
    os._exit(0 if int(total[0]) == 0 else 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="CP ranks, one process each")
    ap.add_argument("--backend", default="auto", help="auto, host or cuda")
    ap.add_argument("--slow-rank", type=int, default=None,
                    help="this rank's attention starts late in every layer (a straggler)")
    ap.add_argument("--slow-ms", type=float, default=150.0, help="how late, in milliseconds")
    ap.add_argument("--fault", default=None,
                    help="inject a fault, e.g. plain-alloc-on-load (the original bug: loaded "
                         "pages lose their owners, and attention reads wrong KV)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.backend, args.fault,
                                                     args.slow_rank, args.slow_ms))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        print(f"error: exit statuses by rank {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
