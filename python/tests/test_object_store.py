"""A page store whose objects a Python object keeps (issue 44): `RankCache.attach_storage`
takes any object with `put_object`, `get_object`, `objects_exist` and `remove_object`; the
rank writes and checks the records (the bytes a directory store writes), so wrong bytes
under a key are refused and counted whatever keeps them."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import cp_hicache

DEP = dict(model="mla", page_size=16, cp=1, layers=2)
PROMPT = np.arange(160, dtype=np.uint32)  # 10 pages


class DictStore:
    """Objects in a dict: the four methods a store object needs."""

    def __init__(self):
        self.objects = {}
        self.lock = threading.Lock()

    def put_object(self, name, data):
        with self.lock:
            if name in self.objects:
                return False
            self.objects[name] = bytes(data)
            return True

    def get_object(self, name):
        return self.objects.get(name)

    def objects_exist(self, names):
        return [n in self.objects for n in names]

    def remove_object(self, name):
        self.objects.pop(name, None)


def _cache(**kw):
    dep = cp_hicache.Deployment(**dict(DEP, **kw))
    return cp_hicache.RankCache(dep, device_pages=64, host_pages=64, backend="host")


def test_a_python_object_keeps_the_records_and_a_fresh_cache_reads_them(tmp_path):
    store = DictStore()
    first = _cache()
    first.attach_storage(store)
    assert first.serve(PROMPT)["storage_records_written"] == 10
    first.close()
    assert len(store.objects) == 10
    assert all(n.startswith("cp-hicache/") for n in store.objects)

    # The same bytes a directory store writes for the same pages.
    on_disk = _cache()
    on_disk.attach_storage(tmp_path / "store")
    on_disk.serve(PROMPT)
    on_disk.close()
    files = sorted(p.read_bytes() for p in (tmp_path / "store" / "records").rglob("*.rec"))
    assert files == sorted(store.objects.values())

    rc = _cache()
    rc.attach_storage(store)
    s = rc.serve(PROMPT)
    assert s["storage_hit_tokens"] == 160 and s["mismatched_tokens"] == 0, s
    rc.close()


def test_wrong_bytes_under_a_key_are_refused_and_counted():
    store = DictStore()
    first = _cache()
    first.attach_storage(store)
    first.serve(PROMPT)
    first.close()
    names = list(store.objects)  # in write order: page 0 first
    store.objects[names[3]] = b"not a record"
    rc = _cache()
    rc.attach_storage(store)
    s = rc.serve(PROMPT)
    assert s["storage_records_read"] == 3 and s["storage_refused_torn"] == 1, s
    assert s["mismatched_tokens"] == 0, s
    rc.close()


def test_an_object_without_the_methods_is_refused():
    rc = _cache()
    with pytest.raises(cp_hicache.UsageError, match="lacks put_object"):
        rc.attach_storage(type("Half", (), {"get_object": lambda self, n: None})())
    rc.close()


class BatchDictStore(DictStore):
    """A DictStore with the batch calls at addresses, whose object at position
    `fail_put`/`fail_get` of each batch fails: an exception instance in its answer's place,
    as MooncakeStore answers for one object whose put or get failed."""

    def __init__(self, fail_put=None, fail_get=None):
        super().__init__()
        self.fail_put, self.fail_get = fail_put, fail_get

    def put_objects_from(self, names, addrs, sizes):
        out = []
        for i, (n, a, s) in enumerate(zip(names, addrs, sizes)):
            if i == self.fail_put:
                out.append(RuntimeError(f"put {n} failed"))
                continue
            data = b"".join(ctypes.string_at(p, k) for p, k in zip(a, s))
            out.append(self.put_object(n, data))
        return out

    def get_objects_into(self, names, addrs, sizes):
        out = []
        for i, (n, a, s) in enumerate(zip(names, addrs, sizes)):
            data = self.objects.get(n)
            if i == self.fail_get:
                out.append(RuntimeError(f"get {n} failed"))
            elif data is None:
                out.append(None)
            else:
                at = 0
                for p, k in zip(a, s):
                    k = min(k, len(data) - at)
                    if k > 0:
                        ctypes.memmove(p, data[at : at + k], k)
                    at += max(k, 0)
                out.append(len(data))
        return out


def test_one_failed_object_of_a_batch_fails_alone():
    # A node's ten records go in one batch; the fourth's put fails: the other nine are
    # written and counted, one I/O error.
    store = BatchDictStore(fail_put=3)
    first = _cache()
    first.attach_storage(store)
    s = first.serve(PROMPT)
    assert s["storage_records_written"] == 9 and s["storage_io_errors"] == 1, s
    first.close()
    assert len(store.objects) == 9

    # A request's ten reads go in one batch; the sixth's get fails: the five before it
    # are a hit (a failed read ends the run as a miss does), one I/O error.
    store.fail_put = None
    full = _cache()
    full.attach_storage(store)
    full.serve(PROMPT)
    full.close()
    store.fail_get = 5
    rc = _cache()
    rc.attach_storage(store)
    s = rc.serve(PROMPT)
    assert s["storage_records_read"] == 5 and s["storage_io_errors"] == 1, s
    assert s["mismatched_tokens"] == 0, s
    rc.close()
