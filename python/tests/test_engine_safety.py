"""The step API over a real gloo group, one process per rank, as an engine drives it: a rank
that cannot start fails its peers at once; ranks that disagree (prompts, settings) are caught
at the step where they differ; a forward that failed on one rank becomes an abandon on every
rank; a failure that needs evictions is rolled back on every rank, host pools included;
``close`` and the context manager leave the group together."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import cp_hicache  # noqa: E402

#: The group timeout: a peer that waited for it instead of failing fast would show.
TIMEOUT_S = 60


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT_S))


def _dep(size: int, **kw) -> cp_hicache.Deployment:
    return cp_hicache.Deployment(model="mla", page_size=16, cp=size, layers=2, **kw)


def _error(e: BaseException) -> list:
    return [type(e).__name__, str(e)]


def _run(target, size: int, tmp_path, *args) -> list:
    mp.start_processes(target, args=(size, _port(), str(tmp_path), *args), nprocs=size,
                       start_method="spawn")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]


def _save(out: str, rank: int, log: dict) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(log, f)


def _bad_tuning_rank(rank: int, size: int, port: int, out: str) -> None:
    _join(rank, size, port)
    log = {}
    tuning = None
    if rank == 1:
        tuning = os.path.join(out, "tuning.json")
        with open(tuning, "w") as f:
            f.write("{ not json")
    start = time.monotonic()
    try:
        cp_hicache.RankCache(_dep(size), rank, dist.group.WORLD, device_pages=65,
                             host_pages=32, backend="host", tuning=tuning)
        log["error"] = None
    except (cp_hicache.CacheError, ValueError) as e:
        log["error"] = _error(e)
    log["seconds"] = time.monotonic() - start
    _save(out, rank, log)


def test_a_rank_that_cannot_start_fails_its_peers_at_once(tmp_path):
    """Rank 1's tuning file is not JSON: it raises its own UsageError, and rank 0, which was
    about to wait in the start-up round for the group timeout, raises GroupError naming rank 1
    and the reason within seconds."""
    logs = _run(_bad_tuning_rank, 2, tmp_path)
    kind, message = logs[1]["error"]
    assert kind == "UsageError" and "tuning" in message, logs[1]
    kind, message = logs[0]["error"]
    assert kind == "GroupError", logs[0]
    assert "the CP group cannot start: rank 1 failed: could not start" in message, message
    assert "tuning" in message, message
    assert logs[0]["seconds"] < 20, logs[0]  # not the 60 s group timeout


def _differing_rank(rank: int, size: int, port: int, out: str, setting: str) -> None:
    _join(rank, size, port)
    kw = dict(device_pages=65, host_pages=32, backend="host")
    layout = "zigzag"
    if setting == "device_pages":
        kw["device_pages"] = 65 + rank
    else:
        layout = ["zigzag", "round-robin"][rank]
    try:
        cp_hicache.RankCache(_dep(size, layout=layout), rank, dist.group.WORLD, **kw)
        log = {"error": None}
    except (cp_hicache.CacheError, ValueError) as e:
        log = {"error": _error(e)}
    _save(out, rank, log)


@pytest.mark.parametrize(
    "setting, message",
    [
        ("device_pages", "device pages: rank 0 65, rank 1 66"),
        ("layout", "CP layout: rank 0 zigzag, rank 1 round-robin"),
    ],
)
def test_ranks_with_different_settings_refuse_to_start(tmp_path, setting, message):
    for log in _run(_differing_rank, 2, tmp_path, setting):
        kind, shown = log["error"]
        assert kind == "UsageError", log
        assert message in shown, shown


def _steps_rank(rank: int, size: int, port: int, out: str) -> None:
    _join(rank, size, port)
    log = {}
    with cp_hicache.RankCache(_dep(size), rank, dist.group.WORLD, device_pages=6 * size + 1,
                              host_pages=64, backend="host") as rc:
        shared = list(range(64))
        rc.serve(shared)
        before = rc.digest()
        # Different prompts: caught at the step, undone everywhere, and the group goes on.
        mine = shared if rank == 0 else list(range(1000, 1064))
        try:
            rc.begin(mine, allocate=True)
            log["diverged"] = None
        except cp_hicache.CacheError as e:
            log["diverged"] = _error(e)
        log["undone"] = rc.digest() == before
        log["after divergence"] = rc.serve(shared)["device_hit_tokens"]

        # Rank 1's forward fails: it ends the request with ok=False while rank 0 finishes.
        longer = shared + list(range(5000, 5040))
        req = rc.begin(longer, allocate=True)
        try:
            log["ended"] = rc.finish(req, ok=(rank != 1))
        except cp_hicache.CacheError as e:
            log["ended"] = _error(e)
        rc.check_invariants()
        log["digests agree"] = len(set(rc.all_digests())) == 1

        # A failure in a request that must evict (7 pages a rank; the cached prefixes hold
        # most of them) is rolled back on every rank with executors of their own: the
        # replicas agree afterwards, every host pool matches its tree, and what the failed
        # request evicted (and may have overwritten) is not served from the device again.
        rc.serve(longer)  # request 4
        if rank == 1:
            rc.inject_launch_failure(5)  # requests count serve and begin calls: the next one
        big = list(range(20_000, 20_000 + 16 * 10))  # 10 pages: evicts the cached prefixes
        try:
            rc.serve(big)
            log["failed"] = None
        except cp_hicache.CacheError as e:
            log["failed"] = _error(e)
        log["agree after rollback"] = len(set(rc.all_digests())) == 1
        rc.check_invariants()
        log["served after"] = rc.serve(big)["mismatched_tokens"]
        log["prefix after"] = rc.serve(longer)["mismatched_tokens"]
    try:
        rc.serve(shared)
        log["after close"] = None
    except cp_hicache.CacheError as e:
        log["after close"] = _error(e)
    log["closed"] = rc.closed
    _save(out, rank, log)
    dist.barrier()


def test_the_step_api_catches_divergence_and_agrees_on_how_requests_end(tmp_path):
    logs = _run(_steps_rank, 2, tmp_path)
    for r, log in enumerate(logs):
        kind, message = log["diverged"]
        assert kind == "DivergedError", (r, log)
        assert "request 1 begin+allocate" in message and "rank(s) 0 vs rank(s) 1" in message
        assert log["undone"] and log["after divergence"] == 64, (r, log)
        if r == 1:
            assert log["ended"] is None, log  # finish(ok=False) returns None
        else:
            kind, message = log["ended"]
            assert kind == "RequestAbandoned" and "rank(s) 1 could not finish it" in message
        assert log["digests agree"], (r, log)
        kind, message = log["failed"]
        assert "injected" in message or "rank 1 failed" in message, (r, log)
        assert log["agree after rollback"], (r, log)
        assert log["served after"] == 0 and log["prefix after"] == 0, (r, log)
        assert log["closed"] and log["after close"][0] == "CacheError", (r, log)
        assert "closed" in log["after close"][1]


def _layout_rank(rank: int, size: int, port: int, out: str, layout: str, run) -> None:
    _join(rank, size, port)
    log = {}
    dep = _dep(size, layout=layout, interleave_size=run)
    with cp_hicache.RankCache(dep, rank, dist.group.WORLD, device_pages=16 * size + size,
                              host_pages=64, backend="host") as rc:
        prompt = list(range(3 * 16 * size + 5))  # whole granules and a partial one
        first = rc.serve(prompt)
        # 15 granules of the 16 the pool has: evicts the prompt, which stays on the host.
        big = rc.serve(list(range(10_000, 10_000 + 15 * 16 * size)))
        again = rc.serve(prompt)
        log["mismatched"] = sum(s["mismatched_tokens"] for s in [first, big, again])
        log["host hit"] = again["host_hit_tokens"]
        req = rc.begin(prompt, allocate=True)
        owners, slots = rc.token_locations(req)
        log["owners"] = owners.tolist()
        log["pages"] = [int(p) for p in req.pages]
        rc.abandon(req)
        rc.check_invariants()
        log["digests agree"] = len(set(rc.all_digests())) == 1
    _save(out, rank, log)


@pytest.mark.parametrize("layout, run", [("page-interleave", None), ("token-interleave", 4)])
def test_interleaved_layouts_serve_verified_with_positional_owners(tmp_path, layout, run):
    size = 2
    logs = _run(_layout_rank, size, tmp_path, layout, run)
    tokens = 3 * 16 * size + 5
    per_run = run or 16
    for log in logs:
        assert log["mismatched"] == 0, log
        assert log["host hit"] == 3 * 16 * size, log
        assert log["digests agree"], log
        assert log["owners"] == [(t // per_run) % size for t in range(tokens)], log
        pages = log["pages"]
        assert len(pages) % size == 0
        # Aligned groups: granule g's pages are b*cp .. b*cp + cp - 1 for some b.
        for g in range(0, len(pages), size):
            base = pages[g] - pages[g] % size
            assert pages[g:g + size] == [base + r for r in range(size)], pages
