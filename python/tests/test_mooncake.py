"""The storage tier over a real Mooncake Store (issue 44): a master started from the wheel
on loopback (mooncake_fixture), ranks writing records through `RankCache.attach_storage(
"mooncake://...")`, fresh caches of another CP degree reading them back verified, and a
record damaged in the store refused and counted."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

import numpy as np
import pytest

import cp_hicache
from mooncake_fixture import mooncake_master  # noqa: F401  (the fixture)
from mooncake_fixture import spawn_segment_holder

LAYERS = 2
PAGE = 16
PROMPTS = [np.arange(i * 1000, i * 1000 + 160, dtype=np.uint32) for i in range(3)]  # 10 pages


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _holder(master):
    """A client that holds the records: its segment outlives the writer processes (a
    client's segment, and the objects in it, leave the cluster with the client)."""
    from cp_hicache.mooncake import MooncakeStore

    return MooncakeStore(master.url, **master.options)


class Recording:
    """A MooncakeStore that remembers the names it wrote (to damage one)."""

    def __init__(self, inner):
        self.inner = inner
        self.names = []

    def put_object(self, name, data):
        self.names.append(name)
        return self.inner.put_object(name, data)

    def put_objects_from(self, names, addrs, sizes):
        self.names.extend(names)
        return self.inner.put_objects_from(names, addrs, sizes)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_mooncake_store_moves_whole_objects(mooncake_master):
    from cp_hicache.mooncake import parse_url

    s = _holder(mooncake_master)
    assert s.objects_exist(["a", "b"]) == [False, False]
    assert s.put_object("a", b"first") is True
    assert s.put_object("a", b"second") is False  # one writer: the first stays
    assert s.get_object("a") == b"first" and s.get_object("b") is None
    assert s.objects_exist(["a", "b"]) == [True, False]
    s.remove_object("a")
    s.remove_object("a")
    assert s.objects_exist(["a"]) == [False]
    s.close()
    with pytest.raises(cp_hicache.UsageError, match="mooncake://HOST:PORT"):
        parse_url("mooncake://nowhere")


def test_one_failed_object_of_a_batch_fails_alone(mooncake_master):
    """An object whose put or get fails in a batch is answered by an exception instance in
    its place (not raised): the batch's others are written, counted for usage, and read."""
    from cp_hicache.mooncake import MooncakeError

    s = _holder(mooncake_master)
    real = s._store

    class SecondFails:
        """The engine, whose second object of each batch call fails."""

        def __getattr__(self, name):
            return getattr(real, name)

        def batch_put_from(self, keys, addrs, sizes):
            rcs = real.batch_put_from(keys[:1] + keys[2:], addrs[:1] + addrs[2:],
                                      sizes[:1] + sizes[2:])
            return list(rcs[:1]) + [-1] + list(rcs[1:])

        def batch_get_into(self, keys, addrs, sizes):
            return list(real.batch_get_into(keys, addrs, sizes)[:1]) + [-1] * (len(keys) - 1)

    s._store = SecondFails()
    src = np.arange(300, dtype=np.uint8)
    dst = np.zeros(300, dtype=np.uint8)
    names = ["x0", "x1", "x2"]
    got = s.put_objects_from(names, [[src.ctypes.data + 100 * i] for i in range(3)], [[100]] * 3)
    assert got[0] is True and isinstance(got[1], MooncakeError) and got[2] is True, got
    assert s.objects_exist(names) == [True, False, True]
    assert sorted(s._put_sizes) == ["x0", "x2"]
    got = s.get_objects_into(["x0", "x2"], [[dst.ctypes.data], [dst.ctypes.data + 200]],
                             [[100], [100]])
    assert got[0] == 100 and isinstance(got[1], MooncakeError), got
    assert dst[:100].tobytes() == src[:100].tobytes()
    s._store = real
    s.close()


def test_a_put_answered_short_counts_the_unanswered_objects_failed(mooncake_master):
    """An engine answering fewer put codes than objects: every object of the call is an
    error (which of them it wrote is unknown), none counted as written."""
    from cp_hicache import _native
    from cp_hicache.mooncake import MooncakeError

    s = _holder(mooncake_master)
    real = s._store

    class Short:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_put_from(self, keys, addrs, sizes):
            return list(real.batch_put_from(keys, addrs, sizes))[:1]

        def batch_put_from_multi_buffers(self, keys, addrs, sizes):
            return list(real.batch_put_from_multi_buffers(keys, addrs, sizes))[:1]

    s._store = Short()
    src = np.arange(300, dtype=np.uint8)
    got = s.put_objects_from(["s0", "s1", "s2"], [[src.ctypes.data + 100 * i] for i in range(3)],
                             [[100]] * 3)
    # Which objects the answer leaves out is unknown: none counts as written.
    assert all(isinstance(g, MooncakeError) for g in got), got
    assert "unanswered" in str(got[1])
    assert s._put_sizes == {}
    # Through the page store: every record of the batch failed, none counted written.
    page = 4096
    buf = np.zeros(3 * page, dtype=np.uint8)
    ps = _native.PageStore.over(s, "short-answers", page)
    with pytest.raises(cp_hicache.UsageError, match="unanswered"):
        ps.put_many([f"p{i}" for i in range(3)], [[(buf.ctypes.data + i * page, page)]
                                                  for i in range(3)])
    assert ps.stats()["records_written"] == 0
    s._store = real
    s.close()


def test_an_empty_reply_of_an_object_that_is_there_is_a_failed_read(mooncake_master):
    """On the bytes path Mooncake's `get` answers b"" both for a key it does not hold and
    for a read that failed; it holds no empty object. An empty reply for an object that is
    there is a failed read (an error in its place, the batch's others read), not a miss;
    for one that is not there, a miss."""
    from cp_hicache import _native
    from cp_hicache.mooncake import MooncakeError, MooncakeStore

    store = MooncakeStore(mooncake_master.url, **mooncake_master.options, zero_copy=False)
    page = 4096
    ps = _native.PageStore.over(store, "empty-reply", page)
    src = np.random.default_rng(3).integers(0, 256, size=2 * page, dtype=np.uint8)
    dst = np.zeros_like(src)
    at = lambda a, i: [(a.ctypes.data + i * page, page)]  # noqa: E731
    assert ps.put_many(["a", "b"], [at(src, 0), at(src, 1)]) == [True, True]
    objects = list(store._put_sizes)
    real = store._store

    class LosesB:
        def __getattr__(self, name):
            return getattr(real, name)

        def get(self, name):
            return b"" if name == objects[1] else real.get(name)

    store._store = LosesB()
    with pytest.raises(MooncakeError, match="empty reply"):
        store.get_object(objects[1])
    assert store.get_object("absent") is None
    got = store.get_objects_into([objects[0], objects[1], "absent"],
                                 [[dst.ctypes.data]] * 3, [[page + 64]] * 3)
    assert got[0] == page + 64 and isinstance(got[1], MooncakeError) and got[2] is None, got
    with pytest.raises(cp_hicache.UsageError, match="empty reply"):
        ps.get_many(["a", "b"], [at(dst, 0), at(dst, 1)])
    st = ps.stats()
    assert st["misses"] == 0 and st["refused_torn"] == 0, st
    store._store = real
    assert ps.get_many(["a", "b"], [at(dst, 0), at(dst, 1)]) == [True, True]
    assert np.array_equal(src, dst)
    store.close()


class Removals:
    """A MooncakeStore that remembers its removals: ``("one", 1)`` per ``remove_object``,
    ``("batch", len(names))`` per ``remove_objects``."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def remove_object(self, name):
        self.calls.append(("one", 1))
        return self.inner.remove_object(name)

    def remove_objects(self, names):
        self.calls.append(("batch", len(names)))
        return self.inner.remove_objects(names)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _writer(
    rank: int, port: int, url: str, options: dict, out: str, layout: dict, prompts=None
) -> None:
    import torch.distributed as dist

    from cp_hicache.mooncake import MooncakeStore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=2, layers=LAYERS, **layout)
    rc = cp_hicache.RankCache(
        dep, rank, dist.group.WORLD, device_pages=64, host_pages=64, backend="host"
    )
    # Writers contribute no memory: the records go to the holder's segment.
    store = Removals(MooncakeStore(url, **dict(options, segment_bytes=0)))
    rc.attach_storage(store)
    stats = [rc.serve(p) for p in (PROMPTS if prompts is None else prompts)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"stats": stats, "removals": store.calls}, f)
    dist.barrier()
    rc.close()


def _read_back(master, prompts) -> None:
    """A fresh CP 1 cache reads every page of ``prompts`` back from the store, verified."""
    pages = sum(len(p) for p in prompts) // PAGE
    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=1, layers=LAYERS)
    rc = cp_hicache.RankCache(dep, device_pages=2 * pages, host_pages=2 * pages, backend="host")
    rc.attach_storage(master.url, options=dict(master.options, segment_bytes=0))
    for p in prompts:
        s = rc.serve(p)
        assert s["storage_hit_tokens"] == len(p) and s["storage_records_read"] == len(p) // PAGE, s
        assert s["mismatched_tokens"] == 0, s
    rc.close()


def _written(out, ranks=2):
    """The writers' stats, and the records they wrote, summed."""
    runs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    for run in runs:
        assert all(s["mismatched_tokens"] == 0 for s in run["stats"]), run
    return runs, sum(s["storage_records_written"] for run in runs for s in run["stats"])


@pytest.mark.parametrize("layout", [
    {},
    # vLLM's decode-CP layout: each rank holds runs of 4 tokens of every page, so each
    # record is written as two parts, and the writer of the last one assembles it.
    {"layout": "token-interleave", "interleave_size": 4},
], ids=["zigzag", "token-interleave"])
def test_cp2_rank_processes_write_and_a_fresh_cp1_cache_reads_back(
    mooncake_master, tmp_path, layout
):
    """Two rank processes at CP 2 write every record (zigzag: each whole, by its page's
    owner; token-interleave: in two parts, one per rank, assembled without a lock by the
    writer of the last); a fresh CP 1 cache reads every page back, byte for byte."""
    pytest.importorskip("torch")
    import torch.multiprocessing as mp

    holder = _holder(mooncake_master)
    mp.start_processes(
        _writer,
        args=(_port(), mooncake_master.url, mooncake_master.options, str(tmp_path), layout),
        nprocs=2, start_method="spawn",
    )
    _, written = _written(tmp_path)
    # Every page once: whole, by its owner; in parts, by the writer whose removal of the
    # record's part 0 claims its assembly (two that see its parts complete at once).
    assert written == 30, written

    _read_back(mooncake_master, PROMPTS)
    holder.close()


def test_records_in_parts_complete_in_one_batch_each_from_two_writers(
    mooncake_master, tmp_path
):
    """Token-interleave at CP 2, prompts of 32 pages: each rank writes its part of a
    request's 32 records in one batch, and the batch that completes records claims them
    all in one ``batch_remove`` of their part 0 (and clears their other parts in one more),
    never one removal per record; the two writers racing for the same records, each
    record is still put and counted once, and read back whole."""
    pytest.importorskip("torch")
    import torch.multiprocessing as mp

    prompts = [np.arange(i * 5000, i * 5000 + 32 * PAGE, dtype=np.uint32) for i in range(2)]
    holder = _holder(mooncake_master)
    mp.start_processes(
        _writer,
        args=(_port(), mooncake_master.url, mooncake_master.options, str(tmp_path),
              {"layout": "token-interleave", "interleave_size": 4}, prompts),
        nprocs=2, start_method="spawn",
    )
    runs, written = _written(tmp_path)
    assert written == 64, written
    removals = [tuple(c) for run in runs for c in run["removals"]]
    # Per request and writer at most two batches (the claims, the other parts); the
    # records of a request complete together: some batch claims several.
    assert all(sum(1 for c in run["removals"] if c[0] == "batch") <= 2 * len(prompts)
               for run in runs), removals
    assert max(n for kind, n in removals if kind == "batch") >= 2, removals
    # A single removal is a part read as damaged (read while the other writer, which
    # claimed its record, cleared it), removed again: at most one a part written.
    assert sum(1 for kind, _ in removals if kind == "one") <= 2 * written, removals

    _read_back(mooncake_master, prompts)
    holder.close()


def test_a_record_damaged_in_mooncake_is_refused_and_counted(mooncake_master):
    from cp_hicache.mooncake import MooncakeStore

    holder = _holder(mooncake_master)
    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=1, layers=LAYERS)
    store = Recording(
        MooncakeStore(mooncake_master.url, **dict(mooncake_master.options, segment_bytes=0))
    )
    first = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    first.attach_storage(store)
    assert first.serve(PROMPTS[0])["storage_records_written"] == 10
    first.close()
    assert len(store.names) == 10
    # Page 5's record: one payload byte flipped, put back under its key.
    damaged = bytearray(store.get_object(store.names[5]))
    damaged[100] ^= 0xFF
    store.damage(store.names[5], bytes(damaged))

    rc = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    rc.attach_storage(store)
    s = rc.serve(PROMPTS[0])
    # The first five pages read back, the damaged sixth refused (the rest recomputed).
    assert s["storage_records_read"] == 5 and s["storage_hit_tokens"] == 80, s
    assert s["storage_refused_checksum"] == 1, s
    assert s["computed_tokens"] == 80 and s["mismatched_tokens"] == 0, s
    rc.close()
    holder.close()


def test_the_master_killed_mid_run_degrades_to_recompute(mooncake_master):
    """The master gone: the next request's storage calls fail (counted as I/O errors) and
    it is computed and verified, in seconds, not hung."""
    import signal
    import time

    from cp_hicache.mooncake import MooncakeStore

    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=1, layers=LAYERS)
    rc = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    rc.attach_storage(MooncakeStore(mooncake_master.url, **mooncake_master.options))
    assert rc.serve(PROMPTS[0])["storage_records_written"] == 10
    os.kill(mooncake_master.pid, signal.SIGKILL)
    t = time.monotonic()
    s = rc.serve(PROMPTS[1])
    assert time.monotonic() - t < 60
    assert s["computed_tokens"] == 160 and s["mismatched_tokens"] == 0, s
    assert s["storage_io_errors"] >= 1 and s["storage_records_written"] == 0, s
    rc.close()


def test_batches_and_usage_counts_what_this_client_put(mooncake_master):
    """`PageStore.put_many`/`get_many` over a MooncakeStore (one batch_put_from and one
    batch_get_into of the records, at the page store's addresses), byte for byte; `usage` reports the bytes of
    the records this client put and the cluster still holds; an object longer than a
    record under a record's name is refused (not read) and counted."""
    from cp_hicache import _native
    from cp_hicache.mooncake import MooncakeStore

    store = MooncakeStore(mooncake_master.url, **mooncake_master.options)
    page = 4096
    ps = _native.PageStore.over(store, "usage-test", page)
    src = np.random.default_rng(1).integers(0, 256, size=8 * page, dtype=np.uint8)
    dst = np.zeros_like(src)
    names = [f"page-{i}" for i in range(8)]
    at = lambda a, i: [(a.ctypes.data + i * page, page)]  # noqa: E731
    assert ps.put_many(names, [at(src, i) for i in range(8)]) == [True] * 8
    assert ps.put_many(names[:2], [at(src, i) for i in range(2)]) == [True] * 2  # there
    st = ps.stats()
    assert st["records_written"] == 8 and st["already_present"] == 2, st
    assert st["usage_bytes"] == 8 * (64 + page), st
    assert ps.get_many(names + ["absent"], [at(dst, i) for i in range(8)] + [at(dst, 0)]) == (
        [True] * 8 + [False]
    )
    assert np.array_equal(src, dst)
    # Another client removes two records: this one no longer counts them.
    other = MooncakeStore(mooncake_master.url, **dict(mooncake_master.options, segment_bytes=0))
    objects = [n for n in store._put_sizes]
    other.remove_object(objects[0])
    other.remove_object(objects[1])
    assert ps.stats()["usage_bytes"] == 6 * (64 + page)
    # A longer object under a record's name: refused, counted, removed.
    other.damage(objects[2], b"x" * (2 * page))
    got = ps.get_many(names, [at(dst, i) for i in range(8)])
    assert got.count(False) == 3, got
    st = ps.stats()
    assert st["refused_checksum"] == 1 and st["misses"] == 3, st
    assert other.objects_exist([objects[2]]) == [False]
    other.close()
    store.close()


def test_large_records_go_as_their_header_and_the_page_in_place(mooncake_master):
    """Records of 512 KiB of payload or more are put as two buffers each, their header and
    the page in place (`batch_put_from_multi_buffers`: nothing copied), and read back so
    (`batch_get_into_multi_buffers`: the payload straight into the caller's memory,
    checked there), byte for byte, in one buffer per page and in several; a damaged one is
    refused. The stored bytes are a record built whole."""
    from cp_hicache import _native
    from cp_hicache.mooncake import MooncakeStore

    store = MooncakeStore(mooncake_master.url, **mooncake_master.options)
    assert store.gathers_puts is True
    store._store = calls = _Calls(store._store)
    page = 512 << 10
    ps = _native.PageStore.over(store, "in-place", page)
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, size=4 * page, dtype=np.uint8)
    dst = np.zeros_like(src)

    def parts(a, i):  # pages 0-1 in one buffer, 2-3 in two
        base = a.ctypes.data + i * page
        return [(base, page)] if i < 2 else [(base, 1000), (base + 1000, page - 1000)]

    names = [f"page-{i}" for i in range(4)]
    assert ps.put_many(names, [parts(src, i) for i in range(4)]) == [True] * 4
    assert ps.get_many(names, [parts(dst, i) for i in range(4)]) == [True] * 4
    assert np.array_equal(src, dst)
    used = set(calls.names)
    assert {"batch_put_from_multi_buffers", "batch_get_into_multi_buffers"} <= used, used
    assert not used & {"batch_put_from", "batch_get_into"}, used
    # What is stored is the record whole: 64 bytes of header, then the page.
    obj = next(iter(store._put_sizes))
    raw = store.get_object(obj)
    assert len(raw) == 64 + page and raw[:8] == b"CPHCPAGE"
    bad = bytearray(raw)
    bad[64 + 12345] ^= 1
    store.damage(obj, bytes(bad))
    assert ps.get_many(names, [parts(dst, i) for i in range(4)]).count(False) == 1
    assert ps.stats()["refused_checksum"] == 1
    store.close()


CP8_ARGS = ["--model", "mla", "--page-size", "64", "--layers", "2", "--conversations", "6"]


@pytest.fixture(scope="module")
def cp8_records(tmp_path_factory):
    """`python -m cp_hicache.replay --storage mooncake://...`: eight rank processes at CP 8
    write the records (contributing no memory: a holder client keeps them) into a master of
    this module's, once, for the readers of other CP degrees. Yields the storage URL."""
    pytest.importorskip("torch")
    from conftest import launch
    from mooncake_fixture import mooncake_master_binary, start_master, stop_master

    tmp = tmp_path_factory.mktemp("cp8")
    proc, master = start_master(mooncake_master_binary(), tmp / "mooncake_master.log")
    try:
        holder = _holder(master)
        url = (f"{master.url}?metadata_server="
               f"{master.options['metadata_server']}&segment_bytes=0&buffer_bytes=4194304")
        w = launch(["--ranks", "8", "--cp", "8", *CP8_ARGS, "--storage", url,
                    "--json", str(tmp / "w.json")])
        assert w.returncode == 0, w.stderr[-3000:]
        wj = json.loads((tmp / "w.json").read_text())
        assert wj["storage_records_written"] > 0 and wj["mismatched_tokens"] == 0, wj
        yield url
        holder.close()
    finally:
        stop_master(proc)


def _replay_reads_back(url, tmp_path, ranks):
    """A fresh `python -m cp_hicache.replay` of the same workload at CP `ranks`, one
    process per rank, over the CP 8 records: storage hits, every one a whole record read
    and verified, nothing refused, 0 mismatches."""
    from conftest import launch

    r = launch(["--ranks", str(ranks), "--cp", str(ranks), *CP8_ARGS, "--storage", url,
                "--json", str(tmp_path / "r.json")])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{ranks} processes, torch.distributed group" in r.stdout, r.stdout
    rj = json.loads((tmp_path / "r.json").read_text())
    assert rj["storage_hit_tokens"] > 0 and rj["mismatched_tokens"] == 0, rj
    assert rj["storage_records_read"] * 64 == rj["storage_hit_tokens"], rj
    assert rj["storage_refused_checksum"] == 0 and rj["storage_refused_torn"] == 0, rj
    assert rj["storage_refused_fingerprint"] == 0 and rj["storage_io_errors"] == 0, rj
    return rj


def test_a_cp8_replay_writes_and_fresh_cp4_rank_processes_read_back(cp8_records, tmp_path):
    """Four fresh rank processes at CP 4 read the CP 8 records back with storage hits and
    0 mismatches."""
    _replay_reads_back(cp8_records, tmp_path, 4)


def test_a_cp8_replay_writes_and_a_fresh_cp1_process_reads_back(cp8_records, tmp_path):
    """One fresh rank process at CP 1 (the whole sequence on one rank) reads the CP 8
    records back with storage hits and 0 mismatches."""
    _replay_reads_back(cp8_records, tmp_path, 1)


def test_the_rust_cli_replay_says_it_reaches_mooncake_only_through_python(tmp_path, binary):
    """The launcher's checks pass a mooncake:// store; the in-process CLI, which has no
    Python, refuses it (exit status 2) naming the launcher, and makes no directory."""
    import subprocess

    from cp_hicache import _native

    args = ["--model", "mla", "--page-size", "64", "--layers", "2", "--conversations", "2",
            "--storage", "mooncake://127.0.0.1:1"]
    status, text, ranks, _ = _native.check_replay(["--ranks", "1", "--cp", "1", *args])
    assert status is None, text
    out = subprocess.run([str(binary), "replay", "--cp", "2", *args, "-q"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "only through Python (python -m cp_hicache.replay" in out.stderr
    assert not any(tmp_path.iterdir())


LAYERS_BIG = 16


def test_two_client_processes_contribute_segments(mooncake_master, tmp_path):
    """Two holder processes each contribute a 24 MiB segment; a writer contributing none
    writes more records than one segment holds, so both hold some; a fresh reader reads
    every page back. When one holder leaves, its records go with it: the reader's misses
    are computed and verified, never served wrong."""
    import subprocess

    from cp_hicache.mooncake import MooncakeStore

    holders = [
        spawn_segment_holder(mooncake_master.url, mooncake_master.options["metadata_server"],
                             24 << 20, buffer_bytes=4 << 20)
        for _ in range(2)
    ]
    try:
        for h in holders:
            assert h.stdout.readline().strip() == "ready"
        opts = dict(mooncake_master.options, segment_bytes=0)
        # 120 records of about 300 KB: more than one segment holds, 3/4 of both.
        dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=1, layers=LAYERS_BIG)
        prompts = [np.arange(i * 5000, i * 5000 + 640, dtype=np.uint32) for i in range(3)]
        store = Recording(MooncakeStore(mooncake_master.url, **opts))
        w = cp_hicache.RankCache(dep, device_pages=256, host_pages=256, backend="host")
        w.attach_storage(store)
        stats = [w.serve(p) for p in prompts]
        w.close()
        assert sum(s["storage_records_written"] for s in stats) == 120, stats
        assert 24 << 20 < sum(s["storage_bytes_written"] for s in stats) < 40 << 20, stats
        r = cp_hicache.RankCache(dep, device_pages=256, host_pages=256, backend="host")
        r.attach_storage(store)
        s = r.serve(prompts[0])
        assert s["storage_hit_tokens"] == 640 and s["mismatched_tokens"] == 0, s
        r.close()
        # One holder leaves, and its segment's records with it; the other's stay.
        holders[0].stdin.close()
        holders[0].wait(timeout=60)
        left = sum(store.objects_exist(store.names))
        assert 0 < left < 120, left
        r = cp_hicache.RankCache(dep, device_pages=256, host_pages=256, backend="host")
        r.attach_storage(store)
        got = [r.serve(p) for p in prompts]
        r.close()
        hits = sum(s["storage_hit_tokens"] for s in got)
        assert all(s["mismatched_tokens"] == 0 for s in got), got
        assert sum(s["computed_tokens"] for s in got) == 3 * 640 - hits, got
    finally:
        for h in holders:
            if h.poll() is None:
                h.stdin.close()
                try:
                    h.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    h.kill()
                    h.wait()


def test_the_master_restarted_under_a_running_client_is_used_again(mooncake_master, tmp_path):
    """The master killed: requests fail their storage calls (counted I/O errors, a clear
    error naming the master) and are computed, in seconds; started again on its ports, the
    same client (the same RankCache) writes and reads records again."""
    import signal
    import time

    from cp_hicache.mooncake import MooncakeError, MooncakeStore
    from mooncake_fixture import mooncake_master_binary, restart_master, stop_master

    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=1, layers=LAYERS)
    store = MooncakeStore(mooncake_master.url, **mooncake_master.options)
    rc = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    rc.attach_storage(store)
    assert rc.serve(PROMPTS[0])["storage_records_written"] == 10
    os.kill(mooncake_master.pid, signal.SIGKILL)
    t = time.monotonic()
    s = rc.serve(PROMPTS[1])
    assert time.monotonic() - t < 60
    assert s["computed_tokens"] == 160 and s["mismatched_tokens"] == 0, s
    assert s["storage_io_errors"] >= 1 and s["storage_records_written"] == 0, s
    with pytest.raises(MooncakeError, match=mooncake_master.url.split("//")[1]):
        store.objects_exist(["x"])
    assert store.usage() > 0  # the last count, not an error, while the master is down
    proc = restart_master(
        mooncake_master_binary(), mooncake_master, tmp_path / "mooncake_master.log"
    )
    try:
        # The same client, the same RankCache, unchanged (no new cache, no new attach),
        # finds the new master: fresh prompts (each new to this cache, so each is looked up
        # in and written to the store) until one is written whole.
        fresh_prompts = (np.arange(50_000 + i * 1000, 50_000 + i * 1000 + 160, dtype=np.uint32)
                         for i in range(1000))
        deadline = time.monotonic() + 60
        while True:
            written = next(fresh_prompts)
            s = rc.serve(written)
            if s["storage_records_written"] == 10 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert s["storage_records_written"] == 10 and s["mismatched_tokens"] == 0, s
        # ...and reads: records another client wrote to the restarted master are storage
        # hits of this same RankCache.
        other_store = MooncakeStore(mooncake_master.url, **mooncake_master.options)
        other = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
        other.attach_storage(other_store)
        theirs = np.arange(90_000, 90_160, dtype=np.uint32)
        assert other.serve(theirs)["storage_records_written"] == 10
        s = rc.serve(theirs)
        assert s["storage_hit_tokens"] == 160 and s["storage_records_read"] == 10, s
        assert s["mismatched_tokens"] == 0 and s["storage_io_errors"] == 0, s
        # What this RankCache wrote after the restart is read back by the other client.
        s = other.serve(written)
        assert s["storage_hit_tokens"] == 160 and s["mismatched_tokens"] == 0, s
        other.close()
        rc.close()
        other_store.close()
        store.close()
    finally:
        stop_master(proc)


class _Calls:
    """Mooncake's client, its calls counted by name."""

    def __init__(self, inner):
        self.inner, self.names = inner, []

    def __getattr__(self, name):
        f = getattr(self.inner, name)

        def call(*args):
            self.names.append(name)
            return f(*args)

        return call


def test_the_bytes_path_of_other_transports_round_trips_byte_for_byte(mooncake_master):
    """Transports other than TCP cannot read this process's memory at any address, so
    `MooncakeStore` moves their objects through `put`/`get` of bytes: forced here over TCP
    (`zero_copy=False`). The page store's batches of pages in one buffer and in several,
    and the store's own calls with several buffers per object (joined on put, scattered
    on get), round-trip byte for byte through Mooncake's `put` and `get` only; a longer
    object is not read, a damaged record is refused."""
    from cp_hicache import _native
    from cp_hicache.mooncake import MooncakeStore

    store = MooncakeStore(mooncake_master.url, **mooncake_master.options, zero_copy=False)
    assert store.zero_copy is False
    store._store = calls = _Calls(store._store)
    page = 4096
    ps = _native.PageStore.over(store, "bytes-path", page)
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, size=6 * page, dtype=np.uint8)
    dst = np.zeros_like(src)

    def parts(a, i):  # pages 0-2 in one buffer, 3-5 in three of uneven sizes
        base = a.ctypes.data + i * page
        if i < 3:
            return [(base, page)]
        return [(base, 1000), (base + 1000, 3000), (base + 4000, page - 4000)]

    names = [f"page-{i}" for i in range(6)]
    assert ps.put_many(names, [parts(src, i) for i in range(6)]) == [True] * 6
    assert ps.stats()["records_written"] == 6
    assert ps.put_many(names[:1], [parts(src, 0)]) == [True]
    assert ps.stats()["already_present"] == 1
    assert ps.get_many(names, [parts(dst, i) for i in range(6)]) == [True] * 6
    assert np.array_equal(src, dst)
    dst[:] = 0
    assert ps.get(names[4], parts(dst, 4)) and ps.put("page-6", parts(src, 5))
    assert np.array_equal(src[4 * page : 5 * page], dst[4 * page : 5 * page])

    # The store's own calls, several buffers per object.
    a = rng.integers(0, 256, size=300, dtype=np.uint8)
    b = np.zeros(400, dtype=np.uint8)
    addr = lambda x, at: x.ctypes.data + at  # noqa: E731
    assert store.put_objects_from(["raw"], [[addr(a, 0), addr(a, 100)]], [[100, 200]]) == [True]
    assert store.get_object("raw") == a.tobytes()
    got = store.get_objects_into(
        ["raw", "absent"], [[addr(b, 0), addr(b, 250)], [addr(b, 0)]], [[250, 150], [10]]
    )
    assert got == [300, None] and b[:300].tobytes() == a.tobytes() and not b[300:].any()
    b[:] = 0
    assert store.get_objects_into(["raw"], [[addr(b, 0)]], [[299]]) == [300]  # not read
    assert not b.any()
    used = set(calls.names)
    assert {"put", "get"} <= used, used
    assert not used & {"batch_put_from", "batch_get_into", "batch_put_from_multi_buffers",
                       "batch_get_into_multi_buffers"}, used

    # A damaged record through the bytes path: refused, counted.
    obj = next(n for n in store._put_sizes if n.startswith("cp-hicache/"))
    bad = bytearray(store.get_object(obj))
    bad[200] ^= 1
    store.damage(obj, bytes(bad))
    assert ps.get_many(names, [parts(dst, i) for i in range(6)]).count(False) == 1
    assert ps.stats()["refused_checksum"] == 1
    store.close()


GROUP_TIMEOUT_S = 10


def _rank_under_a_killed_master(rank: int, port: int, url: str, options: dict, out: str) -> None:
    """One CP 2 rank process (gloo group, a short timeout): reads PROMPTS[0] from storage,
    then, once the test has killed the master, serves PROMPTS[1] (its records are in the
    store, never in this cache) and asks the store itself."""
    import time

    import torch.distributed as dist

    from cp_hicache.mooncake import MooncakeError, MooncakeStore

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=2, layers=LAYERS)
    rc = cp_hicache.RankCache(
        dep, rank, dist.group.WORLD, device_pages=64, host_pages=64, backend="host"
    )
    store = MooncakeStore(url, **dict(options, segment_bytes=0))
    rc.attach_storage(store)
    before = rc.serve(PROMPTS[0])
    dist.barrier()
    if rank == 0:
        open(os.path.join(out, "ready"), "w").close()
    while not os.path.exists(os.path.join(out, "killed")):
        time.sleep(0.05)
    after = rc.serve(PROMPTS[1])
    try:
        store.objects_exist(["x"])
        error = None
    except MooncakeError as e:
        error = str(e)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"before": before, "after": after, "error": error}, f)
    dist.barrier()
    rc.close()
    # Without the store's teardown, which with the master gone waits out its retries.
    os._exit(0)


def test_the_master_killed_under_a_cp2_group_of_rank_processes_degrades_to_recompute(
    mooncake_master, tmp_path
):
    """Two rank processes at CP 2 (gloo, a 10 s group timeout) read a prompt's records from
    Mooncake; the master is killed; their next request, whose records are in the store, is
    a storage miss on both ranks, computed and verified (counted I/O errors, nothing
    written), with the group intact although the request's failing storage calls take
    longer than the group timeout: no rank waits it out in a collective (one that did would
    raise CpGroupError and fail its rank). The store's error names the master."""
    pytest.importorskip("torch")
    import signal
    import time

    import torch.multiprocessing as mp

    # The records' segment is another process's (stopped by its pid at the end): a
    # client closed with its master gone waits out the master's retries (about 20 s).
    holder = spawn_segment_holder(mooncake_master.url, mooncake_master.options["metadata_server"],
                                  64 << 20, buffer_bytes=4 << 20)
    assert holder.stdout.readline().strip() == "ready"
    dep = cp_hicache.Deployment(model="mla", page_size=PAGE, cp=1, layers=LAYERS)
    w = cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")
    w.attach_storage(mooncake_master.url, options=dict(mooncake_master.options, segment_bytes=0))
    assert sum(w.serve(p)["storage_records_written"] for p in PROMPTS[:2]) == 20
    w.close()

    ctx = mp.start_processes(
        _rank_under_a_killed_master,
        args=(_port(), mooncake_master.url, mooncake_master.options, str(tmp_path)),
        nprocs=2, start_method="spawn", join=False,
    )
    try:
        while not (tmp_path / "ready").exists():
            assert all(p.is_alive() for p in ctx.processes), "a rank ended before the kill"
            time.sleep(0.05)
        os.kill(mooncake_master.pid, signal.SIGKILL)
        (tmp_path / "killed").touch()
        # Bounds a hang of the test itself; a rank stuck in a collective fails at the
        # group timeout, well before.
        deadline = time.monotonic() + 300
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the rank processes hung"
    finally:
        holder.kill()
        holder.wait()
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:
        b, a = g["before"], g["after"]
        assert b["storage_hit_tokens"] == 160 and b["mismatched_tokens"] == 0, b
        assert a["storage_hit_tokens"] == 0 and a["computed_tokens"] == 160, a
        assert a["mismatched_tokens"] == 0 and a["storage_records_written"] == 0, a
        assert g["error"] and mooncake_master.url.split("//")[1] in g["error"], g
    assert sum(g["after"]["storage_io_errors"] for g in got) >= 1, got
