"""The Python face under hostile and careless input: every boundary defends itself with a
clear error, nothing hangs and nothing crashes. Cases that could hang or crash the
interpreter run in a subprocess with a timeout, so a regression fails instead of stalling."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest

import cp_hicache

DEP = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=2)


def make(**kw) -> cp_hicache.RankCache:
    args = dict(device_pages=64, host_pages=64, backend="host")
    args.update(kw)
    return cp_hicache.RankCache(DEP, **args)


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter; the last line of its stdout is its JSON verdict."""
    prelude = "import json, sys, numpy as np, cp_hicache\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout)


def verdict(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- Peer pools -----------------------------------------------------------------------------


def test_a_peer_view_never_reaches_outside_its_mapping():
    # A group that hands this rank its own handle for its peer: the view of "rank 1" is this
    # rank's own pool, of the same size, and reading its last byte is in bounds.
    out = run_isolated("""
        import torch
        class Echo:
            rank, size = 0, 2
            def exchange(self, what, payload, why):
                return [(what, payload, why)] * 2
        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=2, layers=2)
        rc = cp_hicache.RankCache(dep, 0, Echo(), device_pages=65, host_pages=16,
                                  backend="host")
        t = torch.from_dlpack(rc.pool("mla_kv", owner=1))
        last = int(t[-1, -1, -1])
        print(json.dumps({"shape": list(t.shape), "last": last}))
    """)
    v = verdict(out)
    assert v["shape"] == [2, 33, 16 * 1152] and v["last"] == 0xA5


# --- Re-entrancy, interrupts ----------------------------------------------------------------


def test_a_call_back_into_the_cache_from_exchange_is_refused_not_deadlocked():
    out = run_isolated("""
        class CallsBack:
            rank, size = 0, 1
            rc = None
            def exchange(self, what, payload, why):
                if self.rc is not None:
                    self.rc.digest()
                return [(what, payload, why)]
        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=1)
        g = CallsBack()
        rc = cp_hicache.RankCache(dep, 0, g, device_pages=32, host_pages=16, backend="host")
        g.rc = rc
        try:
            rc.serve(range(64))
            print(json.dumps({"error": None}))
        except cp_hicache.CacheError as e:
            print(json.dumps({"error": [type(e).__name__, str(e)]}))
    """, timeout=60)
    kind, message = verdict(out)["error"]
    assert kind == "GroupError", message
    assert "from inside its own group's exchange" in message, message


def test_an_interrupt_inside_exchange_propagates_as_itself():
    class Interrupts:
        rank, size = 0, 1
        armed = False

        def exchange(self, what, payload, why):
            if self.armed:
                raise KeyboardInterrupt
            return [(what, payload, why)]

    g = Interrupts()
    rc = cp_hicache.RankCache(DEP, 0, g, device_pages=32, host_pages=16, backend="host")
    g.armed = True
    with pytest.raises(KeyboardInterrupt):
        rc.serve(range(64))
    # The group is broken for good: nothing more is served on it.
    g.armed = False
    with pytest.raises(cp_hicache.GroupError):
        rc.serve(range(64))


def test_reads_never_wait_behind_a_step_in_a_round():
    """A step waiting on a slow peer holds the rank: `locate` and `pool` answer at once, and
    `digest` (meaningless mid-step) says so at once instead of waiting for the round."""
    import threading

    class Slow:
        rank, size = 0, 1
        delay = 0.0

        def exchange(self, what, payload, why):
            time.sleep(self.delay)
            return [(what, payload, why)]

    g = Slow()
    rc = cp_hicache.RankCache(DEP, 0, g, device_pages=32, host_pages=16, backend="host")
    g.delay = 3.0  # every round of the step takes 3 s
    step = threading.Thread(target=rc.serve, args=(range(64),))
    step.start()
    time.sleep(0.5)
    start = time.monotonic()
    owners, local = rc.locate([1, 2])
    assert rc.pool("mla_kv").shape[0] == 2
    with pytest.raises(cp_hicache.CacheError, match="a step is running"):
        rc.digest()
    assert time.monotonic() - start < 2.0, "a read waited behind the step's round"
    step.join()
    g.delay = 0.0
    assert rc.digest()


# --- Files and sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom"])
def test_a_tuning_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    path = kind
    if kind == "fifo":
        path = str(tmp_path / "tuning.json")
        os.mkfifo(path)
    out = run_isolated(f"""
        dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=1)
        try:
            cp_hicache.RankCache(dep, device_pages=32, host_pages=16, backend="host",
                                 tuning={path!r})
            print(json.dumps({{"error": None}}))
        except cp_hicache.UsageError as e:
            print(json.dumps({{"error": str(e)}}))
    """, timeout=60)
    assert "not a regular file" in verdict(out)["error"]


def test_a_huge_tuning_file_is_refused_without_reading_it(tmp_path):
    big = tmp_path / "tuning.json"
    with open(big, "wb") as f:
        f.truncate(64 << 20)
    start = time.monotonic()
    with pytest.raises(cp_hicache.UsageError, match="more than the 16777216"):
        make(tuning=str(big))
    assert time.monotonic() - start < 10


def test_pools_larger_than_memory_are_refused_up_front():
    start = time.monotonic()
    with pytest.raises(cp_hicache.UsageError, match="lower device_pages"):
        make(device_pages=2**30)
    assert time.monotonic() - start < 10  # nothing was allocated first


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(device_pages=2**40), "device_pages=1099511627776"),
        (dict(device_pages=0), "device_pages=0"),
        (dict(device_pages=-5), "device_pages=-5"),
        (dict(device_pages=True), "device_pages=True"),
        (dict(host_pages=2.5), "host_pages=2.5"),
        (dict(host_pages="8"), "host_pages='8'"),
    ],
)
def test_page_counts_are_whole_numbers_named_in_the_error(kw, message):
    with pytest.raises(cp_hicache.UsageError, match=message.replace("(", r"\(")):
        make(**kw)


# --- Token input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, message",
    [
        (bytearray(b"abcd"), "not bytearray"),
        (b"abcd", "not bytes"),
        (memoryview(b"abcd"), "not memoryview"),
        ("abcd", "not str"),
        (np.array([1, 2], "timedelta64[s]"), "must be integers"),
        (np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]), "masked array"),
        ([True, False], "must be integers, not bool"),
        (np.array([1.0, 2.0]), "must be integers, not float64"),
        ([[1, 2]], "one-dimensional"),
        ([-1], "fit in u32"),
        ([2**32], "fit in u32"),
    ],
)
def test_only_integer_tokens_are_served(tokens, message):
    with pytest.raises(cp_hicache.UsageError, match=message):
        make().serve(tokens)


def test_integer_tokens_of_every_width_are_served():
    rc = make()
    for dtype in ("uint8", "int16", "uint32", "int64"):
        assert rc.serve(np.arange(40, dtype=dtype))["mismatched_tokens"] == 0
    assert rc.serve(range(40))["prompt_tokens"] == 40
    assert rc.serve([])["prompt_tokens"] == 0


# --- Cycles ---------------------------------------------------------------------------------


class Engine:
    """An engine object that is its own group and holds its cache: a reference cycle."""

    rank, size = 0, 1

    def __init__(self):
        self.cache = cp_hicache.RankCache(DEP, 0, self, device_pages=32, host_pages=16,
                                          backend="host")

    def exchange(self, what, payload, why):
        return [(what, payload, why)]


def test_an_engine_that_is_its_own_group_is_collected():
    refs = []
    for _ in range(5):
        e = Engine()
        e.cache.serve(range(32))
        refs.append(weakref.ref(e.cache._native))
        del e
    gc.collect()
    assert all(r() is None for r in refs), "the native caches were never collected"


# --- Lying groups ---------------------------------------------------------------------------


def test_a_short_digest_from_the_group_aborts_it():
    class ShortDigests:
        rank, size = 0, 1

        def exchange(self, what, payload, why):
            if "digests" in what and payload is not None:
                payload = payload[:5]
            return [(what, payload, why)]

    rc = cp_hicache.RankCache(DEP, 0, ShortDigests(), device_pages=32, host_pages=16,
                              backend="host")
    with pytest.raises(cp_hicache.GroupError, match="5-byte digest"):
        rc.all_digests()
    with pytest.raises(cp_hicache.GroupError):
        rc.serve(range(32))


@pytest.mark.parametrize("how", ["a failure", "an exception"])
def test_a_failure_in_the_rollback_round_aborts_the_group(how):
    """A rollback stopped half-way (its round failed) leaves a replica that may differ from
    its peers': the group is aborted, naming the rank and the step, and nothing more is
    served (it used to be a plain CacheError, and serving went on)."""

    class BreaksRollbacks:
        rank, size = 0, 1

        def exchange(self, what, payload, why):
            if "rollback" in what:
                if how == "an exception":
                    raise RuntimeError("the network went away")
                return [(what, None, "a peer failed its rollback")]
            return [(what, payload, why)]

    rc = cp_hicache.RankCache(DEP, 0, BreaksRollbacks(), device_pages=32, host_pages=16,
                              backend="host")
    rc.serve(range(32))
    rc.inject_launch_failure(1)
    with pytest.raises(cp_hicache.GroupError, match="rollback"):
        rc.serve(range(100, 164))
    with pytest.raises(cp_hicache.GroupError):
        rc.serve(range(32))


# --- Lifecycle and messages -----------------------------------------------------------------


def test_token_locations_refuse_another_caches_request():
    a, b = make(), make()
    req = a.begin(range(40), allocate=True)
    with pytest.raises(cp_hicache.UsageError, match="another RankCache"):
        b.token_locations(req)
    a.abandon(req)


def test_wait_layer_checks_its_range_with_or_without_a_load():
    rc = make()
    req = rc.begin(range(40), allocate=True)
    assert req.loading_layers == 0
    with pytest.raises(cp_hicache.UsageError, match="layer 5 is outside the deployment's 2"):
        req.wait_layer(5)
    req.wait_layer(1)
    rc.abandon(req)


def test_layer_waits_loads_layer_by_layer_and_refuses_non_booleans():
    rc = make()
    assert rc.layer_waits is False
    with pytest.raises(cp_hicache.UsageError, match="True or False"):
        rc.layer_waits = 1
    rc.serve(range(64))
    rc.evict(64)
    rc.layer_waits = True
    assert rc.layer_waits is True
    req = rc.begin(range(64), allocate=True)
    assert req.cached_pages == 4 and req.loading_layers == 2
    for layer in range(2):
        req.wait_layer(layer)
    rc.finish(req)
    assert rc.serve(range(64))["mismatched_tokens"] == 0


def test_wait_layer_on_the_engines_stream_takes_only_a_stream_handle():
    rc = make()
    rc.serve(range(64))
    rc.evict(64)
    rc.layer_waits = True
    req = rc.begin(range(64), allocate=True)
    assert req.loading_layers == 2
    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    for bad in (-1, 2**64, True, 1.5, "0", object(), Stream(-3), Stream("s")):
        with pytest.raises(cp_hicache.UsageError, match="CUstream handle"):
            req.wait_layer(0, stream=bad)
    # On the CPU the copies ran before begin returned: any handle orders nothing.
    req.wait_layer(0, stream=0)
    req.wait_layer(1, stream=np.uint64(2**64 - 1))
    req.wait_layer(1, stream=Stream(12345))
    with pytest.raises(cp_hicache.UsageError, match="layer 2 is outside"):
        req.wait_layer(2, stream=0)
    rc.finish(req)
    assert rc.serve(range(64))["mismatched_tokens"] == 0


def test_messages_speak_python():
    rc = make(device_pages=4)
    with pytest.raises(cp_hicache.CacheFullError) as full:
        rc.serve(range(16 * 8))
    assert "raise device_pages" in str(full.value) and "--" not in str(full.value)
    req = rc.begin(range(16))
    with pytest.raises(cp_hicache.UsageError) as misuse:
        rc.finish(req)
    assert "allocate first" in str(misuse.value)
    assert "invalid cluster setting" not in str(misuse.value)
    rc.abandon(req)


def test_closing_twice_and_using_after_close():
    with make() as rc:
        rc.serve(range(32))
        pool = rc.pool("mla_kv")
    assert rc.closed
    rc.close()  # idempotent
    with pytest.raises(cp_hicache.CacheError, match="closed"):
        rc.serve(range(32))
    with pytest.raises(cp_hicache.CacheError, match="closed"):
        rc.pool("mla_kv")
    # A pool taken before close still reads its memory.
    assert np.from_dlpack(pool).shape[0] == 2


# --- Two ranks over gloo, in a script of their own ---------------------------------------

#: What every two-rank script starts with: a gloo group over 127.0.0.1 (the rank's body
#: follows, indented into ``rank_main(rank, out)``), and the launcher that runs it.
TWO_RANKS = """
import json, os, socket, sys, time
from datetime import timedelta
import torch.distributed as dist
import torch.multiprocessing as mp
import cp_hicache

def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    dep = cp_hicache.Deployment(model="mla", page_size=16, cp=2, layers=1)
{body}

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(port, sys.argv[1]), nprocs=2, start_method="spawn")
"""


def run_two_ranks(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Runs ``body`` (the rank's code: ``rank``, ``dep``, ``out`` and ``cp_hicache`` in
    scope) on two ranks, each a process, in a fresh interpreter with a timeout."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(body=textwrap.indent(textwrap.dedent(body), "    ")))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                          text=True, timeout=300)


def test_check_invariants_catches_misowned_pages(tmp_path):
    """Under ``fault="plain-alloc-on-load"`` (the seed's bug) the first load-back puts pages
    under owners other than those recorded at backup: ``check_invariants`` says so on every
    rank, as a debug check in the spirit of SGLang's ``SGLANG_DEBUG_MEMORY_POOL`` must."""
    out = run_two_ranks(tmp_path, """
        with cp_hicache.RankCache(dep, rank, dist.group.WORLD, device_pages=65, host_pages=64,
                                  backend="host", fault="plain-alloc-on-load") as rc:
            prompt = list(range(16 * 8))
            rc.serve(prompt)
            rc.check_invariants()
            rc.evict(1 << 30)
            rc.serve(prompt)
            try:
                rc.check_invariants()
                error = None
            except cp_hicache.CacheError as e:
                error = str(e)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(error, f)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    errors = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for e in errors:
        assert e is not None and "is owned by rank" in e, errors


def test_ctrl_c_interrupts_a_wait_for_a_late_peer(tmp_path):
    """Rank 1 never makes the next round. Rank 0 waits in it; Ctrl-C (SIGINT) one second in
    ends the wait at once with KeyboardInterrupt, not at the 60 s group timeout, and the group
    is broken for good (the next call raises GroupError)."""
    out = run_two_ranks(tmp_path, """
        rc = cp_hicache.RankCache(dep, rank, dist.group.WORLD, device_pages=65,
                                  host_pages=16, backend="host")
        if rank == 1:
            while not os.path.exists(os.path.join(out, "done")):
                time.sleep(0.05)
            os._exit(0)
        import signal, threading
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            rc.serve(list(range(64)))
            result = "served"
        except KeyboardInterrupt:
            result = "interrupted"
        elapsed = time.monotonic() - start
        try:
            rc.serve(list(range(64)))
            after = "served"
        except cp_hicache.GroupError:
            after = "GroupError"
        with open(os.path.join(out, "rank0.json"), "w") as f:
            json.dump([result, elapsed, after], f)
        open(os.path.join(out, "done"), "w").close()
        os._exit(0)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    result, elapsed, after = json.loads((tmp_path / "rank0.json").read_text())
    assert result == "interrupted" and after == "GroupError", (result, after)
    assert elapsed < 30, elapsed  # the group timeout is 60 s


def test_ranks_that_exit_without_closing_leave_nothing_in_dev_shm(tmp_path):
    """Two ranks over gloo build their caches, serve, and leave with ``os._exit`` (no close,
    no destructors): their pools' shared-memory names were removed once every peer had
    mapped them, so nothing of theirs is left in /dev/shm."""
    out = run_two_ranks(tmp_path, """
        rc = cp_hicache.RankCache(dep, rank, dist.group.WORLD, device_pages=65,
                                  host_pages=16, backend="host")
        rc.serve(list(range(64)))
        with open(os.path.join(out, f"pid{rank}"), "w") as f:
            f.write(str(os.getpid()))
        dist.barrier()
        os._exit(0)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    pids = [(tmp_path / f"pid{r}").read_text() for r in range(2)]
    left = [n for n in os.listdir("/dev/shm")
            if any(n.startswith(f"cp-hicache-{pid}-") for pid in pids)]
    assert left == [], left


_CLOSE_FREES = """
import gc, os
import numpy as np
import cp_hicache

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

dep = cp_hicache.Deployment(model="mla", page_size=16, cp=1, layers=4)
big = dict(device_pages=2048, host_pages=16, backend="host")  # 4 x 2048 x 18 KiB pools
pool_bytes = 4 * 2048 * 16 * 1152
rc = cp_hicache.RankCache(dep, **big)
before = rss()
rc.close()
assert before - rss() > pool_bytes // 2, "close kept the pools"

rc = cp_hicache.RankCache(dep, **big)
tensor = np.from_dlpack(rc.pool("mla_kv"))
rc.close()
held = rss()
assert int(tensor[-1, -1, -1]) == 0xA5  # the view still reads its memory
del tensor
gc.collect()
assert held - rss() > pool_bytes // 2, "the last view's end kept the pools"
"""


def test_close_frees_the_pools_at_once_or_when_the_last_view_goes():
    """``close()`` frees the pools deterministically: at once when no pool object or tensor
    is left, else when the last one goes (not whenever the collector runs). In a fresh
    interpreter: the resident size it measures is the process's, and what earlier tests in
    this process left to the allocator (a real model's weights, torch's arenas) once hid the
    pools' release there."""
    out = subprocess.run([sys.executable, "-c", _CLOSE_FREES], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


# --- A store this process may not write ----------------------------------------------------


def test_a_store_nobody_may_write_is_read_and_says_so():
    """Issue 44, finding 5: a page store this process may only read (another user's, a
    read-only mount) opens for reading: `stats()['read_only']` says so, its records are
    served, `put` returns False and nothing in it changes. Permission bits do not bind root,
    so under root the reader runs as `nobody`."""
    import shutil
    import tempfile

    fp, page = "test read-only v1", 64
    top = tempfile.mkdtemp()
    try:
        os.chmod(top, 0o755)  # the reader must reach the store
        root = os.path.join(top, "store")
        s = cp_hicache._native.PageStore(root, fp, page, 1 << 20)
        a = np.arange(page, dtype=np.uint8)
        assert s.put("a", [(int(a.ctypes.data), page)])
        assert s.stats()["read_only"] is False
        del s
        gc.collect()

        def tree():
            out = []
            for d, dirs, files in os.walk(root):
                for n in dirs + files:
                    st = os.lstat(os.path.join(d, n))
                    out.append((os.path.join(d, n), st.st_size, st.st_mtime_ns))
            return sorted(out)

        def chmod_tree(dirs: int, files: int):
            for d, subdirs, names in os.walk(root):
                for n in names:
                    os.chmod(os.path.join(d, n), files)
                for n in subdirs:
                    os.chmod(os.path.join(d, n), dirs)
            os.chmod(root, dirs)

        chmod_tree(0o555, 0o444)  # readable by all, writable by none
        before = tree()
        code = f"""
        s = cp_hicache._native.PageStore({root!r}, {fp!r}, {page}, 1 << 20)
        out = np.zeros({page}, np.uint8)
        hit = s.get("a", [(int(out.ctypes.data), {page})])
        b = np.ones({page}, np.uint8)
        put = s.put("b", [(int(b.ctypes.data), {page})])
        st = s.stats()
        print(json.dumps(dict(read_only=st["read_only"], hit=hit,
                              same=out.tolist() == list(range({page})), put=put,
                              written=st["records_written"])))
        """
        prelude = "import json, sys, numpy as np, cp_hicache\n"
        as_nobody = dict(user=65534, group=65534, cwd="/") if os.geteuid() == 0 else {}
        out = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                             capture_output=True, text=True, timeout=120, **as_nobody)
        after = tree()
        chmod_tree(0o755, 0o644)
        assert verdict(out) == dict(read_only=True, hit=True, same=True, put=False, written=0)
        assert after == before, "the read-only store changed"
    finally:
        shutil.rmtree(top, ignore_errors=True)
