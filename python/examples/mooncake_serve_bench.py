"""The rank's serving path over Mooncake Store (issue 44): how many calls of the Mooncake
client a request's storage writes and reads make, and how long they take.

Starts a ``mooncake_master`` on free loopback ports (``python/tests/mooncake_fixture.py``;
the wheel from ``scripts/mooncake-env.sh``) with another process holding the segment, so
the bytes cross loopback TCP. A ``RankCache`` (CP 1, the host backend, ``--layers`` layers
of MLA, pages of ``--page-size`` tokens) serves ``--prompts`` prompts of ``--tokens``
tokens each, writing every page's record to the store; a fresh ``RankCache`` then serves
the same prompts, reading every page back from the store, verified. Each store is a
``MooncakeStore`` seen through a wrapper that counts the calls the page store makes of it
and the records they carry, and the calls of Mooncake's client under it (``batch_put_from``,
``batch_get_into``, ``batch_is_exist``, ...: each a round trip to the master, and for a
put or a get, transfers to or from the segment's holder).

Reported, best of ``--repeat`` (fresh prompts each time): calls per request for the writes
and for the reads, records per call, and the wall time of the writing and of the reading
requests (the whole ``serve``: synthesis, verification and the store's calls), and of it
the time spent in the store's calls (Mooncake's client and the Python around it). Run::

    scripts/python-dev.sh && scripts/mooncake-env.sh
    nice -n 10 .venv/bin/python python/examples/mooncake_serve_bench.py
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))

from mooncake_fixture import (  # noqa: E402
    mooncake_master_binary,
    spawn_segment_holder,
    start_master,
    stop_master,
)

import cp_hicache  # noqa: E402
from cp_hicache.mooncake import MooncakeStore  # noqa: E402

class Counting:
    """A MooncakeStore whose calls are counted (``calls``) with the objects they carry
    (``objects``) and the seconds they took (``seconds``), by method."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = collections.Counter()
        self.objects = collections.Counter()
        self.seconds = 0.0

    def _n(self, method, n):
        self.calls[method] += 1
        self.objects[method] += n

    def _timed(self, f, *args):
        t = time.perf_counter()
        try:
            return f(*args)
        finally:
            self.seconds += time.perf_counter() - t

    def put_object(self, name, data):
        self._n("put_object", 1)
        return self._timed(self.inner.put_object, name, data)

    def get_object(self, name):
        self._n("get_object", 1)
        return self._timed(self.inner.get_object, name)

    def objects_exist(self, names):
        self._n("objects_exist", len(names))
        return self._timed(self.inner.objects_exist, names)

    def remove_object(self, name):
        self._n("remove_object", 1)
        return self._timed(self.inner.remove_object, name)

    def remove_objects(self, names):
        self._n("remove_objects", len(names))
        return self._timed(self.inner.remove_objects, names)

    def put_objects_from(self, names, addrs, sizes):
        self._n("put_objects_from", len(names))
        return self._timed(self.inner.put_objects_from, names, addrs, sizes)

    def get_objects_into(self, names, addrs, sizes):
        self._n("get_objects_into", len(names))
        return self._timed(self.inner.get_objects_into, names, addrs, sizes)

    def usage(self):
        return self.inner.usage()


class Client:
    """Mooncake's client (``MooncakeDistributedStore``), its calls counted by method."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = collections.Counter()

    def __getattr__(self, name):
        f = getattr(self.inner, name)

        def call(*args):
            self.calls[name] += 1
            return f(*args)

        return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    dep = cp_hicache.Deployment(model="mla", page_size=a.page_size, cp=1, layers=a.layers)
    pages = a.tokens // a.page_size
    with tempfile.TemporaryDirectory() as tmp:
        proc, master = start_master(mooncake_master_binary(), Path(tmp) / "master.log")
        holder = None
        try:
            meta = master.options["metadata_server"]
            segment = 1 << 30
            holder = spawn_segment_holder(master.url, meta, segment)
            assert holder.stdout.readline().strip() == "ready"
            opts = dict(metadata_server=meta, segment_bytes=0, buffer_bytes=64 << 20)
            best = {}
            in_store = {}
            counts = {}
            record_bytes = 0
            for rep in range(a.repeat):
                prompts = [
                    np.arange(base, base + a.tokens, dtype=np.uint32)
                    for base in ((rep * a.prompts + i) * 100_000 for i in range(a.prompts))
                ]
                for phase in ("write", "read"):
                    store = Counting(MooncakeStore(master.url, **opts))
                    store.inner._store = client = Client(store.inner._store)
                    rc = cp_hicache.RankCache(
                        dep, device_pages=4 * pages, host_pages=4 * pages, backend="host"
                    )
                    rc.attach_storage(store)
                    t = time.perf_counter()
                    stats = [rc.serve(p) for p in prompts]
                    dt = time.perf_counter() - t
                    rc.close()
                    store.inner.close()
                    assert all(s["mismatched_tokens"] == 0 for s in stats), stats
                    if phase == "write":
                        n = sum(s["storage_records_written"] for s in stats)
                        record_bytes = sum(s["storage_bytes_written"] for s in stats) // n
                    else:
                        n = sum(s["storage_records_read"] for s in stats)
                        assert all(s["storage_hit_tokens"] == a.tokens for s in stats), stats
                    assert n == a.prompts * pages, (phase, n)
                    if dt < best.get(phase, float("inf")):
                        best[phase], in_store[phase] = dt, store.seconds
                    counts[phase] = (dict(store.calls), dict(store.objects), dict(client.calls))
            print(
                f"{a.prompts} requests of {a.tokens} tokens ({pages} records of "
                f"{record_bytes} bytes each), MLA, {a.layers} layers, CP 1, best of "
                f"{a.repeat}, loopback TCP, segment held by another process, "
                f"cp_hicache {cp_hicache.__version__}"
            )
            print(
                "| phase | page store's calls per request (records) | Mooncake client calls "
                "per request | wall per request | of it in the store's calls |"
            )
            print("|---|---|---|---|---|")
            for phase in ("write", "read"):
                calls, objects, client_calls = counts[phase]
                text = ", ".join(
                    f"{m} {calls[m] / a.prompts:g} ({objects[m] / a.prompts:g})"
                    for m in sorted(calls)
                )
                low = ", ".join(
                    f"{m} {client_calls[m] / a.prompts:g}"
                    for m in sorted(client_calls)
                    if m != "close"
                )
                print(
                    f"| {phase} | {text} | {low} | {best[phase] / a.prompts * 1e3:.1f} ms "
                    f"| {in_store[phase] / a.prompts * 1e3:.1f} ms |"
                )
        finally:
            if holder is not None:
                holder.stdin.close()
                holder.wait(timeout=60)
            stop_master(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
