"""Mooncake Store throughput through the page store (issue 44), against Mooncake's own batch
calls of the same bytes in the same run.

Starts a ``mooncake_master`` on free loopback ports (the tests' fixture code,
``python/tests/mooncake_fixture.py``; the wheel from ``scripts/mooncake-env.sh``) and
measures, for ``--pages`` pages of ``--page-bytes`` each, kept in
host memory:

- ``mooncake``: ``batch_put_from`` then ``batch_get_into`` of the pages, from and into a
  buffer registered with ``register_buffer`` (the zero-copy calls SGLang's Mooncake backend
  makes);
- ``mooncake multi-buffer``: ``batch_put_from_multi_buffers`` then
  ``batch_get_into_multi_buffers`` of each page as two buffers, a 64-byte header and the
  page in place (what a record with no copy would be: whether Mooncake moves two buffers
  per object as fast as one);
- ``page store put_many / get_many``: ``_native.PageStore.over(MooncakeStore)`` batches of
  the same pages from and into the same host memory (records: header, checksum, canonical
  key; every read checked): one ``batch_put_from`` and one ``batch_get_into`` of the
  records, from and into the page store's own buffers (no Python copies);
- ``page store put / get, per page``: the same, one page per call (what the rank does);
- ``..., through bytes``: per page over the store's ``put_object``/``get_object`` only,
  copying each record through Python ``bytes`` (the page store's path before the batch
  calls).

By default another process holds the segment (``--holder process``), so the bytes cross
loopback TCP, as between machines; with ``--holder self`` Mooncake copies within this
process.

Each is repeated ``--repeat`` times on fresh keys (the objects of a repetition are removed
after it: ``remove_all(force)``); the best repetition of each is reported, in GB/s of page
bytes. Run::

    scripts/python-dev.sh && scripts/mooncake-env.sh
    nice -n 10 .venv/bin/python python/examples/mooncake_bench.py
"""

from __future__ import annotations

import argparse
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


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-bytes", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-per-page", action="store_true", help="skip the per-page path")
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
            ps = _native.PageStore.over(store, "bench", size)
            # The same store without the batch calls: the page store then copies
            # each record through Python bytes (put_object/get_object), as before them.
            bytes_only = _native.PageStore.over(BytesOnly(store), "bench", size)

            results = {}

            def record(name, put_s, get_s):
                best = results.setdefault(name, [float("inf"), float("inf")])
                best[0] = min(best[0], put_s)
                best[1] = min(best[1], get_s)

            for rep in range(a.repeat):
                # Mooncake's own batch calls from and into registered memory.
                keys = [f"raw-{rep}-{i}" for i in range(n)]
                dst[:] = 0

                def put_raw():
                    rcs = raw.batch_put_from(keys, ptrs_src, [size] * n)
                    assert all(r == 0 for r in rcs), rcs

                def get_raw():
                    rcs = raw.batch_get_into(keys, ptrs_dst, [size] * n)
                    assert all(r == size for r in rcs), rcs

                record("mooncake batch_put_from / batch_get_into", _timed(put_raw), _timed(get_raw))
                assert np.array_equal(src, dst)
                raw.remove_all(True)

                keys = [f"multi-{rep}-{i}" for i in range(n)]
                dst[:] = 0
                two = [[heads.ctypes.data + i * 64, p] for i, p in enumerate(ptrs_src)]
                two_dst = [[heads_dst.ctypes.data + i * 64, p] for i, p in enumerate(ptrs_dst)]

                def put_multi():
                    rcs = raw.batch_put_from_multi_buffers(keys, two, [[64, size]] * n)
                    assert all(r == 0 for r in rcs), rcs

                def get_multi():
                    rcs = raw.batch_get_into_multi_buffers(keys, two_dst, [[64, size]] * n)
                    assert all(r == size + 64 for r in rcs), rcs

                record("mooncake multi-buffer (64-byte header + page)", _timed(put_multi),
                       _timed(get_multi))
                assert np.array_equal(src, dst)
                raw.remove_all(True)

                names = [f"b-{rep}-{i}" for i in range(n)]
                dst[:] = 0

                def put_many():
                    assert all(ps.put_many(names, parts_src))

                def get_many():
                    assert all(ps.get_many(names, parts_dst))

                record("page store put_many / get_many", _timed(put_many), _timed(get_many))
                assert np.array_equal(src, dst)
                raw.remove_all(True)

                for label, pstore in (
                    ("page store put / get, per page", ps),
                    ("page store put / get, per page, through bytes", bytes_only),
                ):
                    if a.no_per_page:
                        break
                    names = [f"p-{rep}-{i}" for i in range(n)]
                    dst[:] = 0

                    def put_each():
                        for k, p in zip(names, parts_src):
                            assert pstore.put(k, p)

                    def get_each():
                        for k, p in zip(names, parts_dst):
                            assert pstore.get(k, p)

                    record(label, _timed(put_each), _timed(get_each))
                    assert np.array_equal(src, dst)
                    raw.remove_all(True)

            print(
                f"{n} pages of {size} bytes ({total / 1e6:.1f} MB), best of {a.repeat}, "
                f"loopback TCP, segment held by "
                f"{'another process' if holder else 'this client'}, "
                f"cp_hicache {cp_hicache.__version__}"
            )
            base = results["mooncake batch_put_from / batch_get_into"]
            print("| path | put GB/s | get GB/s | put vs Mooncake | get vs Mooncake |")
            print("|---|---|---|---|---|")
            for name, (put_s, get_s) in results.items():
                print(
                    f"| {name} | {total / put_s / 1e9:.2f} | {total / get_s / 1e9:.2f} "
                    f"| {base[0] / put_s:.2f}× | {base[1] / get_s:.2f}× |"
                )
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
