"""Mooncake Store throughput through the page store (issue 44), against Mooncake's own batch
calls of the same bytes in the same run.

Starts a ``mooncake_master`` on free loopback ports (the tests' fixture code,
``python/tests/mooncake_fixture.py``; the wheel from ``scripts/mooncake-env.sh``) and
measures, for ``--pages`` pages of ``--page-bytes`` each, kept in
host memory:

- ``mooncake``: ``batch_put_from`` then ``batch_get_into`` of the pages, from and into a
  buffer registered with ``register_buffer`` (the zero-copy calls SGLang's Mooncake backend
  makes);
- ``mooncake multi-buffer`` (``--multi-buffer-baseline``): ``batch_put_from_multi_buffers``
  then ``batch_get_into_multi_buffers`` of each page as two buffers, a 64-byte header and
  the page in place (whether Mooncake moves two buffers per object as fast as one);
- ``page store put_many / get_many``: ``_native.PageStore.over(MooncakeStore)`` batches of
  the same pages from and into the same host memory (records: header, checksum, canonical
  key; every read checked): one ``batch_is_exist`` and one put, one get. Records of at
  least 512 KiB of payload (``storage::object::GATHER_BYTES``) go as their header and the
  page in place (``batch_put_from_multi_buffers``, nothing copied) and come back so
  (``batch_get_into_multi_buffers``: the header into a buffer of its own, the payload
  straight into the caller's memory, checked there); smaller ones are built whole in one
  buffer (the page copied behind its header) for ``batch_put_from``, and read whole into
  one by ``batch_get_into``, the payload then copied out;
- ``..., records copied whole`` (``--copy-path``): the same store told not to gather
  (``gathers_puts = False``), so every size goes the second way;
- ``page store put / get, per page``: one page per call;
- ``..., through bytes``: per page over the store's ``put_object``/``get_object`` only,
  copying each record through Python ``bytes`` (the page store's path before the batch
  calls).

By default another process holds the segment (``--holder process``), so the bytes cross
loopback TCP, as between machines; with ``--holder self`` Mooncake copies within this
process.

``--repeat`` rounds run every path in turn, on fresh keys (the objects of each path are
removed after it: ``remove_all(force)``), the order reversed every other round, so that on
a shared, noisy machine each path meets the same load as Mooncake's own call beside it. For
each path: the median and range of its GB/s (of page bytes) over the rounds, and of its
ratio to the same round's Mooncake baseline (its time over the baseline's). Run::

    scripts/python-dev.sh && scripts/mooncake-env.sh
    nice -n 10 .venv/bin/python python/examples/mooncake_bench.py --repeat 9 --copy-path
"""

from __future__ import annotations

import argparse
import os
import statistics
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
from cp_hicache import _native  # noqa: E402
from cp_hicache.mooncake import MooncakeStore  # noqa: E402


class BytesOnly:
    """A MooncakeStore seen through its four object methods only (bytes in, bytes out)."""

    def __init__(self, inner):
        self.inner = inner

    def put_object(self, name, data):
        return self.inner.put_object(name, data)

    def get_object(self, name):
        return self.inner.get_object(name)

    def objects_exist(self, names):
        return self.inner.objects_exist(names)

    def remove_object(self, name):
        return self.inner.remove_object(name)


BASE = "mooncake batch_put_from / batch_get_into"


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-bytes", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-per-page", action="store_true", help="skip the per-page paths")
    ap.add_argument("--copy-path", action="store_true",
                    help="also the page store building each record in one buffer (a copy of "
                    "the page behind its header), as before the header and page went apart")
    ap.add_argument("--multi-buffer-baseline", action="store_true",
                    help="also Mooncake's own multi-buffer calls (a 64-byte header + the page)")
    ap.add_argument(
        "--holder", choices=["self", "process"], default="process",
        help="who contributes the segment: this client (Mooncake then copies within the "
        "process), or another process (the bytes cross loopback TCP; the default)",
    )
    a = ap.parse_args(argv)
    n, size = a.pages, a.page_bytes
    total = n * size
    # The segment holds one repetition of each path at a time (records are 64 bytes more).
    segment = 2 * n * (size + 4096) + (64 << 20)

    with tempfile.TemporaryDirectory() as tmp:
        proc, master = start_master(mooncake_master_binary(), Path(tmp) / "master.log")
        try:
            meta = master.options["metadata_server"]
            holder = None
            if a.holder == "process":
                holder = spawn_segment_holder(master.url, meta, segment)
                assert holder.stdout.readline().strip() == "ready"
            store = MooncakeStore(
                master.url,
                metadata_server=meta,
                segment_bytes=segment if holder is None else 0,
                buffer_bytes=64 << 20,
            )
            raw = store._store  # the MooncakeDistributedStore client, for the baseline
            src = np.random.default_rng(0).integers(0, 256, size=total, dtype=np.uint8)
            dst = np.zeros(total, dtype=np.uint8)
            heads = np.zeros(n * 64, dtype=np.uint8)
            heads_dst = np.zeros(n * 64, dtype=np.uint8)
            for buf in (src, dst, heads, heads_dst):
                rc = raw.register_buffer(buf.ctypes.data, buf.nbytes)
                assert rc == 0, f"register_buffer failed ({rc})"
            ptrs_src = [src.ctypes.data + i * size for i in range(n)]
            ptrs_dst = [dst.ctypes.data + i * size for i in range(n)]
            parts_src = [[(p, size)] for p in ptrs_src]
            parts_dst = [[(p, size)] for p in ptrs_dst]
            # The same store without the batch calls: the page store then copies
            # each record through Python bytes (put_object/get_object), as before them.
            bytes_only = _native.PageStore.over(BytesOnly(store), "bench", size)

            # The copy path: the same store seen without `gathers_puts`, so the page store
            # builds each record in one buffer (the payload copied behind its header).
            store.gathers_puts = False
            ps_copy = _native.PageStore.over(store, "bench", size)
            store.gathers_puts = True
            ps = _native.PageStore.over(store, "bench", size)

            def check():
                assert np.array_equal(src, dst)
                dst[:] = 0
                raw.remove_all(True)

            paths = []  # (name, put(tag), get(tag)): tag makes a round's keys fresh

            def raw_put(tag):
                rcs = raw.batch_put_from([f"raw-{tag}-{i}" for i in range(n)], ptrs_src,
                                         [size] * n)
                assert all(r == 0 for r in rcs), rcs

            def raw_get(tag):
                rcs = raw.batch_get_into([f"raw-{tag}-{i}" for i in range(n)], ptrs_dst,
                                         [size] * n)
                assert all(r == size for r in rcs), rcs

            paths.append((BASE, raw_put, raw_get))
            if a.multi_buffer_baseline:
                two = [[heads.ctypes.data + i * 64, p] for i, p in enumerate(ptrs_src)]
                two_dst = [[heads_dst.ctypes.data + i * 64, p] for i, p in enumerate(ptrs_dst)]

                def multi_put(tag):
                    rcs = raw.batch_put_from_multi_buffers(
                        [f"multi-{tag}-{i}" for i in range(n)], two, [[64, size]] * n)
                    assert all(r == 0 for r in rcs), rcs

                def multi_get(tag):
                    rcs = raw.batch_get_into_multi_buffers(
                        [f"multi-{tag}-{i}" for i in range(n)], two_dst, [[64, size]] * n)
                    assert all(r == size + 64 for r in rcs), rcs

                paths.append(("mooncake multi-buffer (64-byte header + page)", multi_put,
                              multi_get))

            def batched(pstore, prefix):
                def put(tag):
                    assert all(pstore.put_many([f"{prefix}-{tag}-{i}" for i in range(n)],
                                               parts_src))

                def get(tag):
                    assert all(pstore.get_many([f"{prefix}-{tag}-{i}" for i in range(n)],
                                               parts_dst))

                return put, get

            paths.append(("page store put_many / get_many", *batched(ps, "g")))
            if a.copy_path:
                paths.append(("page store put_many / get_many, records copied whole",
                              *batched(ps_copy, "c")))
            if not a.no_per_page:
                for label, pstore, prefix in (
                    ("page store put / get, per page", ps, "p"),
                    ("page store put / get, per page, through bytes", bytes_only, "y"),
                ):
                    def put_each(tag, pstore=pstore, prefix=prefix):
                        for i, p in enumerate(parts_src):
                            assert pstore.put(f"{prefix}-{tag}-{i}", p)

                    def get_each(tag, pstore=pstore, prefix=prefix):
                        for i, p in enumerate(parts_dst):
                            assert pstore.get(f"{prefix}-{tag}-{i}", p)

                    paths.append((label, put_each, get_each))

            # Rounds of every path in turn, the order reversed every other round (so no path
            # always runs first, or right after another); each round's ratio is to the
            # baseline of the same round.
            times = {name: ([], []) for name, _, _ in paths}
            for rnd in range(a.repeat):
                order = paths if rnd % 2 == 0 else paths[::-1]
                for name, put, get in order:
                    times[name][0].append(_timed(lambda: put(rnd)))
                    times[name][1].append(_timed(lambda: get(rnd)))
                    check()

            print(
                f"{n} pages of {size} bytes ({total / 1e6:.1f} MB), {a.repeat} rounds, "
                f"loopback TCP, segment held by "
                f"{'another process' if holder else 'this client'}, "
                f"cp_hicache {cp_hicache.__version__}, load average "
                f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}"
            )
            print("GB/s of page bytes: median (min–max); ratio: median (min–max) of each "
                  "round's time of Mooncake's own call over the path's")
            print("| path | put GB/s | get GB/s | put vs Mooncake | get vs Mooncake |")
            print("|---|---|---|---|---|")
            base = times[BASE]

            def spread(xs):
                return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"

            for name, (puts, gets) in times.items():
                gbs = lambda ts: spread([total / t / 1e9 for t in ts])  # noqa: E731
                rput = spread([b / t for b, t in zip(base[0], puts)])
                rget = spread([b / t for b, t in zip(base[1], gets)])
                print(f"| {name} | {gbs(puts)} | {gbs(gets)} | {rput}× | {rget}× |")
            print(f"store stats: {ps.stats()}")
            store.close()
            if holder is not None:
                holder.stdin.close()
                holder.wait(timeout=60)
        finally:
            stop_master(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
