"""The scheduler-side overhead of cp_hicache.vllm.CpHiCacheConnector (the planner alone), per
request, against a store that holds the records of N earlier requests (issue 43).

Each timed request (a prompt of 8 blocks of 16 tokens and one token more, 4 layers) goes
through what vLLM's scheduler calls on the connector for one
request: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, then
``build_connector_meta`` for a step that runs it (its prompt's saves planned),
``request_finished`` and ``update_connector_output`` with the workers' report of the step
(its saves settled). Half the requests share a cached prefix (a hit of every whole block but
the last); the others miss. ``--host-bytes`` is each worker's host tier (the connector's
``host_bytes``, default its default): the misses' saves are admitted to it once settled, so
the planner's host accounting is in the timed loop (0: the store alone). Run in the vLLM
environment::

    source "$(scripts/vllm-env.sh | tail -n1)"
    python scripts/bench_vllm_planner.py --cached 1000 10000 [--host-bytes 0]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.environ.get("CP_HICACHE_VLLM_TESTS", ""))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tests.v1.kv_connector.unit.utils import create_request, create_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from cp_hicache.vllm import CpHiCacheConnector, CpHiCacheWorkerMeta, block_names  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

BS = 16


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


class _NewReq:
    def __init__(self, req_id, block_ids):
        self.req_id = req_id
        self.block_ids = (block_ids,)


class _Cached:
    req_ids: list = []
    new_block_ids: list = []


class _Out:
    def __init__(self, new, scheduled):
        self.scheduled_new_reqs = new
        self.scheduled_cached_reqs = _Cached()
        self.num_scheduled_tokens = scheduled
        self.preempted_req_ids = set()


def bench(cached: int, timed: int, prompt_blocks: int, layers: int,
          host_bytes: Optional[int]) -> dict:
    path = tempfile.mkdtemp(prefix="cp-hicache-planner-")
    extra = {"path": path}
    if host_bytes is not None:
        extra["host_bytes"] = host_bytes
    cfg = create_vllm_config(block_size=BS, kv_connector="CpHiCacheConnector",
                             kv_connector_module_path="cp_hicache.vllm", kv_role="kv_both",
                             kv_connector_extra_config=extra)
    kcc = KVCacheConfig(num_blocks=1 << 16, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"l{i}" for i in range(layers)],
                         FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64,
                                           dtype=torch.float16))])
    c = CpHiCacheConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    page = np.zeros(c.page_bytes, dtype=np.uint8)
    parts = [(page.ctypes.data, page.nbytes)]
    n_tokens = prompt_blocks * BS + 1
    # The store: `cached` earlier requests' prompts, every whole block.
    t0 = time.perf_counter()
    for i in range(cached):
        r = create_request(request_id=i + 1, num_tokens=n_tokens, max_tokens=1, block_size=BS)
        for name in block_names(r.all_token_ids, BS):
            c.store.put(name, parts)
    fill_s = time.perf_counter() - t0
    reqs = []
    for j in range(timed):
        # Even: a cached request's prompt again (a hit); odd: a prompt nobody cached.
        rid = (j // 2) % cached + 1 if j % 2 == 0 else 10_000_000 + j
        reqs.append(create_request(request_id=rid, num_tokens=n_tokens, max_tokens=1,
                                   block_size=BS))
    hits = 0
    lookup = 0.0
    t0 = time.perf_counter()
    for k, r in enumerate(reqs):
        t1 = time.perf_counter()
        n, _ = c.get_num_new_matched_tokens(r, 0)
        lookup += time.perf_counter() - t1
        hits += n > 0
        ids = list(range(k * (prompt_blocks + 1), (k + 1) * (prompt_blocks + 1)))
        c.update_state_after_alloc(r, _Blocks(ids), n)
        meta = c.build_connector_meta(_Out([_NewReq(r.request_id, ids)],
                                           {r.request_id: n_tokens - n}))
        c.request_finished(r, ids)
        c.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=CpHiCacheWorkerMeta(steps={meta.step: 1})))
    dt = time.perf_counter() - t0
    ps = c.planner_stats()
    # Every step's saves settled (the last verdict waits for a next step's metadata).
    assert ps["saves_rejected"] == 0 and ps["unsettled"] <= 1, ps
    return {"cached_requests": cached, "records": cached * prompt_blocks,
            "host_slots": c.host_slots, "host_admitted": ps["host_admitted"],
            "timed_requests": timed, "hits": hits, "fill_s": round(fill_s, 2),
            "us_per_request": round(dt / timed * 1e6, 1),
            "lookup_us_per_request": round(lookup / timed * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cached", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--timed", type=int, default=2000)
    ap.add_argument("--prompt-blocks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--host-bytes", type=int, default=None,
                    help="each worker's host tier (default: the connector's default)")
    a = ap.parse_args()
    for n in a.cached:
        print(bench(n, a.timed, a.prompt_blocks, a.layers, a.host_bytes), flush=True)


if __name__ == "__main__":
    main()
