"""The calls an engine makes per request, with cp_hicache as its KV cache.

Each CP rank is a process (as in SGLang, vLLM, TensorRT-LLM), joined in a gloo group. Per
process: warm the kernels up once, build the rank's cache, take its KV pools as torch tensors.
Per request, on every rank:

1. ``begin``        match the prompt; start loading its host-only part back, layer by layer;
2. ``allocate``     pages for the tokens to compute (zigzag over the owners);
3. the forward      per layer: wait for that layer's load, "attention" reads every cached page
                    from its owner's pool (checking it holds what the engine wrote when it
                    computed it), and the rank writes the KV of the new pages it owns;
4. ``finish``       insert the pages, back them up to host memory, release.

Between rounds the engine evicts everything from the device (memory pressure), so the second
round's prefixes come back from host memory: the bytes the engine wrote must survive the round
trip, in pages with the same owners. The "model" is a stand-in: a page's KV is bytes derived
from its tokens and layer.

    python python/examples/engine_loop.py --ranks 2
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
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


def rank_main(rank: int, size: int, port: int, backend: str, fault) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=120))
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=size, layers=4)

    # Once per process, before serving: no request waits for a compiler.
    warm = cp_hicache.warm_up(dep, backend=backend)
    rc = cp_hicache.RankCache(
        dep, rank, dist.group.WORLD, device_pages=64 * size + 1, host_pages=256, backend=backend,
        fault=fault,
    )
    buffer = dep.buffers[0]
    # Every owner's pool as this rank reaches it (its own, and its mappings of its peers').
    pools = [torch.from_dlpack(rc.pool(buffer, owner=r)) for r in range(size)]
    page_bytes = pools[0].shape[2]
    if rank == 0:
        print(f"warm-up: {warm.kernels} kernels, {warm.cache_hits} from the cache, "
              f"{warm.milliseconds:.0f} ms; pools {tuple(pools[0].shape)} x {size} owners")

    wrong = checked = 0
    for i, tokens in enumerate(prompts(rounds=2)):
        if i == len(prompts(1)):
            rc.evict(1 << 30)  # memory pressure: every prefix goes to host memory
        req = rc.begin(tokens)                     # 1. match + layer-wise load-back
        rc.allocate(req)                           # 2. pages for the rest
        pages = req.pages
        owners, local = rc.locate(pages)
        for layer in range(dep.layers):            # 3. the forward, layer by layer
            req.wait_layer(layer) if req.loading_layers else None
            for p in range(req.cached_pages):      # attention reads cached KV from its owner
                want = page_kv(tokens, p, layer, dep.page_size, page_bytes)
                got = pools[owners[p]][layer, local[p]]
                checked += 1
                wrong += int(not torch.equal(got, want))
            for p in range(req.cached_pages, len(pages)):
                if owners[p] == rank:              # each rank writes the pages it owns
                    pools[rank][layer, local[p]] = page_kv(tokens, p, layer, dep.page_size, page_bytes)
        dist.barrier()                             # every owner's pages are written
        stats = rc.finish(req)                     # 4. insert + back up + release
        if rank == 0:
            print(f"request {i:2}: {len(tokens):4} tokens, device hit {stats['device_hit_tokens']:4}, "
                  f"loaded {stats['host_hit_tokens']:4}, computed {stats['computed_tokens']:4}")
    total = torch.tensor([wrong, checked])
    dist.all_reduce(total)
    if rank == 0:
        print(f"cached pages read back by attention: {int(total[1])} page-layers, "
              f"{int(total[0])} wrong")
    dist.barrier()
    os._exit(0 if int(total[0]) == 0 else 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2, help="CP ranks, one process each")
    ap.add_argument("--backend", default="auto", help="auto, host or cuda")
    ap.add_argument("--fault", default=None,
                    help="inject a fault, e.g. plain-alloc-on-load (the original bug: loaded "
                         "pages lose their owners, and attention reads wrong KV)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.backend, args.fault))
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
