"""Four ranks, each a process, agreeing through a torch.distributed gloo group: the rank API
an engine calls, with a fault injected on one rank that every rank rolls back."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import cp_hicache  # noqa: E402

RANKS = 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=60))
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=RANKS, layers=2)
    rc = cp_hicache.RankCache(
        dep, rank, dist.group.WORLD, device_pages=129, host_pages=64, backend="host"
    )
    log = {"peer_pools": rc.peer_pools, "group_kind": rc.group_kind, "steps": []}
    p1 = list(range(320))  # 20 pages over 4 owners
    p2 = p1[:160] + list(range(10_000, 10_160))

    def step(name, f):
        try:
            log["steps"].append([name, f(), None])
        except cp_hicache.CacheError as e:
            log["steps"].append([name, None, f"{type(e).__name__}: {e}"])

    step("cold", lambda: rc.serve(p1))
    step("device hit", lambda: rc.serve(p1))
    step("evict", lambda: rc.evict(1 << 30))
    step("loaded back", lambda: rc.serve(p1))
    if rank == RANKS - 1:
        rc.inject_launch_failure(3)  # the 4th serve call: p2 below
    before = (rc.all_digests(), rc.host_digest())
    step("failed on rank 3", lambda: rc.serve(p2))
    log["unchanged"] = (rc.all_digests(), rc.host_digest()) == before  # host pools too
    step("after the failure", lambda: rc.serve(p2))
    log["digests"] = rc.all_digests()
    log["pool_shape"] = list(rc.pool("mla_kv").shape)
    rc.check_invariants()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)
    dist.barrier()


def test_four_ranks_over_gloo_serve_verify_and_roll_back_together(tmp_path):
    mp.start_processes(_rank, args=(_port(), str(tmp_path)), nprocs=RANKS, start_method="spawn")
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    for r, log in enumerate(logs):
        assert log["group_kind"] == "torch.distributed"
        assert log["peer_pools"] == "shared-memory"
        assert log["pool_shape"] == [2, 33, 16 * 1152]  # ceil(129 / 4) local pages
        steps = {name: (ok, err) for name, ok, err in log["steps"]}
        assert steps["cold"][0]["computed_tokens"] == 320
        assert steps["device hit"][0]["device_hit_tokens"] == 320
        loaded = steps["loaded back"][0]
        assert loaded["host_hit_tokens"] == 320 and loaded["pages_loaded"] == 20
        for name in ("cold", "device hit", "loaded back", "after the failure"):
            assert steps[name][0]["mismatched_tokens"] == 0, (r, name)
        ok, err = steps["failed on rank 3"]
        assert ok is None
        if r == 3:
            assert "injected" in err, err
        else:
            assert "rank 3 failed" in err, err  # every peer names the rank that failed
        assert log["unchanged"], r  # rolled back everywhere
    assert len({tuple(log["digests"]) for log in logs}) == 1
    assert len(set(logs[0]["digests"])) == 1  # every rank's replica agrees
